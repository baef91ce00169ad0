"""LintContext: what a rule check sees — the merged plan data, the validated Plan, the positions.

Checks read the raw merged data for the rule tables (so style and pattern rules still run when some
other part of the plan fails validation) and `ctx.plan` for everything typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from planc.lint.diagnostic import Diagnostic
from planc.spec.patterns import MAX_ALTERNATIVES, Pattern, PatternError, try_pattern
from planc.spec.source import KeyPath, Position, nearest_key_position

TABLES = ("tp_plan", "ep_plan")

# Alternatives over all patterns of one plan: rules compare them pairwise (PLC406), so the total is
# bounded too. The shipped plans have under 40.
MAX_PLAN_ALTERNATIVES = 4 * MAX_ALTERNATIVES


def mapping_key(keypath: KeyPath) -> str:
    """Where a problem is in a plan given as a mapping: `<mapping>['experts']['ep_implementation']`."""
    return "<mapping>" + "".join(f"[{k!r}]" for k in keypath)


@dataclass
class LintContext:
    data: dict[str, Any]  # merged document (extends resolved), plain data
    plan: Any  # planc.spec.model.Plan, or None when validation failed
    path: Optional[str]
    key_positions: dict[KeyPath, Position]
    value_positions: dict[KeyPath, Position]
    _patterns: Optional[dict[tuple[str, str], "Pattern | PatternError"]] = field(default=None, repr=False, compare=False)

    def position(self, keypath: KeyPath) -> Position:
        """Position of a key, else of the nearest enclosing key, else the top of the file."""
        return nearest_key_position(self.key_positions, keypath, self.path)

    def value_position(self, keypath: KeyPath) -> Position:
        pos = self.value_positions.get(tuple(keypath))
        return pos if pos is not None and tuple(keypath) in self.key_positions else self.position(keypath)

    def written(self, keypath: KeyPath) -> bool:
        """Whether the key is written in the plan (or a parent it extends), not just a default."""
        return tuple(keypath) in self.key_positions

    def diag(
        self, code: str, message: str, hint: str, keypath: KeyPath = (), *, at_value: bool = False,
        fix: Optional[str] = None,
    ) -> Diagnostic:
        """`fix`: the text that replaces the key (or the value, `at_value`) when the hint is that sure of it."""
        from planc.lint.registry import severity_of

        # a plan given as a mapping: no text to point into (a text's root value has a position, even `{}`'s)
        if self.path is None and not self.key_positions and not self.value_positions:
            return Diagnostic(code, severity_of(code), message, hint, None, key=mapping_key(keypath))
        pos = self.value_position(keypath) if at_value else self.position(keypath)
        exact = tuple(keypath) in (self.value_positions if at_value else self.key_positions)
        return Diagnostic(code, severity_of(code), message, hint, pos, fix=fix if exact else None)

    def table(self, name: str) -> Iterator[tuple[str, str]]:
        """(pattern, style) entries of a rule table as written, skipping entries of the wrong type."""
        table = self.data.get(name) if isinstance(self.data, dict) else None
        if isinstance(table, dict):
            for pattern, style in table.items():
                if isinstance(pattern, str) and isinstance(style, str):
                    yield pattern, style

    def patterns(self, name: str) -> Iterator[tuple[str, str, "Pattern | PatternError"]]:
        """(pattern, style, parsed) of a rule table; past the plan's alternatives budget `parsed` is
        a PatternError, so no rule expands more than MAX_PLAN_ALTERNATIVES in total."""
        if self._patterns is None:
            self._patterns, total = {}, 0
            for table in TABLES:
                for pattern, _style in self.table(table):
                    parsed = try_pattern(pattern)
                    if isinstance(parsed, Pattern):
                        total += len(parsed.alternatives)
                        if total > MAX_PLAN_ALTERNATIVES:
                            parsed = PatternError(
                                pattern,
                                f"the plan's patterns expand to more than {MAX_PLAN_ALTERNATIVES} alternatives "
                                "in total up to this one",
                                "write fewer brace alternatives: use `*` for segments whose names do not matter",
                            )
                    self._patterns[(table, pattern)] = parsed
        for pattern, style in self.table(name):
            yield pattern, style, self._patterns[(name, pattern)]
