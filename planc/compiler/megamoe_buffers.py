"""Mega MoE's buffers per rank, before launch: the symmetric buffer every Mega MoE layer shares and one layer's work.

Two backends allocate differently (`experts.megamoe.backend`, planc.spec.choices):

- `deep_gemm` (SM100): DeepGEMM's `get_symm_buffer_for_mega_moe` sizes one symmetric buffer from the tokens per
  rank it is built for (DeepGEMM 54e2261, `csrc/apis/mega.hpp get_symm_buffer_size_for_mega_moe`,
  `layout/mega_moe.cuh`, `deep_gemm/mega/__init__.py`, `heuristics/mega_moe.hpp get_num_wave_pool_tokens`);
  `deepgemm_symmetric_bytes` is that rule.
- `triton` and `reference`: planc's `ReferenceBuffer` (planc.kernels.megamoe.reference): FP8 x, its UE8M0
  scales, top-k ids (int64) and weights (fp32) per token, plus one layer's dispatch (every rank's staged rows
  all-gathered), the BF16 slot outputs and the SwiGLU activations (planc.kernels.megamoe.triton.forward).
- `reference` also keeps every layer's local experts dequantized (fp32 on a CPU, bf16 on a GPU: priced fp32) and
  runs each step over every gathered slot in the compute dtype (`reference_layer_bytes`).

Both buffers are built for `capacity_for(tokens, experts.megamoe.max_tokens_per_rank)` tokens
(planc.kernels.megamoe.buffers): the plan's size when the batch fits in it, else the next power of two.
Pure arithmetic: the compiler prices them without torch.
"""

from __future__ import annotations

from typing import Optional

GRAN = 32  # hidden elements per UE8M0 scale byte
FP32 = 4
_BLOCK_T = 64  # Triton backend rows per block: a local expert's last block is padded to it


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def capacity(tokens: int, max_tokens_per_rank: Optional[int]) -> int:
    """Tokens per rank the buffer is built for (planc.kernels.megamoe.buffers.capacity_for, without torch)."""
    if max_tokens_per_rank is not None and tokens <= max_tokens_per_rank:
        return max_tokens_per_rank
    return 1 if tokens <= 1 else 1 << (tokens - 1).bit_length()


def deepgemm_symmetric_bytes(ranks: int, experts: int, tokens: int, top_k: int, hidden: int, intermediate: int,
                             fp8: bool = True) -> int:
    """DeepGEMM's symmetric buffer for `tokens` per rank: W + T(bH + 12k) + N(bH + 4 + bI) + 2kTH, plus the FP8
    scale-factor pools TH/32 + N(H + I)/2, with T aligned to 384 and N the wave pool's tokens."""
    local = experts // ranks
    t = _align(tokens, 384)
    b = 1 if fp8 else 2
    n = 786_432 if t >= 6144 else 1_824_768
    n = max(ranks * t, min(n, ranks * t * local, _align(ranks * t * top_k + 383 * local, 384)))
    pool = _align(ranks * t * min(top_k, local) + 191 * local, 384)
    w = _align(32 + 16 * experts + 8 * local + 2 * n + 4 * local * ranks * ranks * t + 12 * pool, 16)
    total = w + t * (b * hidden + 12 * top_k) + n * (b * hidden + 4 + b * intermediate) + 2 * top_k * t * hidden
    if fp8:
        total += t * hidden // 32 + n * (hidden + intermediate) // 2
    return total


def reference_buffer_bytes(tokens: int, top_k: int, hidden: int) -> int:
    """planc's `ReferenceBuffer` (triton and reference backends): x FP8, x_sf, top-k ids and weights."""
    return tokens * (hidden + hidden // GRAN + 8 * top_k + 4 * top_k)


def fp4_experts_bytes(local_experts: int, hidden: int, intermediate: int) -> int:
    """One layer's local experts as FP4 (`experts.megamoe.quantize: fp4`, planc.kernels.megamoe.quant): two e2m1
    values a byte and a UE8M0 scale byte per 32, for gate_up [E_loc, 2I, H] and down [E_loc, H, I]."""
    weights = local_experts * 3 * hidden * intermediate
    return weights // 2 + weights // GRAN


def reference_experts_bytes(local_experts: int, hidden: int, intermediate: int, itemsize: int = 4) -> int:
    """The reference backend's dequantized copy of one layer's local experts, kept per module after its first call
    (`ReferenceRunner.weights`: gate_up [E_loc, 2I, H] and down [E_loc, H, I] in the compute dtype, fp32 on a CPU and
    bf16 on a GPU)."""
    return local_experts * 3 * hidden * intermediate * itemsize


def reference_layer_bytes(ranks: int, rows: int, top_k: int, hidden: int, intermediate: int, itemsize: int = 4) -> int:
    """One layer's work on the reference backend (`local_experts_forward` over every gathered slot, then the
    combine) with `rows` staged tokens per rank: the all-gathered dispatch; per slot the gathered FP8 row, its
    dequantized copy, the BF16 L1 output, the fp32 gate, SiLU and activation, the FP8 requantized activation and its
    dequantized copy, the L2 output in the compute dtype and in BF16 twice (masked, then placed back in order); the
    combine's received slots and their fp32 sum."""
    m = ranks * rows
    slots = m * top_k
    gathered = m * (hidden + hidden // GRAN + 12 * top_k)
    per_slot = hidden * (1 + 2 * itemsize + 3 * 2) + intermediate * (2 * 2 + 3 * FP32 + 1 + itemsize) + 8 * 4
    combine = slots * hidden * 2 + rows * top_k * hidden * FP32
    return gathered + slots * per_slot + combine


def triton_layer_bytes(ranks: int, rows: int, local_experts: int, top_k: int, hidden: int, intermediate: int,
                       fp8: bool = False) -> int:
    """One Mega MoE layer's work on the triton backend with `rows` staged tokens per rank: the all-gathered
    dispatch, the dequantized BF16 tokens, the BF16 slot outputs (zeros for other ranks' experts), the SwiGLU
    activations of this rank's slots (each local expert's rows padded to a block) and the combined output. `fp8`:
    the FP8 path's instead (planc.kernels.megamoe.triton.fp8): the tokens cast to e4m3 with a scale per row, the
    SwiGLU output in FP32 and then cast to e4m3 with a scale per row."""
    m = ranks * rows
    gathered = m * (hidden + hidden // GRAN + 12 * top_k)
    slots = m * top_k
    act = slots + local_experts * _BLOCK_T
    tokens, activations = (m * hidden + FP32 * m, (FP32 + 1) * act * intermediate + FP32 * act) if fp8 else \
        (2 * m * hidden, 2 * act * intermediate)
    return gathered + tokens + 2 * slots * hidden + activations + 4 * slots + 2 * rows * hidden


def triton_fp8_layout_bytes(local_experts: int, hidden: int, intermediate: int) -> int:
    """The Triton backend's FP8-path layout of one layer's local experts (`PackedExperts.e4m3`, made when a batch
    first takes that path on Hopper and kept beside the FP4 layout): the same FP4 words and scale bytes reordered,
    and the row-scaled scale words (one byte per 32 weights)."""
    return fp4_experts_bytes(local_experts, hidden, intermediate) + local_experts * 3 * hidden * intermediate // GRAN


__all__ = ["capacity", "deepgemm_symmetric_bytes", "fp4_experts_bytes", "reference_buffer_bytes",
           "reference_experts_bytes", "reference_layer_bytes", "triton_fp8_layout_bytes", "triton_layer_bytes"]
