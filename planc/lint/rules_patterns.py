"""Pattern rules: rule-table patterns that can never match a module path."""

from __future__ import annotations

from typing import Iterator

from planc.lint.context import TABLES, LintContext
from planc.lint.diagnostic import Diagnostic
from planc.lint.registry import rule
from planc.spec.patterns import PatternError

_HEAD = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n"

INVALID_PATTERN = "PLC300"


@rule(
    INVALID_PATTERN, "invalid-pattern", "A pattern can never match (empty segment, bad braces, glob syntax)",
    needs_plan=False,
    bad=_HEAD + "  model.layers.*.self_attn.{q,k,v_proj: colwise\n",
    good=_HEAD + "  model.layers.*.self_attn.{q,k,v}_proj: colwise\n",
)
def check_patterns(ctx: LintContext) -> Iterator[Diagnostic]:
    """A pattern is dot-separated segments: `*` is one whole segment, `{a,b}` lists alternatives inside
    a segment. Empty segments (`a..b`), unbalanced or nested braces, `*` inside a name (`q*`) and
    regex or glob characters can never match a module path, so the rule would silently do nothing.
    Brace groups multiply: a pattern may expand to at most 256 alternatives and a plan to 1024 in
    total (the count is computed before expanding), so a hostile plan cannot make lint, compile or
    apply take unbounded time or memory."""
    for table in TABLES:
        for pattern, _style, parsed in ctx.patterns(table):
            if isinstance(parsed, PatternError):
                yield ctx.diag(
                    INVALID_PATTERN,
                    f"{table} pattern `{pattern}` can never match: {parsed.problem}",
                    parsed.hint,
                    (table, pattern),
                )
