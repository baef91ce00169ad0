"""load_plan(): a plan source -> LoadedPlan (the merged, validated Plan plus positions).

`extends` merges the parent first (mappings key by key, the child wins; rule tables by pattern);
positions point at whichever file the winning key came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from pydantic import ValidationError

from planc.spec.model import Plan
from planc.spec.source import Position, SourceDoc, SourceError, parse_yaml

MAX_PLAN_BYTES = 1 << 20


@dataclass
class LoadedPlan:
    """A validated plan and where each of its keys was written."""

    plan: Plan
    path: Optional[str]
    docs: list = field(default_factory=list)  # SourceDocs, child first
    key_positions: dict = field(default_factory=dict)

    def position(self, keypath) -> Optional[Position]:
        keypath = tuple(keypath)
        while keypath:
            pos = self.key_positions.get(keypath)
            if pos is not None:
                return pos
            keypath = keypath[:-1]
        return Position(self.path, 1, 1) if self.path else None


class LoadError(Exception):
    """A problem found while loading, before validation (used by load_plan to build diagnostics)."""

    def __init__(self, code: str, message: str, hint: str, position: Optional[Position]):
        super().__init__(message)
        self.code, self.message, self.hint, self.position = code, message, hint, position


def read_source(path: str) -> SourceDoc:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
    except OSError as e:
        raise LoadError("PLC002", f"cannot read plan: {e.strerror}", "check the path", Position(path, 1, 1)) from None
    if len(raw) > MAX_PLAN_BYTES:
        raise LoadError("PLC002", "plan file is larger than 1 MiB", "plans are small: split or trim it", Position(path, 1, 1))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise LoadError("PLC002", "plan is not valid UTF-8", "save the file as UTF-8", Position(path, line, 1)) from None
    return parse_yaml(text, path)


def _merge(parent: dict, child: dict) -> dict:
    out = dict(parent)
    for k, v in child.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _collect(doc: SourceDoc, root_dir: str, seen: tuple[str, ...]) -> tuple[dict, dict, list]:
    """Resolve `extends` chains: returns (merged data, key positions, docs child-first)."""
    data = doc.data
    if not isinstance(data, dict):
        raise LoadError(
            "PLC003", "a plan must be a YAML mapping", "start from `version: 1` and `model: {type: ...}`",
            Position(doc.path, 1, 1),
        )
    positions: dict = {}
    docs = [doc]
    parent_data: dict = {}
    ext = data.get("extends")
    if isinstance(ext, str) and doc.path:
        parent_path = os.path.realpath(os.path.join(os.path.dirname(doc.path), ext))
        where = doc.value_position(("extends",))
        if os.path.commonpath([parent_path, root_dir]) != root_dir:
            raise LoadError(
                "PLC004", f"`extends: {ext}` leaves the directory tree of the linted plan ({root_dir})",
                "keep parent plans next to or below the plan that extends them", where,
            )
        if parent_path in seen:
            chain = " -> ".join(os.path.basename(s) for s in seen + (parent_path,))
            raise LoadError("PLC004", f"`extends` cycle: {chain}", "remove the `extends` that closes the cycle", where)
        if not os.path.isfile(parent_path):
            raise LoadError("PLC004", f"`extends: {ext}`: no such file", "give a path relative to this plan", where)
        parent_doc = read_source(parent_path)
        parent_data, positions, parent_docs = _collect(parent_doc, root_dir, seen + (parent_path,))
        docs += parent_docs
    merged = _merge(parent_data, {k: v for k, v in data.items() if k != "extends"})
    if "extends" in data:
        merged["extends"] = data["extends"]
    positions = {**positions, **doc.key_positions}
    return merged, positions, docs


def load_document(doc: SourceDoc) -> tuple[dict, dict, list]:
    """Merge a parsed document with its parents; returns (data, key positions, docs)."""
    root_dir = os.path.dirname(os.path.realpath(doc.path)) if doc.path else os.getcwd()
    seen = (os.path.realpath(doc.path),) if doc.path else ()
    return _collect(doc, root_dir, seen)


def validate(data: Mapping[str, Any]) -> Plan:
    return Plan.model_validate(dict(data))


def load_plan(source) -> LoadedPlan:
    """Load a plan from a path, a YAML string, a mapping or a LoadedPlan; raises PlanError when invalid."""
    from planc.errors import PlanError

    if isinstance(source, LoadedPlan):
        return source
    if isinstance(source, Plan):
        return LoadedPlan(plan=source, path=None)
    if isinstance(source, Mapping):
        try:
            return LoadedPlan(plan=validate(source), path=None)
        except ValidationError as e:
            from planc.lint.runner import diagnostics_from_validation

            raise PlanError(diagnostics_from_validation(e, None, {})) from None
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml"))):
        path = os.fspath(source)
        from planc.lint.runner import lint_file

        diags = lint_file(path)
        errors = [d for d in diags if d.severity == "error"]
        if errors:
            raise PlanError(errors)
        doc = read_source(path)
        data, positions, docs = load_document(doc)
        return LoadedPlan(plan=validate(data), path=path, docs=docs, key_positions=positions)
    if isinstance(source, str):
        from planc.lint.runner import lint_text

        diags = lint_text(source)
        errors = [d for d in diags if d.severity == "error"]
        if errors:
            raise PlanError(errors)
        doc = parse_yaml(source, None)
        data, positions, docs = load_document(doc)
        return LoadedPlan(plan=validate(data), path=None, docs=docs, key_positions=positions)
    raise TypeError(f"load_plan() takes a path, YAML text, a mapping or a LoadedPlan, not {type(source).__name__}")
