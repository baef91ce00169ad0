"""Plan sources -> LoadedPlan (the merged, validated Plan plus positions): extends, merge, validation.

`extends` merges the parent first (mappings key by key, the child wins; rule tables by pattern);
positions point at whichever file the winning key came from. A parent must live inside the directory
tree of the plan that was loaded first, so a plan in a repository cannot make the linter read
`/etc/passwd` or a file outside the checkout; `extends: planc:NAME` names a shipped plan instead. `load_plan`
itself lives one layer up, in `planc.lint.plan_loader`: loading goes through the linter, so `load_plan` and
`planc lint` reject exactly the same plans with exactly the same diagnostics.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from planc.spec.shipped import PLANS_DIR, SHIPPED_PREFIX, shipped_names, shipped_reference
from planc.spec.source import (
    NOT_A_MAPPING,
    KeyPath,
    Position,
    SourceDoc,
    SourceError,
    nearest_key_position,
    parse_yaml,
    read_text,
)

if TYPE_CHECKING:
    from planc.spec.model import Plan

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
    docs: list[SourceDoc] = field(default_factory=list)  # child first
    key_positions: dict[KeyPath, Position] = field(default_factory=dict)
    value_positions: dict[KeyPath, Position] = field(default_factory=dict)
    diagnostics: list[Any] = field(default_factory=list)  # planc.lint Diagnostics: a layer up  # warnings the linter found (errors raise instead)

    def position(self, keypath: KeyPath) -> Optional[Position]:
        """Position of a key, else of the nearest enclosing key, else the top of the file."""
        if not self.key_positions and not self.path:
            return None  # built from a mapping or a Plan: there is no source to point at
        return nearest_key_position(self.key_positions, keypath, self.path)

    def value_position(self, keypath: KeyPath) -> Optional[Position]:
        return self.value_positions.get(tuple(keypath)) or self.position(keypath)


@dataclass
class MergedSource:
    """A document with its `extends` chain merged in, before validation."""

    data: dict[str, Any]
    path: Optional[str]
    docs: list[SourceDoc]  # child first
    key_positions: dict[KeyPath, Position]
    value_positions: dict[KeyPath, Position]
    problems: list[SourceError]  # non-fatal SourceErrors of every document in the chain


def _real_dir(doc: SourceDoc) -> str:
    """The resolved directory a document's relative `extends` starts from (the working directory for text)."""
    return os.path.dirname(os.path.realpath(doc.path)) if doc.path else os.getcwd()


def resolve_extends(doc: SourceDoc, root_dir: Optional[str] = None) -> MergedSource:
    """Merge `doc` with its parents. `root_dir`: the tree parents must stay in (default: doc's directory)."""
    if root_dir is None:
        root_dir = _real_dir(doc)
    seen = (os.path.realpath(doc.path),) if doc.path else ()
    return _collect(doc, os.path.realpath(root_dir), seen)


def _collect(doc: SourceDoc, root_dir: str, seen: tuple[str, ...]) -> MergedSource:
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
    if ext.startswith(SHIPPED_PREFIX):
        parent, root_dir = _shipped_parent(doc, ext, seen), os.path.realpath(PLANS_DIR)
    else:
        parent = _parent_doc(doc, ext, root_dir, seen)
    assert parent.path is not None  # read from a file
    merged = _collect(parent, root_dir, seen + (os.path.realpath(parent.path),))
    return _merge(merged, doc)


def _shipped_parent(doc: SourceDoc, ext: str, seen: tuple[str, ...]) -> SourceDoc:
    """The shipped plan `extends: planc:NAME` names: customising a shipped plan takes no copy of it. It is read from
    the package (its own `extends` stay inside the shipped plans) and diagnostics in it name its file."""
    where = doc.value_position(("extends",)) or Position(doc.path, 1, 1)
    found = shipped_reference(ext)
    if found is None:
        names = shipped_names()
        raise SourceError(
            EXTENDS_MISSING,
            f"`extends: {ext}`: planc ships no plan named `{ext[len(SHIPPED_PREFIX):]}`",
            f"write `extends: planc:NAME` with one of: {', '.join(names)}" if names
            else "this planc was installed without its shipped plans: reinstall it, or extend a plan file",
            where,
        )
    real = os.path.realpath(found)
    _check_chain(real, seen, where)
    return parse_yaml(read_text(real), str(found))


def _check_chain(real: str, seen: tuple[str, ...], where: Position) -> None:
    """PLC201 when the parent `real` closes a cycle or makes the chain deeper than MAX_EXTENDS_DEPTH."""
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


_NUL_SHOWN = "\\0"


def _parent_doc(doc: SourceDoc, ext: str, root_dir: str, seen: tuple[str, ...]) -> SourceDoc:
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
    if not ext.strip() or os.path.isabs(ext) or "\x00" in ext:  # a NUL byte is no path (os.path raises on it)
        raise SourceError(
            EXTENDS_OUTSIDE,
            f"`extends: {ext.replace(chr(0), _NUL_SHOWN)}` must be a path relative to this plan",
            "write the parent's path relative to this plan's directory, e.g. `extends: base.yaml`",
            where,
        )
    shown = os.path.normpath(os.path.join(base, ext))
    real = os.path.realpath(os.path.join(_real_dir(doc), ext))
    if os.path.commonpath([real, root_dir]) != root_dir:
        raise SourceError(
            EXTENDS_OUTSIDE,
            f"`extends: {ext}` points outside the directory tree of the linted plan ({root_dir})",
            "keep the parent plan next to or below the plan that is linted, and give a relative path",
            where,
        )
    _check_chain(real, seen, where)
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
            e.position = dataclasses.replace(e.position, path=shown)
        raise


def _merge(parent: MergedSource, child: SourceDoc) -> MergedSource:
    """Child over parent: mappings merge key by key, anything else is replaced (with its positions)."""
    replaced: set[KeyPath] = set()  # key paths where the child's value replaced the parent's subtree

    def merge(p: dict[str, Any], c: dict[str, Any], prefix: KeyPath) -> dict[str, Any]:
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

    def keep(kp: KeyPath) -> bool:
        return not any(kp[:i] in replaced for i in range(1, len(kp) + 1))

    keys = {kp: pos for kp, pos in parent.key_positions.items() if keep(kp) and kp != ("extends",)}
    values = {kp: pos for kp, pos in parent.value_positions.items() if keep(kp) and kp != ("extends",)}
    keys.update(child.key_positions)
    values.update(child.value_positions)
    return MergedSource(
        data, child.path, [child, *parent.docs], keys, values, list(child.problems) + parent.problems
    )


def validate(data: Mapping[str, Any]) -> Plan:
    """The pydantic Plan of merged data; raises pydantic.ValidationError."""
    from planc.spec.model import Plan

    return Plan.model_validate(dict(data))
