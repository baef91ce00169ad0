"""What every compiler pass shares: a plan rule, and the problem collector.

Each pass (`match`, `checks`, `experts_assignments`, `layout`, `accounting`) is a set of functions
over one `Resolver` (`planc.compiler.resolve`); they report through `Resolver.problems`, which folds
the same problem on many layers into one line. The codes they report are registered beside the
checks that report them (`planc.lint.registry.compile_rule`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

from planc.compiler.compiled import CompileProblem, SourceRule, Table, Where
from planc.lint.diagnostic import Diagnostic
from planc.spec.source import KeyPath
from planc.compiler.walk import ModelWalk, generic_path
from planc.spec.patterns import Pattern

if TYPE_CHECKING:
    from planc.spec.loaded_plan import LoadedPlan
    from planc.spec.model import Parallel


TABLES: tuple[Table, ...] = ("tp_plan", "ep_plan")


class Resolution(Protocol):
    """What a pass reads and writes on the Resolver (`planc.compiler.resolve`), so no pass imports it."""

    loaded: LoadedPlan
    plan: Any  # planc.spec.model.Plan
    walk: ModelWalk
    parallel: Parallel
    tp: int
    ep: int
    active: dict[str, bool]  # "tp" / "ep": the table's size is above 1
    megamoe: bool
    problems: Problems
    warnings: list[Diagnostic]
    rules: list[PlanRule]
    by_dtype: dict[str, int]  # bytes per rank by dtype, filled by the accounting pass

    def sizes_hint(self, fallback: str) -> str: ...


@dataclass
class PlanRule:
    """One rule of the plan, with what it matched."""

    index: int
    table: Table
    pattern_text: str
    style: str
    source: SourceRule
    pattern: Optional[Pattern] = None
    targets: set[str] = field(default_factory=set)
    per_alternative: list[int] = field(default_factory=list)  # hit count per alternative

    @property
    def kind(self) -> str:
        return "tp" if self.table == "tp_plan" else "ep"


class Problems:
    """Collects problems, folding the same problem on many layers into one line with a count."""

    def __init__(self) -> None:
        self._groups: OrderedDict[tuple[str, str, str, str, Optional[str]], list[Optional[str]]] = OrderedDict()

    def add(self, code: str, message: str, where: str, hint: str, fqn: Optional[str] = None) -> None:
        key = (code, message, where, hint, generic_path(fqn) if fqn else None)
        self._groups.setdefault(key, []).append(fqn)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def build(self) -> list[Diagnostic]:
        out = []
        for (code, message, where, hint, generic), fqns in self._groups.items():
            concrete = list(dict.fromkeys(f for f in fqns if f))
            if not concrete:
                module = None
            elif len(concrete) == 1:
                module = concrete[0]
            else:
                module = f"{generic} ({len(concrete)} targets, e.g. {concrete[0]})"
            out.append(CompileProblem(code, message, module, where, hint))
        return out


def key_where(loaded: LoadedPlan, keypath: KeyPath) -> Where:
    pos = loaded.position(keypath)
    return Where(str(pos), pos) if pos is not None else Where(".".join(str(k) for k in keypath))


def source_rule(loaded: LoadedPlan, table: Table, pattern: str, style: str) -> SourceRule:
    pos = loaded.key_positions.get((table, pattern)) if loaded.key_positions else None
    if pos is None:
        return SourceRule(table, pattern, style)
    return SourceRule(table, pattern, style, pos.path or "<string>", pos.line, pos.col)
