"""Training rules: the `training:` section against the experts kernel and itself.

`training:` says how the plan's `dp_size` replicas train (docs/train.md). Two settings cannot train:
experts whose kernel has no backward, and FSDP mixed precision without FSDP.
"""

from __future__ import annotations

from typing import Iterator

from planc.lint.context import LintContext
from planc.lint.diagnostic import Diagnostic
from planc.lint.registry import rule
from planc.spec.pairings import MIXED_PRECISION_FSDP, TRAINING_EXPERTS

TRAINING_INFERENCE_ONLY = TRAINING_EXPERTS.code  # PLC700
MIXED_PRECISION_WITHOUT_FSDP = MIXED_PRECISION_FSDP.code  # PLC701

_TOP = "version: 1\nmodel: {type: deepseek_v4}\nparallel: {tp_size: 2, ep_size: 2, dp_size: 2}\n"
_EP = (
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
)


@rule(
    TRAINING_INFERENCE_ONLY, "training-with-inference-only-experts",
    "`training:` with experts that have no backward (`deepgemm_megamoe`)",
    bad=_TOP + "experts: {implementation: deepgemm_megamoe}\ntraining: {data_parallel: fsdp}\n" + _EP,
    good=_TOP + "experts: {implementation: grouped_mm, ep_implementation: all_to_all}\n"
    "training: {data_parallel: fsdp}\n" + _EP,
)
def check_training_inference_only(ctx: LintContext) -> Iterator[Diagnostic]:
    """The Mega MoE kernel (`experts.implementation: deepgemm_megamoe`) is inference-only: its forward
    refuses autograd, so a plan that declares `training:` could never take a step. Train with
    `grouped_mm` experts and `ep_implementation: all_to_all` (or `all_reduce`), and keep the Mega MoE
    plan for serving: `planc.save` writes a checkpoint that loads under either plan."""
    if ctx.plan.training is not None and TRAINING_EXPERTS.violated(ctx.plan.model_dump(exclude_none=True)):
        yield ctx.diag(
            TRAINING_INFERENCE_ONLY,
            "experts.implementation `deepgemm_megamoe` is inference-only (its kernel has no backward) "
            "but the plan declares `training:`",
            "train with `experts: {implementation: grouped_mm, ep_implementation: all_to_all}`, or remove "
            "the `training:` section from this serving plan",
            TRAINING_EXPERTS.key, at_value=True,  # where the schema reports it too
        )


@rule(
    MIXED_PRECISION_WITHOUT_FSDP, "mixed-precision-without-fsdp",
    "`training.mixed_precision` without `data_parallel: fsdp`",
    bad=_TOP + "experts: {ep_implementation: all_to_all}\n"
    "training:\n  data_parallel: replicate\n  mixed_precision: {param_dtype: bfloat16}\n" + _EP,
    good=_TOP + "experts: {ep_implementation: all_to_all}\n"
    "training:\n  data_parallel: fsdp\n  mixed_precision: {param_dtype: bfloat16}\n" + _EP,
)
def check_mixed_precision_without_fsdp(ctx: LintContext) -> Iterator[Diagnostic]:
    """`training.mixed_precision` is FSDP2's `MixedPrecisionPolicy`: parameters all-gathered in
    `param_dtype`, gradients reduced in `reduce_dtype`. With `data_parallel: replicate` (the default)
    nothing would apply it. Write `data_parallel: fsdp`, or drop `mixed_precision` and load the model
    in the dtype it should train in (`planc.load(..., dtype=torch.bfloat16)`)."""
    training = ctx.plan.training
    if training is not None and MIXED_PRECISION_FSDP.violated(ctx.plan.model_dump(exclude_none=True)):
        yield ctx.diag(
            MIXED_PRECISION_WITHOUT_FSDP,
            f"`training.mixed_precision` applies only with `data_parallel: fsdp`, got `{training.data_parallel}`",
            "write `data_parallel: fsdp`, or remove `mixed_precision` (load the model in the dtype to train in)",
            MIXED_PRECISION_FSDP.key, at_value=True,  # where the schema reports it too
        )
