"""How far a sharded run may be from its unsharded twin, per dtype and stage: derived, not tuned.

Every comparison is relative to the reference's own scale, `||sharded - unsharded||_2 / ||unsharded||_2`
(elementwise relative errors blow up where the reference is near zero). The bound is a multiple of the
dtype's machine epsilon (`torch.finfo(dtype).eps`):

- fp32: sharding reorders sums (a rowwise all-reduce adds partial sums a dense matmul adds in one
  loop). The error bound of a reordered sum of n terms is n*eps (Higham's gamma_n); the widths a verify
  runs stay under 2^10 per reduction, so forward stages (logits, loss, generate, the forward after a
  step or a reload) get 2^10 * eps = 1.2e-4 and gradients, two reductions per forward one (input and
  weight gradients), 2^11 * eps = 2.4e-4.
- bf16: every activation is rounded to 8 mantissa bits whatever the order, so the reorderings add only
  a few roundings: 4 * eps = 3.1e-2 for forward stages (torch.testing's bf16 rtol, 1.6e-2, is 2 * eps),
  8 * eps = 6.3e-2 for gradients.

Gradients are divided by the larger of their own norm and their share of the whole gradient's (stages.py), so a
near-zero gradient does not turn summation noise into an error of order one.

A sharding mistake (a missing or doubled reduction, a statistic over a shard, rows in the wrong order)
gives errors of order 1: both bounds sit orders of magnitude below it.

The Mega MoE kernel stages (kernels.py) compare the Triton backend's BF16 output with the reference backend's on the
same FP4 weights and tokens, with DeepGEMM's calc_diff `1 - 2 sum(xy) / sum(x^2 + y^2)` (docs/megamoe.md), which is
about half the squared relative L2 error when the two are close. On the BF16 path the backends do the same
arithmetic and only the order of the FP32 sums differs, which can flip the final BF16 rounding of an output (one
ulp, at most eps(bf16) = 2^-7 of it) and, through L1's rounding, an FP8 requantization step. Every output one ulp off
gives calc_diff <= eps^2 / 2 = 3.1e-5; the bound, 1e-4, is about three times that (the contract the GPU tests hold
the backend to). One wrong expert out of 32, a wrong scale or a misplaced slot gives 1e-3 and more. The FP8 path
(on Hopper, the batches whose rows per local expert `config.FP8_CONFIGS` names) rounds its operands to e4m3 with one
scale per row (or per 128 channels): DeepGEMM's bound for its FP8 GEMMs against BF16, 1e-2.
"""

from __future__ import annotations

from dataclasses import dataclass

# machine epsilon of the dtypes verify runs (torch.finfo(dtype).eps), so this module needs no torch
EPS = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7}
# stage kind -> multiple of eps, per dtype
_FACTORS = {
    "float32": {"forward": 2 ** 10, "gradient": 2 ** 11},
    "bfloat16": {"forward": 4, "gradient": 8},
}
# stages and whether they compare gradients
STAGE_KINDS = {
    "logits": "forward", "loss": "forward", "grads": "gradient", "clip": "gradient", "step": "gradient",
    "reshard": "forward", "generate": "forward",
}


@dataclass(frozen=True)
class Tolerance:
    """The bound one stage is held to: `rel` on `||a - b|| / ||b||`, and how it was derived."""

    rel: float
    rule: str


def tolerance(stage: str, dtype: str) -> Tolerance:
    """The tolerance of `stage` (a key of STAGE_KINDS) in `dtype` (`float32` or `bfloat16`)."""
    kind = STAGE_KINDS[stage]
    factor = _FACTORS[dtype][kind]
    return Tolerance(factor * EPS[dtype], f"{factor} x eps({dtype}) ({kind} stage)")


KERNEL_CALC_DIFF = {"bf16": 1e-4, "fp8": 1e-2}  # calc_diff bounds of the kernel stages, per Triton path (above)


def kernel_tolerance(fp8: bool) -> Tolerance:
    """The calc_diff bound of a kernel stage: the Triton backend against the reference backend, on its BF16 path or
    (`fp8`) its FP8 path."""
    if fp8:
        return Tolerance(KERNEL_CALC_DIFF["fp8"], "kernels: calc_diff <= 1e-2 on the Triton FP8 path (DeepGEMM's "
                         "bound for FP8 GEMMs against BF16)")
    return Tolerance(KERNEL_CALC_DIFF["bf16"], "kernels: calc_diff <= 1e-4 on the Triton BF16 path (only the FP32 "
                     "sum order differs from the reference: ~3x every output one BF16 ulp off, eps^2/2)")
