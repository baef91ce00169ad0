"""Rewrite removed styles into the current plan form, as a text edit that keeps everything else.

A plan is reviewed code: its comments explain its choices. So the migration never re-serialises the
YAML; it edits single lines at the positions the positional parser reports, and every line it does
not touch stays byte for byte. The rewrites (transformers >= 5.23 removed the old styles):

- `megamoe_router` / `ep_router` rules: dropped (the EP implementation remaps expert ids itself and
  Mega MoE takes global ids); a trailing comment on the dropped line is kept as a comment line.
- `megamoe_experts` -> `ep_dispatch_experts` (moved to ep_plan if written in tp_plan), and
  `experts.implementation: deepgemm_megamoe` added or set, since the style implied it; an
  `ep_implementation` other than `auto`/`deepgemm_megamoe` becomes `auto`.
- `moe_tp_experts` in ep_plan: when ep_plan shards that module's parameters by expert (`grouped_gemm`)
  it was the old EP experts rule and becomes `ep_dispatch_experts` (with `ep_implementation:
  all_reduce` when an `ep_router` rule was dropped: that pair was the old masked all-reduce EP);
  otherwise it is tensor parallelism and moves to tp_plan.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Optional

from planc.errors import PlancError
from planc.spec.pairings import MEGAMOE_EXPERTS_EP
from planc.spec.source import Position, SourceDoc, parse_yaml

ROUTER_STYLES = ("megamoe_router", "ep_router")
MEGAMOE_STYLES = ("megamoe_router", "megamoe_experts")
_EXPERTS_OK_EP = MEGAMOE_EXPERTS_EP.allowed  # what Mega MoE experts run under: `auto` or their own strategy


class MigrateError(PlancError, ValueError):
    """A plan the line editor cannot rewrite safely (e.g. a rule table in flow style `{a: b}`)."""


@dataclass
class Migration:
    original: str
    text: str
    changes: list[str] = field(default_factory=list)  # one sentence per rewrite, for the CLI

    @property
    def changed(self) -> bool:
        return self.text != self.original

    def diff(self, path: str = "plan.yaml") -> str:
        return "".join(
            difflib.unified_diff(
                self.original.splitlines(keepends=True),
                self.text.splitlines(keepends=True),
                fromfile=f"a/{path}",
                tofile=f"b/{path}",
            )
        )


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" "))]


def _newline(lines: list[str]) -> str:
    return "\r\n" if lines and lines[0].endswith("\r\n") else "\n"


def _trailing_comment(line: str, value_col: int) -> Optional[str]:
    m = re.search(r"\s#.*$", line[value_col - 1 :].rstrip("\r\n"))
    return m.group(0).strip() if m else None


def _replace_value(line: str, col: int, old: str, new: str) -> str:
    """Replace the scalar `old` (plain or quoted) that starts at 1-based `col` with `new`."""
    i = col - 1
    for quote in ("", "'", '"'):
        token = f"{quote}{old}{quote}"
        if line.startswith(token, i):
            return line[:i] + f"{quote}{new}{quote}" + line[i + len(token) :]
    raise MigrateError(f"cannot find `{old}` at column {col} of: {line.rstrip()}")


class _Editor:
    """Line edits keyed by 0-based line index, applied bottom-up so indices stay valid."""

    def __init__(self, text: str):
        self.lines = text.splitlines(keepends=True)
        if self.lines and not self.lines[-1].endswith("\n"):
            self.lines[-1] += _newline(self.lines)
            self.added_final_newline = True
        else:
            self.added_final_newline = False
        self.nl = _newline(self.lines)
        self.replace: dict[int, list[str]] = {}
        self.insert_after: dict[int, list[str]] = {}
        self.append: list[str] = []

    def line(self, i: int) -> str:
        return self.replace[i][0] if self.replace.get(i) else self.lines[i]

    def set(self, i: int, new_lines: list[str]) -> None:
        self.replace[i] = new_lines

    def add_after(self, i: int, new_lines: list[str]) -> None:
        self.insert_after.setdefault(i, []).extend(new_lines)

    def result(self) -> str:
        out = list(self.lines)
        for i in sorted(set(self.replace) | set(self.insert_after), reverse=True):
            after = self.insert_after.get(i, [])
            out[i + 1 : i + 1] = after
            if i in self.replace:
                out[i : i + 1] = self.replace[i]
        out.extend(self.append)
        text = "".join(out)
        if self.added_final_newline and text.endswith(self.nl) and not self.append:
            text = text[: -len(self.nl)]
        return text


def _at(position: Optional[Position]) -> Position:
    """The position of a key this migration read from the document (so it was written there)."""
    assert position is not None
    return position


def _rules(doc: SourceDoc, table: str) -> list[tuple[str, str]]:
    data = doc.data.get(table) if isinstance(doc.data, dict) else None
    return list(data.items()) if isinstance(data, dict) else []


def _block_table(doc: SourceDoc, table: str) -> None:
    """Refuse tables in flow style: one rule per line is what the editor relies on."""
    tpos = doc.key_position((table,))
    for pattern, _ in _rules(doc, table):
        kpos, vpos = doc.key_position((table, pattern)), doc.value_position((table, pattern))
        if kpos is None or vpos is None or tpos is None or kpos.line == tpos.line or kpos.line != vpos.line:
            raise MigrateError(
                f"`{table}` must be written one rule per line (block style) for `planc migrate`; "
                f"rewrite `{table}: {{...}}` as an indented mapping first"
            )


def migrate_text(text: str, path: Optional[str] = None) -> Migration:
    """Rewrite removed styles; returns the Migration (unchanged text when nothing needed rewriting)."""
    doc = parse_yaml(text, path)
    if not isinstance(doc.data, dict):
        raise MigrateError("a plan is a YAML mapping")
    for table in ("tp_plan", "ep_plan"):
        _block_table(doc, table)
    ed = _Editor(text)
    changes: list[str] = []
    tp_rules, ep_rules = _rules(doc, "tp_plan"), _rules(doc, "ep_plan")
    styles = {s for _, s in tp_rules + ep_rules}
    dropped_ep_router = False
    moves: dict[str, list[str]] = {"tp_plan": [], "ep_plan": []}

    def lineno(table: str, pattern: str) -> int:
        return _at(doc.key_position((table, pattern))).line - 1

    for table, rules in (("tp_plan", tp_rules), ("ep_plan", ep_rules)):
        for pattern, style in rules:
            i = lineno(table, pattern)
            vpos = _at(doc.value_position((table, pattern)))
            line = ed.lines[i]
            if style in ROUTER_STYLES:
                comment = _trailing_comment(line, vpos.col)
                ed.set(i, [f"{_indent(line)}{comment}{ed.nl}"] if comment else [])
                dropped_ep_router |= style == "ep_router"
                changes.append(f"dropped `{pattern}: {style}` from {table} (no router rule is needed)")
            elif style == "megamoe_experts":
                new = _replace_value(line, vpos.col, style, "ep_dispatch_experts")
                if table == "tp_plan":
                    ed.set(i, [])
                    moves["ep_plan"].append(new.lstrip(" "))
                    changes.append(f"`{pattern}: megamoe_experts` -> `ep_dispatch_experts`, moved to ep_plan")
                else:
                    ed.set(i, [new])
                    changes.append(f"`{pattern}: megamoe_experts` -> `ep_dispatch_experts`")
            elif style == "moe_tp_experts" and table == "ep_plan":
                by_expert = any(
                    s == "grouped_gemm" and p.startswith(pattern + ".") for p, s in ep_rules
                )
                if by_expert:
                    ed.set(i, [_replace_value(line, vpos.col, style, "ep_dispatch_experts")])
                    changes.append(
                        f"`{pattern}: moe_tp_experts` in ep_plan -> `ep_dispatch_experts` (its parameters are "
                        "sharded by expert)"
                    )
                else:
                    ed.set(i, [])
                    moves["tp_plan"].append(line.lstrip(" "))
                    changes.append(f"moved `{pattern}: moe_tp_experts` from ep_plan to tp_plan")
    if dropped_ep_router and "moe_tp_experts" in {s for _, s in ep_rules}:
        _set_experts_key(ed, doc, "ep_implementation", "all_reduce", changes, only_if_absent=True)
    if styles & set(MEGAMOE_STYLES):
        _set_experts_key(ed, doc, "implementation", MEGAMOE_EXPERTS_EP.value or "", changes)
        experts = doc.data.get("experts")
        ep = experts.get("ep_implementation") if isinstance(experts, dict) else None
        if ep is not None and ep not in _EXPERTS_OK_EP:
            _set_experts_key(ed, doc, "ep_implementation", "auto", changes)
    for table, new_lines in moves.items():
        if new_lines:
            _append_rules(ed, doc, table, new_lines)
    for table, rules in (("tp_plan", tp_rules), ("ep_plan", ep_rules)):
        emptied = rules and all(ed.replace.get(lineno(table, p)) == [] for p, _ in rules)
        if emptied and not moves[table]:  # `table:` with nothing under it is null, which does not validate
            i = _at(doc.key_position((table,))).line - 1
            head = ed.line(i).rstrip("\r\n")
            m = re.match(r"^(\s*\S+:)(\s*#.*)?$", head)
            if m:
                ed.set(i, [f"{m.group(1)} {{}}{m.group(2) or ''}{ed.nl}"])
    return Migration(text, ed.result(), changes)


def _set_experts_key(
    ed: _Editor, doc: SourceDoc, key: str, value: str, changes: list[str], only_if_absent: bool = False
) -> None:
    experts = doc.data.get("experts")
    if isinstance(experts, dict) and key in experts:
        if only_if_absent or experts[key] == value:
            return
        vpos = _at(doc.value_position(("experts", key)))
        i = vpos.line - 1
        ed.set(i, [_replace_value(ed.line(i), vpos.col, str(experts[key]), value)])
        changes.append(f"experts.{key}: {experts[key]} -> {value}")
        return
    if isinstance(experts, dict):
        kpos = _at(doc.key_position(("experts",)))
        children = [c for c in (doc.key_position(("experts", k)) for k in experts) if c is not None]
        if children and children[0].line == kpos.line:
            raise MigrateError("`experts` is written in flow style `{...}`: add `" + key + ": " + value + "` yourself")
        indent = " " * ((children[0].col - 1) if children else kpos.col + 1)
        ed.add_after(kpos.line - 1, [f"{indent}{key}: {value}{ed.nl}"])
    else:
        # no experts block: put one before the first rule table (or at the end)
        firsts = [f for f in (doc.key_position((t,)) for t in ("tp_plan", "ep_plan") if t in doc.data) if f is not None]
        block = [f"experts:{ed.nl}", f"  {key}: {value}{ed.nl}"]
        if firsts:
            ed.add_after(min(f.line for f in firsts) - 2, block)  # -1 inserts before the first line
        else:
            ed.append.extend(block)
    changes.append(f"added experts.{key}: {value}")


def _append_rules(ed: _Editor, doc: SourceDoc, table: str, new_lines: list[str]) -> None:
    rules = _rules(doc, table)
    if rules:
        last = max(_at(doc.key_position((table, p))).line for p, _ in rules) - 1
        indent = " " * (_at(doc.key_position((table, rules[0][0]))).col - 1)
        ed.add_after(last, [indent + ln for ln in new_lines])
        return
    tpos = doc.key_position((table,))
    if tpos is not None:  # `table: {}` or `table:` with nothing under it
        i = tpos.line - 1
        head = re.sub(r":\s*(\{\s*\}|null|~)?\s*(#.*)?$", lambda m: ":" + (f"  {m.group(2)}" if m.group(2) else ""),
                      ed.line(i).rstrip("\r\n"))
        ed.set(i, [head + ed.nl] + ["  " + ln for ln in new_lines])
        return
    ed.append.extend([f"{table}:{ed.nl}"] + ["  " + ln for ln in new_lines])
