"""Builders shared by the Mega MoE tests: real transformers experts modules with seeded weights, routings."""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config, MixtralConfig
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from planc.kernels.megamoe.triton.config import GLUON_CONFIGS

# The shipped Gluon configs, which the tests compile and run: blocks of 80 rows (no two-tail loop body: under the
# 168-register cap L1 keeps its wgmma asynchronous) and of 96 (ptxas serializes that L1's wgmma under the cap); both
# with the warp-specialized L2 (`hopper_prefill_ws`). The same with the cp.async L2 (`hopper_prefill`) beside them.
GLUON_80_ROWS, GLUON = (config for _, config in GLUON_CONFIGS if config is not None)
assert (GLUON_80_ROWS.block_t, GLUON.block_t) == (80, 96) and GLUON_80_ROWS.gluon == GLUON.gluon == 2
CP_ASYNC_80_ROWS, CP_ASYNC = (c.cp_async_l2() for c in (GLUON_80_ROWS, GLUON))

E, H, I, K = 8, 128, 64, 3  # small shapes; the reference needs H % 32 == 0 and I % 32 == 0


def full_weights(seed: int = 0, *, num_experts=E, hidden=H, inter=I):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    return w1.bfloat16(), w2.bfloat16()


def mixtral_experts(w1, w2) -> MixtralExperts:
    """A real MixtralExperts holding the given (possibly EP-sliced) bf16 weights."""
    cfg = MixtralConfig(hidden_size=w1.shape[2], intermediate_size=w2.shape[2], num_local_experts=w1.shape[0])
    m = MixtralExperts(cfg)
    with torch.no_grad():
        m.gate_up_proj = torch.nn.Parameter(w1.clone())
        m.down_proj = torch.nn.Parameter(w2.clone())
    return m


def deepseek_v4_experts(w1, w2, swiglu_limit: float) -> DeepseekV4Experts:
    cfg = DeepseekV4Config(
        hidden_size=w1.shape[2], moe_intermediate_size=w2.shape[2], n_routed_experts=w1.shape[0],
        swiglu_limit=swiglu_limit,
    )
    m = DeepseekV4Experts(cfg)
    m.config = cfg  # the experts class keeps only `limit`; planc reads `config.swiglu_limit`
    with torch.no_grad():
        m.gate_up_proj = torch.nn.Parameter(w1.clone())
        m.down_proj = torch.nn.Parameter(w2.clone())
    return m


def routing(num_tokens: int, seed: int, *, num_experts=E, topk=K, masked: float = 0.0, hidden=H):
    """x [T, H] bf16, global ids [T, K] (raw top-k scores as weights, like DeepGEMM's test), some -1 slots."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).bfloat16()
    scores = torch.randn(num_tokens, num_experts, generator=g)
    weights, idx = torch.topk(scores, topk, dim=-1)
    if masked:
        drop = torch.rand(num_tokens, topk, generator=g) < masked
        idx = idx.masked_fill(drop, -1)
        weights = weights.masked_fill(drop, 0.0)
    return x, idx, weights


def planc_reference(fp4, x, idx, w, clamp: float) -> torch.Tensor:
    """planc's reference layer on FP4 experts `fp4` (a module holding them) for BF16 tokens `x`, after its staging's
    FP8 cast: what a peer's output is judged against, within DeepGEMM's FP8 bound."""
    from planc.kernels.megamoe.quant import float_to_ue8m0_bytes, quantize_fp8
    from planc.kernels.megamoe.reference import DequantizedExperts, combine, local_experts_forward

    ref = DequantizedExperts.from_fp4(fp4.gate_up_proj, fp4.gate_up_proj_scale_inv, fp4.down_proj,
                                      fp4.down_proj_scale_inv)
    q, sf = quantize_fp8(x)
    return combine(local_experts_forward(q, float_to_ue8m0_bytes(sf), idx, w, ref, first_expert=0,
                                         activation_clamp=clamp))


# Ops that make a device tensor from a Python number or fill one: on a GPU each is a kernel of its own, replayed with
# every CUDA graph of the layer (the installed-layer GPU test forbids them in its graphs).
FILL_OPS = ("scalar_tensor", "fill_", "full", "zeros", "zeros_like", "ones", "ones_like", "full_like", "new_zeros",
            "new_ones", "new_full")


def fill_ops(fn) -> tuple[object, list[str]]:
    """`fn()`'s result and the `FILL_OPS` it dispatched, traced op by op on CPU (TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Trace():
        result = fn()
    return result, [op for op in ops if op.split(".")[0] in FILL_OPS]
