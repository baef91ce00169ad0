"""The FP8-math path of the Triton backend for prefill-size batches: FP8 x FP8 MMAs with FP32 accumulation.

Why: at ~64 rows per expert the BF16 path multiplies at the BF16 tensor-core rate, half of what Hopper's FP8 MMA
does. Here both GEMMs take FP8 e4m3 operands (`tl.dot` on float8e4nv, wgmma on sm_90) and promote each 128-deep
K block's FP32 partial sum into the accumulator times its two block scales, as DeepGEMM's SM90 FP8 GEMMs do. The
FP4 weights stay packed (the same `layout.shuffle_fp4` words the BF16 path reads): each K tile is expanded in
registers to e4m3 and exists nowhere else.

Numerics (docs/megamoe.md, "The FP8 path"; `tests/kernels/megamoe/emulation.py` emulates them in float64):
- activations: the staged FP8 rows (per-32 UE8M0) are re-cast per (row, 128 channels): sf = 2**ceil(log2(amax *
  fl(1/448))) (UE8M0, at least 2**-126), values RNE onto e4m3 (`x_blocks_kernel`).
- weights: per (row, 128 K) the largest of its four UE8M0 bytes, ref; each e2m1 code times 2**(s - ref + 1) is
  rounded to e4m3 (exact while s >= ref - 9: the e2m1 grid shifted by at most 9 binades stays on the e4m3 grid),
  the block scale is 2**(ref - 128).
- L1: sum over K blocks of fp32(block MMA) * sx * sw, rounded to BF16 once; the SwiGLU epilogue of the BF16 path
  (clamp, routing weight); the result re-cast per (row, 128 intermediate channels) as the activations (no floor:
  an all-zero group gets sf 0), stored as e4m3 bytes and FP32 scales.
- L2: the same block MMAs over the intermediate dimension, rounded to BF16 per slot; the combine is unchanged.

The row-scaled numerics (`KernelConfig(fp8=6)`, `hopper_fp8` with ROW_SCALED): the same casts with one scale for a
whole row instead of per 128 (activations per token, `x_rows_kernel`; weights: ref the largest UE8M0 byte of the row,
`layout.row_scaled_words`; L1's output per row, `l1_out_rows_kernel`), so the FP8 MMAs of every K block accumulate in
one FP32 sum (the tensor cores' own accumulation), scaled by sw * sx once before the BF16 rounding.
"""

from __future__ import annotations

import torch

from planc.kernels.megamoe.triton import hopper_fp8, hopper_fp8_ws, hopper_prefill, target
from planc.kernels.megamoe.triton.config import KernelConfig
from planc.kernels.megamoe.triton.layout import PackedExperts
from planc.kernels.megamoe.triton.routing import no_slots, other_slots, route
from planc.kernels.megamoe.triton.target import tl, triton

BLOCK = 128  # the scale block of both operands along K, and of the L1 output along its channels

if triton is not None:
    from planc.kernels.megamoe.triton.jit import (
        _block_slots,
        _e4m3_bits,
        _fp4_expand,
        _fp4_load,
        _fp4_offsets,
        _pow2_ceil_exponent,
        _round_e4m3,
        bf16_rne,
        e4m3_value,
        swiglu,
        tile_ids,
        zero_other_slots,
    )

    @triton.jit
    def _cast_blocks(v, ROWS: tl.constexpr, COLS: tl.constexpr, FLOOR: tl.constexpr):
        """FP32 ``[ROWS, COLS]`` -> (e4m3 bytes ``[ROWS, COLS]``, FP32 scales ``[ROWS, COLS / 128]``): per 128
        columns sf = 2**ceil(log2(amax * fl(1/448))), at least 2**-126 when FLOOR (else 0 for an all-zero group),
        RNE onto e4m3."""
        g = tl.reshape(v, (ROWS, COLS // 128, 128))
        e = _scale_exponent(tl.max(tl.abs(g), axis=2), FLOOR)
        return tl.reshape(_e4m3_at(g, e[:, :, None]), (ROWS, COLS)), (e << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _scale_exponent(amax, FLOOR: tl.constexpr):
        """The biased exponent e of the scale 2**(e - 127) = 2**ceil(log2(amax * fl(1/448))) of a group whose largest
        magnitude is `amax` (at least 2**-126 when FLOOR, else 0 for an all-zero group)."""
        e = _pow2_ceil_exponent(amax * (1.0 / 448.0))
        if FLOOR:
            e = tl.maximum(e, 1)
        return tl.minimum(e, 254)

    @triton.jit
    def _e4m3_at(v, e):
        """FP32 values -> e4m3 bytes of v / 2**(e - 127) (RNE, saturated at 448)."""
        sf_inv = (tl.minimum(tl.maximum(254 - e, 0), 254) << 23).to(tl.float32, bitcast=True)
        return _e4m3_bits(tl.minimum(tl.maximum(v * sf_inv, -448.0), 448.0))

    @triton.jit
    def _staged_values(q_ptr, sf_ptr, row, col, hidden):
        """The staged FP8 rows' values (e4m3 bytes times their per-32 UE8M0 scales) at channels `col` of `row`."""
        b = tl.load(q_ptr + row * hidden + col).to(tl.int32)
        s = tl.load(sf_ptr + row * (hidden // 32) + col // 32).to(tl.int32)
        return e4m3_value(b) * (s << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _k_position(col):
        """Where channel `col` goes in the FP8 wgmma kernels' K order (`layout.fp8_k_order`: channel 32 q + 8 s + 4 h
        + i of each 128 at 32 s + 16 h + 4 q + i)."""
        c = col % 128
        return col - c + ((c // 8) % 4) * 32 + ((c // 4) % 2) * 16 + (c // 32) * 4 + c % 4

    @triton.jit
    def x_blocks_kernel(q_ptr, sf_ptr, x8_ptr, xs_ptr, hidden, idx_ptr, slots_ptr, first, num_local, stride_slots,
                        BH: tl.constexpr, PERMUTE: tl.constexpr, NUM_TOPK: tl.constexpr, BK: tl.constexpr,
                        ZERO: tl.constexpr):
        """The staged FP8 rows (per-32 UE8M0) of one row and BH channels -> e4m3 bytes with one FP32 scale per 128
        channels (what the FP8 L1 reads); PERMUTE: each 128 channels stored in the FP8 wgmma's K order
        (`layout.fp8_k_order`: channel 32 q + 8 s + 4 h + i at 32 s + 16 h + 4 q + i); ZERO: also zeros in those
        channels of the row's slots on no local expert (`jit.zero_other_slots`)."""
        row = tl.program_id(0).to(tl.int64)
        if ZERO:
            zero_other_slots(idx_ptr, slots_ptr, row, tl.program_id(1), first, num_local, hidden, stride_slots,
                             NUM_TOPK, BK, BH)
        col = tl.program_id(1) * BH + tl.arange(0, BH)
        v = _staged_values(q_ptr, sf_ptr, row, col, hidden)
        q, sf = _cast_blocks(tl.reshape(v, (1, BH)), 1, BH, True)
        if PERMUTE:
            col = _k_position(col)
        tl.store(x8_ptr + row * hidden + col, tl.reshape(q, (BH,)))
        blk = tl.program_id(1) * (BH // 128) + tl.arange(0, BH // 128)
        tl.store(xs_ptr + row * (hidden // 128) + blk, tl.reshape(sf, (BH // 128,)))

    @triton.jit
    def x_rows_kernel(q_ptr, sf_ptr, x8_ptr, xs_ptr, hidden, idx_ptr, slots_ptr, first, num_local, stride_slots,
                      BH: tl.constexpr, NUM_TOPK: tl.constexpr, BK: tl.constexpr, ZERO: tl.constexpr):
        """`x_blocks_kernel` with one scale for the whole row (the row-scaled path, `KernelConfig(fp8=6)`), the
        channels in the FP8 wgmma kernels' K order: two passes over the row (its largest magnitude from each 32-group's
        largest byte, then the cast), BH channels at a time."""
        row = tl.program_id(0).to(tl.int64)
        amax = 0.0
        for c in range(hidden // BH):
            # e4m3 magnitudes order as their 7-bit patterns, and a power-of-two scale keeps the order (the products
            # are exact in FP32): each 32-group's largest byte, decoded once, is its largest value
            b = tl.load(q_ptr + row * hidden + c * BH + tl.arange(0, BH)).to(tl.int32) & 0x7F
            g = c * (BH // 32) + tl.arange(0, BH // 32)
            s = tl.load(sf_ptr + row * (hidden // 32) + g).to(tl.int32)
            top = e4m3_value(tl.max(tl.reshape(b, (BH // 32, 32)), axis=1)) * (s << 23).to(tl.float32, bitcast=True)
            amax = tl.maximum(amax, tl.max(top, axis=0))
        e = _scale_exponent(amax, True)
        for c in range(hidden // BH):
            if ZERO:
                zero_other_slots(idx_ptr, slots_ptr, row, c, first, num_local, hidden, stride_slots, NUM_TOPK, BK, BH)
            col = c * BH + tl.arange(0, BH)
            q = _e4m3_at(_staged_values(q_ptr, sf_ptr, row, col, hidden), e)
            tl.store(x8_ptr + row * hidden + _k_position(col), q)
        tl.store(xs_ptr + row, (e << 23).to(tl.float32, bitcast=True))

    @triton.jit
    def l1_out_rows_kernel(a_ptr, q_ptr, s_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, inter, num_local,
                           BT: tl.constexpr, BC: tl.constexpr):
        """`l1_out_blocks_kernel` with one scale for the whole row (the row-scaled path), stored ``[R]``: two passes
        over the row, BC channels at a time. Only the blocks' routed rows (L1 writes no others; L2 multiplies the
        rest of its block's tile into output columns it drops)."""
        row = tl.program_id(0)
        b = row // BT
        if tl.load(block_expert_ptr + b) >= num_local:
            return
        if row % BT >= tl.load(block_end_ptr + b) - tl.load(block_row_ptr + b):
            return
        base = row.to(tl.int64) * inter
        amax = 0.0
        for c in range(inter // BC):
            amax = tl.maximum(amax, tl.max(tl.abs(tl.load(a_ptr + base + c * BC + tl.arange(0, BC))), axis=0))
        e = _scale_exponent(amax, False)
        for c in range(inter // BC):
            col = c * BC + tl.arange(0, BC)
            tl.store(q_ptr + base + col, _e4m3_at(tl.load(a_ptr + base + col), e))
        tl.store(s_ptr + row, (e << 23).to(tl.float32, bitcast=True))

    @triton.jit
    def l1_out_blocks_kernel(a_ptr, q_ptr, s_ptr, block_expert_ptr, inter, total_rows, num_local,
                             BT: tl.constexpr, BC: tl.constexpr):
        """L1's FP32 SwiGLU outputs of one block row and BC channels -> e4m3 bytes and one FP32 scale per 128
        channels, no floor (`_cast_blocks`), the scales stored ``[I/128, R]`` (what the Gluon L2 reads); rows of
        blocks past the routed ones are skipped (never read)."""
        row = tl.program_id(0)
        if tl.load(block_expert_ptr + row // BT) >= num_local:
            return
        col = tl.program_id(1) * BC + tl.arange(0, BC)
        v = tl.load(a_ptr + row.to(tl.int64) * inter + col)
        q, sf = _cast_blocks(tl.reshape(v, (1, BC)), 1, BC, False)
        tl.store(q_ptr + row.to(tl.int64) * inter + col, tl.reshape(q, (BC,)))
        blk = tl.program_id(1) * (BC // 128) + tl.arange(0, BC // 128)
        tl.store(s_ptr + blk * total_rows + row, tl.reshape(sf, (BC // 128,)))

    @triton.jit
    def _weight_block(w_base, s_base, w_off, s_off, kc, num_g, BN: tl.constexpr, INTERPRET: tl.constexpr):
        """The [BN, 128] weight tile at K 64*kc as e4m3 (FP32 values of the e4m3 grid under the interpreter) and its
        row scales ``[BN]``: each row's codes times 2**(s - ref + 1), ref its largest scale byte in the tile; the
        row's scale 2**(ref - 128)."""
        w, sw = _fp4_load(w_base, s_base, w_off, s_off, kc, num_g)  # [2, G, 32, 4], [2, G, 32]
        b0 = sw & 0xFF  # byte 2 m8 + jh: row half m8, K half jh of a 64-K block
        b1 = (sw >> 8) & 0xFF
        b2 = (sw >> 16) & 0xFF
        b3 = (sw >> 24) & 0xFF
        r0 = tl.max(tl.maximum(b0, b1), axis=0)  # [G, 32]: rows m8 = 0, over both 64-K blocks
        r1 = tl.max(tl.maximum(b2, b3), axis=0)
        shifted = (tl.maximum(b0 - r0[None] + 128, 0) | (tl.maximum(b1 - r0[None] + 128, 0) << 8)
                   | (tl.maximum(b2 - r1[None] + 128, 0) << 16) | (tl.maximum(b3 - r1[None] + 128, 0) << 24))
        v = _fp4_expand(w, shifted, BN, 128, False, INTERPRET)  # exact: |v| <= 12
        if INTERPRET:
            v = _round_e4m3(v.to(tl.float32))
        else:
            v = v.to(tl.float8e4nv)
        G: tl.constexpr = BN // 16
        lane_rows = tl.join(tl.max(tl.reshape(r0, (G, 8, 4)), axis=2), tl.max(tl.reshape(r1, (G, 8, 4)), axis=2))
        ref = tl.reshape(tl.permute(lane_rows, (0, 2, 1)), (BN,))  # rows 16 g + 8 m8 + r
        scale_bits = tl.where(ref >= 2, (ref - 1) << 23, 0x800000 >> (2 - tl.minimum(ref, 2)))
        return v, scale_bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _act_block(ptrs, s_ptrs, row_ok, INTERPRET: tl.constexpr):
        """A ``[BT, 128]`` tile of e4m3 bytes as FP8 (FP32 under the interpreter) and its row scales ``[BT]``."""
        b = tl.load(ptrs, mask=row_ok[:, None], other=0)
        sx = tl.load(s_ptrs, mask=row_ok, other=0.0)
        if INTERPRET:
            return e4m3_value(b.to(tl.int32)), sx
        return b.to(tl.float8e4nv, bitcast=True), sx

    @triton.jit
    def fp8_l1_kernel(
        x8_ptr, xs_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr,
        out_ptr, outs_ptr, hidden, inter, num_topk, num_local, stride_we, stride_se, clamp,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, INTERPRET: tl.constexpr,
        NUM_STAGES: tl.constexpr, SWAP_AB: tl.constexpr,
    ):
        """L1 of one block of rows and BN gate (and as many up) columns in FP8 block MMAs, then the SwiGLU epilogue
        and the per-128 e4m3 cast of its output (`out` bytes, `outs` scales)."""
        pid_b, pid_n, _ = tile_ids(inter // BN)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert >= num_local:
            return
        row_ok, slot = _block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT)
        token = (slot // num_topk).to(tl.int64)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        num_g = inter // 8  # 2I rows in groups of 16
        wg_off, sg_off = _fp4_offsets(pid_n * (BN // 16), num_g, BN, 128)
        wu_off, su_off = _fp4_offsets(pid_n * (BN // 16) + inter // 16, num_g, BN, 128)
        x_ptrs = x8_ptr + token[:, None] * hidden + tl.arange(0, 128)[None, :]  # [BT, 128]
        xs_ptrs = xs_ptr + token * (hidden // 128)

        if SWAP_AB:  # the weight rows are the MMA's M dimension
            acc_g = tl.zeros((BN, BT), dtype=tl.float32)
            acc_u = tl.zeros((BN, BT), dtype=tl.float32)
        else:  # the block's rows are
            acc_g = tl.zeros((BT, BN), dtype=tl.float32)
            acc_u = tl.zeros((BT, BN), dtype=tl.float32)
        for kb in tl.range(0, hidden // 128, num_stages=NUM_STAGES):
            x, sx = _act_block(x_ptrs + kb * 128, xs_ptrs + kb, row_ok, INTERPRET)
            wg, sg = _weight_block(w_base, s_base, wg_off, sg_off, kb * 2, num_g, BN, INTERPRET)
            wu, su = _weight_block(w_base, s_base, wu_off, su_off, kb * 2, num_g, BN, INTERPRET)
            if SWAP_AB:
                xt = tl.trans(x)
                acc_g += tl.dot(wg, xt, out_dtype=tl.float32) * (sg[:, None] * sx[None, :])
                acc_u += tl.dot(wu, xt, out_dtype=tl.float32) * (su[:, None] * sx[None, :])
            else:
                acc_g += tl.dot(x, tl.trans(wg), out_dtype=tl.float32) * (sx[:, None] * sg[None, :])
                acc_u += tl.dot(x, tl.trans(wu), out_dtype=tl.float32) * (sx[:, None] * su[None, :])
        if not SWAP_AB:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)

        topw = tl.load(weight_ptr + slot, mask=row_ok, other=0.0)
        a = swiglu(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP)  # [BN, BT]
        q, sf = _cast_blocks(tl.trans(a), BT, BN, False)  # [BT, BN] bytes, [BT, BN / 128] scales
        out_rows = (pid_b * BT + tl.arange(0, BT)).to(tl.int64)
        tl.store(out_ptr + out_rows[:, None] * inter + pid_n * BN + tl.arange(0, BN)[None, :], q)
        blk = pid_n * (BN // 128) + tl.arange(0, BN // 128)
        tl.store(outs_ptr + out_rows[:, None] * (inter // 128) + blk[None, :], sf)

    @triton.jit
    def fp8_l2_kernel(
        a8_ptr, as_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        hidden, inter, num_local, stride_we, stride_se, stride_out,
        BT: tl.constexpr, BN: tl.constexpr, INTERPRET: tl.constexpr, NUM_STAGES: tl.constexpr,
        SWAP_AB: tl.constexpr,
    ):
        """L2 of one block of rows and BN hidden columns in FP8 block MMAs; each slot's BF16 output to its slot."""
        pid_b, pid_n, _ = tile_ids(hidden // BN)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert >= num_local:
            return
        row_ok, slot = _block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        num_g = hidden // 16
        w_off, s_off = _fp4_offsets(pid_n * (BN // 16), num_g, BN, 128)
        rows = (pid_b * BT + tl.arange(0, BT)).to(tl.int64)
        a_ptrs = a8_ptr + rows[:, None] * inter + tl.arange(0, 128)[None, :]
        as_ptrs = as_ptr + rows * (inter // 128)

        offs_n = pid_n * BN + tl.arange(0, BN)
        if SWAP_AB:
            acc = tl.zeros((BN, BT), dtype=tl.float32)
            for kb in tl.range(0, inter // 128, num_stages=NUM_STAGES):
                a, sa = _act_block(a_ptrs + kb * 128, as_ptrs + kb, row_ok, INTERPRET)
                w, sw = _weight_block(w_base, s_base, w_off, s_off, kb * 2, num_g, BN, INTERPRET)
                acc += tl.dot(w, tl.trans(a), out_dtype=tl.float32) * (sw[:, None] * sa[None, :])
            out_ptrs = out_ptr + slot[None, :].to(tl.int64) * stride_out + offs_n[:, None]
            tl.store(out_ptrs, bf16_rne(acc), mask=row_ok[None, :])
        else:
            acc = tl.zeros((BT, BN), dtype=tl.float32)
            for kb in tl.range(0, inter // 128, num_stages=NUM_STAGES):
                a, sa = _act_block(a_ptrs + kb * 128, as_ptrs + kb, row_ok, INTERPRET)
                w, sw = _weight_block(w_base, s_base, w_off, s_off, kb * 2, num_g, BN, INTERPRET)
                acc += tl.dot(a, tl.trans(w), out_dtype=tl.float32) * (sa[:, None] * sw[None, :])
            out_ptrs = out_ptr + slot[:, None].to(tl.int64) * stride_out + offs_n[None, :]
            tl.store(out_ptrs, bf16_rne(acc), mask=row_ok[:, None])


def x_blocks(x_fp8: torch.Tensor, x_sf: torch.Tensor, permute: bool = False,
             zero: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Staged FP8 rows ``[M, H]`` with UE8M0 bytes ``[M, H/32]`` -> e4m3 bytes ``[M, H]`` (uint8) and FP32 scales
    ``[M, H/128]``, one per 128 channels (see the module docstring); `permute`: the channels of each 128 in the FP8
    wgmma kernels' K order (`layout.fp8_k_order`); `zero` (`routing.other_slots`): the same kernel zeroes the slot
    outputs of no local expert."""
    m, hidden = x_fp8.shape
    x8 = torch.empty((m, hidden), dtype=torch.uint8, device=x_fp8.device)
    xs = torch.empty((m, hidden // BLOCK), dtype=torch.float32, device=x_fp8.device)
    if m:
        bh = 1024 if hidden % 1024 == 0 else BLOCK
        x_blocks_kernel[(m, hidden // bh)](x_fp8.contiguous().view(torch.uint8), x_sf.contiguous(), x8, xs, hidden,
                                           **(zero or no_slots(x_fp8)), BH=bh, PERMUTE=permute, num_warps=4)
    return x8, xs


def x_rows(x_fp8: torch.Tensor, x_sf: torch.Tensor, zero: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x_blocks(permute=True)` with one scale per row (the row-scaled path): e4m3 bytes ``[M, H]`` and FP32 scales
    ``[M, 1]``."""
    m, hidden = x_fp8.shape
    x8 = torch.empty((m, hidden), dtype=torch.uint8, device=x_fp8.device)
    xs = torch.empty((m, 1), dtype=torch.float32, device=x_fp8.device)
    if m:
        x_rows_kernel[(m,)](x_fp8.contiguous().view(torch.uint8), x_sf.contiguous(), x8, xs, hidden,
                            **(zero or no_slots(x_fp8)),
                            BH=1024 if hidden % 1024 == 0 else BLOCK, num_warps=4)
    return x8, xs


def l1_out_rows(a32: torch.Tensor, act: torch.Tensor, act_s: torch.Tensor, block_expert: torch.Tensor,
                block_row: torch.Tensor, block_end: torch.Tensor, num_local: int, block_t: int) -> None:
    """L1's FP32 outputs ``[R, I]`` -> e4m3 bytes `act` ``[R, I]`` and one scale per row, `act_s` ``[1, R]`` (the
    routed rows of each block: `routing.route`'s `block_row` / `block_end`)."""
    rows, inter = a32.shape
    l1_out_rows_kernel[(rows,)](a32, act, act_s, block_expert, block_row, block_end, inter, num_local, BT=block_t,
                                BC=1024 if inter % 1024 == 0 else BLOCK, num_warps=4)


def l1_out_blocks(a32: torch.Tensor, act: torch.Tensor, act_s: torch.Tensor, block_expert: torch.Tensor,
                  num_local: int, block_t: int) -> None:
    """L1's FP32 outputs ``[R, I]`` -> e4m3 bytes `act` ``[R, I]`` and scales `act_s` ``[I/128, R]`` per (row, 128
    channels), as the fused L1 epilogue casts them (`hopper_fp8` with 4 warps a program)."""
    rows, inter = a32.shape
    bc = 1024 if inter % 1024 == 0 else BLOCK
    l1_out_blocks_kernel[(rows, inter // bc)](a32, act, act_s, block_expert, inter, rows, num_local, BT=block_t,
                                              BC=bc, num_warps=4)


def size_problem(hidden: int, inter: int) -> str | None:
    """None when the FP8 path takes these shapes (its scale blocks are 128 deep), else why not."""
    if hidden % BLOCK or inter % BLOCK:
        return f"the FP8 path needs hidden and intermediate sizes divisible by {BLOCK}, got {hidden} and {inter}"
    return None


def fp8_local_experts_forward(
    x_fp8: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
    experts: PackedExperts, *, first_expert: int, clamp: float | None, config: KernelConfig,
) -> torch.Tensor:
    """`triton_local_experts_forward` for a `KernelConfig(fp8=1 to 6)`: BF16 ``[M, K, H]`` slot outputs (zeros for other
    ranks' experts), the FP8 numerics of the module docstring (fp8=6: the row-scaled ones)."""
    m, k = topk_idx.shape
    hidden, inter, num_local = experts.hidden, experts.intermediate, experts.num_local_experts
    problem = size_problem(hidden, inter)
    if problem:
        raise ValueError(problem + ": use a config without fp8")
    device = x_fp8.device
    ws = config.fp8 in (4, 5)  # the warp-specialized kernels (`hopper_fp8_ws`)
    rows = config.fp8 == 6  # one scale per row (`hopper_fp8`, ROW_SCALED)
    if config.fp8 in (3, 6):
        why = hopper_prefill.gluon_unavailable_reason(device)
        if why is not None:
            raise RuntimeError(f"KernelConfig(fp8={config.fp8}) runs Gluon kernels for Hopper: {why}; use fp8=1 or a "
                               f"BF16 config")
    if ws:
        why = hopper_fp8_ws.unavailable(device)
        if why is not None:
            raise RuntimeError(f"KernelConfig(fp8={config.fp8}) runs warp-specialized Gluon kernels for Hopper: {why}; "
                               f"use fp8=3, fp8=1 or a BF16 config")
    out = torch.empty((m * k, hidden), dtype=torch.bfloat16, device=device)
    if m == 0:
        return out.view(m, k, hidden)
    gluon = config.fp8 >= 3  # the Gluon kernels, on the FP8 layout of the same experts
    zero = other_slots(topk_idx, out, first_expert, num_local)
    x8, xs = x_rows(x_fp8, x_sf, zero) if rows else x_blocks(x_fp8, x_sf, permute=gluon, zero=zero)
    weights = topk_weights.reshape(-1).float().contiguous()
    bt = config.block_t
    sorted_slots, block_expert, block_row, block_end = route(
        topk_idx, first_expert=first_expert, num_local_experts=num_local, block_t=bt)
    nblocks = block_expert.numel()
    act = torch.empty((nblocks * bt, inter), dtype=torch.uint8, device=device)
    act_s = torch.empty((nblocks * bt, inter // BLOCK), dtype=torch.float32, device=device)
    if gluon:
        kernels = hopper_fp8_ws if ws else hopper_fp8
        e4 = experts.e4m3()
        act_s = torch.empty((1 if rows else inter // BLOCK, nblocks * bt), dtype=torch.float32, device=device)
        if not rows:  # the row-scaled L1 reads each token's one scale where it scales its sums
            xs = hopper_fp8.block_row_scales(xs, sorted_slots, block_row, block_end, num_topk=k, block_t=bt)
        s1, s2 = e4.row_scaled() if rows else (e4.s1, e4.s2)
        s1 = s1.reshape(num_local, -1).view(torch.int32)
        s2 = s2.reshape(num_local, -1).view(torch.int32)
        # a program of less than a scale block (or of part of a row's, `rows`) leaves its SwiGLU output in FP32 for
        # `l1_out_blocks` (`l1_out_rows`) to cast
        half = rows or kernels.l1_channels(config) < BLOCK
        a32 = torch.empty((nblocks * bt, inter), dtype=torch.float32, device=device) if half else None
        extra = dict(row_scaled=True) if rows else {}
        kernels.l1(x8.view(torch.float8_e4m3fn), xs, e4.w1, s1, sorted_slots, weights, block_expert, block_row,
                   block_end, act, act_s, clamp=clamp, num_topk=k, config=config, a32=a32, **extra)
        if a32 is not None and rows:
            l1_out_rows(a32, act, act_s, block_expert, block_row, block_end, num_local, bt)
        elif a32 is not None:
            l1_out_blocks(a32, act, act_s, block_expert, num_local, bt)
        kernels.l2(act.view(torch.float8_e4m3fn), act_s, e4.w2, s2, sorted_slots, block_expert, block_row,
                   block_end, out, config=config, **extra)
        return out.view(m, k, hidden)
    s1 = experts.s1.reshape(num_local, -1).view(torch.int32)
    s2 = experts.s2.reshape(num_local, -1).view(torch.int32)
    interpret = target.interpreting()
    regs = config.launch_registers()
    fp8_l1_kernel[(nblocks * (inter // config.l1_n),)](
        x8, xs, experts.w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, act_s,
        hidden, inter, k, num_local, experts.w1.stride(0), s1.stride(0), 0.0 if clamp is None else clamp,
        HAS_CLAMP=clamp is not None, BT=bt, BN=config.l1_n, INTERPRET=interpret, NUM_STAGES=config.num_stages,
        SWAP_AB=config.fp8 == 1, num_warps=config.num_warps, num_stages=config.num_stages, **regs,
    )
    fp8_l2_kernel[(nblocks * (hidden // config.l2_n),)](
        act, act_s, experts.w2, s2, sorted_slots, block_expert, block_row, block_end, out,
        hidden, inter, num_local, experts.w2.stride(0), s2.stride(0), out.stride(0),
        BT=bt, BN=config.l2_n, INTERPRET=interpret, NUM_STAGES=config.num_stages, SWAP_AB=config.fp8 == 1,
        num_warps=config.num_warps, num_stages=config.num_stages, **config.launch_registers("L2"),
    )
    return out.view(m, k, hidden)
