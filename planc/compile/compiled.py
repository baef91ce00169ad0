"""CompiledPlan: the complete, immutable answer to "what will apply do to this model".

Every concrete parameter and module with its style (a module's parameters always before the module:
transformers computes silently wrong results otherwise), every experts module with its EP strategy,
the sizes, per-rank bytes, and a fingerprint that ranks compare before installing anything.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Literal, Optional

from planc.compile.ep import EPStrategy
from planc.spec.model import Experts, Parallel


@dataclass(frozen=True)
class SourceRule:
    """The plan rule an assignment came from, with its position for error messages."""

    table: Literal["tp_plan", "ep_plan"]
    pattern: str
    style: str
    file: Optional[str] = None
    line: Optional[int] = None
    col: Optional[int] = None

    @property
    def where(self) -> str:
        if self.file and self.line:
            return f"{self.file}:{self.line}:{self.col or 1}"
        return f"{self.table}[{self.pattern!r}]"


@dataclass(frozen=True)
class Assignment:
    """One concrete target (parameter or module) and the style installed on it."""

    fqn: str
    target: Literal["parameter", "module"]
    style: str
    rule: SourceRule


@dataclass(frozen=True)
class ExpertsAssignment:
    """An experts module (transformers experts contract) and how it runs under this plan."""

    fqn: str
    strategy: Optional[EPStrategy]  # None when the experts are tensor-parallel (moe_tp_experts) or replicated
    num_experts: int
    num_local_experts: int
    top_k: Optional[int]
    hidden_size: Optional[int]
    intermediate_size: Optional[int]
    has_gate: bool
    is_fp4: bool


@dataclass(frozen=True)
class CompileWarning:
    code: str
    message: str
    hint: str
    where: str


@dataclass(frozen=True)
class RuleCoverage:
    """What one rule matched: the numbers `planc explain` prints per pattern."""

    rule: SourceRule
    modules: int
    parameters: int
    bytes_total: int
    bytes_per_rank: int


@dataclass(frozen=True)
class CompiledPlan:
    model_type: str
    model_class: str
    parallel: Parallel
    experts_settings: Experts
    assignments: tuple[Assignment, ...]
    experts: tuple[ExpertsAssignment, ...]
    coverage: tuple[RuleCoverage, ...]
    bytes_sharded_per_rank: int
    bytes_replicated_per_rank: int
    warnings: tuple[CompileWarning, ...] = ()
    fingerprint: str = field(default="")

    def __post_init__(self) -> None:
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", _fingerprint(self))

    @property
    def bytes_per_rank(self) -> int:
        return self.bytes_sharded_per_rank + self.bytes_replicated_per_rank

    def assignment_for(self, fqn: str) -> Optional[Assignment]:
        for a in self.assignments:
            if a.fqn == fqn:
                return a
        return None

    def to_json(self) -> dict:
        """Canonical, JSON-ready form (also what the fingerprint hashes, minus the fingerprint)."""
        return {
            "model_type": self.model_type,
            "model_class": self.model_class,
            "parallel": self.parallel.model_dump(),
            "experts_settings": self.experts_settings.model_dump(),
            "assignments": [
                {"fqn": a.fqn, "target": a.target, "style": a.style, "table": a.rule.table, "pattern": a.rule.pattern}
                for a in self.assignments
            ],
            "experts": [
                {
                    "fqn": e.fqn,
                    "strategy": e.strategy.to_json() if e.strategy else None,
                    "num_experts": e.num_experts,
                    "num_local_experts": e.num_local_experts,
                    "top_k": e.top_k,
                    "hidden_size": e.hidden_size,
                    "intermediate_size": e.intermediate_size,
                    "has_gate": e.has_gate,
                    "is_fp4": e.is_fp4,
                }
                for e in self.experts
            ],
            "bytes_sharded_per_rank": self.bytes_sharded_per_rank,
            "bytes_replicated_per_rank": self.bytes_replicated_per_rank,
        }

    def __str__(self) -> str:
        from planc.compile.render import render_text

        return render_text(self)


def _fingerprint(plan: CompiledPlan) -> str:
    blob = json.dumps(plan.to_json(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
