"""`hopper_fp8`'s GEMMs with their copies in a warp of their own: the FP8 path warp-specialized.

Why: the FP8 Gluon kernels (`KernelConfig(fp8=3)`) ran at 0.73x of the BF16 path at 4096 tokens (H100, docs/megamoe.md).
Their K loop issues about twice the MMA's time on the CUDA cores (expansion, promotion, the cp.async ring's
addresses, waits, CTA barriers and fences), and ptxas makes each iteration end waiting for its last wgmma (C7514,
`hopper_fp8.promoted_sums`), so the tensor cores idle while one program's warps expand and promote. Here
(`KernelConfig(fp8=4)`) one producer warp (`gl.warp_specialize`) streams each 128-deep K block into a ring of
stages: the weight words `[G, 256]` and scale words `[1, BN]` (gate and up for L1) by TMA, the block's e4m3
activation rows `[ROWS, 128]` and their block scales by cp.async (L1 gathers the rows by token, which TMA cannot),
all completing on the stage's `ready` mbarrier (`hopper_decode`'s protocol: `cp.async.mbarrier.arrive` per copying
thread, then the TMA bytes). The four MMA warps only wait, expand, multiply and promote, and free a stage on its
`empty` mbarrier once the last read of it is done, each thread by its own arrival: no CTA barrier, fence, cp.async
wait or copy address in their loop, fewer registers, so two programs share an SM and one's MMAs run while the
other's warps promote and expand.

`KernelConfig(fp8=5)` adds converter warps (`_convert_partition`): they expand each stage's words into e4m3 tiles in
shared memory, and the MMA warps (`converted_sums`) multiply both operands from there and promote.

The K loop (`hopper_fp8.promoted_sums`, here fed by the producer's ring) and the epilogues are `hopper_fp8`'s, so the
outputs are its bits (the `gpu` tests compare them). Numerics: `fp8`'s module docstring. Gluon has no CPU
interpreter: CI compiles the kernels for sm_90 (`tests/kernels/megamoe/test_hopper_fp8_compile.py`).
"""

from __future__ import annotations

import torch

from planc.kernels.megamoe.triton import hopper_decode
from planc.kernels.megamoe.triton import hopper_fp8 as hf8
from planc.kernels.megamoe.triton import hopper_prefill as hp
from planc.kernels.megamoe.triton import hopper_prefill_ws as hpws

# None when this Triton can build the kernels (what `hopper_decode` needs: warp specialization, TMA, cp.async
# arrivals on an mbarrier), else why not.
unavailable_reason: str | None = hopper_decode.unavailable_reason
if unavailable_reason is None:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _PRODUCER_WARPS = gl.constexpr(1)

    @triton.constexpr_function
    def _x_layout():
        """The producer warp's [rows, 128] e4m3 activation tile: a row a thread (16 bytes a copy), 32 rows a pass:
        one row address per thread and pass, which the producer's 24 registers hold."""
        return gl.BlockedLayout([1, 16], [32, 1], [1, 1], [1, 0])

    @gluon.jit
    def _copy_partition(w_desc, s_desc, wa_s, sa_s, wb_s, sb_s, x_s, sx_s, ready, empty, x_ptr, xs_ptr, sorted_ptr,
                        row0, nrows, a_row0, num_topk, k_dim, total_rows, k_blocks, wa_row, wb_row, s_row, na0, nb0,
                        num_g, ROWS: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr,
                        PASSES: gl.constexpr):
        """The producer warp: K block i's weight words and scale words by TMA (gate and up when GATED) and the
        block's activation rows [ROWS, 128] and their scales by cp.async, into stage j % STAGES once it is free (j
        counts K blocks over the passes: pass p streams the rows BN p further). L1 (GATED) gathers the rows by
        token (`sorted_ptr`'s slots over `num_topk`), L2 reads its block's rows from `a_row0` on; rows past the
        block's end are zeros."""
        x_ptrs, x_ok = hopper_decode.activation_rows(x_ptr, sorted_ptr, row0, nrows, a_row0, num_topk, k_dim, ROWS, 128,
                                                     _x_layout(), GATED)
        sx_ptrs = xs_ptr + a_row0 + gl.arange(0, ROWS, layout=hf8.sx_layout(1))
        G: gl.constexpr = w_desc.block_type.shape[0]
        BN: gl.constexpr = s_desc.block_type.shape[1]
        nbytes: gl.constexpr = (2 if GATED else 1) * (w_desc.block_type.nbytes + s_desc.block_type.nbytes)
        for j in range(PASSES * k_blocks):
            s = j % STAGES
            p = j // k_blocks
            i = j - p * k_blocks
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # a new barrier passes phase 1 at once
            bar = ready.index(s)
            hp.async_load(x_s.index(s), x_ptrs + i * 128, mask=x_ok)
            hp.async_load(sx_s.index(s), sx_ptrs + i * total_rows)
            _cp.mbarrier_arrive(bar, increment_count=False)  # one of the barrier's 32 + 1 arrivals per thread
            mbarrier.expect(bar, nbytes)
            hpws.tma_load(w_desc, [wa_row + i * num_g + p * G, 0], bar, wa_s.index(s))
            hpws.tma_load(s_desc, [s_row + i, na0 + p * BN], bar, sa_s.index(s))
            if GATED:
                hpws.tma_load(w_desc, [wb_row + i * num_g + p * G, 0], bar, wb_s.index(s))
                hpws.tma_load(s_desc, [s_row + i, nb0 + p * BN], bar, sb_s.index(s))

    @gluon.jit
    def _ring_acquire(ring, kb, k_blocks, PAST_END: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr):
        """The stage of K block kb, its copies landed (PAST_END: kb may be k_blocks, then the last block's again, its
        stage not yet freed: its barrier's phase is the one already waited for). `ring`: (ready, empty, the ring's
        count of K blocks before this loop's first: the earlier passes')."""
        ready, empty, j0 = ring
        if PAST_END:
            kb = gl.minimum(kb, k_blocks - 1)
        return hpws.wait_stage(ready, j0 + kb, STAGES)

    @gluon.jit
    def _ring_stage(ring, kb, STAGES: gl.constexpr):
        ready, empty, j0 = ring
        return (j0 + kb) % STAGES

    @gluon.jit
    def _ring_release(ring, kb, STAGES: gl.constexpr):
        """Free K block kb's stage by this thread's arrival (`empty` counts every MMA thread, as in `hopper_decode`'s
        mma.sync loop), after its wait that retired the stage's wgmma and its loads from the stage: no barrier of the
        MMA warps and no proxy fence per stage (`hopper_prefill_ws.release_stage` has both: MEMBAR, FENCE and a
        128-thread BAR.SYNC in SASS)."""
        ready, empty, j0 = ring
        _cp.mbarrier_arrive(empty.index((j0 + kb) % STAGES), increment_count=False)

    @gluon.jit
    def _ring_drain(ring):
        """Nothing: the producer's copies are waited for by `ready`."""

    @gluon.jit
    def _convert_operand(w_s, s_s, c_s, s, BN: gl.constexpr, WARPS: gl.constexpr):
        """Stage s's words of one operand -> its e4m3 tile [BN, 128] in `c_s` (the wgmma's shared-memory A operand,
        the MMA's K order of `layout.fp8_k_order`), by `hopper_fp8`'s table expansion: the A registers `fp8=3`
        multiplies, stored."""
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = hf8.words_layout(WARPS)
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=hf8.mma_layout(WARPS, 64), k_width=4)
        lo, hi = hf8.lane_tables(s_s, s, G, WL, WARPS)
        d0, d1 = hf8.expand_e4m3(hf8._words(w_s, s, WL), lo, hi)
        c_s.index(s).store(hf8.operand(d0, d1, AL))

    @gluon.jit
    def _convert_partition(wa_s, sa_s, wb_s, sb_s, ca_s, cb_s, ready, conv, k_blocks, BN: gl.constexpr,
                           STAGES: gl.constexpr, GATED: gl.constexpr, PASSES: gl.constexpr, WARPS: gl.constexpr):
        """The converter warps (`fp8=5`): each K block's words (gate and up when GATED), once landed, expanded to
        e4m3 tiles in the stage's A buffers; a proxy fence and one arrival on `conv` after the partition's barrier
        (`hopper_prefill_ws.release_stage`) hand them to the wgmma. A stage's A buffers are rewritten only after the
        producer refilled it, which waits for the MMA warps to free it (their wgmma retired)."""
        for j in range(PASSES * k_blocks):
            s = hpws.wait_stage(ready, j, STAGES)
            _convert_operand(wa_s, sa_s, ca_s, s, BN, WARPS)
            if GATED:
                _convert_operand(wb_s, sb_s, cb_s, s, BN, WARPS)
            hpws.release_stage(conv, j, STAGES)

    @gluon.jit
    def _converted_stage(ready, conv, j, STAGES: gl.constexpr):
        """K block j's stage, its copies landed and its operands converted."""
        s = hpws.wait_stage(conv, j, STAGES)
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)  # passed already: the cp.async rows' and scales' visibility
        return s

    @gluon.jit
    def converted_sums(ops, j0, k_blocks, BN: gl.constexpr, N: gl.constexpr, STAGES: gl.constexpr,
                       GATED: gl.constexpr, num_warps: gl.constexpr):
        """`hopper_fp8.promoted_sums`' block sums on the converter's e4m3 tiles (`fp8=5`): both wgmma operands from
        shared memory, so the MMA warps only wait, multiply, promote and free stages. GATED: gate (a) and up (b)
        of each K block alternate; else K blocks in pairs into one sum. Each block sum is promoted while the other
        operand's wgmma runs, never across the loop's back edge (C7514, `promoted_sums`), in `promoted_sums`'
        order: the same bits."""
        wa_s, sa_s, wb_s, sb_s, x_s, sx_s, ready, empty, ca_s, cb_s, conv = ops
        MMA: gl.constexpr = hf8.mma_layout(num_warps, N)
        acc_a = gl.zeros([BN, N], gl.float32, MMA)
        acc_b = gl.zeros([BN, N], gl.float32, MMA)
        pa = gl.zeros([BN, N], gl.float32, MMA)
        pb = gl.zeros([BN, N], gl.float32, MMA)
        STEP: gl.constexpr = 1 if GATED else 2
        ring = (ready, empty, j0)
        for i in range(0, k_blocks, STEP):
            st = _converted_stage(ready, conv, j0 + i, STAGES)
            x_t = hf8._rows(x_s, st, N).permute((1, 0))
            pa = warpgroup_mma(ca_s.index(st), x_t, pa, use_acc=False, is_async=True)
            pa, pb = warpgroup_mma_wait(1, deps=(pa, pb))  # retires nothing; without it ptxas waits for a here
            # b's block sum of block i - 1 (retired by the last iteration's final wait), promoted under a's MMA
            swb, sxb = hf8.block_scales(sb_s if GATED else sa_s, sx_s, (j0 + gl.maximum(i - 1, 0)) % STAGES, BN, N,
                                        num_warps)
            if i > 0:
                _ring_release(ring, i - 1, STAGES)
            if GATED:
                acc_b = warpgroup_mma_wait(1, deps=(acc_b + pb * (swb[:, None] * sxb[None, :]),))
                pb = warpgroup_mma(cb_s.index(st), x_t, pb, use_acc=False, is_async=True)
            else:
                acc_a = warpgroup_mma_wait(1, deps=(acc_a + pb * (swb[:, None] * sxb[None, :]),))
                st1 = _converted_stage(ready, conv, j0 + i + 1, STAGES)
                pb = warpgroup_mma(ca_s.index(st1), hf8._rows(x_s, st1, N).permute((1, 0)), pb, use_acc=False,
                                   is_async=True)
            pa, pb = warpgroup_mma_wait(1, deps=(pa, pb))
            swa, sxa = hf8.block_scales(sa_s, sx_s, st, BN, N, num_warps)
            if not GATED:
                _ring_release(ring, i, STAGES)
            acc_a = warpgroup_mma_wait(1, deps=(acc_a + pa * (swa[:, None] * sxa[None, :]),))
            pb = warpgroup_mma_wait(0, deps=(pb,))
        # b's last block
        swb, sxb = hf8.block_scales(sb_s if GATED else sa_s, sx_s, (j0 + k_blocks - 1) % STAGES, BN, N, num_warps)
        _ring_release(ring, k_blocks - 1, STAGES)
        if GATED:
            acc_b += pb * (swb[:, None] * sxb[None, :])
        else:
            acc_a += pb * (swb[:, None] * sxb[None, :])
        return acc_a, acc_b

    @gluon.jit
    def _gemm(ops, j0, k_blocks, BN: gl.constexpr, N: gl.constexpr, STAGES: gl.constexpr,
              GATED: gl.constexpr, CONVERT: gl.constexpr, num_warps: gl.constexpr):
        """The block sums of K blocks j0.. of the producer's ring: expanded by the MMA warps (`hopper_fp8.promoted_sums`,
        fp8=4) or by the converter warps (`converted_sums`, fp8=5)."""
        if CONVERT:
            return converted_sums(ops, j0, k_blocks, BN, N, STAGES, GATED, num_warps)
        else:
            wa_s, sa_s, wb_s, sb_s, x_s, sx_s, ready, empty, ca_s, cb_s, conv = ops
            return hf8.promoted_sums((ready, empty, j0), _ring_acquire, _ring_stage, _ring_release, _ring_drain, wa_s,
                                     sa_s, wb_s, sb_s, x_s, sx_s, k_blocks, BN, N, STAGES, GATED, num_warps)

    @gluon.jit
    def _mma_block(ops, k_blocks, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0,
                   nrows, inter, total_rows, stride_out, clamp, HAS_CLAMP: gl.constexpr, N: gl.constexpr,
                   ROWS: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, PASSES: gl.constexpr,
                   CONVERT: gl.constexpr, num_warps: gl.constexpr):
        """The K loops over the block's first N rows and the epilogue: `hopper_fp8`'s, or (L1 in two passes of 64
        channels on 4 warps) both halves of a 128-channel scale block, the first's SwiGLU output held while the
        second multiplies, cast together: no FP32 round trip through memory."""
        BN: gl.constexpr = 16 * num_warps
        acc_a, acc_b = _gemm(ops, 0, k_blocks, BN, N, STAGES, GATED, CONVERT, num_warps)
        if not GATED:
            hf8.l2_epilogue(acc_a, sorted_ptr, out_ptr, pid_n, row0, nrows, stride_out, N, num_warps)
        elif PASSES == 1:
            hf8.l1_epilogue(acc_a, acc_b, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0,
                            nrows, inter, total_rows, clamp, HAS_CLAMP, N, ROWS, num_warps)
        else:
            MMA: gl.constexpr = hf8.mma_layout(num_warps, N)
            a0 = hf8.l1_activation(acc_a, acc_b, sorted_ptr, weight_ptr, row0, nrows, clamp, HAS_CLAMP, N, num_warps)
            acc_a, acc_b = _gemm(ops, k_blocks, k_blocks, BN, N, STAGES, GATED, CONVERT, num_warps)
            a1 = hf8.l1_activation(acc_a, acc_b, sorted_ptr, weight_ptr, row0, nrows, clamp, HAS_CLAMP, N, num_warps)
            amax = gl.maximum(gl.max(gl.abs(a0), axis=0), gl.max(gl.abs(a1), axis=0))
            out_rows = pid_b * ROWS + gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
            offs = pid_n * 2 * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
            hf8.l1_cast_store(a0, amax, out_ptr, out_rows, offs, inter)
            e = hf8.l1_cast_store(a1, amax, out_ptr, out_rows, offs + BN, inter)
            gl.store(outs_ptr + pid_n * total_rows + out_rows, (e << 23).to(gl.float32, bitcast=True))

    @gluon.jit
    def _mma_partition(wa_s, sa_s, wb_s, sb_s, x_s, sx_s, ready, empty, ca_s, cb_s, conv, k_blocks,
                       sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0, nrows, inter,
                       total_rows, stride_out, clamp, HAS_CLAMP: gl.constexpr, ROWS: gl.constexpr,
                       STAGES: gl.constexpr, GATED: gl.constexpr, PASSES: gl.constexpr, CONVERT: gl.constexpr,
                       num_warps: gl.constexpr):
        """The MMA warps: a block of at most half ROWS rows (an expert's last) runs an MMA half as wide, as
        `hopper_fp8` does."""
        ops = (wa_s, sa_s, wb_s, sb_s, x_s, sx_s, ready, empty, ca_s, cb_s, conv)
        if ROWS > 32 and nrows <= ROWS // 2:
            _mma_block(ops, k_blocks, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0,
                       nrows, inter, total_rows, stride_out, clamp, HAS_CLAMP, ROWS // 2, ROWS, STAGES, GATED, PASSES,
                       CONVERT, num_warps)
        else:
            _mma_block(ops, k_blocks, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0,
                       nrows, inter, total_rows, stride_out, clamp, HAS_CLAMP, ROWS, ROWS, STAGES, GATED, PASSES,
                       CONVERT, num_warps)

    @gluon.jit
    def fp8_ws_kernel(
        x_ptr, xs_ptr, w_desc, s_desc, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr,
        block_end_ptr, out_ptr, outs_ptr, a32_ptr, n_rows, k_dim, inter, num_topk, num_local, total_rows, stride_out,
        clamp, GATED: gl.constexpr, HAS_CLAMP: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr,
        PASSES: gl.constexpr, CONVERT: gl.constexpr, CONVERT_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """One GEMM of the FP8 path for one block of up to ROWS rows and PASSES x BN output channels, BN = 16 x
        num_warps: L1 (GATED: `n_rows` = 2I gate|up rows over K = hidden, the tokens' e4m3 rows gathered, `xs`
        their block scales [H/128, R] in block-row order) or L2 (`n_rows` = hidden over K = intermediate, L1's e4m3
        rows in block order, `xs` [I/128, R]). CONVERT (fp8=5): as many converter warps as MMA warps, at
        CONVERT_REGS registers a thread, expand each stage's words into e4m3 tiles the wgmma reads from shared
        memory."""
        BN: gl.constexpr = 16 * num_warps
        G: gl.constexpr = BN // 16
        n_out = (n_rows // 2 if GATED else n_rows) // (BN * PASSES)
        pid_b, pid_n, expert, row0, nrows = hp.program_block(block_expert_ptr, block_row_ptr, block_end_ptr, n_out)
        if expert < num_local:
            k_blocks = k_dim // 128
            num_g = n_rows // 16
            wa_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 256], w_desc.layout)
            sa_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BN], s_desc.layout)
            if GATED:
                wb_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 256], w_desc.layout)
                sb_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BN], s_desc.layout)
            else:  # not read
                wb_s = wa_s
                sb_s = sa_s
            x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, ROWS, 128], hf8.x_tile_layout())
            sx_s = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS],
                                             gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            if CONVERT:
                ca_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 128], hf8.x_tile_layout())
                if GATED:
                    cb_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 128], hf8.x_tile_layout())
                else:  # not read
                    cb_s = ca_s
                conv = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            else:  # not read
                ca_s = x_s
                cb_s = x_s
                conv = ready
            for s in gl.static_range(STAGES):
                mbarrier.init(ready.index(s), count=1 + 32 * _PRODUCER_WARPS)  # the TMA bytes' and each copier's
                mbarrier.init(empty.index(s), count=32 * num_warps)  # each MMA thread (`_ring_release`)
                if CONVERT:
                    mbarrier.init(conv.index(s), count=1)  # the converter warps' (`hopper_prefill_ws.release_stage`)
            s_row = expert * k_blocks  # the scale words' rows: one per (expert, K block), n_rows words each
            wa_row = s_row * num_g + pid_n * PASSES * G  # the words' rows: per (expert, K block, row group), 256 words
            wb_row = wa_row + num_g // 2  # L1's up rows: I further
            na0 = pid_n * PASSES * BN
            # (the partitions' arguments are written out in each call: a tuple built apart turns constexprs into
            # tensors)
            if CONVERT:
                gl.warp_specialize([
                    (_mma_partition, (wa_s, sa_s, wb_s, sb_s, x_s, sx_s, ready, empty, ca_s, cb_s, conv,
                                      k_blocks, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0,
                                      nrows, inter, total_rows, stride_out, clamp, HAS_CLAMP, ROWS, STAGES, GATED,
                                      PASSES, CONVERT, num_warps)),
                    (_copy_partition, (w_desc, s_desc, wa_s, sa_s, wb_s, sb_s, x_s, sx_s, ready, empty, x_ptr, xs_ptr,
                                       sorted_ptr, row0, nrows, pid_b * ROWS, num_topk, k_dim, total_rows, k_blocks,
                                       wa_row, wb_row, s_row, na0, na0 + n_rows // 2, num_g, ROWS, STAGES, GATED,
                                       PASSES)),
                    (_convert_partition, (wa_s, sa_s, wb_s, sb_s, ca_s, cb_s, ready, conv, k_blocks, BN,
                                          STAGES, GATED, PASSES, num_warps)),
                ], [_PRODUCER_WARPS, num_warps], [hpws.PRODUCER_REGS, CONVERT_REGS])
            else:
                gl.warp_specialize([
                    (_mma_partition, (wa_s, sa_s, wb_s, sb_s, x_s, sx_s, ready, empty, ca_s, cb_s, conv,
                                      k_blocks, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0,
                                      nrows, inter, total_rows, stride_out, clamp, HAS_CLAMP, ROWS, STAGES, GATED,
                                      PASSES, CONVERT, num_warps)),
                    (_copy_partition, (w_desc, s_desc, wa_s, sa_s, wb_s, sb_s, x_s, sx_s, ready, empty, x_ptr, xs_ptr,
                                       sorted_ptr, row0, nrows, pid_b * ROWS, num_topk, k_dim, total_rows, k_blocks,
                                       wa_row, wb_row, s_row, na0, na0 + n_rows // 2, num_g, ROWS, STAGES, GATED,
                                       PASSES)),
                ], [_PRODUCER_WARPS], [hpws.PRODUCER_REGS])


# The register cap where the config sets none: a program is 8 warps (the 4 MMA warps and the producer's warpgroup at
# 24 registers a thread), so 128 fits two programs per SM and leaves the MMA warps 232; uncapped, ptxas may take 255
# and one program fills an SM.
DEFAULT_REGISTERS = 128
# With the converter warps (fp8=5) a program is 12 warps (4 MMA, the converter's 4, the producer's warpgroup): 80
# fits two programs per SM and leaves the MMA warps 160 beside the converter's `CONVERT_REGISTERS`.
CONVERT_DEFAULT_REGISTERS = 80
# The converter warps' registers: a lane expands 8 words of one row group at a time (16 A registers, its group's
# table words and the store addresses). At 56 (Triton 3.6, V4's tiles) its loop reloads one value from the stack and
# the MMA warps' loops spill nothing; at 64 they spill.
CONVERT_REGISTERS = 56


def descriptors(w, s_words, bn: int) -> tuple:
    """The TMA descriptors of one GEMM's FP8-layout weights (`layout.shuffle_fp4_e4m3`): the words [G, 256] of one
    K block's row groups (per expert, K block, row group: 256 words) and the scale words [1, bn] (per expert and K
    block: one word per row)."""
    _, plain = hpws.tma_layouts()
    n_rows = w.shape[1]
    words = w.view(-1, 256)  # views: the parameters are contiguous (a copy would be a second weight tensor)
    scales = s_words.view(-1, n_rows)
    return (TensorDescriptor.from_tensor(words, [bn // 16, 256], plain),
            TensorDescriptor.from_tensor(scales, [1, bn], plain))


def _launch(x, xs, w, s_words, sorted_slots, weights, block_expert, block_row, block_end, out, outs, a32, *, gated,
            inter, num_topk, total_rows, clamp, num_warps, passes, config, layer):
    w_desc, s_desc = descriptors(w, s_words, 16 * num_warps)
    n_rows, k_dim = w.shape[1], x.shape[1]
    n_out = (n_rows // 2 if gated else n_rows) // (16 * num_warps * passes)
    fp8_ws_kernel[(block_expert.numel() * n_out,)](
        x, xs, w_desc, s_desc, sorted_slots, weights, block_expert, block_row, block_end, out,
        outs, a32, n_rows, k_dim, inter, num_topk, w.shape[0], total_rows, out.stride(0),
        0.0 if clamp is None else clamp, GATED=gated, HAS_CLAMP=clamp is not None, ROWS=config.block_t,
        STAGES=config.num_stages, PASSES=passes, CONVERT=config.fp8 == 5, CONVERT_REGS=CONVERT_REGISTERS,
        num_warps=num_warps, maxnreg=config.launch_registers(layer).get("maxnreg", DEFAULT_REGISTERS),
    )


def l1_channels(config) -> int:
    """The channels an L1 program covers: `l1_n` (fewer than a 128-channel scale block: the output then goes out in
    FP32 for `fp8.l1_out_blocks` to cast)."""
    return config.l1_n


def l1_passes(config) -> int:
    """L1's passes per program: its channels on 16 x num_warps at a time (128 on 4 warps: two, cast in the kernel;
    64 on 4 warps or 128 on 8: one)."""
    return l1_channels(config) // (16 * config.num_warps)


def l1(x8, xs, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, act_s, *, clamp, num_topk,
       config, a32=None):
    """`hopper_fp8.l1` (same arguments, same outputs) on the warp-specialized kernel, `l1_passes(config)` passes a
    program; `a32` (FP32 outputs for `fp8.l1_out_blocks` to cast) where a program covers 64 channels."""
    _launch(x8, xs, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, act_s,
            act_s if a32 is None else a32, gated=True, inter=w1.shape[1] // 2, num_topk=num_topk,
            total_rows=act.shape[0], clamp=clamp, num_warps=config.num_warps, passes=l1_passes(config),
            config=config, layer="L1")


def l2(act, act_s, w2, s2, sorted_slots, block_expert, block_row, block_end, out, *, config):
    """`hopper_fp8.l2` (same arguments, same outputs) on the warp-specialized kernel."""
    _launch(act, act_s, w2, s2, sorted_slots, sorted_slots, block_expert, block_row, block_end, out, out, out,
            gated=False, inter=act.shape[1], num_topk=1, total_rows=act.shape[0], clamp=None,
            num_warps=config.l2_n // 16, passes=1, config=config, layer="L2")


def unavailable(device: torch.device) -> str | None:
    """Why `KernelConfig(fp8=4 or 5)` cannot run on `device`, or None."""
    return hp.gluon_unavailable_reason(device) or unavailable_reason
