"""What every compiler pass shares: the problem codes, a plan rule, and the problem collector.

Each pass (`match`, `checks`, `layout`, `bytes`) is a set of functions over one `Resolver`
(`planc.compiler.resolve`); they report through `Resolver.problems`, which folds the same problem on
many layers into one line.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from planc.compiler.compiled import CompileProblem, SourceRule
from planc.compiler.walk import generic_path
from planc.spec.patterns import Pattern

# Problem codes (documented in docs/compile.md).
UNMATCHED_RULE = "PLC601"
EXPERTS_UNCOVERED = "PLC602"
CONFLICTING_RULES = "PLC603"
TP_ON_EP_EXPERTS = "PLC604"
STYLE_NOT_INSTALLABLE = "PLC605"
EXPERTS_NOT_DIVISIBLE = "PLC606"
MODEL_TYPE_MISMATCH = "PLC607"
MEGAMOE_NO_GATE = "PLC608"
MEGAMOE_TOP_K = "PLC609"
MEGAMOE_EP_SIZE = "PLC610"
MEGAMOE_SIZES = "PLC611"
MEGAMOE_NOT_FP4 = "PLC612"
WRONG_TARGET = "PLC613"
EP_RESOLUTION = "PLC614"
EXPERTS_PARTIAL = "PLC615"
UNEVEN_SHARD = "PLC616"
HEAD_SPLIT = "PLC617"
WRONG_TABLE = "PLC618"
BAD_PATTERN = "PLC619"
BAD_SIZES = "PLC620"
MEGAMOE_ACTIVATION = "PLC621"
MEGAMOE_KERNEL_BLOCKS = "PLC622"
BARE_PARAM_UNWRAPPED = "PLC623"
EXPERTS_IMPL_FIXED = "PLC624"
BLOCK_GRID = "PLC625"
# Layout pass (planc.compiler.layout).
LAYOUT_SHARDED_INTO_REPLICATED = "PLC630"
LAYOUT_ROWWISE_WITHOUT_SHARDED = "PLC631"
LAYOUT_OUTPUT_LEFT_SHARDED = "PLC632"
LAYOUT_NORM_OVER_SHARDED = "PLC633"
LAYOUT_PRODUCERS_DISAGREE = "PLC634"
LAYOUT_MODULE_PARAM_CONFLICT = "PLC635"
# Memory budget (planc.compiler.memory).
DEVICE_MEMORY = "PLC660"
# Warning codes.
REPLICATED_DENSE = "PLC651"
TABLE_INACTIVE = "PLC652"
MEGAMOE_ALIGNMENT = "PLC653"

@dataclass
class PlanRule:
    """One rule of the plan, with what it matched."""

    index: int
    table: str  # "tp_plan" | "ep_plan"
    pattern_text: str
    style: str
    source: SourceRule
    pattern: Optional[Pattern] = None
    targets: set = field(default_factory=set)
    per_alternative: list = field(default_factory=list)  # hit count per alternative

    @property
    def kind(self) -> str:
        return "tp" if self.table == "tp_plan" else "ep"


class Problems:
    """Collects problems, folding the same problem on many layers into one line with a count."""

    def __init__(self) -> None:
        self._groups: "OrderedDict[tuple, list]" = OrderedDict()

    def add(self, code: str, message: str, where: str, hint: str, fqn: Optional[str] = None) -> None:
        key = (code, message, where, hint, generic_path(fqn) if fqn else None)
        self._groups.setdefault(key, []).append(fqn)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def build(self) -> list[CompileProblem]:
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


def key_where(loaded, keypath: tuple) -> str:
    pos = loaded.position(keypath)
    return str(pos) if pos is not None else ".".join(str(k) for k in keypath)


def source_rule(loaded, table: str, pattern: str, style: str) -> SourceRule:
    pos = loaded.key_positions.get((table, pattern)) if loaded.key_positions else None
    if pos is None:
        return SourceRule(table, pattern, style)
    return SourceRule(table, pattern, style, pos.path or "<string>", pos.line, pos.col)
