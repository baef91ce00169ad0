"""VerifyReport: what `planc verify` found, as fields (`planc.verify`) and as text or JSON (the CLI).

`ok` is the verdict: every stage within its tolerance. Each StageResult carries its largest absolute and
relative error, the tolerance and how it was derived; a mismatch carries the Divergence localised to the
first module (forward order) or parameter (backward order) that differs, with the plan rule that sharded it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

CERTIFIED, MISMATCH, NOT_RUN = 0, 1, 2  # the CLI's exit codes


@dataclass(frozen=True)
class RuleRef:
    """A plan rule: the table, pattern and style, and where it is written (`file:line:col`, or the table key)."""

    table: str
    pattern: str
    style: str
    where: str

    def __str__(self) -> str:
        return f"{self.table} `{self.pattern}: {self.style}` at {self.where}"


@dataclass(frozen=True)
class Divergence:
    """The first place the sharded model differs from its twin.

    `module`: the module path (for a gradient, the module owning `parameter`); `direction`: `forward` (its
    inputs equal the twin's, its output does not) or `backward` (the first parameter in backward order whose
    gathered gradient differs); `rules`: the plan rules that shard the module or a module inside it
    (`rule`: the first of them, None for a module the plan leaves replicated)."""

    stage: str
    direction: str
    module: str
    rel_error: float
    parameter: Optional[str] = None
    rules: tuple[RuleRef, ...] = ()
    note: str = ""
    tokens: Optional[int] = None  # a kernel stage's divergence: the batch (tokens per rank) it showed at
    expert: Optional[int] = None  # and the expert (global id) whose slots differ most

    @property
    def rule(self) -> Optional[RuleRef]:
        return self.rules[0] if self.rules else None

    @property
    def style(self) -> Optional[str]:
        return self.rules[0].style if self.rules else None

    @property
    def where(self) -> Optional[str]:
        return self.rules[0].where if self.rules else None

    def describe(self) -> str:
        if self.direction == "kernel":
            lines = [f"first divergence in stage `{self.stage}`: layer `{self.module}` at {self.tokens} token"
                     f"{'s' if (self.tokens or 0) > 1 else ''} per rank, calc_diff {self.rel_error:.3g}"]
            lines += [f"  sharded by {r}" for r in self.rules]
            return "\n".join(lines + ([f"  {self.note}"] if self.note else []))
        what = f"parameter `{self.parameter}` (gradient, backward order)" if self.parameter else \
            f"module `{self.module}` (forward order: its inputs match the unsharded model's, its output does not)"
        lines = [f"first divergence in stage `{self.stage}`: {what}, relative error {self.rel_error:.3g}"]
        if self.rules:
            lines += [f"  sharded by {r}" for r in self.rules]
        else:
            lines.append("  no plan rule shards it: replicated on every rank")
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)


@dataclass(frozen=True)
class StageResult:
    """One stage's comparison: max abs and relative error (`||a - b|| / ||b||`) over every rank and tensor; a
    kernel stage's `max_rel_error` is its `measure`, DeepGEMM's calc_diff."""

    name: str
    max_abs_error: float
    max_rel_error: float
    tolerance: float
    tolerance_rule: str
    ok: bool
    detail: str = ""
    measure: str = "rel"  # what max_rel_error and tolerance bound: `rel` (||a - b|| / ||b||) or `calc_diff`

    @property
    def verdict(self) -> str:
        return "ok" if self.ok else "MISMATCH"


@dataclass(frozen=True)
class SkippedStage:
    """A stage verify would run but could not here (the Mega MoE kernel stages without a GPU): why. Not a failure."""

    name: str
    reason: str


@dataclass
class VerifyReport:
    """The verdict of `planc.verify`: `ok` when every stage held; `stages` in the order run; `first_divergence`
    where one did not. `setup` says what ran (plan, sizes, model, shrink, dtype); `error` is set when it could not
    run at all (then `ok` is False and `exit_code` 2). `skipped`: stages that could not run here, with why (the
    verdict does not count them)."""

    plan: str
    world_size: int
    sizes: dict[str, int]
    dtype: str
    model: str
    shrink: list[str] = field(default_factory=list)
    stages: list[StageResult] = field(default_factory=list)
    skipped: list[SkippedStage] = field(default_factory=list)
    first_divergence: Optional[Divergence] = None
    notes: list[str] = field(default_factory=list)
    error: Optional[str] = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.stages) and all(s.ok for s in self.stages)

    @property
    def exit_code(self) -> int:
        if self.error is not None:
            return NOT_RUN
        return CERTIFIED if self.ok else MISMATCH

    def stage(self, name: str) -> StageResult:
        return next(s for s in self.stages if s.name == name)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["exit_code"] = self.exit_code
        for s, raw in zip(self.stages, data["stages"]):
            raw["verdict"] = s.verdict
        if self.first_divergence is not None:
            d = data["first_divergence"]
            d.update(rule=asdict(self.first_divergence.rule) if self.first_divergence.rule else None,
                     style=self.first_divergence.style, where=self.first_divergence.where)
        return data

    def render_json(self) -> str:
        return json.dumps(self.to_json(), indent=2, default=str)

    def render_text(self) -> str:
        sizes = " ".join(f"{k}={v}" for k, v in self.sizes.items())
        lines = [f"planc verify: {self.plan} at {sizes} ({self.world_size} CPU ranks, gloo), {self.dtype}",
                 f"model: {self.model}"]
        lines += [f"shrink: {s}" for s in self.shrink]
        lines += [f"note: {n}" for n in self.notes]
        if self.error is not None:
            lines.append(f"could not run: {self.error}")
            return "\n".join(lines) + "\n"
        width = max([len(s.name) for s in self.stages] + [len(k.name) for k in self.skipped] + [5])
        lines.append(f"{'stage':<{width}}  {'max abs':>9}  {'rel':>9}  {'tolerance':>9}  verdict")
        for s in self.stages:
            lines.append(f"{s.name:<{width}}  {s.max_abs_error:9.2e}  {s.max_rel_error:9.2e}  {s.tolerance:9.2e}  "
                         f"{s.verdict}{'  ' + s.detail if s.detail else ''}")
        for k in self.skipped:
            lines.append(f"{k.name:<{width}}  {'-':>9}  {'-':>9}  {'-':>9}  not run: {k.reason}")
        if self.first_divergence is not None:
            lines.append(self.first_divergence.describe())
        rules = sorted({s.tolerance_rule for s in self.stages})
        lines.append("tolerances: " + "; ".join(rules))
        verdict = "CERTIFIED: the sharded run computes what the unsharded model computes" if self.ok else \
            "MISMATCH: the sharded run does not compute what the unsharded model computes"
        if not self.ok and all(s.ok for s in self.stages if s.name != "memory"):  # numerics certified, memory not
            verdict = ("MEMORY: the sharded run computes what the unsharded model computes, but `planc explain` "
                       "under-predicts rank 0's peak: size the job on the measured peak")
        elif not self.ok and all(s.ok for s in self.stages if s.measure != "calc_diff"):  # only kernel stages failed
            verdict = ("MISMATCH: the sharded run computes what the unsharded model computes, but the Triton Mega MoE "
                       "kernels do not compute what the reference backend computes")
        lines.append(f"{verdict} ({self.seconds:.0f} s)")
        return "\n".join(lines) + "\n"
