"""Which AdamW step torch takes on a planc model, read from what the plan shards (no torch here).

torch 2.13 (`torch/optim/optimizer.py`, `_default_to_fused_or_foreach`): a parameter group with `foreach=None` (the
default) steps with foreach when every parameter's type is one torch lists (`torch.Tensor`, `nn.Parameter`, and
`DTensor`, which `torch.distributed.tensor` appends on import) and every parameter sits on a device with foreach
kernels (CUDA; not CPU, whose default is the for-loop step). The foreach step then runs once per (device, dtype)
sub-group (`_group_tensors_by_device_and_dtype`). A foreach op cannot take plain tensors and DTensors together, so
planc's step pre-hook (`planc.runtime.data_parallel.loop_over_mixed_groups`) sets `foreach=False` on a group that
holds both: that group steps tensor by tensor.

What a parameter is after `planc.apply`:
- the data-parallel wrap (`CompiledPlan.data_parallel_wraps`: FSDP2's `fully_shard` or `replicate`, the model root
  a unit of its own) makes every parameter a DTensor;
- without it, a parameter whose TP style splits it (its row in `planc.spec.styles` has dims: `shard_param`) or that
  `grouped_gemm` splits by expert is a DTensor; the rest (norms, routers, whatever a plan leaves whole) stay plain.

For `torch.optim.AdamW(model.parameters())` (one group, as planc's docs and the memory harness build it) on CUDA:
foreach when all parameters are of one kind, for-loop when the TP/EP shards sit beside plain parameters (every
shipped plan at dp 1 without mixed precision). A user who splits parameters into groups (Hugging Face Trainer's
decay / no-decay) gets this rule per group; `planc explain --optimizer` overrides the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planc.spec.styles import STYLE, dispatches_experts, splits_by_expert

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan
    from planc.compiler.walk import ModelWalk

# How AdamW can step: foreach (torch's CUDA default), for-loop (tensor by tensor: CPU's default), fused (opt-in).
STEPS = ("foreach", "for-loop", "fused")
# The training moment the step's temporaries set (planc.compiler.peak_memory; the fused-step hint reads it).
OPTIMIZER_STEP = "optimizer step"


@dataclass(frozen=True)
class AdamWStep:
    """The step torch takes for the model's parameters as one group on CUDA, and why."""

    step: str  # foreach | for-loop
    why: str
    dtensors: int  # parameters that are DTensors after planc.apply
    plain: int  # parameters that stay plain tensors

    def to_json(self) -> dict[str, object]:
        return {"step": self.step, "why": self.why, "dtensor_parameters": self.dtensors,
                "plain_parameters": self.plain}


def for_loop_temporaries(sizes: list[int]) -> int:
    """The most the for-loop step holds beyond the model states, for parameters of `sizes` bytes in step order.

    `_single_tensor_adam` computes `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` for each
    parameter: the square root and the quotient (two copies of it) while the previous parameter's `denom` is still
    bound (the name is rebound only when the new one is complete)."""
    return max((prev + 2 * size for prev, size in zip([0, *sizes], sizes)), default=0)


def foreach_temporaries(groups: list[int]) -> int:
    """The most the foreach step holds beyond the model states, for (device, dtype) groups of `groups` bytes in the
    order torch steps them (first appearance in the parameter group).

    `_multi_tensor_adam`'s one out-of-place op is `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`: a copy of
    the group's exp_avg_sq (like its parameters), while the previous group's list is still bound."""
    return max((prev + size for prev, size in zip([0, *groups], groups)), default=0)


def is_dtensor(style: str) -> bool:
    """Whether a parameter assignment of `style` leaves a DTensor (planc.runtime.install's step_shard_parameters)."""
    if splits_by_expert(style):
        return True
    if dispatches_experts(style):
        return False  # a module style its parameters inherit: grouped_gemm rules shard them
    row = STYLE.get(style)
    return row is not None and row.shards


def adamw_step(compiled: CompiledPlan, walk: ModelWalk) -> AdamWStep:
    """The AdamW step on CUDA for `AdamW(model.parameters())` once `compiled` is applied to the model `walk` reads."""
    seen: set[int] = set()
    params = []
    for info in walk.params.values():
        if info.tensor_id not in seen:  # tied parameters once, as model.parameters() yields them
            seen.add(info.tensor_id)
            params.append(info.fqn)
    if compiled.data_parallel_wraps:
        return AdamWStep("foreach", "the data-parallel wrap (FSDP2) makes every parameter a DTensor: one kind, so "
                         "torch's CUDA default, foreach", len(params), 0)
    split = {a.fqn for a in compiled.assignments if a.target == "parameter" and is_dtensor(a.style)}
    dtensors = sum(1 for fqn in params if fqn in split)
    plain = len(params) - dtensors
    if dtensors and plain:
        return AdamWStep("for-loop", f"{dtensors} TP/EP-split parameters (DTensors) beside {plain} plain ones in one "
                         "group: planc's step pre-hook sets foreach=False (a foreach op cannot mix them)",
                         dtensors, plain)
    kind = "DTensors" if dtensors else "plain tensors"
    return AdamWStep("foreach", f"every parameter is one kind ({kind}): torch's CUDA default, foreach", dtensors, plain)


__all__ = ["OPTIMIZER_STEP", "STEPS", "AdamWStep", "adamw_step", "for_loop_temporaries", "foreach_temporaries", "is_dtensor"]
