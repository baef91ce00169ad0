"""load_plan(): a plan source -> LoadedPlan (the merged, validated Plan plus positions).

`extends` merges the parent first (mappings key by key, the child wins; rule tables by pattern);
positions point at whichever file the winning key came from. A parent must live inside the directory
tree of the plan that was loaded first, so a plan in a repository cannot make the linter read
`/etc/passwd` or a file outside the checkout. Loading goes through the linter, so `load_plan` and
`planc lint` reject exactly the same plans with exactly the same diagnostics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from planc.spec.source import (
    NOT_A_MAPPING,
    Position,
    SourceDoc,
    SourceError,
    nearest_key_position,
    parse_yaml,
    read_text,
)

# Codes (documented in planc.lint.rules_extends).
EXTENDS_OUTSIDE = "PLC200"
EXTENDS_CYCLE = "PLC201"
EXTENDS_MISSING = "PLC202"

MAX_EXTENDS_DEPTH = 16


@dataclass
class LoadedPlan:
    """A validated plan and where each of its keys was written."""

    plan: Any  # planc.spec.model.Plan
    path: Optional[str]
    docs: list = field(default_factory=list)  # SourceDocs, child first
    key_positions: dict = field(default_factory=dict)
    value_positions: dict = field(default_factory=dict)
    diagnostics: list = field(default_factory=list)  # warnings the linter found (errors raise instead)

    def position(self, keypath) -> Optional[Position]:
        """Position of a key, else of the nearest enclosing key, else the top of the file."""
        if not self.key_positions and not self.path:
            return None  # built from a mapping or a Plan: there is no source to point at
        return nearest_key_position(self.key_positions, keypath, self.path)

    def value_position(self, keypath) -> Optional[Position]:
        return self.value_positions.get(tuple(keypath)) or self.position(keypath)


@dataclass
class MergedSource:
    """A document with its `extends` chain merged in, before validation."""

    data: dict
    path: Optional[str]
    docs: list  # SourceDocs, child first
    key_positions: dict
    value_positions: dict
    problems: list  # non-fatal SourceErrors of every document in the chain


def _real_dir(doc: SourceDoc) -> str:
    """The resolved directory a document's relative `extends` starts from (the working directory for text)."""
    return os.path.dirname(os.path.realpath(doc.path)) if doc.path else os.getcwd()


def resolve_extends(doc: SourceDoc, root_dir: Optional[str] = None) -> MergedSource:
    """Merge `doc` with its parents. `root_dir`: the tree parents must stay in (default: doc's directory)."""
    if root_dir is None:
        root_dir = _real_dir(doc)
    seen = (os.path.realpath(doc.path),) if doc.path else ()
    return _collect(doc, os.path.realpath(root_dir), seen)


def _collect(doc: SourceDoc, root_dir: str, seen: tuple) -> MergedSource:
    data = doc.data
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}, not a mapping"
        raise SourceError(
            NOT_A_MAPPING,
            f"a plan must be a YAML mapping; this document is {kind}",
            "start the plan with `version: 1`, `model: {type: ...}` and `parallel: {tp_size: ...}`",
            Position(doc.path, 1, 1),
        )
    ext = data.get("extends")
    if not isinstance(ext, str):  # absent, or a wrong type that validation reports
        return MergedSource(data, doc.path, [doc], dict(doc.key_positions), dict(doc.value_positions), list(doc.problems))
    parent = _parent_doc(doc, ext, root_dir, seen)
    merged = _collect(parent, root_dir, seen + (os.path.realpath(parent.path),))
    return _merge(merged, doc)


def _parent_doc(doc: SourceDoc, ext: str, root_dir: str, seen: tuple) -> SourceDoc:
    where = doc.value_position(("extends",)) or Position(doc.path, 1, 1)
    if not ext.isprintable():  # NUL makes every os.path call raise; other control characters are typos too
        bad = sorted({repr(c)[1:-1] for c in ext if not c.isprintable()})
        raise SourceError(
            EXTENDS_MISSING,
            f"`extends` is not a file path: it contains {', '.join(bad)}",
            "write the parent's path relative to this plan's directory, e.g. `extends: base.yaml`",
            where,
        )
    base = os.path.dirname(doc.path) if doc.path else ""
    shown = os.path.normpath(os.path.join(base, ext))
    real = os.path.realpath(os.path.join(_real_dir(doc), ext))
    if not ext.strip() or os.path.isabs(ext):
        raise SourceError(
            EXTENDS_OUTSIDE,
            f"`extends: {ext}` must be a path relative to this plan",
            "write the parent's path relative to this plan's directory, e.g. `extends: base.yaml`",
            where,
        )
    if os.path.commonpath([real, root_dir]) != root_dir:
        raise SourceError(
            EXTENDS_OUTSIDE,
            f"`extends: {ext}` points outside the directory tree of the linted plan ({root_dir})",
            "keep the parent plan next to or below the plan that is linted, and give a relative path",
            where,
        )
    if real in seen:
        chain = " -> ".join(os.path.basename(s) for s in seen + (real,))
        raise SourceError(EXTENDS_CYCLE, f"`extends` cycle: {chain}", "remove the `extends` that closes the cycle", where)
    if len(seen) > MAX_EXTENDS_DEPTH:
        raise SourceError(
            EXTENDS_CYCLE,
            f"`extends` chain is deeper than {MAX_EXTENDS_DEPTH} plans",
            "flatten the chain: one or two levels of `extends` are enough",
            where,
        )
    if not os.path.isfile(real):
        raise SourceError(
            EXTENDS_MISSING,
            f"`extends: {ext}`: no such plan file ({shown})",
            "give the parent's path relative to this plan's directory",
            where,
        )
    try:
        return parse_yaml(read_text(real), shown)
    except SourceError as e:
        if e.position.path is None or e.position.path == real:
            e.position = Position(shown, e.position.line, e.position.col)
        raise


def _merge(parent: MergedSource, child: SourceDoc) -> MergedSource:
    """Child over parent: mappings merge key by key, anything else is replaced (with its positions)."""
    replaced: set = set()  # key paths where the child's value replaced the parent's subtree

    def merge(p: dict, c: dict, prefix: tuple) -> dict:
        out = dict(p)
        for k, v in c.items():
            kp = prefix + (k,)
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = merge(out[k], v, kp)
            else:
                if k in out:
                    replaced.add(kp)
                out[k] = v
        return out

    data = merge({k: v for k, v in parent.data.items() if k != "extends"}, child.data, ())

    def keep(kp: tuple) -> bool:
        return not any(kp[:i] in replaced for i in range(1, len(kp) + 1))

    keys = {kp: pos for kp, pos in parent.key_positions.items() if keep(kp) and kp != ("extends",)}
    values = {kp: pos for kp, pos in parent.value_positions.items() if keep(kp) and kp != ("extends",)}
    keys.update(child.key_positions)
    values.update(child.value_positions)
    return MergedSource(
        data, child.path, [child, *parent.docs], keys, values, list(child.problems) + parent.problems
    )


def validate(data: Mapping[str, Any]):
    """The pydantic Plan of merged data; raises pydantic.ValidationError."""
    from planc.spec.model import Plan

    return Plan.model_validate(dict(data))


def _looks_like_path(text: str) -> bool:
    """One line that names a file: a .yaml/.yml suffix, an existing path, or no YAML mapping syntax at all
    (`plans/mixtral`); YAML plan text always has a `key: value`."""
    if "\n" in text:
        return False
    return text.strip().endswith((".yaml", ".yml")) or os.path.exists(text) or (":" not in text and "{" not in text)


def _not_a_plan_file(path: str):
    """A PLC002 Diagnostic when `path` is a directory or does not exist (with the .yaml it may mean), else None."""
    from planc.lint.diagnostic import ERROR, Diagnostic
    from planc.spec.source import UNREADABLE

    where = Position(path, 1, 1)
    try:
        if os.path.isdir(path):
            plans = sorted(n for n in os.listdir(path) if n.endswith((".yaml", ".yml")))[:3]
            example = ", ".join(f"`{os.path.join(path, n)}`" for n in plans) or "`plans/mixtral.yaml`"
            return Diagnostic(UNREADABLE, ERROR, f"`{path}` is a directory; a plan is one YAML file",
                              f"pass one plan file, e.g. {example}", where)
        if not os.path.exists(path):
            near = [path + s for s in (".yaml", ".yml") if os.path.isfile(path + s)]
            hint = f"did you mean `{near[0]}`?" if near else "pass the path of a .yaml plan file, YAML text, a mapping or a Plan"
            return Diagnostic(UNREADABLE, ERROR, f"no such plan file: `{path}`", hint, where)
    except (ValueError, OSError):  # a NUL byte, a path too long: read_text reports it
        return None
    return None


PARALLEL_KEYS = ("tp_size", "ep_size", "dp_size")


def load_plan(source, *, parallel: Optional[Mapping[str, int]] = None) -> LoadedPlan:
    """Load a plan from a path, a YAML string, a mapping, a Plan or a LoadedPlan; raises PlanError when invalid.

    Every source except a Plan (already validated) or a LoadedPlan (returned as is) goes through the
    linter: a plan that `planc lint` rejects does not load, and the PlanError carries the same
    diagnostics. Warnings are kept on `LoadedPlan.diagnostics`.

    `parallel` runs the plan at other sizes (`{"tp_size": 2, "ep_size": 2}`; keys left out keep the
    plan's values): the plan is loaded as written, then linted again with the sizes replaced, so
    the size rules (PLC500-PLC503) and the EP rules hold at the sizes that will run.
    """
    loaded = _load(source)
    return with_parallel(loaded, parallel) if parallel else loaded


def with_parallel(loaded: LoadedPlan, parallel: Mapping[str, int]) -> LoadedPlan:
    """`loaded` with its `parallel` sizes replaced, linted again; PlanError (naming the override) if that fails."""
    from planc.errors import PlanError
    from planc.lint import runner
    from planc.lint.context import LintContext

    if not isinstance(parallel, Mapping) or not set(parallel) <= set(PARALLEL_KEYS):
        unknown = sorted(set(parallel) - set(PARALLEL_KEYS)) if isinstance(parallel, Mapping) else parallel
        raise TypeError(f"parallel= takes a mapping with the keys {', '.join(PARALLEL_KEYS)}; got {unknown!r}")
    data = loaded.plan.model_dump(exclude_none=True)
    data.pop("extends", None)  # merged already
    data["parallel"] = {**data["parallel"], **dict(parallel)}
    # the sizes no longer come from the file: diagnostics about them point at its `parallel` key
    keys = {kp: p for kp, p in loaded.key_positions.items() if kp[:1] != ("parallel",) or len(kp) == 1}
    values = {kp: p for kp, p in loaded.value_positions.items() if kp[:1] != ("parallel",) or len(kp) == 1}
    result = runner.check_context(LintContext(data, None, loaded.path, keys, values))
    shown = ", ".join(f"{k}={v}" for k, v in parallel.items())
    errors = [d for d in result.diagnostics if d.severity == "error"]
    if errors or result.loaded is None:
        import dataclasses

        raise PlanError([dataclasses.replace(d, message=f"{d.message} (with parallel sizes {shown})")
                         for d in errors or result.diagnostics])
    result.loaded.docs = loaded.docs
    result.loaded.diagnostics = list(result.diagnostics)
    return result.loaded


def _load(source) -> LoadedPlan:
    from planc.errors import PlanError
    from planc.lint import runner
    from planc.spec.model import Plan

    if isinstance(source, LoadedPlan):
        return source
    if isinstance(source, Plan):
        return LoadedPlan(plan=source, path=None)
    if isinstance(source, Mapping):
        result = runner.check_data(dict(source))
    elif isinstance(source, os.PathLike) or (isinstance(source, str) and _looks_like_path(source)):
        path = os.fspath(source)
        not_a_file = _not_a_plan_file(path)
        if not_a_file is not None:
            raise PlanError([not_a_file])
        result = runner.check_file(path)
    elif isinstance(source, str):
        result = runner.check_text(source)
    else:
        raise TypeError(
            f"load_plan() takes a path, YAML text, a mapping, a Plan or a LoadedPlan, not {type(source).__name__}"
        )
    errors = [d for d in result.diagnostics if d.severity == "error"]
    if errors or result.loaded is None:
        raise PlanError(errors or result.diagnostics)
    result.loaded.diagnostics = list(result.diagnostics)
    return result.loaded
