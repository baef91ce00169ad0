"""The split-K decode kernels: batches of a few tokens (1-4 at top-6) read every routed expert's weights once, spread
over many more programs than the batch has output tiles, with several K tiles of weights in flight per program.

Why: a 1-token V4 batch has 6 experts x 48 gate/up tiles for L1 and 6 x 112 hidden tiles for L2 (2.2 and 5.1
programs per SM on 132 SMs), and each program of the general kernels (`jit.l1_swiglu_kernel`, `jit.l2_kernel`) keeps
one 64-deep K tile (4 KB of L1 words, 2 KB of L2 words) in flight: a few KB per SM, far from what keeps HBM busy
(bandwidth x latency: ~3.35 TB/s x ~1.5 µs is ~40 KB per SM). Here:
- both GEMMs split their K dimension (L1: hidden, `l1_split`; L2: intermediate, `l2_split`), so a batch of one
  token has several programs per SM in both kernels (`config.pick_config` sizes the splits from the SM count);
- each program loads `depth` K tiles of 64 per iteration into registers while it expands and multiplies the previous
  `depth` (`depth` x 4 KB in flight per L1 program, x 2 KB per L2 program);
- the split partial sums are reduced by the last program of each output tile to arrive (a per-tile arrival counter,
  `tl.atomic_add` with acquire-release order): it adds the partials in split order (deterministic: the same bits on
  every run) and runs the epilogue (L1: SwiGLU, clamp, routing weight and FP8 requantization, `jit.swiglu_requant`;
  L2: the BF16 rounding into the slot's output), so no reduction kernel is launched, and the counter is left at 0;
- the weights stream either by register prefetch of `depth` K tiles (`KernelConfig.prefetch`) or through Triton's
  cp.async pipeline of `num_stages` shared-memory buffers (`num_stages - 1` K tiles in flight, no registers held).
Launches per call: the prologue (`prologue_kernel`: routing, the tokens' BF16 values and the zeros of slots on no
local expert, one launch; `KernelConfig.prologue=0`: three, as the general path), then L1 and L2, or both as one
persistent launch (`decode_persistent_kernel`, `KernelConfig.persistent`: work items by ticket, an L2 item waiting
for its block's L1 tiles), or as the same split-K grid in Gluon with the copies in a producer warp (`hopper_decode`,
`KernelConfig.decode_ws`). The general path has L1's reduction kernel besides.

Numerics: the general path's (docs/megamoe.md, steps 3-6). L1 with the same `l1_split` sums the same FP32 partials
in the same order as `jit.l1_reduce_kernel`; L2's split changes only the order of its FP32 sums.
"""

from __future__ import annotations

import torch

from planc.kernels.megamoe.triton import hopper_decode, jit, routing, stream_k, target
from planc.kernels.megamoe.triton.target import tl, triton

# Arrival counters (int32, zero between kernels: the last program of each tile puts its counter back to 0), one set
# per device and stream: kernels on one stream run one after the other, so a set is never in use by two at once.
_COUNTERS: dict[tuple[str, int | None, int], torch.Tensor] = {}
# The sets are slices of one buffer per device, zeroed when it is allocated, outside any CUDA-graph capture: a stream
# whose first decode call is captured (torch.cuda.graph captures on a stream of its own, after warm-up calls on
# another) takes a slice with no launch, where a `torch.zeros` there would put a fill kernel into the graph, run on
# every replay (1 µs beside the 97 µs of V4's experts at 1 token on an H100).
_POOL_COUNTERS = 1 << 16
_POOLS: dict[tuple[str, int | None], list] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """`count` zeroed int32 arrival counters for the kernels launched next on the current stream of `device`,
    allocated once per (device, stream) and grown when a call needs more (no per-call fill: the kernels leave them at
    zero). Host bookkeeping only: no device read, so a call can be captured in a CUDA graph."""
    index, stream = device.index, 0
    if device.type == "cuda":
        index = torch.cuda.current_device() if index is None else index  # `cuda` and `cuda:0`: one set
        stream = torch.cuda.current_stream(index).cuda_stream
    key = (device.type, index, stream)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < count:
        have = _zeroed_slice(device, index, max(count, 2 * (have.numel() if have is not None else 0)))
        _COUNTERS[key] = have
    return have


def _zeroed_slice(device: torch.device, index: int | None, count: int) -> torch.Tensor:
    """`count` zeroed int32 counters no other stream holds: the next slice of the device's buffer (`_POOLS`); a new
    buffer, zeroed and synchronized before any stream uses it, where this one is spent, unless the current stream
    is capturing: then a `torch.zeros` of its own, which the graph replays."""
    key = (device.type, index)
    pool = _POOLS.get(key)
    if pool is None or pool[1] + count > pool[0].numel():
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(count, dtype=torch.int32, device=device)
        pool = [torch.zeros(max(count, _POOL_COUNTERS), dtype=torch.int32, device=device), 0]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zeroed on this stream before another stream takes a slice
        _POOLS[key] = pool
    buf, start = pool
    pool[1] = start + count
    return buf[start:start + count]


# The persistent decode kernel (`KernelConfig.persistent`): its register cap where the config sets none, programs
# per SM, and how many polls an L2 item waits for its block's L1 tiles before it gives up and counts a stall
# (`stalls`): ~a second of polling, where a wait takes microseconds. Compiled for sm_90 by Triton 3.6 (6 cp.async
# stages, 16-row blocks, N tiles of 64, the V4 layer's 16-divisible sizes and strides), the two-launch L1 holds 79
# registers and 37.9 KB of shared memory (5 programs per SM), L2 56; the persistent kernel, both bodies in one loop,
# 168 uncapped (3 per SM): capped at 96 it spills 32 bytes and fits 5 by registers and by shared memory, as L1 does.
# One program more per SM than fit: it starts when the others leave, finds no ticket and leaves. Measured on an H100
# (2026-12-06) it ran the V4 layer at 1 token in 111.6 µs against 105.0 for the two launches: the table does not pick
# it (`config.DECODE_CONFIGS`).
_PERSISTENT_MAXNREG = 96
_PERSISTENT_PROGRAMS_PER_SM = 6
_MAX_POLLS = 1 << 20
_STALLS: dict[tuple[str, int | None], torch.Tensor] = {}


def stalls(device: torch.device) -> torch.Tensor:
    """The count (int32, one per device, never reset) of L2 items of the persistent decode kernel that stopped
    waiting for their block's L1 tiles (`_MAX_POLLS`): their slots are wrong. 0 unless something is broken."""
    index = device.index if device.type != "cuda" or device.index is not None else torch.cuda.current_device()
    key = (device.type, index)
    if key not in _STALLS:  # a slice of the counters' zeroed buffer: no fill kernel, captured or not
        _STALLS[key] = _zeroed_slice(device, index, 1)
    return _STALLS[key]


if triton is not None:

    @triton.jit
    def _dependent_launch(PDL: tl.constexpr):
        """With PDL (the kernel launched with programmatic dependent launch): wait until the kernel before it on the
        stream has finished and its writes are visible (before this kernel touches any memory, so completions stay
        ordered down the chain), then let the next kernel launch: its programs take SM slots as this one's leave."""
        if PDL:
            target.gdc_wait()
            target.gdc_launch_dependents()

    @triton.jit
    def prologue_kernel(
        idx_ptr, sorted_ptr, blocks_ptr, scratch_ptr, num_slots, first, num_local, num_blocks,
        q_ptr, sf_ptr, x_ptr, out_ptr, hidden, stride_out,
        BS: tl.constexpr, BE: tl.constexpr, BB: tl.constexpr, BT: tl.constexpr, LOG_BE: tl.constexpr,
        NUM_TOPK: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr,
    ):
        """What a decode batch needs before L1, in one launch: program 0 routes (`jit.route_kernel`); program
        1 + r * chunks + c dequantizes channels [c * BH, +BH) of token row r to BF16 (`jit.dequant_x_chunk`) and
        writes zeros there in the row's slots whose expert is not local (`jit.zero_other_slots`)."""
        _dependent_launch(PDL)
        pid = tl.program_id(0)
        if pid == 0:
            jit.route_kernel(idx_ptr, sorted_ptr, blocks_ptr, scratch_ptr, num_slots, first, num_local, num_blocks,
                             BS, BE, BB, BT, LOG_BE)
        else:
            chunks = tl.cdiv(hidden, BH)
            row = ((pid - 1) // chunks).to(tl.int64)
            chunk = (pid - 1) % chunks
            jit.dequant_x_chunk(q_ptr, sf_ptr, x_ptr, row, chunk, hidden, BH)
            jit.zero_other_slots(idx_ptr, out_ptr, row, chunk, first, num_local, hidden, stride_out, NUM_TOPK, BK, BH)

    @triton.jit
    def _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok, kc, num_g):
        """The gate words, gate scale words, up words, up scale words and tokens (``[64, BT]``) of the K tile at
        64*kc, as loaded: nothing waits on them until their MMA."""
        gw, gs = jit._fp4_load(w_base, s_base, wg_off, sg_off, kc, num_g)
        uw, us = jit._fp4_load(w_base, s_base, wu_off, su_off, kc, num_g)
        return gw, gs, uw, us, tl.load(x_ptrs + kc * 64, mask=row_ok[None, :], other=0.0)

    @triton.jit
    def _l1_mma(acc_g, acc_u, gw, gs, uw, us, x, BN: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr):
        if INTERPRET:
            x = x.to(tl.float32)  # the interpreter's dot multiplies BF16 operands as integers
        acc_g = tl.dot(jit._fp4_expand(gw, gs, BN, 64, LARGE, INTERPRET), x, acc_g)
        acc_u = tl.dot(jit._fp4_expand(uw, us, BN, 64, LARGE, INTERPRET), x, acc_u)
        return acc_g, acc_u

    @triton.jit
    def _l1_item(
        x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr,
        out_ptr, ws_ptr, cnt_ptr,
        hidden, inter, num_topk, num_local,
        stride_x, stride_we, stride_se, stride_out,
        clamp, tile, sid, num_blocks,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr,
        PREFETCH: tl.constexpr, NUM_STAGES: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        """L1 of one block of rows, BN gate (and as many up) columns (`tile`: block * (inter / BN) + N tile) and
        hidden slice `sid` of SPLIT; the weights stream by register prefetch of DEPTH K tiles (PREFETCH) or through
        NUM_STAGES cp.async buffers; the last slice to arrive sums the slices' FP32 partials in order and runs the
        SwiGLU epilogue (module docstring). Returns 1 where this call wrote the tile's activations, else 0."""
        pid_b = tile // (inter // BN)
        pid_n = tile % (inter // BN)
        done = pid_b * 0
        expert = tl.load(block_expert_ptr + pid_b)
        if expert < num_local:
            row_ok, slot = jit._block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT)
            token = slot // num_topk

            w_base = w_ptr + expert.to(tl.int64) * stride_we
            s_base = s_ptr + expert.to(tl.int64) * stride_se
            num_g = inter // 8  # 2I rows in groups of 16
            wg_off, sg_off = jit._fp4_offsets(pid_n * (BN // 16), num_g, BN, 64)  # gate rows
            wu_off, su_off = jit._fp4_offsets(pid_n * (BN // 16) + inter // 16, num_g, BN, 64)  # up rows
            x_ptrs = x_ptr + token[None, :].to(tl.int64) * stride_x + tl.arange(0, 64)[:, None]  # [64, BT]

            acc_g = tl.zeros((BN, BT), dtype=tl.float32)
            acc_u = tl.zeros((BN, BT), dtype=tl.float32)
            chunks = hidden // (SPLIT * 64)
            kc0 = sid * chunks
            if PREFETCH:
                # DEPTH K tiles in flight: chunks a, b (DEPTH >= 2), c and d (DEPTH 4), each its gate words and scale
                # words, up words and scale words, and tokens; unpacked (loop-carried tuples lower differently across
                # Triton versions)
                iters = chunks // DEPTH
                ag, ags, au, aus, ax = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok, kc0,
                                                 num_g)
                if DEPTH >= 2:
                    bg, bgs, bu, bus, bx = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok,
                                                     kc0 + 1, num_g)
                if DEPTH >= 4:
                    cg, cgs, cu, cus, cx = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok,
                                                     kc0 + 2, num_g)
                    dg, dgs, du, dus, dx = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok,
                                                     kc0 + 3, num_g)
                for i in tl.range(0, iters, num_stages=1):
                    kn = kc0 + tl.minimum(i + 1, iters - 1) * DEPTH  # the last iteration reloads its own tiles
                    ag0, ags0, au0, aus0, ax0 = ag, ags, au, aus, ax
                    ag, ags, au, aus, ax = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok, kn,
                                                     num_g)
                    if DEPTH >= 2:
                        bg0, bgs0, bu0, bus0, bx0 = bg, bgs, bu, bus, bx
                        bg, bgs, bu, bus, bx = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok,
                                                         kn + 1, num_g)
                    if DEPTH >= 4:
                        cg0, cgs0, cu0, cus0, cx0 = cg, cgs, cu, cus, cx
                        dg0, dgs0, du0, dus0, dx0 = dg, dgs, du, dus, dx
                        cg, cgs, cu, cus, cx = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok,
                                                         kn + 2, num_g)
                        dg, dgs, du, dus, dx = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok,
                                                         kn + 3, num_g)
                    acc_g, acc_u = _l1_mma(acc_g, acc_u, ag0, ags0, au0, aus0, ax0, BN, LARGE, INTERPRET)
                    if DEPTH >= 2:
                        acc_g, acc_u = _l1_mma(acc_g, acc_u, bg0, bgs0, bu0, bus0, bx0, BN, LARGE, INTERPRET)
                    if DEPTH >= 4:
                        acc_g, acc_u = _l1_mma(acc_g, acc_u, cg0, cgs0, cu0, cus0, cx0, BN, LARGE, INTERPRET)
                        acc_g, acc_u = _l1_mma(acc_g, acc_u, dg0, dgs0, du0, dus0, dx0, BN, LARGE, INTERPRET)
            else:  # Triton's software pipeline: NUM_STAGES - 1 K tiles in flight through shared memory
                for kc in tl.range(kc0, kc0 + chunks, num_stages=NUM_STAGES):
                    gw, gs, uw, us, x = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok, kc,
                                                  num_g)
                    acc_g, acc_u = _l1_mma(acc_g, acc_u, gw, gs, uw, us, x, BN, LARGE, INTERPRET)

            offs_n = pid_n * BN + tl.arange(0, BN)
            out_rows = pid_b * BT + tl.arange(0, BT)
            out_ptrs = out_ptr + out_rows[None, :].to(tl.int64) * stride_out + offs_n[:, None]
            topw = tl.load(weight_ptr + slot, mask=row_ok, other=0.0)
            if SPLIT == 1:
                tl.store(out_ptrs, jit.swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP, BN, BT))
                done = done + 1
            else:
                split_stride = num_blocks.to(tl.int64) * BT * 2 * inter
                ws = ws_ptr + out_rows[None, :].to(tl.int64) * (2 * inter) + offs_n[:, None]
                mine = ws + sid.to(tl.int64) * split_stride
                tl.store(mine, acc_g, mask=row_ok[None, :])
                tl.store(mine + inter, acc_u, mask=row_ok[None, :])
                if jit.last_to_arrive(cnt_ptr + tile, SPLIT):
                    acc_g = tl.zeros((BN, BT), dtype=tl.float32)
                    acc_u = tl.zeros((BN, BT), dtype=tl.float32)
                    # split order, as `jit.l1_reduce_kernel`; a loop, not unrolled: the partials of all splits in
                    # registers at once would raise the whole kernel's register count (fewer programs per SM)
                    for s in tl.range(0, SPLIT, num_stages=1):
                        acc_g += tl.load(ws + s * split_stride, mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
                        acc_u += tl.load(ws + s * split_stride + inter, mask=row_ok[None, :], other=0.0,
                                         cache_modifier=".cg")
                    tl.store(out_ptrs, jit.swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP, BN, BT))
                    done = done + 1
        return done

    @triton.jit
    def decode_l1_kernel(
        x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr,
        out_ptr, ws_ptr, cnt_ptr,
        hidden, inter, num_topk, num_local,
        stride_x, stride_we, stride_se, stride_out,
        clamp,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr,
        PREFETCH: tl.constexpr, NUM_STAGES: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """`_l1_item` of tile `program_id(0)`, slice `program_id(1)`."""
        _dependent_launch(PDL)
        _l1_item(x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr,
                 out_ptr, ws_ptr, cnt_ptr, hidden, inter, num_topk, num_local, stride_x, stride_we, stride_se,
                 stride_out, clamp, tl.program_id(0), tl.program_id(1), tl.num_programs(0) // (inter // BN),
                 HAS_CLAMP, BT, BN, DEPTH, SPLIT, PREFETCH, NUM_STAGES, LARGE, INTERPRET)

    @triton.jit
    def _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kc, num_g):
        w, sw = jit._fp4_load(w_base, s_base, w_off, s_off, kc, num_g)
        return w, sw, tl.load(a_ptrs + kc * 64)

    @triton.jit
    def _l2_mma(acc, w, sw, x, BN: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr):
        if INTERPRET:
            x = x.to(tl.float32)
        return tl.dot(jit._fp4_expand(w, sw, BN, 64, LARGE, INTERPRET), x, acc)

    @triton.jit
    def _l2_item(
        a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr, ws_ptr, cnt_ptr,
        hidden, inter, num_local,
        stride_a, stride_we, stride_se, stride_out, tile, sid, num_blocks,
        BT: tl.constexpr, BN: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
        NUM_STAGES: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        """L2 of one block of rows, BN hidden columns (`tile`: block * (hidden / BN) + N tile) and intermediate slice
        `sid` of SPLIT, the weights streamed as in L1; the last slice to arrive sums the partials in split order,
        rounds to BF16 and writes each row's slot."""
        pid_b = tile // (hidden // BN)
        pid_n = tile % (hidden // BN)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert < num_local:
            row_ok, slot = jit._block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT)

            w_base = w_ptr + expert.to(tl.int64) * stride_we
            s_base = s_ptr + expert.to(tl.int64) * stride_se
            a_rows = pid_b * BT + tl.arange(0, BT)
            a_ptrs = a_ptr + a_rows[None, :].to(tl.int64) * stride_a + tl.arange(0, 64)[:, None]  # [64, BT]
            num_g = hidden // 16
            w_off, s_off = jit._fp4_offsets(pid_n * (BN // 16), num_g, BN, 64)

            acc = tl.zeros((BN, BT), dtype=tl.float32)
            chunks = inter // (SPLIT * 64)
            kc0 = sid * chunks
            if PREFETCH:
                iters = chunks // DEPTH
                aw, asw, ax = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kc0, num_g)
                if DEPTH >= 2:
                    bw, bsw, bx = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kc0 + 1, num_g)
                if DEPTH >= 4:
                    cw, csw, cx = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kc0 + 2, num_g)
                    dw, dsw, dx = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kc0 + 3, num_g)
                for i in tl.range(0, iters, num_stages=1):
                    kn = kc0 + tl.minimum(i + 1, iters - 1) * DEPTH
                    aw0, asw0, ax0 = aw, asw, ax
                    aw, asw, ax = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kn, num_g)
                    if DEPTH >= 2:
                        bw0, bsw0, bx0 = bw, bsw, bx
                        bw, bsw, bx = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kn + 1, num_g)
                    if DEPTH >= 4:
                        cw0, csw0, cx0 = cw, csw, cx
                        dw0, dsw0, dx0 = dw, dsw, dx
                        cw, csw, cx = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kn + 2, num_g)
                        dw, dsw, dx = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kn + 3, num_g)
                    acc = _l2_mma(acc, aw0, asw0, ax0, BN, LARGE, INTERPRET)
                    if DEPTH >= 2:
                        acc = _l2_mma(acc, bw0, bsw0, bx0, BN, LARGE, INTERPRET)
                    if DEPTH >= 4:
                        acc = _l2_mma(acc, cw0, csw0, cx0, BN, LARGE, INTERPRET)
                        acc = _l2_mma(acc, dw0, dsw0, dx0, BN, LARGE, INTERPRET)
            else:
                for kc in tl.range(kc0, kc0 + chunks, num_stages=NUM_STAGES):
                    w, sw, x = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kc, num_g)
                    acc = _l2_mma(acc, w, sw, x, BN, LARGE, INTERPRET)

            offs_n = pid_n * BN + tl.arange(0, BN)
            out_ptrs = out_ptr + slot[None, :].to(tl.int64) * stride_out + offs_n[:, None]
            if SPLIT == 1:
                tl.store(out_ptrs, jit.bf16_rne(acc), mask=row_ok[None, :])
            else:
                split_stride = num_blocks.to(tl.int64) * BT * hidden
                ws = ws_ptr + a_rows[None, :].to(tl.int64) * hidden + offs_n[:, None]
                tl.store(ws + sid.to(tl.int64) * split_stride, acc, mask=row_ok[None, :])
                if jit.last_to_arrive(cnt_ptr + tile, SPLIT):
                    acc = tl.zeros((BN, BT), dtype=tl.float32)
                    for s in tl.range(0, SPLIT, num_stages=1):
                        acc += tl.load(ws + s * split_stride, mask=row_ok[None, :], other=0.0, cache_modifier=".cg")
                    tl.store(out_ptrs, jit.bf16_rne(acc), mask=row_ok[None, :])

    @triton.jit
    def decode_l2_kernel(
        a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr, ws_ptr, cnt_ptr,
        hidden, inter, num_local,
        stride_a, stride_we, stride_se, stride_out,
        BT: tl.constexpr, BN: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
        NUM_STAGES: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
    ):
        """`_l2_item` of tile `program_id(0)`, slice `program_id(1)`."""
        _dependent_launch(PDL)
        _l2_item(a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr, ws_ptr,
                 cnt_ptr, hidden, inter, num_local, stride_a, stride_we, stride_se, stride_out, tl.program_id(0),
                 tl.program_id(1), tl.num_programs(0) // (hidden // BN), BT, BN, DEPTH, SPLIT, PREFETCH, NUM_STAGES,
                 LARGE, INTERPRET)

    @triton.jit
    def _real_blocks(block_expert_ptr, num_blocks, num_local, BB: tl.constexpr):
        """How many row blocks hold rows (`routing.route` puts them first): the stream-K kernels share only their
        tiles, so a batch on fewer experts than the bound `routing.max_blocks` counts leaves no program idle."""
        b = tl.arange(0, BB)
        e = tl.load(block_expert_ptr + b, mask=b < num_blocks, other=num_local)
        return tl.sum((e < num_local).to(tl.int32), axis=0)

    @triton.jit
    def _partial_ptr(ws_ptr, program, start, piece, run, max_segments, SLOT: tl.constexpr):
        """The workspace slot of `program`'s partial of schedule tile `piece` (`stream_k.partial_slot`: the index of
        that segment among the program's, its span starting at step `start`, `run` steps per schedule tile)."""
        return ws_ptr + (program * max_segments + piece - start // run) * SLOT  # int32: programs x segments x SLOT

    @triton.jit
    def _segment(i, end, steps, slices, tiles):
        """The segment of a span at step `i` (the span ending at `end`): its schedule tile (`stream_k.segment`), the
        output tile, the K steps [k0, k1) of that tile it covers, and the step after it."""
        run = steps // slices
        piece = i // run
        s = piece // tiles
        k0 = s * run + i - piece * run
        n = tl.minimum(run, end - piece * run)  # steps of the schedule tile up to the segment's end
        return piece, piece % tiles, k0, s * run + n, piece * run + n

    @triton.jit
    def _arrivals(tile, steps, slices, tiles, total, programs):
        """How many segments of the schedule cover a part of output `tile` (over its `slices` schedule tiles)."""
        run = steps // slices
        count = tile * 0
        for s in tl.range(0, slices, num_stages=1):
            _, n = stream_k._contributors(s * tiles + tile, run, total, programs)
            count += n
        return count

    @triton.jit
    def _stream_k_share(block_expert_ptr, num_blocks, num_local, n_tiles, steps, BB: tl.constexpr):
        """This program's share of a stream-K kernel: (tiles, total steps, first step, end step, programs) over the
        blocks that hold rows."""
        programs = tl.num_programs(0)
        tiles = _real_blocks(block_expert_ptr, num_blocks, num_local, BB) * n_tiles
        total = tiles * steps
        start, end = stream_k._span(tl.program_id(0), total, programs)
        return tiles, total, start, end, programs

    @triton.jit
    def _sum_partials(ws_ptr, tile, run, slices, tiles, total, programs, max_segments, cell, SLOT: tl.constexpr,
                      BN: tl.constexpr, BT: tl.constexpr, PAIR: tl.constexpr):
        """A tile's FP32 partials summed in schedule order (the same bits on every run): each contributor's [BN, BT]
        at `cell` of its workspace slot (SLOT floats) and, with PAIR (L1's gate and up), the second one after it."""
        acc = tl.zeros((BN, BT), dtype=tl.float32)
        acc2 = tl.zeros((BN, BT), dtype=tl.float32)
        for s in tl.range(0, slices, num_stages=1):
            first, count = stream_k._contributors(s * tiles + tile, run, total, programs)
            for c in tl.range(first, first + count, num_stages=1):
                c_start, _ = stream_k._span(c, total, programs)
                part = _partial_ptr(ws_ptr, c, c_start, s * tiles + tile, run, max_segments, SLOT)
                acc += tl.load(part + cell, cache_modifier=".cg")
                if PAIR:
                    acc2 += tl.load(part + BN * BT + cell, cache_modifier=".cg")
        return acc, acc2

    @triton.jit
    def decode_l1_stream_k_kernel(
        x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr,
        out_ptr, ws_ptr, cnt_ptr,
        hidden, inter, num_topk, num_local, num_blocks, slices, max_segments,
        stride_x, stride_we, stride_se, stride_out,
        clamp,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, NUM_STAGES: tl.constexpr,
        LARGE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
    ):
        """L1 under the stream-K schedule (`stream_k`): this program's even share of the (slice, tile, K step) space
        of the blocks that hold rows, segment by segment, each segment's K steps through NUM_STAGES cp.async buffers.
        A whole tile (`slices` 1) runs the epilogue at once (the split-1 path's bits); a part stores its FP32 gate
        and up partials in its workspace slot and counts its arrival at the tile; the tile's last arrival sums the
        partials in schedule order and runs the epilogue (`jit.swiglu_requant`)."""
        _dependent_launch(PDL)
        pid = tl.program_id(0)
        n_tiles = inter // BN
        steps = hidden // 64
        run = steps // slices
        tiles, total, start, end, programs = _stream_k_share(block_expert_ptr, num_blocks, num_local, n_tiles, steps, BB)
        num_g = inter // 8  # 2I rows in groups of 16
        cell = tl.arange(0, BN)[:, None] * BT + tl.arange(0, BT)[None, :]  # a [BN, BT] partial, row-major
        i = start
        while i < end:
            piece, tile, k0, k1, after = _segment(i, end, steps, slices, tiles)
            pid_b = tile // n_tiles
            pid_n = tile % n_tiles
            expert = tl.load(block_expert_ptr + pid_b)
            row_ok, slot = jit._block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT)
            token = slot // num_topk
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            s_base = s_ptr + expert.to(tl.int64) * stride_se
            wg_off, sg_off = jit._fp4_offsets(pid_n * (BN // 16), num_g, BN, 64)  # gate rows
            wu_off, su_off = jit._fp4_offsets(pid_n * (BN // 16) + inter // 16, num_g, BN, 64)  # up rows
            x_ptrs = x_ptr + token[None, :].to(tl.int64) * stride_x + tl.arange(0, 64)[:, None]  # [64, BT]
            acc_g = tl.zeros((BN, BT), dtype=tl.float32)
            acc_u = tl.zeros((BN, BT), dtype=tl.float32)
            for kc in tl.range(k0, k1, num_stages=NUM_STAGES):
                gw, gs, uw, us, x = _l1_chunk(w_base, s_base, wg_off, sg_off, wu_off, su_off, x_ptrs, row_ok, kc,
                                              num_g)
                acc_g, acc_u = _l1_mma(acc_g, acc_u, gw, gs, uw, us, x, BN, LARGE, INTERPRET)
            last = k1 - k0 == steps
            if k1 - k0 < steps:
                part = _partial_ptr(ws_ptr, pid, start, piece, run, max_segments, 2 * BN * BT)
                tl.store(part + cell, acc_g)
                tl.store(part + BN * BT + cell, acc_u)
                last = jit.last_to_arrive(cnt_ptr + tile, _arrivals(tile, steps, slices, tiles, total, programs))
                if last:
                    acc_g, acc_u = _sum_partials(ws_ptr, tile, run, slices, tiles, total, programs, max_segments,
                                                 cell, 2 * BN * BT, BN, BT, True)
            if last:
                out_rows = pid_b * BT + tl.arange(0, BT)
                out_ptrs = out_ptr + out_rows[None, :].to(tl.int64) * stride_out + (pid_n * BN + tl.arange(0, BN))[:, None]
                topw = tl.load(weight_ptr + slot, mask=row_ok, other=0.0)
                tl.store(out_ptrs, jit.swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP, BN, BT))
            i = after

    @triton.jit
    def decode_l2_stream_k_kernel(
        a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr, ws_ptr, cnt_ptr,
        hidden, inter, num_local, num_blocks, slices, max_segments,
        stride_a, stride_we, stride_se, stride_out,
        BT: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, NUM_STAGES: tl.constexpr, LARGE: tl.constexpr,
        INTERPRET: tl.constexpr, PDL: tl.constexpr,
    ):
        """L2 under the stream-K schedule, as `decode_l1_stream_k_kernel`: tiles of BN hidden columns, K over the
        intermediate size; a tile's last arrival rounds the sum to BF16 into each row's slot."""
        _dependent_launch(PDL)
        pid = tl.program_id(0)
        n_tiles = hidden // BN
        steps = inter // 64
        run = steps // slices
        tiles, total, start, end, programs = _stream_k_share(block_expert_ptr, num_blocks, num_local, n_tiles, steps, BB)
        num_g = hidden // 16
        cell = tl.arange(0, BN)[:, None] * BT + tl.arange(0, BT)[None, :]
        i = start
        while i < end:
            piece, tile, k0, k1, after = _segment(i, end, steps, slices, tiles)
            pid_b = tile // n_tiles
            pid_n = tile % n_tiles
            expert = tl.load(block_expert_ptr + pid_b)
            row_ok, slot = jit._block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT)
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            s_base = s_ptr + expert.to(tl.int64) * stride_se
            a_rows = pid_b * BT + tl.arange(0, BT)
            a_ptrs = a_ptr + a_rows[None, :].to(tl.int64) * stride_a + tl.arange(0, 64)[:, None]  # [64, BT]
            w_off, s_off = jit._fp4_offsets(pid_n * (BN // 16), num_g, BN, 64)
            acc = tl.zeros((BN, BT), dtype=tl.float32)
            for kc in tl.range(k0, k1, num_stages=NUM_STAGES):
                w, sw, x = _l2_chunk(w_base, s_base, w_off, s_off, a_ptrs, kc, num_g)
                acc = _l2_mma(acc, w, sw, x, BN, LARGE, INTERPRET)
            last = k1 - k0 == steps
            if k1 - k0 < steps:
                tl.store(_partial_ptr(ws_ptr, pid, start, piece, run, max_segments, BN * BT) + cell, acc)
                last = jit.last_to_arrive(cnt_ptr + tile, _arrivals(tile, steps, slices, tiles, total, programs))
                if last:
                    acc, _ = _sum_partials(ws_ptr, tile, run, slices, tiles, total, programs, max_segments, cell,
                                           BN * BT, BN, BT, False)
            if last:
                out_ptrs = out_ptr + slot[None, :].to(tl.int64) * stride_out + (pid_n * BN + tl.arange(0, BN))[:, None]
                tl.store(out_ptrs, jit.bf16_rne(acc), mask=row_ok[None, :])
            i = after

    @triton.jit
    def decode_persistent_kernel(
        x_ptr, w1_ptr, s1_ptr, w2_ptr, s2_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr,
        block_end_ptr, act_ptr, out_ptr, ws1_ptr, ws2_ptr, cnt_ptr, stalls_ptr,
        hidden, inter, num_topk, num_local, num_blocks,
        stride_x, stride_w1, stride_s1, stride_w2, stride_s2, stride_act, stride_out,
        clamp, max_polls,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, DEPTH: tl.constexpr,
        SPLIT1: tl.constexpr, SPLIT2: tl.constexpr, PREFETCH: tl.constexpr, NUM_STAGES: tl.constexpr,
        NUM_STAGES2: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
    ):
        """L1 and L2 in one launch of a few programs per SM, each taking work items by ticket (an atomic counter)
        until none is left: first every L1 item (`_l1_item`, in the order of `decode_l1_kernel`'s grid), then every
        L2 item (`_l2_item`). An L2 item waits (polls with acquire) until its block's L1 tiles are all written,
        which each tile's writer counts with release. Why it cannot deadlock: an item waits only on items of lower
        tickets, already taken by programs that are running and wait on nothing. A wait is cut off after
        `max_polls` polls and counted in `stalls` (never expected: the tests check it stays 0), so a fault cannot
        hang the GPU. The last program to leave puts the tickets and counters back to 0 for the next launch."""
        _dependent_launch(PDL)
        l1_tiles = num_blocks * (inter // BN1)
        l2_tiles = num_blocks * (hidden // BN2)
        n_l1 = l1_tiles * SPLIT1
        total = n_l1 + l2_tiles * SPLIT2
        l2_cnt = cnt_ptr + l1_tiles
        done_ptr = l2_cnt + l2_tiles  # per block: its L1 tiles written
        ticket_ptr = done_ptr + num_blocks
        exit_ptr = ticket_ptr + 1
        t = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
        while t < total:
            if t < n_l1:
                tile = t % l1_tiles
                written = _l1_item(x_ptr, w1_ptr, s1_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr,
                                   block_end_ptr, act_ptr, ws1_ptr, cnt_ptr, hidden, inter, num_topk, num_local,
                                   stride_x, stride_w1, stride_s1, stride_act, clamp, tile, t // l1_tiles,
                                   num_blocks, HAS_CLAMP, BT, BN1, DEPTH, SPLIT1, PREFETCH, NUM_STAGES, LARGE,
                                   INTERPRET)
                if written > 0:
                    tl.debug_barrier()  # every thread's activation stores come before the release below
                    tl.atomic_add(done_ptr + tile // (inter // BN1), 1, sem="release", scope="gpu")
            else:
                u = t - n_l1
                tile = u % l2_tiles
                b = tile // (hidden // BN2)
                if tl.load(block_expert_ptr + b) < num_local:
                    need = inter // BN1
                    have = tl.atomic_add(done_ptr + b, 0, sem="acquire", scope="gpu")
                    polls = have * 0
                    while (have < need) & (polls < max_polls):
                        have = tl.atomic_add(done_ptr + b, 0, sem="acquire", scope="gpu")
                        polls += 1
                    if have < need:
                        tl.atomic_add(stalls_ptr, 1, sem="relaxed", scope="gpu")
                _l2_item(act_ptr, w2_ptr, s2_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr,
                         out_ptr, ws2_ptr, l2_cnt, hidden, inter, num_local, stride_act, stride_w2, stride_s2,
                         stride_out, tile, u // l2_tiles, num_blocks, BT, BN2, DEPTH, SPLIT2, PREFETCH, NUM_STAGES2,
                         LARGE, INTERPRET)
            t = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
        left = tl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu")
        if left == tl.num_programs(0) - 1:  # every other program has left: no ticket is taken after this
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(exit_ptr, 0, sem="relaxed", scope="gpu")
            for i in tl.range(0, num_blocks):
                tl.atomic_xchg(done_ptr + i, 0, sem="relaxed", scope="gpu")


def _pdl_launch(pdl: bool) -> dict:
    """A decode kernel's PDL constexpr and, where set, the launch option that goes with it."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def prologue(x_fp8: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, out: torch.Tensor, *, first_expert: int,
             num_local_experts: int, block_t: int, pdl: bool = False):
    """`prologue_kernel`: the tokens' exact BF16 values ``[M, H]`` (what `forward.dequantize_x` gives), `routing.route`'s
    output for `block_t`-row blocks, and zeros written into `out`'s ``[M*K, H]`` rows of slots on no local expert;
    `pdl`: launched with programmatic dependent launch where the device has it (`KernelConfig.pdl`)."""
    m, hidden = x_fp8.shape
    num_topk = topk_idx.shape[1]
    x = torch.empty((m, hidden), dtype=torch.bfloat16, device=x_fp8.device)
    idx = topk_idx.reshape(-1)
    routed, args, constexprs = routing.fused_route_launch(idx, first_expert=first_expert,
                                                          num_local_experts=num_local_experts, block_t=block_t)
    bh = min(1024, triton.next_power_of_2(hidden))
    prologue_kernel[(1 + m * triton.cdiv(hidden, bh),)](
        idx, *args, x_fp8.contiguous().view(torch.uint8), x_sf.contiguous(), x, out, hidden, out.stride(0),
        **constexprs, NUM_TOPK=num_topk, BK=triton.next_power_of_2(num_topk), BH=bh, num_warps=4,
        **_pdl_launch(pdl and target.pdl_available(x_fp8.device)),
    )
    return x, routed


def decode_forward(x: torch.Tensor, routed, weights: torch.Tensor, experts, out: torch.Tensor, *, num_topk: int,
                   clamp: float | None, config, prefetch: bool, interpret: bool) -> None:
    """L1 and L2 of a decode batch into `out` (``[M*K, H]`` BF16, zero for slots of no local expert): `x` the tokens'
    exact BF16 values (`forward.dequantize_x`), `routed` `routing.route`'s output, `weights` the routing weights per
    slot (FP32), `config` a fitted decode config (`KernelConfig.decode`)."""
    sorted_slots, block_expert, block_row, block_end = routed
    hidden, inter, num_local = experts.hidden, experts.intermediate, experts.num_local_experts
    device = out.device
    nblocks, bt = block_expert.numel(), config.block_t
    l1_tiles, l2_tiles = nblocks * (inter // config.l1_n), nblocks * (hidden // config.l2_n)
    s1, s2 = config.l1_split, config.l2_split
    act = torch.empty((nblocks * bt, inter), dtype=torch.bfloat16, device=device)
    ws1 = torch.empty((s1, nblocks * bt, 2 * inter) if s1 > 1 else (1,), dtype=torch.float32, device=device)
    ws2 = torch.empty((s2, nblocks * bt, hidden) if s2 > 1 else (1,), dtype=torch.float32, device=device)
    s1w = experts.s1.reshape(num_local, -1).view(torch.int32)  # one int32 per (K block, row group, r)
    s2w = experts.s2.reshape(num_local, -1).view(torch.int32)
    pdl = bool(config.pdl) and target.pdl_available(device)
    stream = dict(BT=bt, DEPTH=config.decode, PREFETCH=prefetch, NUM_STAGES=config.num_stages,
                  LARGE=experts.large_scales, INTERPRET=interpret, num_warps=config.num_warps, **_pdl_launch(pdl))
    if config.stream_k:
        _stream_k_forward(x, routed, weights, experts, out, act, s1w, s2w, num_topk=num_topk, clamp=clamp,
                          config=config, interpret=interpret, pdl=pdl)
        return
    if config.persistent:
        # both kernels' arrival counters side by side, then per block its L1 tiles written, the ticket, the exits
        counters = arrival_counters(device, l1_tiles + l2_tiles + nblocks + 2)
        items = l1_tiles * s1 + l2_tiles * s2
        programs = min(items, _PERSISTENT_PROGRAMS_PER_SM * target.sm_count(device))
        decode_persistent_kernel[(programs,)](
            x, experts.w1, s1w, experts.w2, s2w, sorted_slots, weights, block_expert, block_row, block_end, act, out,
            ws1, ws2, counters, stalls(device),
            hidden, inter, num_topk, num_local, nblocks,
            x.stride(0), experts.w1.stride(0), s1w.stride(0), experts.w2.stride(0), s2w.stride(0), act.stride(0),
            out.stride(0), 0.0 if clamp is None else clamp, _MAX_POLLS,
            HAS_CLAMP=clamp is not None, BN1=config.l1_n, BN2=config.l2_n, SPLIT1=s1, SPLIT2=s2,
            NUM_STAGES2=config.l2_stages or config.num_stages, **stream,
            **({} if interpret else {"maxnreg": config.maxnreg or _PERSISTENT_MAXNREG}),
        )
        return
    counters = arrival_counters(device, max(l1_tiles, l2_tiles))
    if config.decode_ws:  # the same split-K grid, in Gluon
        hopper_decode.decode_ws_forward(x, routed, weights, experts, out, act, ws1, ws2, counters, s1w, s2w,
                                        num_topk=num_topk, clamp=clamp, config=config)
        return
    decode_l1_kernel[(l1_tiles, s1)](
        x, experts.w1, s1w, sorted_slots, weights, block_expert, block_row, block_end, act, ws1, counters,
        hidden, inter, num_topk, num_local,
        x.stride(0), experts.w1.stride(0), s1w.stride(0), act.stride(0),
        0.0 if clamp is None else clamp,
        HAS_CLAMP=clamp is not None, BN=config.l1_n, SPLIT=s1, **stream, **config.launch_registers(),
    )
    decode_l2_kernel[(l2_tiles, s2)](
        act, experts.w2, s2w, sorted_slots, block_expert, block_row, block_end, out, ws2, counters,
        hidden, inter, num_local,
        act.stride(0), experts.w2.stride(0), s2w.stride(0), out.stride(0),
        BN=config.l2_n, SPLIT=s2, **{**stream, "NUM_STAGES": config.l2_stages or config.num_stages},
        **config.launch_registers("L2"),
    )


def _per_sm(config, layer: str) -> int:
    return config.l2_stream_k if layer == "L2" and config.l2_stream_k else config.stream_k


def stream_k_programs(config, device: torch.device, tiles: int, steps: int, layer: str = "L1") -> int:
    """The stream-K grid of one GEMM: `config.stream_k` (L2: `l2_stream_k` where set) programs per SM of `device`,
    at most one per (tile, K step) of the largest batch the launch can get."""
    return max(1, min(_per_sm(config, layer) * target.sm_count(device), tiles * steps))


# An SM's register file on sm_80 and sm_90: 64K 32-bit registers, given to warps in units of 256 (8 per thread).
_SM_REGISTERS = 65536


def stream_k_registers(config, layer: str = "L1") -> dict:
    """The launch's register cap under stream-K: the config's (`maxnreg`, `l2_maxnreg`) where it sets one, else the
    most that lets the schedule's programs per SM share an SM, since the grid counts on them all being resident and
    ptxas does not weigh residency. Compiled for sm_90 by Triton 3.6 at V4's sizes the stream-K L1 holds 128
    registers (4 programs per SM); capped at 96 (5 per SM) it spills 64 bytes outside its K loop (docs/megamoe.md)."""
    if config.launch_registers(layer) or target.interpreting():
        return config.launch_registers(layer)
    per_thread = _SM_REGISTERS // (_per_sm(config, layer) * config.num_warps * 32)
    return {"maxnreg": min(255, per_thread // 8 * 8)}


def _stream_k_forward(x, routed, weights, experts, out, act, s1w, s2w, *, num_topk, clamp, config, interpret,
                      pdl) -> None:
    """`decode_forward` under the stream-K schedule (`KernelConfig.stream_k`): L1 and L2 each on a grid of
    `stream_k_programs`, every program one even share of its GEMM's (slice, tile, K step) space (`l1_split` and
    `l2_split` slices); a partial per segment of a program in the workspace (`stream_k.partial_slot`)."""
    sorted_slots, block_expert, block_row, block_end = routed
    hidden, inter, num_local = experts.hidden, experts.intermediate, experts.num_local_experts
    device = out.device
    nblocks, bt = block_expert.numel(), config.block_t
    l1_tiles, l2_tiles = nblocks * (inter // config.l1_n), nblocks * (hidden // config.l2_n)
    s1, s2 = config.l1_split, config.l2_split
    p1 = stream_k_programs(config, device, l1_tiles, hidden // 64)
    p2 = stream_k_programs(config, device, l2_tiles, inter // 64, "L2")
    # at most this many segments per program, over every batch the launch can get (up to `nblocks` blocks of rows)
    seg1 = stream_k.max_segments(l1_tiles * (hidden // 64), p1, hidden // 64 // s1)
    seg2 = stream_k.max_segments(l2_tiles * (inter // 64), p2, inter // 64 // s2)
    ws1 = torch.empty((p1, seg1, 2 * config.l1_n, bt), dtype=torch.float32, device=device)
    ws2 = torch.empty((p2, seg2, config.l2_n, bt), dtype=torch.float32, device=device)
    counters = arrival_counters(device, max(l1_tiles, l2_tiles))
    common = dict(BT=bt, BB=triton.next_power_of_2(nblocks), LARGE=experts.large_scales, INTERPRET=interpret,
                  num_warps=config.num_warps, **_pdl_launch(pdl))
    decode_l1_stream_k_kernel[(p1,)](
        x, experts.w1, s1w, sorted_slots, weights, block_expert, block_row, block_end, act, ws1, counters,
        hidden, inter, num_topk, num_local, nblocks, s1, seg1,
        x.stride(0), experts.w1.stride(0), s1w.stride(0), act.stride(0),
        0.0 if clamp is None else clamp,
        HAS_CLAMP=clamp is not None, BN=config.l1_n, NUM_STAGES=config.num_stages, **common,
        **stream_k_registers(config),
    )
    decode_l2_stream_k_kernel[(p2,)](
        act, experts.w2, s2w, sorted_slots, block_expert, block_row, block_end, out, ws2, counters,
        hidden, inter, num_local, nblocks, s2, seg2,
        act.stride(0), experts.w2.stride(0), s2w.stride(0), out.stride(0),
        BN=config.l2_n, NUM_STAGES=config.l2_stages or config.num_stages, **common,
        **stream_k_registers(config, "L2"),
    )
