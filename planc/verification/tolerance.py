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

A sharding mistake (a missing or doubled reduction, a statistic over a shard, rows in the wrong order)
gives errors of order 1: both bounds sit orders of magnitude below it.
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
