"""The Triton backend's prefill GEMMs for Hopper, in Gluon (Triton's explicit-layout dialect): async wgmma.

Why: in the Triton kernels' loops (`jit`) every wgmma is waited on at once (Triton makes a register-A dot async only
when its operand is loop-invariant), so each K tile's FP4 expansion and its MMA run one after the other, and a
64-row block of one expert pads ~64 rows per expert (DeepSeek-V4 at 4096 tokens) to 1.5x. Here, written in Gluon
with the same weight layout, expansion and numerics:

- each wgmma is issued asynchronously and waited for one step later, so the CUDA cores expand the next weight tile
  while the tensor cores multiply (L1: the up tile while the gate tile multiplies, then the next gate tile; L2: K
  tiles in pairs, each operand expanded while the other multiplies); under the tuned register cap ptxas waits at
  once in the 96-row L1 (C7515), which buys a third program per SM and was measured faster, and keeps the 80-row
  L1 asynchronous (`config.GLUON_CONFIGS`);
- the weight words, their scale words and the activation tiles stream through shared memory by cp.async,
  `STAGES` K tiles ahead (each thread copies and later reads back exactly its own MMA operand words, 16 bytes);
- a block holds up to 80 or 96 rows of one expert (`block_t`): one 64-row MMA plus one 16-row MMA per 16 rows
  past 64, picked per block at run time (two or three loop bodies), so a block pads at most 15 rows and each
  weight tile is expanded once for all of them.

The products and their FP32 sums are those of the Triton kernels (same wgmma, same K order): the outputs are bit
for bit the same (checked on the GPU: `tests/kernels/megamoe/test_triton_gpu.py`). Gluon has no CPU interpreter, so CI
compiles these kernels for sm_90 (`tests/kernels/megamoe/test_hopper_prefill_compile.py`) and the GPU tests run them.
Gluon's API moves between Triton releases: this file is written against 3.6 (torch 2.11's) and runs on 3.6-3.9
through the aliases below.
"""

from __future__ import annotations

import torch

try:  # Gluon ships with Triton >= 3.5; its Hopper module is what the kernels need
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # pragma: no cover - no Triton, or one without Gluon
    gluon = None

from planc.kernels.megamoe.triton import target


def gluon_unavailable_reason(device: torch.device | None) -> str | None:
    """None when these kernels can run on `device`, else why not (the Triton kernels run instead)."""
    if gluon is None:
        return "this Triton has no Gluon (Triton >= 3.5 has it)"
    if target.interpreting():
        return "Gluon kernels do not run under Triton's interpreter"
    if device is None:
        return "Gluon kernels need a CUDA GPU"
    reason = target.triton_unavailable_reason(device)  # no GPU, not NVIDIA's, too old
    if reason is not None:
        return reason
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "the async wgmma kernels are written for Hopper (sm_90)"
    return None


if gluon is not None:
    # Renamed between Triton releases (3.6 names on the right).
    async_load = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # Triton functions compile inside Gluon kernels (with layouts inferred from their arguments): one copy of the
    # expansion's instructions and of the epilogue's numerics, in `jit`; `tile_ids` is the grid order (one block's
    # N tiles are neighbours).
    from planc.kernels.megamoe.triton.jit import (
        bf16_halves,
        bf16_rne,
        expand_words,
        scale_factors,
        swiglu_requant,
        tile_ids,
    )

    @triton.constexpr_function
    def words_layout(num_warps):
        """The weight words of one 64-deep K tile, [16-row group, lane, j]: group g in warp g, 4 words per lane,
        which are that lane's MMA operand registers for the group's 4 16x16 tiles (`layout.shuffle_fp4`)."""
        return gl.BlockedLayout([1, 1, 4], [1, 32, 1], [num_warps, 1, 1], [2, 1, 0])

    @triton.constexpr_function
    def mma_layout(num_warps, n):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])

    @triton.constexpr_function
    def x_tile_layout():
        """The activation tiles in shared memory as wgmma's B operand reads them, 128-byte swizzled: what the cp.async
        copies here, the TMA copies of `hopper_prefill_ws` and the producer warp of `hopper_decode` write."""
        return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    @triton.constexpr_function
    def _x_layout(num_warps):
        return gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    @gluon.jit
    def _fp4_offsets(g0, num_g, G: gl.constexpr, WL: gl.constexpr):
        """Word and scale-word offsets of the [16 G, 64] weight tile of row groups g0.. at K 0 (as
        `jit`'s `_fp4_offsets`, one K block: the tile at K 64 kc is kc * num_g * 128 words further)."""
        g = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
        blk = g0 + g
        w_off = (blk[:, None, None] * 32 + lane[None, :, None]) * 4 + j[None, None, :]
        s_off = blk[:, None] * 8 + (lane // 4)[None, :]
        return w_off, s_off

    @gluon.jit
    def _per_j(lo, hi, layout: gl.constexpr):
        """Factors [G, 32] for K halves jh = 0, 1 -> [G, 32, 4] by j = 2 jh + jl, in the words' layout
        (`jit`'s `_per_j`, whose broadcast Gluon does not take on a blocked layout)."""
        p = gl.join(lo, hi)
        p = gl.join(p, p)
        return gl.convert_layout(gl.reshape(p, (p.shape[0], p.shape[1], 4)), layout, assert_trivial=True)

    @gluon.jit
    def expand_operand(w, sw, BN: gl.constexpr, LARGE: gl.constexpr, AL: gl.constexpr):
        """Words [G, 32, 4] and scale words [G, 32] -> the [BN, 64] BF16 tile in the wgmma A-operand layout, in
        the registers the words are in: `jit`'s `_fp4_expand` (its instructions, `scale_factors` and
        `expand_words`) with the layouts written out, which Gluon needs and Triton infers."""
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = w.type.layout
        s00, s01, s10, s11 = scale_factors(sw, LARGE)
        o0, o1, o2, o3 = expand_words(w, _per_j(s00, s01, WL), _per_j(s10, s11, WL), LARGE)
        c = gl.join(gl.join(bf16_halves(o0), bf16_halves(o1)),
                    gl.join(bf16_halves(o2), bf16_halves(o3)))  # [g, lane, j, k1, k8, m8]
        c = gl.reshape(c, (G, 8, 4, 4, 2, 2, 2))  # g r q j k1 k8 m8
        c = gl.permute(c, (0, 6, 1, 3, 5, 2, 4))  # g m8 r j k8 q k1: rows, then K in order
        # Also the BF16 pairs as int32: the registers the wgmma reads. An async wgmma reads them until it is waited
        # for, and ptxas reuses a register once PTX no longer uses it: the caller passes these to that wait.
        return gl.convert_layout(gl.reshape(c, (BN, 64)), AL, assert_trivial=True), o0, o1, o2, o3

    @gluon.jit
    def _x_pointers(x_ptr, rows, ok, stride_x, XL: gl.constexpr):
        """Pointers [R, 64] to the K-0 activation tile of `rows` (rows not ok read row 0: finite, never stored)."""
        r = gl.where(ok, rows, 0)
        return x_ptr + r[:, None].to(gl.int64) * stride_x + gl.arange(0, 64, layout=gl.SliceLayout(0, XL))[None, :]

    @gluon.jit
    def _issue(tile, k_tiles, w_base, s_base, wa_off, sa_off, wb_off, sb_off, step, sstep, x0, x1,
               wa_s, sa_s, wb_s, sb_s, x_s, xt_s, stage, GATED: gl.constexpr, EXTRA: gl.constexpr):
        """cp.async the K tile `tile` (the last one again past the end) into shared-memory stage `stage`: weight
        words and scale words (one or two operands) and the activation tiles; one commit group."""
        k = gl.minimum(tile, k_tiles - 1)
        async_load(wa_s.index(stage), w_base + k * step + wa_off)
        async_load(sa_s.index(stage), s_base + k * sstep + sa_off)
        if GATED:
            async_load(wb_s.index(stage), w_base + k * step + wb_off)
            async_load(sb_s.index(stage), s_base + k * sstep + sb_off)
        async_load(x_s.index(stage), x0 + k * 64)
        if EXTRA > 0:
            async_load(xt_s.index(stage), x1 + k * 64)
        _cp.commit_group()

    @gluon.jit
    def issue_mma(a, x_t, tail, acc0, acc1, acc2, AL16: gl.constexpr, EXTRA: gl.constexpr):
        """acc += a @ x for the 64 main rows and the 0-2 16-row tails, asynchronously (one commit group each).
        Also returns the tails' operand (a in the 16-column MMA's layout, the same values), which the caller keeps
        alive until those MMAs are waited for."""
        acc0 = warpgroup_mma(a, x_t, acc0, is_async=True)
        a16 = gl.convert_layout(a, AL16, assert_trivial=True)  # A's layout does not depend on N
        if EXTRA > 0:
            acc1 = warpgroup_mma(a16, tail.slice(0, 16).permute((1, 0)), acc1, is_async=True)
            if EXTRA > 1:
                acc2 = warpgroup_mma(a16, tail.slice(16, 16).permute((1, 0)), acc2, is_async=True)
        return acc0, acc1, acc2, a16

    @gluon.jit
    def _next_tile(t, k_tiles, w_base, s_base, wa_off, sa_off, wb_off, sb_off, step, sstep, x0, x1,
                   wa_s, sa_s, wb_s, sb_s, x_s, xt_s, STAGES: gl.constexpr, GATED: gl.constexpr,
                   EXTRA: gl.constexpr):
        """Wait for K tile t's copies and issue tile t + STAGES - 2's; returns t's stage. Tile t - 2's stage is free
        then: every warp has passed the wait that retired its MMAs before this barrier."""
        _cp.wait_group(STAGES - 3)  # this thread's copies of tile t
        # The barrier makes every thread's copies of tile t visible (every warp's MMAs read the whole activation tile)
        # and frees tile t - 2's stage for the copies issued next; the proxy fence orders those generic-proxy writes
        # before the wgmma's async-proxy reads. Their places are Triton's own: its shared-memory analysis (membar)
        # puts a barrier right after a cp.async wait and (3.7+) a proxy fence after the last cp.async issued before a
        # wgmma, so a barrier right after the wait and a fence after the issue are the only ones in the loop (a
        # fence before the issue instead gets a second barrier and fence from the compiler: 3 barriers and 2 fences
        # per K tile). The H200 gave the same bits without either, but the memory
        # model needs both.
        _cta_barrier()
        nxt = t + STAGES - 2
        _issue(nxt, k_tiles, w_base, s_base, wa_off, sa_off, wb_off, sb_off, step, sstep, x0, x1,
               wa_s, sa_s, wb_s, sb_s, x_s, xt_s, nxt % STAGES, GATED, EXTRA)
        fence_async_shared()
        return t % STAGES

    @gluon.jit
    def _gemm(x0, x1, w_base, s_base, wa_off, sa_off, wb_off, sb_off, num_g, k_tiles,
              BN: gl.constexpr, STAGES: gl.constexpr, EXTRA: gl.constexpr, GATED: gl.constexpr,
              LARGE: gl.constexpr, num_warps: gl.constexpr):
        """FP32 sums [BN, 64] + [BN, 16] x 2 of operand a (and b when GATED) times the block's activations over
        all K tiles. Order per K tile: expand a, issue a's MMAs, wait for the previous ones (b's of the last tile),
        expand b, issue b's MMAs, wait for a's: one operand always multiplies while the other expands."""
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = words_layout(num_warps)
        SL: gl.constexpr = gl.SliceLayout(2, WL)
        MMA: gl.constexpr = mma_layout(num_warps, 64)
        MMA16: gl.constexpr = mma_layout(num_warps, 16)
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        AL16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA16, k_width=2)
        XS: gl.constexpr = x_tile_layout()
        WS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
        SS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        wa_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 32, 4], WS)
        sa_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 32], SS)
        if GATED:
            wb_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 32, 4], WS)
            sb_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 32], SS)
        else:  # not read
            wb_s = wa_s
            sb_s = sa_s
        x_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, 64], XS)
        if EXTRA > 0:
            xt_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, x1.shape[0], 64], XS)
        else:  # not read
            xt_s = x_s
        step = num_g * 128
        sstep = num_g * 8
        for s in gl.static_range(STAGES - 2):
            _issue(s, k_tiles, w_base, s_base, wa_off, sa_off, wb_off, sb_off, step, sstep, x0, x1,
                   wa_s, sa_s, wb_s, sb_s, x_s, xt_s, s, GATED, EXTRA)
        a0 = gl.zeros([BN, 64], gl.float32, MMA)
        a1 = gl.zeros([BN, 16], gl.float32, MMA16)
        a2 = gl.zeros([BN, 16], gl.float32, MMA16)
        b0 = gl.zeros([BN, 64], gl.float32, MMA)
        b1 = gl.zeros([BN, 16], gl.float32, MMA16)
        b2 = gl.zeros([BN, 16], gl.float32, MMA16)
        WZ = gl.zeros([G, 32, 4], gl.int32, WL)
        pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3 = WZ, WZ, WZ, WZ, WZ, WZ, WZ, WZ
        # One iteration: two operands' MMAs, each issued while the other's are in flight: L1 the gate and the up
        # tile of one K tile, L2 two K tiles into the same accumulators. A wgmma instruction reads fixed registers
        # until it is waited for, so the operand of the next MMAs must be a different instruction's: a loop with one
        # operand per iteration would overwrite the registers of the MMA still in flight.
        for i in range(0, k_tiles, 1 if GATED else 2):
            st = _next_tile(i, k_tiles, w_base, s_base, wa_off, sa_off, wb_off, sb_off, step, sstep, x0, x1,
                            wa_s, sa_s, wb_s, sb_s, x_s, xt_s, STAGES, GATED, EXTRA)
            x_t = x_s.index(st).permute((1, 0))
            tail = xt_s.index(st)
            # pa* / pb*: the operand registers of the MMAs in flight, kept alive through each wait
            # (see `expand_operand`).
            opa, pa0, pa1, pa2, pa3 = expand_operand(wa_s.index(st).load(WL), sa_s.index(st).load(SL), BN, LARGE, AL)
            a0, a1, a2, _a16 = issue_mma(opa, x_t, tail, a0, a1, a2, AL16, EXTRA)
            a0, a1, a2, b0, b1, b2, pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3 = warpgroup_mma_wait(
                1 + EXTRA, deps=(a0, a1, a2, b0, b1, b2, pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3))
            if GATED:
                opb, pb0, pb1, pb2, pb3 = expand_operand(wb_s.index(st).load(WL), sb_s.index(st).load(SL), BN, LARGE,
                                                         AL)
                b0, b1, b2, _b16 = issue_mma(opb, x_t, tail, b0, b1, b2, AL16, EXTRA)
            else:  # K tile i + 1 (k_tiles is even), into a's accumulators
                st = _next_tile(i + 1, k_tiles, w_base, s_base, wa_off, sa_off, wb_off, sb_off, step, sstep, x0, x1,
                                wa_s, sa_s, wb_s, sb_s, x_s, xt_s, STAGES, GATED, EXTRA)
                opb, pb0, pb1, pb2, pb3 = expand_operand(wa_s.index(st).load(WL), sa_s.index(st).load(SL), BN, LARGE,
                                                         AL)
                a0, a1, a2, _b16 = issue_mma(opb, x_s.index(st).permute((1, 0)), xt_s.index(st), a0, a1, a2, AL16,
                                             EXTRA)
            a0, a1, a2, b0, b1, b2, pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3 = warpgroup_mma_wait(
                1 + EXTRA, deps=(a0, a1, a2, b0, b1, b2, pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3))
        a0, a1, a2, b0, b1, b2 = warpgroup_mma_wait(0, deps=(a0, a1, a2, b0, b1, b2))
        _cp.wait_group(0)
        return a0, a1, a2, b0, b1, b2

    @gluon.jit
    def program_block(block_expert_ptr, block_row_ptr, block_end_ptr, num_n):
        """(block, N tile, local expert, first sorted row, rows) of this program (in `_tile_ids` order). rows
        counts the expert's rows from the block's first on (`route`'s block_end is the expert's end): a body covers
        at most ROWS of them, and its `t < nrows` masks only cut rows past the expert's end."""
        pid_b, pid_n, _ = tile_ids(num_n)
        expert = gl.load(block_expert_ptr + pid_b)
        row0 = gl.load(block_row_ptr + pid_b)
        nrows = gl.load(block_end_ptr + pid_b) - row0
        return pid_b, pid_n, expert, row0, nrows

    @gluon.jit
    def l1_store(acc_g, acc_u, out_ptr, sorted_ptr, weight_ptr, row0, t0, nrows, out_row0, offs0, stride_out,
                  clamp, HAS_CLAMP: gl.constexpr, L: gl.constexpr):
        """L1's epilogue (`jit.swiglu_requant`) on rows t0.. of the block, stored at their block rows."""
        BN: gl.constexpr = acc_g.shape[0]
        R: gl.constexpr = acc_g.shape[1]
        t = t0 + gl.arange(0, R, layout=gl.SliceLayout(0, L))
        ok = t < nrows
        slot = gl.load(sorted_ptr + row0 + t, mask=ok, other=0)
        topw = gl.load(weight_ptr + slot, mask=ok, other=0.0)
        q = gl.convert_layout(swiglu_requant(acc_g, acc_u, topw, ok, clamp, HAS_CLAMP, BN, R), L)
        offs_n = offs0 + gl.arange(0, BN, layout=gl.SliceLayout(1, L))
        gl.store(out_ptr + (out_row0 + t)[None, :].to(gl.int64) * stride_out + offs_n[:, None], q)

    @gluon.jit
    def _l1_block(x_ptr, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, k_tiles, stride_x, sorted_ptr,
                  weight_ptr, out_ptr, stride_out, row0, nrows, num_topk, out_row0, offs0, clamp,
                  HAS_CLAMP: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, EXTRA: gl.constexpr,
                  LARGE: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr):
        XL: gl.constexpr = _x_layout(num_warps)
        t = gl.arange(0, 64, layout=gl.SliceLayout(1, XL))
        slot0 = gl.load(sorted_ptr + row0 + t, mask=t < nrows, other=0)
        x0 = _x_pointers(x_ptr, slot0 // num_topk, t < nrows, stride_x, XL)
        t1 = 64 + gl.arange(0, ROWS - 64, layout=gl.SliceLayout(1, XL))
        slot1 = gl.load(sorted_ptr + row0 + t1, mask=t1 < nrows, other=0)
        x1 = _x_pointers(x_ptr, slot1 // num_topk, t1 < nrows, stride_x, XL)
        g0, g1, g2, u0, u1, u2 = _gemm(x0, x1, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, k_tiles,
                                       BN, STAGES, EXTRA, True, LARGE, num_warps)
        MMA: gl.constexpr = mma_layout(num_warps, 64)
        MMA16: gl.constexpr = mma_layout(num_warps, 16)
        l1_store(g0, u0, out_ptr, sorted_ptr, weight_ptr, row0, 0, nrows, out_row0, offs0, stride_out, clamp,
                  HAS_CLAMP, MMA)
        if EXTRA > 0:
            l1_store(g1, u1, out_ptr, sorted_ptr, weight_ptr, row0, 64, nrows, out_row0, offs0, stride_out, clamp,
                      HAS_CLAMP, MMA16)
            if EXTRA > 1:
                l1_store(g2, u2, out_ptr, sorted_ptr, weight_ptr, row0, 80, nrows, out_row0, offs0, stride_out,
                          clamp, HAS_CLAMP, MMA16)

    @gluon.jit
    def l1_kernel(
        x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        hidden, inter, num_topk, num_local,
        stride_x, stride_we, stride_se, stride_out,
        clamp,
        HAS_CLAMP: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, LARGE: gl.constexpr, ROWS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """`jit.l1_swiglu_kernel` (SPLIT 1) on blocks of up to ROWS rows: BN gate and BN up columns."""
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = words_layout(num_warps)
        pid_b, pid_n, expert, row0, nrows = program_block(block_expert_ptr, block_row_ptr, block_end_ptr, inter // BN)
        if expert < num_local:
            w_base = w_ptr + expert.to(gl.int64) * stride_we
            s_base = s_ptr + expert.to(gl.int64) * stride_se
            num_g = inter // 8  # 2I rows in groups of 16
            wg_off, sg_off = _fp4_offsets(pid_n * G, num_g, G, WL)
            wu_off, su_off = _fp4_offsets(pid_n * G + inter // 16, num_g, G, WL)
            k_tiles = hidden // 64
            out_row0 = pid_b * ROWS
            offs0 = pid_n * BN
            if nrows <= 64:
                _l1_block(x_ptr, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, k_tiles, stride_x,
                          sorted_ptr, weight_ptr, out_ptr, stride_out, row0, nrows, num_topk, out_row0, offs0,
                          clamp, HAS_CLAMP, BN, STAGES, 0, LARGE, ROWS, num_warps)
            elif ROWS == 80:  # a compile-time branch: no two-tail body
                _l1_block(x_ptr, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, k_tiles, stride_x,
                          sorted_ptr, weight_ptr, out_ptr, stride_out, row0, nrows, num_topk, out_row0, offs0,
                          clamp, HAS_CLAMP, BN, STAGES, 1, LARGE, ROWS, num_warps)
            elif nrows <= 80:
                _l1_block(x_ptr, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, k_tiles, stride_x,
                          sorted_ptr, weight_ptr, out_ptr, stride_out, row0, nrows, num_topk, out_row0, offs0,
                          clamp, HAS_CLAMP, BN, STAGES, 1, LARGE, ROWS, num_warps)
            else:
                _l1_block(x_ptr, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, k_tiles, stride_x,
                          sorted_ptr, weight_ptr, out_ptr, stride_out, row0, nrows, num_topk, out_row0, offs0,
                          clamp, HAS_CLAMP, BN, STAGES, 2, LARGE, ROWS, num_warps)

    @gluon.jit
    def l2_store(acc, out_ptr, sorted_ptr, row0, t0, nrows, offs0, stride_out, L: gl.constexpr):
        """L2's rows t0.. of the block, rounded to BF16, to their (token, slot) rows."""
        R: gl.constexpr = acc.shape[1]
        t = t0 + gl.arange(0, R, layout=gl.SliceLayout(0, L))
        ok = t < nrows
        slot = gl.load(sorted_ptr + row0 + t, mask=ok, other=0)
        offs_n = offs0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, L))
        gl.store(out_ptr + slot[None, :].to(gl.int64) * stride_out + offs_n[:, None], bf16_rne(acc),
                 mask=ok[None, :])

    @gluon.jit
    def l2_stores(a0, a1, a2, out_ptr, sorted_ptr, row0, nrows, offs0, stride_out, EXTRA: gl.constexpr,
                   num_warps: gl.constexpr):
        """The block's 64 main rows and its 0-2 16-row tails (`l2_store`)."""
        l2_store(a0, out_ptr, sorted_ptr, row0, 0, nrows, offs0, stride_out, mma_layout(num_warps, 64))
        if EXTRA > 0:
            l2_store(a1, out_ptr, sorted_ptr, row0, 64, nrows, offs0, stride_out, mma_layout(num_warps, 16))
            if EXTRA > 1:
                l2_store(a2, out_ptr, sorted_ptr, row0, 80, nrows, offs0, stride_out, mma_layout(num_warps, 16))

    @gluon.jit
    def _l2_block(a_ptr, w_base, s_base, w_off, s_off, num_g, k_tiles, stride_a, sorted_ptr, out_ptr, stride_out,
                  row0, nrows, a_row0, offs0,
                  BN: gl.constexpr, STAGES: gl.constexpr, EXTRA: gl.constexpr, LARGE: gl.constexpr,
                  ROWS: gl.constexpr, num_warps: gl.constexpr):
        XL: gl.constexpr = _x_layout(num_warps)
        t = gl.arange(0, 64, layout=gl.SliceLayout(1, XL))
        x0 = _x_pointers(a_ptr, a_row0 + t, t < 64, stride_a, XL)
        t1 = 64 + gl.arange(0, ROWS - 64, layout=gl.SliceLayout(1, XL))
        x1 = _x_pointers(a_ptr, a_row0 + t1, t1 < ROWS, stride_a, XL)
        a0, a1, a2, b0, b1, b2 = _gemm(x0, x1, w_base, s_base, w_off, s_off, w_off, s_off, num_g, k_tiles,
                                       BN, STAGES, EXTRA, False, LARGE, num_warps)
        l2_stores(a0, a1, a2, out_ptr, sorted_ptr, row0, nrows, offs0, stride_out, EXTRA, num_warps)

    @gluon.jit
    def l2_kernel(
        a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        hidden, inter, num_local,
        stride_a, stride_we, stride_se, stride_out,
        BN: gl.constexpr, STAGES: gl.constexpr, LARGE: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """`jit.l2_kernel` on blocks of up to ROWS rows."""
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = words_layout(num_warps)
        pid_b, pid_n, expert, row0, nrows = program_block(block_expert_ptr, block_row_ptr, block_end_ptr, hidden // BN)
        if expert < num_local:
            w_base = w_ptr + expert.to(gl.int64) * stride_we
            s_base = s_ptr + expert.to(gl.int64) * stride_se
            num_g = hidden // 16
            w_off, s_off = _fp4_offsets(pid_n * G, num_g, G, WL)
            k_tiles = inter // 64
            a_row0 = pid_b * ROWS
            offs0 = pid_n * BN
            if nrows <= 64:
                _l2_block(a_ptr, w_base, s_base, w_off, s_off, num_g, k_tiles, stride_a, sorted_ptr, out_ptr,
                          stride_out, row0, nrows, a_row0, offs0, BN, STAGES, 0, LARGE, ROWS, num_warps)
            elif ROWS == 80:  # a compile-time branch: no two-tail body
                _l2_block(a_ptr, w_base, s_base, w_off, s_off, num_g, k_tiles, stride_a, sorted_ptr, out_ptr,
                          stride_out, row0, nrows, a_row0, offs0, BN, STAGES, 1, LARGE, ROWS, num_warps)
            elif nrows <= 80:
                _l2_block(a_ptr, w_base, s_base, w_off, s_off, num_g, k_tiles, stride_a, sorted_ptr, out_ptr,
                          stride_out, row0, nrows, a_row0, offs0, BN, STAGES, 1, LARGE, ROWS, num_warps)
            else:
                _l2_block(a_ptr, w_base, s_base, w_off, s_off, num_g, k_tiles, stride_a, sorted_ptr, out_ptr,
                          stride_out, row0, nrows, a_row0, offs0, BN, STAGES, 2, LARGE, ROWS, num_warps)


def l1(x, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, *, clamp, num_topk, large, config):
    """L1 with the SwiGLU epilogue into `act` (block rows of `config.block_t`), as `jit`'s L1 launch."""
    hidden, inter, num_local = x.shape[1], w1.shape[1] // 2, w1.shape[0]
    l1_kernel[(block_expert.numel() * (inter // config.l1_n),)](
        x, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act,
        hidden, inter, num_topk, num_local,
        x.stride(0), w1.stride(0), s1.stride(0), act.stride(0),
        0.0 if clamp is None else clamp,
        HAS_CLAMP=clamp is not None, BN=config.l1_n, STAGES=config.num_stages, LARGE=large, ROWS=config.block_t,
        num_warps=config.num_warps, **config.launch_registers(),
    )


def l2(act, w2, s2, sorted_slots, block_expert, block_row, block_end, out, *, hidden, large, config):
    """L2 from `act` into the slot rows of `out`, as `jit`'s L2 launch."""
    inter, num_local = act.shape[1], w2.shape[0]
    l2_kernel[(block_expert.numel() * (hidden // config.l2_n),)](
        act, w2, s2, sorted_slots, block_expert, block_row, block_end, out,
        hidden, inter, num_local,
        act.stride(0), w2.stride(0), s2.stride(0), out.stride(0),
        BN=config.l2_n, STAGES=config.num_stages, LARGE=large, ROWS=config.block_t, num_warps=config.num_warps,
        **config.launch_registers("L2"),
    )

