"""The FP8 wgmma path's weight layout (`layout.shuffle_fp4_e4m3`) and activation order, on CPU.

The Gluon kernels that read them (`hopper_fp8`) run only on a Hopper GPU (`test_triton_gpu.py` checks their outputs
against the float64 emulation); here the layout itself: every e2m1 code lands in the word, nibble and sign bit the
kernel's expansion reads for its MMA position (`layout.fp8_k_order`), the UE8M0 bytes in the scale word of its row and
K block, L1's rows in L2's K order, and the activations in the same order (`fp8.x_blocks(permute=True)`, under the
interpreter).
"""

import pytest
import torch

from planc.kernels.megamoe.quant import float_to_ue8m0_bytes, quantize_experts_fp4, quantize_fp8
from planc.kernels.megamoe.triton import target
from planc.kernels.megamoe.triton.layout import (
    E4M3_TABLE_ROWS,
    E4m3Experts,
    PackedExperts,
    e4m3_tables,
    fp8_k_order,
    shuffle_fp4,
    unshuffle_fp4,
)
from tests.kernels.megamoe.common import full_weights
from tests.kernels.megamoe.emulation import E2M1, fp8_weights, round_e4m3


def test_unshuffle_undoes_the_bf16_layout():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (2, 32, 64), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (2, 32, 4), generator=g, dtype=torch.uint8)
    back = unshuffle_fp4(*shuffle_fp4(packed, scales))
    assert torch.equal(back[0], packed) and torch.equal(back[1], scales)


def test_k_order_is_a_permutation_that_gives_each_lane_one_32_group():
    order = fp8_k_order()
    assert sorted(order.tolist()) == list(range(128))
    pos = torch.arange(128)
    lane_q = (pos // 4) % 4  # an 8-bit A fragment: lane 4 r + q holds MMA K 4 q + {0..3} (+16) of each 32-deep step
    assert torch.equal(order // 32, lane_q)


def decode(words: torch.Tensor, sbytes: torch.Tensor) -> torch.Tensor:
    """One expert's FP8-layout words int32 [N, K/8] and scale words (bytes) [N, K/32] -> float64 [N, K] weights at the
    MMA's K positions, by the kernel's recipe: per word (8 codes of one row and 32-group) the table row t of its group,
    e4m3(|code| x 2**(1 - t)), looked up by the magnitude nibbles, the sign from its bit; times 2**(ref - 128)."""
    n, k = words.shape[0], 8 * words.shape[1]
    kbs, gs = k // 128, n // 16
    w = (words.to(torch.int64) & 0xFFFFFFFF).view(kbs, gs, 2, 8, 4, 2, 2)  # kb g sh r q sl m8
    sw = sbytes.contiguous().view(torch.int32).to(torch.int64).view(kbs, gs, 2, 8, 1)  # kb g m8 r: row 16 g + 8 m8 + r
    t = (sw >> (8 + 5 * torch.arange(4))) & 31  # [kb, g, m8, r, q]: the table row of group q
    ref = sw & 0xFF  # the row's block scale 2**(ref - 128)
    shift = (1 - t).double().permute(0, 1, 3, 4, 2)[:, :, None, :, :, None, :]  # kb sh r q sl m8, broadcast over sh, sl
    block = torch.pow(2.0, ref.double() - 128).permute(0, 1, 3, 4, 2)[:, :, None, :, :, None, :]
    e2m1 = torch.tensor(E2M1, dtype=torch.float64)
    vals = []
    for c in range(8):  # code c of a word is A register h = c // 4, byte i = c % 4
        mag = (w >> (4 * c)) & 7
        sign = (w >> (8 * c + 7 if c < 4 else 8 * (c - 4) + 3)) & 1
        v = round_e4m3(e2m1[mag] * torch.pow(2.0, shift)) * block
        vals.append(torch.where(sign == 1, -v, v))
    v = torch.stack(vals, -1).view(kbs, gs, 2, 8, 4, 2, 2, 2, 4)  # kb g sh r q sl m8 h i
    # row 16 g + 8 m8 + r; MMA K 128 kb + 32 (2 sh + sl) + 16 h + 4 q + i
    return v.permute(1, 6, 3, 0, 2, 5, 7, 4, 8).reshape(n, k)


@pytest.mark.parametrize("row_scaled", [False, True], ids=["block_scales", "row_scales"])
def test_words_expand_to_the_emulated_weights_in_the_mma_k_order(row_scaled):
    """Per 128-deep K block (fp8=3), and with the row-scaled scale words (fp8=6, `E4m3Experts.row_scaled`, made from
    the block words): one ref per row, the groups far below it rounded or zero as the emulation rounds them."""
    w1, w2 = full_weights(3, num_experts=2, hidden=256, inter=128)
    # groups 2**-12 and 2**-30 below their block's largest: rounded on the e4m3 grid, or to 0
    w1[:, ::3, 32:64] *= 2.0**-12
    w2[:, 1::4, 96:128] *= 2.0**-30
    fp4 = quantize_experts_fp4(w1, w2)
    packed = PackedExperts.from_params(fp4.gate_up_proj, fp4.gate_up_proj_scale_inv, fp4.down_proj,
                                       fp4.down_proj_scale_inv)
    e4 = E4m3Experts.from_packed(packed)
    s1, s2 = e4.row_scaled() if row_scaled else (e4.s1, e4.s2)
    order = fp8_k_order()
    inter = 128
    l1_rows = torch.cat([torch.arange(0, 2 * inter, 128)[:, None] + order[None, :]], dim=0).reshape(-1)
    for e in range(2):
        want1 = fp8_weights(fp4.gate_up_proj[e], float_to_ue8m0_bytes(fp4.gate_up_proj_scale_inv[e]),
                            block=256 if row_scaled else 128)
        want2 = fp8_weights(fp4.down_proj[e], float_to_ue8m0_bytes(fp4.down_proj_scale_inv[e]),
                            block=inter if row_scaled else 128)
        got1 = decode(e4.w1[e], s1[e])
        got2 = decode(e4.w2[e], s2[e])
        # MMA K position j holds weight K 128 kb + order[j]; L1's row j of each 128 is the module's row order[j]
        perm1 = (torch.arange(0, 256, 128)[:, None] + order[None, :]).reshape(-1)
        perm2 = (torch.arange(0, inter, 128)[:, None] + order[None, :]).reshape(-1)
        assert torch.equal(got1, want1[l1_rows][:, perm1])
        assert torch.equal(got2, want2[:, perm2])


def test_tables_hold_the_emulated_e4m3_bytes():
    """Row t, byte m: e2m1 magnitude m times 2**(1 - t) rounded to e4m3 (the emulation's rounding), as bytes."""
    tab = e4m3_tables(torch.device("cpu"))
    got = torch.stack([(tab >> (8 * m)) & 0xFF for m in range(8)], -1).to(torch.uint8).view(torch.float8_e4m3fn)
    t = torch.arange(E4M3_TABLE_ROWS, dtype=torch.float64)
    want = round_e4m3(torch.tensor(E2M1, dtype=torch.float64)[None, :] * torch.pow(2.0, 1 - t)[:, None])
    assert torch.equal(got.double(), want)
    assert not got[-1].double().any()  # the clamped row (a group 16+ binades below its block's largest): all zero


@pytest.mark.skipif(not target.interpreting(), reason="CPU tensors need Triton's interpreter")
def test_activations_are_stored_in_the_mma_k_order():
    from planc.kernels.megamoe.triton.fp8 import x_blocks

    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    plain, s_plain = x_blocks(q, sf)
    permuted, s_perm = x_blocks(q, sf, permute=True)
    perm = (torch.arange(0, 256, 128)[:, None] + fp8_k_order()[None, :]).reshape(-1)
    assert torch.equal(permuted, plain[:, perm]) and torch.equal(s_perm, s_plain)


@pytest.mark.skipif(not target.interpreting(), reason="CPU tensors need Triton's interpreter")
def test_row_scaled_casts_match_the_emulation():
    """The row-scaled path's casts (`fp8.x_rows`, `fp8.l1_out_rows`) under the interpreter: one scale for the whole
    row, as `emulation.fp8_block_cast` with a block of the row; the activations in the MMA's K order, and the slots
    of no local expert zeroed by the same kernel."""
    from planc.kernels.megamoe.triton.fp8 import l1_out_rows, x_rows
    from planc.kernels.megamoe.triton.routing import other_slots
    from tests.kernels.megamoe.emulation import fp8_block_cast

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 1024, generator=g)
    x[1, 512:640] *= 2.0**-9  # a group far below the row's largest: off e4m3's normal range
    x[2, 7] = 300.0
    x[0, 33] = -40.0  # the row's largest magnitude, negative (x_rows finds it from the bytes' magnitudes)
    q, sf = quantize_fp8(x.bfloat16())
    sf = float_to_ue8m0_bytes(sf)
    idx = torch.tensor([[0, 5], [3, -1], [1, 2]])
    slots = torch.ones(6, 1024, dtype=torch.bfloat16)
    got, got_s = x_rows(q, sf, zero=other_slots(idx, slots, 0, 3))
    staged = q.double() * torch.pow(2.0, sf.long().double() - 127).repeat_interleave(32, dim=1)
    perm = (torch.arange(0, 1024, 128)[:, None] + fp8_k_order()[None, :]).reshape(-1)
    for t in range(3):
        want, want_s = fp8_block_cast(staged[t], floor=True, block=1024)
        assert torch.equal(got[t].view(torch.float8_e4m3fn).double(), want[perm]) and got_s[t, 0] == want_s[0]
    assert torch.equal(slots[[1, 2, 3]].float(), torch.zeros(3, 1024))  # experts 5, 3 and -1: not local (0-2)
    assert torch.equal(slots[[0, 4, 5]].float(), torch.ones(3, 1024))

    a32 = torch.randn(8, 256, generator=g)
    a32[2] = 0.0  # an all-zero row: scale 0, no floor
    a32[3, :128] *= 2.0**-10
    act = torch.zeros(8, 256, dtype=torch.uint8)
    act_s = torch.full((1, 8), -1.0)
    # blocks of 2 rows: block 1 holds one routed row, block 3 is past the routed ones
    l1_out_rows(a32, act, act_s, torch.tensor([0, 1, 2, 9]), torch.tensor([0, 2, 3, 5]), torch.tensor([2, 3, 5, 5]),
                num_local=3, block_t=2)
    for r in (0, 1, 2, 4, 5):
        want, want_s = fp8_block_cast(a32[r].double(), floor=False, block=256)
        assert torch.equal(act[r].view(torch.float8_e4m3fn).double(), want) and act_s[0, r] == want_s[0], r
    for r in (3, 6, 7):  # past a block's routed rows, and the unrouted block: not touched
        assert not act[r].any() and act_s[0, r] == -1, r


def test_the_fp8_layout_copy_is_counted_once_made():
    """`PackedExperts.fp8_layout_nbytes` (what the bench reports beside the FP4 bytes): 0 until a batch takes the FP8
    path, then the second copy's bytes, then also its row-scaled scale words (one byte per 32 weights)."""
    fp4 = quantize_experts_fp4(*full_weights(0, num_experts=2, hidden=256, inter=128))
    packed = PackedExperts.from_params(fp4.gate_up_proj, fp4.gate_up_proj_scale_inv, fp4.down_proj,
                                       fp4.down_proj_scale_inv)
    assert packed.fp8_layout_nbytes == 0
    e4 = packed.e4m3()
    assert packed.fp8_layout_nbytes == packed.nbytes
    s1, s2 = e4.row_scaled()
    assert packed.fp8_layout_nbytes == packed.nbytes + s1.nbytes + s2.nbytes == packed.nbytes + packed.s1.nbytes \
        + packed.s2.nbytes
