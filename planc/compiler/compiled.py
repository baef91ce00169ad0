"""CompiledPlan: the complete, immutable answer to "what will apply do to this model".

Every concrete parameter and module with its style (a module's parameters always before the module:
transformers computes silently wrong results otherwise), every experts module with its EP strategy,
the sizes, per-rank bytes, and a fingerprint that ranks compare before installing anything.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from planc.lint.diagnostic import ERROR, WARNING, Diagnostic
from planc.spec.choices import DATA_PARALLEL_MODES, DataParallelMode, ExpertsImplementation
from planc.spec.ep import EPStrategy
from planc.spec.model import Experts, Parallel, Training
from planc.spec.source import Position


Table = Literal["tp_plan", "ep_plan"]  # the plan table a rule is written in


@dataclass(frozen=True)
class SourceRule:
    """The plan rule an assignment came from, with its position for error messages."""

    table: Table
    pattern: str
    style: str
    file: Optional[str] = None
    line: Optional[int] = None
    col: Optional[int] = None

    @property
    def where(self) -> "Where":
        if self.file and self.line:
            return Where(f"{self.file}:{self.line}:{self.col or 1}", Position(self.file, self.line, self.col or 1))
        return Where(f"{self.table}[{self.pattern!r}]")


@dataclass(frozen=True)
class Assignment:
    """One concrete target (parameter or module) and the style installed on it.

    `inherited`: a parameter that has no rule of its own and takes its module's TP style, as in
    transformers (a `colwise` rule on `q_proj` shards `q_proj.weight` and `q_proj.bias`).
    """

    fqn: str
    target: Literal["parameter", "module"]
    style: str
    rule: SourceRule
    inherited: bool = False

    @property
    def table(self) -> Literal["tp", "ep"]:
        return "tp" if self.rule.table == "tp_plan" else "ep"


@dataclass(frozen=True)
class ExpertsAssignment:
    """An experts module (transformers experts contract) and how it runs under this plan."""

    fqn: str
    # None when the experts are tensor-parallel (moe_tp_experts) or replicated, except under Mega MoE:
    # experts with an EP strategy of their own (Mega MoE) always carry it, also at ep_size 1 (the kernel needs
    # its process group)
    strategy: Optional[EPStrategy]
    num_experts: int
    num_local_experts: int
    top_k: Optional[int]
    hidden_size: Optional[int]
    intermediate_size: Optional[int]
    has_gate: bool
    is_fp4: bool
    # "ep" (ep_dispatch_experts), "tp" (moe_tp_experts) or None (replicated: only when tp and ep sizes are 1)
    mode: Optional[Literal["ep", "tp"]] = None
    is_transposed: bool = False
    # "routed": forward(hidden_states, top_k_index, top_k_weights); "dense": every token pre-scaled (Llama 4), run
    # expert-parallel by planc.runtime.ep.dense whatever the strategy says
    dispatch: str = "routed"


class Where(str):
    """A plan location as text (`file:line:col`, or `tp_plan['pattern']` for a plan built in code) that
    also carries its Position, so compile diagnostics get the same shape as lint's."""

    position: Optional[Position] = None

    def __new__(cls, text: str, position: Optional[Position] = None) -> "Where":
        obj = super().__new__(cls, text)
        obj.position = position
        return obj


def _at(where: str) -> dict[str, Any]:
    position = getattr(where, "position", None)
    return {"position": position} if position is not None else {"key": str(where)}


def CompileProblem(code: str, message: str, module: Optional[str], where: str, hint: str) -> Diagnostic:  # CamelCase: reads as the problem it builds
    """One reason the plan does not resolve, as a Diagnostic: what, which module, which plan line, what instead."""
    return Diagnostic(code, ERROR, message, hint, module=module, **_at(where))


def CompileWarning(code: str, message: str, hint: str, where: str) -> Diagnostic:
    """A compile warning, as a Diagnostic (severity `warning`)."""
    return Diagnostic(code, WARNING, message, hint, **_at(where))


@dataclass(frozen=True)
class RuleCoverage:
    """What one rule matched: the numbers `planc explain` prints per pattern."""

    rule: SourceRule
    modules: int
    parameters: int
    bytes_total: int
    bytes_per_rank: int
    active: bool = True  # False: the table's size is 1, so the rule matched but installs nothing
    example: Optional[str] = None  # one concrete target it matched


@dataclass(frozen=True)
class ReplicatedGroup:
    """Parameters no rule shards, grouped by generic module path (`model.layers.*.input_layernorm`)."""

    path: str
    modules: int
    parameters: int
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
    warnings: tuple[Diagnostic, ...] = ()
    fingerprint: str = field(default="")
    plan_name: Optional[str] = None
    plan_path: Optional[str] = None
    bytes_total: int = 0  # all parameters, unsharded (tied tensors once)
    replicated: tuple[ReplicatedGroup, ...] = ()  # dense weights left whole on every rank, by generic path
    bytes_per_rank_by_dtype: tuple[tuple[str, int], ...] = ()  # (dtype, bytes) largest first
    training: Optional[Training] = None  # the plan's `training:` section; None: not declared (replicate)

    @property
    def mesh_dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(sizes, names) of the root DeviceMesh `planc.apply` builds for these sizes (planc.runtime.mesh)."""
        from planc.spec.sizes import mesh_dims

        p = self.parallel
        return mesh_dims(p.tp_size, p.ep_size, p.dp_size)

    @property
    def data_parallel(self) -> str:
        """How the dp replicas train: the plan's `training.data_parallel`, `replicate` when not declared."""
        return self.data_parallel_mode.name

    @property
    def data_parallel_mode(self) -> DataParallelMode:
        """The row of `data_parallel` (planc.spec.choices): what installs and the training bytes ask of it."""
        if self.training is not None:
            return self.training.data_parallel_row
        return DATA_PARALLEL_MODES[Training.model_fields["data_parallel"].default]

    @property
    def data_parallel_wraps(self) -> bool:
        """Whether `planc.runtime.data_parallel` wraps the model in FSDP2 units (every parameter then a DTensor):
        more than one replica, experts that several ranks hold alike (world / ep_size > 1), or mixed precision; never
        with inference-only experts (Mega MoE). One replica with nothing to shard is left as TP/EP made it."""
        if any(e.strategy is not None and e.strategy.inference_only for e in self.experts):
            return False
        p = self.parallel
        holders = p.tp_size * p.dp_size // p.ep_size if p.ep_size > 1 else 1
        mixed = self.training is not None and self.training.mixed_precision is not None
        return p.dp_size > 1 or holders > 1 or mixed

    @property
    def experts_implementation(self) -> ExpertsImplementation:
        """The row of `experts.implementation` (planc.spec.choices): what install and checkpoint ask of the kernel."""
        return self.experts_settings.implementation_row

    def __post_init__(self) -> None:
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", _fingerprint(self))

    @property
    def bytes_per_rank(self) -> int:
        return self.bytes_sharded_per_rank + self.bytes_replicated_per_rank

    @property
    def experts_covered(self) -> int:
        """Experts modules that run expert- or tensor-parallel under this plan."""
        return sum(1 for e in self.experts if e.mode is not None)

    @property
    def full_coverage(self) -> bool:
        """Experts were found, every one is sharded (compile refuses otherwise when a size is > 1), and every
        rule matched. Never full with no experts module: a plan for an MoE model that finds none shards
        nothing of what matters (planc init's llama4_text plan once reported 198 of 200 GiB replicated as full)."""
        sharding = self.parallel.tp_size > 1 or self.parallel.ep_size > 1
        return bool(self.experts) and (not sharding or self.experts_covered == len(self.experts)) and all(
            c.modules + c.parameters > 0 for c in self.coverage
        )

    def assignment_for(self, fqn: str) -> Optional[Assignment]:
        for a in self.assignments:
            if a.fqn == fqn:
                return a
        return None

    def to_json(self) -> dict[str, Any]:
        """Canonical, JSON-ready form (also what the fingerprint hashes, minus the fingerprint)."""
        return {
            "model_type": self.model_type,
            "model_class": self.model_class,
            "parallel": self.parallel.model_dump(),
            "experts_settings": self.experts_settings.model_dump(),
            "assignments": [
                {
                    "fqn": a.fqn,
                    "target": a.target,
                    "style": a.style,
                    "table": a.rule.table,
                    "pattern": a.rule.pattern,
                    "inherited": a.inherited,
                }
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
                    "mode": e.mode,
                    "dispatch": e.dispatch,
                    "is_transposed": e.is_transposed,
                }
                for e in self.experts
            ],
            "bytes_sharded_per_rank": self.bytes_sharded_per_rank,
            "bytes_replicated_per_rank": self.bytes_replicated_per_rank,
            # only when declared, so the fingerprints of plans without it (and their checkpoints) stay the same;
            # activation_checkpointing only when on, for the same reason
            **({"training": self.training.model_dump(exclude={"activation_checkpointing"}
                                                     if not self.training.activation_checkpointing_row.recomputes_layers
                                                     else None)}
               if self.training is not None else {}),
        }

    def __str__(self) -> str:
        from planc.compiler.render import render_text

        return render_text(self)


def _fingerprint(plan: CompiledPlan) -> str:
    blob = json.dumps(plan.to_json(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
