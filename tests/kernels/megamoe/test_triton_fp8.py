"""The Triton backend's FP8-math path (`triton/fp8.py`) under Triton's CPU interpreter, at tiny shapes.

Against the float64 emulation of the same quantization (`emulation.emulate_fp8`): only the FP32 sum order differs,
which may flip a rare BF16 or e4m3 rounding. Against the BF16-path reference and the float64 MoE on the same FP4
weights: within DeepGEMM's bound for its FP8 GEMMs against a BF16 matmul (calc_diff < 0.01).
"""

import dataclasses

import pytest
import torch

from planc.kernels.megamoe.quant import (
    calc_diff,
    dequantize_experts_fp4,
    float_to_ue8m0_bytes,
    quantize_experts_fp4,
    quantize_fp8,
)
from planc.kernels.megamoe.reference import DequantizedExperts, local_experts_forward
from planc.kernels.megamoe.reference import combine as reference_combine
from planc.kernels.megamoe.triton import target
from planc.kernels.megamoe.triton import config as triton_config
from planc.kernels.megamoe.triton.config import KernelConfig, pick_config
from planc.kernels.megamoe.triton.fp8 import x_blocks
from planc.kernels.megamoe.triton.hopper_fp8 import block_row_scales
from planc.kernels.megamoe.triton.forward import combine, triton_local_experts_forward
from planc.kernels.megamoe.triton.layout import PackedExperts
from tests.kernels.megamoe.common import fill_ops, full_weights, routing
from tests.kernels.megamoe.emulation import emulate_fp8, fp8_block_cast, moe_float64

pytestmark = pytest.mark.skipif(
    not target.interpreting(),
    reason="CPU tensors need Triton's interpreter; on a GPU, test_triton_gpu.py runs the kernels",
)

E, H, I = 4, 256, 128  # two 128-deep K blocks in L1, one in L2; two L2 N tiles
FP8_TINY = KernelConfig(block_t=16, l1_n=128, l1_k=128, l2_n=128, l2_k=128, num_warps=4, num_stages=2, fp8=1)
FP8_TINY_ROWS_M = KernelConfig(block_t=16, l1_n=128, l1_k=128, l2_n=128, l2_k=128, num_warps=4, num_stages=2, fp8=2)


def fp4_experts(seed=0, spread_groups=False):
    w1, w2 = full_weights(seed, num_experts=E, hidden=H, inter=I)
    if spread_groups:  # some 32-groups 2**-12 and 2**-30 below their neighbours: codes off the e4m3 grid, and zeros
        w1 = w1.clone()
        w1[:, ::3, 32:64] *= 2.0**-12
        w1[:, 1::5, 160:192] *= 2.0**-30
    fp4 = quantize_experts_fp4(w1, w2)
    params = (fp4.gate_up_proj, fp4.gate_up_proj_scale_inv, fp4.down_proj, fp4.down_proj_scale_inv)
    return fp4, PackedExperts.from_params(*params), DequantizedExperts.from_fp4(*params)


def staged(num_tokens, seed, masked=0.0):
    x, idx, w = routing(num_tokens, seed, num_experts=E, topk=2, masked=masked, hidden=H)
    q, sf = quantize_fp8(x)
    return x, q, float_to_ue8m0_bytes(sf), idx, w


def layer(q, sf, idx, w, packed, clamp, config):
    out = triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=clamp, config=config)
    return combine(out)


def test_activation_blocks_are_the_emulated_cast():
    _, q, sf, _, _ = staged(5, 1)
    x8, xs = x_blocks(q, sf)
    x = q.double() * torch.pow(2.0, sf.long().double() - 127).repeat_interleave(32, dim=1)
    for t in range(5):
        eq, es = fp8_block_cast(x[t], floor=True)
        assert torch.equal(x8[t].view(torch.float8_e4m3fn).double(), eq)
        assert torch.equal(xs[t].double(), es)


@pytest.mark.parametrize("num_tokens,clamp,masked,spread,config", [(3, 0.5, 0.3, False, FP8_TINY),
                                                                   (6, None, 0.0, True, FP8_TINY_ROWS_M)],
                         ids=["swap_ab", "rows_m"])
def test_fp8_path_matches_its_float64_emulation(num_tokens, clamp, masked, spread, config):
    fp4, packed, deq = fp4_experts(num_tokens, spread)
    x, q, sf, idx, w = staged(num_tokens, num_tokens, masked)
    y = layer(q, sf, idx, w, packed, clamp, config)
    emulated = emulate_fp8(q, sf, idx, w, fp4, clamp=clamp)
    assert y.dtype == torch.bfloat16 and y.shape == (num_tokens, H)
    assert calc_diff(y.double(), emulated) < 1e-5
    assert (y.double() != emulated).sum() <= 0.02 * y.numel()  # FP32 sum order may flip a rare rounding
    # Against the BF16-path reference on the same FP4 weights and the float64 MoE: DeepGEMM's FP8 bound.
    ref = reference_combine(local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=clamp))
    assert calc_diff(y.double(), ref.double()) < 0.01
    w1, w2 = dequantize_experts_fp4(fp4, torch.float64)
    assert calc_diff(y.double(), moe_float64(x, idx, w, w1, w2, clamp=clamp)) < 0.01


@pytest.mark.parametrize("spread", [False, True], ids=["plain", "spread_groups"])
def test_row_scaled_numerics_stay_within_deepgemms_fp8_bound(spread):
    """The row-scaled path (`KernelConfig(fp8=6)`, one scale per row of each operand: its Gluon kernels run only on
    Hopper, `test_triton_gpu.py` checks them against this emulation) against the BF16-path reference on the same FP4
    weights and the float64 MoE: within DeepGEMM's FP8 bound, with 32-groups 2**-12 and 2**-30 below their rows'."""
    fp4, _, deq = fp4_experts(3, spread)
    x, _, _, idx, w = staged(6, 6, 0.2)
    if spread:  # activations as LLMs have them: an outlier channel, a group far below the row's largest
        x = x.clone()
        x[:, 5] *= 60
        x[:, 64:96] *= 2.0**-8
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    rows = emulate_fp8(q, sf, idx, w, fp4, clamp=0.5, rows=True)
    ref = reference_combine(local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=0.5))
    assert calc_diff(rows, ref.double()) < 0.01
    w1, w2 = dequantize_experts_fp4(fp4, torch.float64)
    assert calc_diff(rows, moe_float64(x, idx, w, w1, w2, clamp=0.5)) < 0.01
    assert calc_diff(rows, emulate_fp8(q, sf, idx, w, fp4, clamp=0.5)) < 0.01  # and the per-128 blocks


def test_fp8_path_is_picked_by_its_table_row_only_where_fp8_mma_runs(monkeypatch):
    """`FP8_CONFIGS` as measured: the row-scaled Gluon FP8 kernels (fp8=6) take V4's batches from 16 rows per local
    expert on Hopper (32-row blocks, 64-row ones from 31, 80-row ones with L2 on 8 warps from 52, 128-row ones from 84,
    an EP 8 rank's share of a prefill included), the BF16 tables below 16 rows and wherever FP8 MMAs or the Gluon
    kernels do not run; a row is taken from its bound up, on shapes it fits."""
    def fp8(rows_per_expert, gluon=True, fp8=True, inter=3072):
        return pick_config(round(rows_per_expert * 384), 384, 7168, inter, gluon=gluon, fp8=fp8)

    picks = [fp8(r).fp8 for r in (8, 15.9, 16, 24, 33.9, 48, 56, 64, 68, 83.9, 84, 96, 512)]
    assert picks == [0, 0, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6]
    assert fp8(16).block_t == 32 and fp8(30.9).block_t == 32 and fp8(31).block_t == 64 and fp8(84).block_t == 128
    assert fp8(51.9).block_t == 64 and fp8(52).block_t == 80 and fp8(83.9).block_t == 80 and fp8(512).block_t == 128
    assert fp8(64).maxnreg == 168 and fp8(64).l2_n == 128 and fp8(64).l2_maxnreg == 128
    assert not fp8(24, gluon=False).fp8 and not fp8(24, fp8=False).fp8
    assert not fp8(24, inter=3072 + 128).fp8  # an odd number of L2 K blocks: the Gluon FP8 L2 takes them in pairs
    row = KernelConfig(block_t=128, l1_n=128, l1_k=128, l2_n=128, l2_k=128, num_warps=8, num_stages=3, fp8=2)
    monkeypatch.setattr(triton_config, "FP8_CONFIGS", ((48, row),))
    rows = 48 * 384
    assert pick_config(rows, 384, 7168, 3072, gluon=True, fp8=True) == row.fit(7168, 3072)
    assert not pick_config(rows, 384, 7168, 3072, gluon=True, fp8=False).fp8
    assert not pick_config(rows - 384, 384, 7168, 3072, gluon=True, fp8=True).fp8  # below the bound
    assert not pick_config(rows, 384, 7168, 3136, gluon=True, fp8=True).fp8  # intermediate % 128 != 0
    with pytest.raises(ValueError, match="hidden and intermediate % 128"):
        FP8_TINY.fit(192, 128)


def test_block_row_scales_puts_no_fill_kernel_into_a_graph():
    """The Gluon FP8 path's host-side gather of the activations' scales runs inside every captured layer: a torch op
    that makes a tensor from a scalar (``torch.where(ok, x, 0)``: a device `scalar_tensor`) is a fill kernel replayed
    with the graph, which the installed-layer GPU test forbids. Traced here op by op; the result is the scale of each
    block row's token (token 0's past a block's end)."""
    xs = torch.rand(10, 8)
    sorted_slots = torch.randperm(20).to(torch.int32)
    block_row, block_end = torch.tensor([0, 16], dtype=torch.int32), torch.tensor([13, 20], dtype=torch.int32)
    got, fills = fill_ops(lambda: block_row_scales(xs, sorted_slots, block_row, block_end, num_topk=2, block_t=16))
    assert not fills, fills
    rows = (block_row[:, None] + torch.arange(16)).reshape(-1)
    ok = rows < block_end.repeat_interleave(16)
    token = torch.tensor([int(sorted_slots[r]) // 2 if k else 0 for r, k in zip(rows.clamp(max=19).tolist(), ok)])
    assert torch.equal(got, xs[token].t())


@pytest.mark.parametrize("fp8", [3, 4, 5, 6])
def test_the_gluon_fp8_kernels_refuse_an_odd_number_of_l2_k_blocks(fp8):
    """Their L2 takes its 128-deep K blocks in pairs: intermediate 384 (3 blocks) would multiply the last one twice."""
    gluon = KernelConfig(block_t=64, l1_n=128, l1_k=128, l2_n=64, l2_k=128, num_warps=4, num_stages=4, fp8=fp8)
    assert gluon.fit(256, 512).fp8 == fp8
    with pytest.raises(ValueError, match=rf"\(fp8={fp8}\) run L2's 128-deep K blocks in pairs: intermediate 384"):
        gluon.fit(256, 384)
    with pytest.raises(ValueError, match=r"fp8=7\) names no FP8 kernels"):
        dataclasses.replace(gluon, fp8=7).fit(256, 512)


@pytest.mark.parametrize("block_t", [80, 128])
def test_only_the_row_scaled_kernels_take_blocks_of_80_and_128_rows(block_t):
    """fp8=6 holds one accumulator per operand (fp8=3 also holds the block sums being promoted); its 80-row blocks
    add a 16-row tail MMA on the same operand (fp8=3 has no such loop)."""
    rows = KernelConfig(block_t=block_t, l1_n=128, l1_k=128, l2_n=64, l2_k=128, num_warps=4, num_stages=4, fp8=6)
    assert rows.fit(256, 512).block_t == block_t
    with pytest.raises(ValueError, match=r"\(fp8=3\) take block_t in \(32, 64\)"):
        dataclasses.replace(rows, fp8=3).fit(256, 512)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a device without Hopper's Gluon kernels")
@pytest.mark.parametrize("fp8", [4, 5, 6])
def test_the_hopper_fp8_kernels_are_refused_off_hopper_by_name(fp8):
    fp4 = quantize_experts_fp4(*full_weights(0, num_experts=E, hidden=H, inter=256))  # 2 L2 K blocks: a pair
    packed = PackedExperts.from_params(fp4.gate_up_proj, fp4.gate_up_proj_scale_inv, fp4.down_proj,
                                       fp4.down_proj_scale_inv)
    _, q, sf, idx, w = staged(4, 0)
    ws = KernelConfig(block_t=64, l1_n=128, l1_k=128, l2_n=64, l2_k=128, num_warps=4, num_stages=4, fp8=fp8)
    what = "Gluon kernels for Hopper: .*use fp8=1" if fp8 == 6 else "warp-specialized Gluon kernels for Hopper: .*use fp8=3"
    with pytest.raises(RuntimeError, match=rf"fp8={fp8}\) runs {what}"):
        triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=None, config=ws)
