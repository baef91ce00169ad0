"""The split-K decode GEMMs for Hopper in Gluon, warp-specialized: a producer warp streams each K tile's copies.

Why: profiled on an H100 at 1 token (docs/megamoe.md, "Where the decode time goes"), the Triton decode kernels
(`decode`) keep two thirds to three quarters of the issue slots busy and lose most cycles to warps that were ready
but not selected: they are bound by the instructions they issue. Their L1 K loop issues ~240 instructions per warp
per 64-deep K tile, of which the FP4 expansion is 104; the rest is the cp.async pipeline (every warp computes and
issues its share of each stage's copies, waits, meets the others at a CTA barrier, fences) and the wgmma's operand
handling. Here the copies leave the MMA warps: one producer warp (`gl.warp_specialize`) issues each K tile's weight
words and scale words as TMA copies and the block's activation rows as cp.async copies, all completing on the
stage's `ready` mbarrier; the four MMA warps wait on it, expand (`hopper_prefill.expand_operand`, the same
instructions) and multiply, then free the stage on its `empty` mbarrier. `KernelConfig.decode_ws` picks the MMA:
1 wgmma (the Triton kernels' instruction and K order: their bits; measured slower on an H100, its MMA warps stalled
at the warpgroup's syncs), 2 mma.sync, each MMA warp on its own 16 rows (166 instructions per L1 K tile compiled,
against 240; on an H100 the same bits as the Triton kernels and within 0-2% of their time with 8-row blocks,
4-12% slower otherwise: docs/megamoe.md).

The schedule is `decode`'s split-K grid: one program per (block, N tile, K slice), the slices' FP32 partial sums
stored and added in slice order by the tile's last program to arrive (`jit.last_to_arrive`), which runs the epilogue
(L1: `jit.swiglu_requant`; L2: BF16 rounding into each row's slot). Gluon has no CPU interpreter:
`tests/kernels/megamoe/test_hopper_prefill_compile.py` compiles the kernels for sm_90 on CPU and the `gpu` tests run
them against the Triton decode kernels.
"""

from __future__ import annotations

from planc.kernels.megamoe.triton import hopper_prefill as hp
from planc.kernels.megamoe.triton import hopper_prefill_ws as hpws

# None when this Triton can build the kernels (what `hopper_prefill_ws` needs, and cp.async arrivals on an
# mbarrier), else why not.
unavailable_reason: str | None = hpws.unavailable_reason
if unavailable_reason is None:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    if not hasattr(_cp, "mbarrier_arrive"):  # pragma: no cover - an older Gluon
        unavailable_reason = "this Triton's Gluon has no cp.async arrival on an mbarrier"

if unavailable_reason is None:
    from planc.kernels.megamoe.triton.jit import last_to_arrive  # Triton functions compile inside Gluon kernels

    async_load = hp.async_load
    # One warp copies: the TMA copies are issued by one thread, the activation rows by the warp's 32 threads (each
    # thread's cp.async copies arrive on the stage's barrier when they land).
    _PRODUCER_WARPS = gl.constexpr(1)

    @triton.constexpr_function
    def _x_layout():
        """The producer warp's [16, 64] activation tile: 8 BF16 (16 bytes) per thread and row, 4 rows per pass."""
        return gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])

    @gluon.jit
    def activation_rows(x_ptr, sorted_ptr, row0, nrows, a_row0, num_topk, stride_x, ROWS: gl.constexpr,
                        COLS: gl.constexpr, XL: gl.constexpr, GATED: gl.constexpr):
        """A producer's addresses of a block's activation rows [ROWS, COLS] in layout XL, and which are the
        block's: L1 (GATED) gathers them by token (`sorted_ptr`'s slots from `row0` over `num_topk`), L2 reads the
        block's rows from `a_row0` on; rows past the block's end (`nrows`) are masked, so their copies write zeros."""
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, XL))
        ok = r < nrows
        if GATED:
            rows = gl.load(sorted_ptr + row0 + r, mask=ok, other=0) // num_topk
        else:
            rows = a_row0 + r
        x_ptrs = x_ptr + rows[:, None].to(gl.int64) * stride_x + gl.arange(0, COLS, layout=gl.SliceLayout(0, XL))[None, :]
        return x_ptrs, gl.broadcast(ok[:, None], x_ptrs)[0]

    @gluon.jit
    def _copy_partition(w_desc, s_desc, wa_s, sa_s, wb_s, sb_s, x_s, ready, empty, x_ptr, sorted_ptr, stride_x,
                        row0, nrows, a_row0, num_topk, k0, k_tiles, num_g, wa_row0, wb_row0, BT: gl.constexpr,
                        STAGES: gl.constexpr, GATED: gl.constexpr):
        """The producer warp: K tile i's weight words [G, 128] and scale words [1, 8 G] by TMA (gate and up rows
        when GATED), and the block's activation rows [BT, 64] by cp.async, into stage i % STAGES once it is free;
        every copy completes on the stage's `ready` barrier. L1 (GATED) gathers the rows by token (`sorted_ptr`'s
        slots over `num_topk`), L2 reads its block's rows from `a_row0` on; rows past the block's end are zeros."""
        G: gl.constexpr = w_desc.block_type.shape[0]
        x_ptrs, x_ok = activation_rows(x_ptr + k0 * 64, sorted_ptr, row0, nrows, a_row0, num_topk, stride_x, BT, 64,
                                       _x_layout(), GATED)
        nbytes: gl.constexpr = (2 if GATED else 1) * (w_desc.block_type.nbytes + s_desc.block_type.nbytes)
        for i in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a new barrier passes phase 1 at once
            bar = ready.index(s)
            async_load(x_s.index(s), x_ptrs + i * 64, mask=x_ok)
            _cp.mbarrier_arrive(bar, increment_count=False)  # one of the barrier's 32 + 1 arrivals per thread
            mbarrier.expect(bar, nbytes)
            row = wa_row0 + (k0 + i) * num_g
            hpws.tma_load(w_desc, [row, 0], bar, wa_s.index(s))
            hpws.tma_load(s_desc, [row // G, 0], bar, sa_s.index(s))
            if GATED:
                row = wb_row0 + (k0 + i) * num_g
                hpws.tma_load(w_desc, [row, 0], bar, wb_s.index(s))
                hpws.tma_load(s_desc, [row // G, 0], bar, sb_s.index(s))

    @gluon.jit
    def operand_bt(w_s, s_s, s, BN: gl.constexpr, BT: gl.constexpr, LARGE: gl.constexpr, num_warps: gl.constexpr):
        """Stage s's weight tile as the A operand of the BT-column wgmma (A's layout does not depend on N)."""
        MMA: gl.constexpr = hp.mma_layout(num_warps, BT)
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        op, p0, p1, p2, p3 = hpws.operand(w_s, s_s, s, BN, LARGE, num_warps)
        return gl.convert_layout(op, AL, assert_trivial=True), p0, p1, p2, p3

    @gluon.jit
    def _mma_loop(wa_s, sa_s, wb_s, sb_s, x_s, ready, empty, k_tiles, BN: gl.constexpr, BT: gl.constexpr,
                  STAGES: gl.constexpr, GATED: gl.constexpr, LARGE: gl.constexpr, num_warps: gl.constexpr):
        """FP32 sums [BN, BT] over the slice's K tiles on wgmma: L1 (GATED) the gate and up rows, L2 K tiles in pairs
        into one accumulator (k_tiles even), each operand's MMA issued before the other is expanded (under the decode
        register caps ptxas waits for each wgmma at once in L1). A wgmma reads its operand registers until it is
        waited for: p* / q* keep them alive through each wait (`hopper_prefill`)."""
        ACC: gl.constexpr = hp.mma_layout(num_warps, BT)
        WL: gl.constexpr = hp.words_layout(num_warps)
        G: gl.constexpr = BN // 16
        acc_a = gl.zeros([BN, BT], gl.float32, ACC)
        acc_b = gl.zeros([BN, BT], gl.float32, ACC)
        WZ = gl.zeros([G, 32, 4], gl.int32, WL)
        p0, p1, p2, p3, q0, q1, q2, q3 = WZ, WZ, WZ, WZ, WZ, WZ, WZ, WZ
        if GATED:
            for i in range(k_tiles):
                s = hpws.wait_stage(ready, i, STAGES)
                x_t = x_s.index(s).permute((1, 0))
                opa, p0, p1, p2, p3 = operand_bt(wa_s, sa_s, s, BN, BT, LARGE, num_warps)
                acc_a = warpgroup_mma(opa, x_t, acc_a, is_async=True)
                acc_a, acc_b, p0, p1, p2, p3, q0, q1, q2, q3 = warpgroup_mma_wait(
                    1, deps=(acc_a, acc_b, p0, p1, p2, p3, q0, q1, q2, q3))
                if i > 0:  # tile i - 1's up MMA is retired: its stage is free
                    hpws.release_stage(empty, i - 1, STAGES)
                opb, q0, q1, q2, q3 = operand_bt(wb_s, sb_s, s, BN, BT, LARGE, num_warps)
                acc_b = warpgroup_mma(opb, x_t, acc_b, is_async=True)
                acc_a, acc_b, p0, p1, p2, p3, q0, q1, q2, q3 = warpgroup_mma_wait(
                    1, deps=(acc_a, acc_b, p0, p1, p2, p3, q0, q1, q2, q3))
        else:
            for i in range(0, k_tiles, 2):
                s = hpws.wait_stage(ready, i, STAGES)
                opa, p0, p1, p2, p3 = operand_bt(wa_s, sa_s, s, BN, BT, LARGE, num_warps)
                acc_a = warpgroup_mma(opa, x_s.index(s).permute((1, 0)), acc_a, is_async=True)
                acc_a, p0, p1, p2, p3, q0, q1, q2, q3 = warpgroup_mma_wait(
                    1, deps=(acc_a, p0, p1, p2, p3, q0, q1, q2, q3))
                if i > 0:
                    hpws.release_stage(empty, i - 1, STAGES)
                t = hpws.wait_stage(ready, i + 1, STAGES)
                opb, q0, q1, q2, q3 = operand_bt(wa_s, sa_s, t, BN, BT, LARGE, num_warps)
                acc_a = warpgroup_mma(opb, x_s.index(t).permute((1, 0)), acc_a, is_async=True)
                acc_a, p0, p1, p2, p3, q0, q1, q2, q3 = warpgroup_mma_wait(
                    1, deps=(acc_a, p0, p1, p2, p3, q0, q1, q2, q3))
                hpws.release_stage(empty, i, STAGES)
        acc_a, acc_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
        hpws.release_stage(empty, k_tiles - 1, STAGES)
        return acc_a, acc_b

    @triton.constexpr_function
    def _mma2_layout(num_warps):
        """mma.sync (m16n8k16): each warp its own 16 weight rows, no warpgroup."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])

    @triton.constexpr_function
    def _acc_layout(num_warps, sync_mma, bt):
        """The [BN, BT] accumulators' layout: mma.sync's, or the BT-column wgmma's."""
        return _mma2_layout(num_warps) if sync_mma else hp.mma_layout(num_warps, bt)

    @gluon.jit
    def _mma2_loop(wa_s, sa_s, wb_s, sb_s, x_s, ready, empty, k_tiles, BN: gl.constexpr, BT: gl.constexpr,
                   STAGES: gl.constexpr, GATED: gl.constexpr, LARGE: gl.constexpr, num_warps: gl.constexpr):
        """`_mma_loop` on mma.sync: each warp multiplies its own 16 rows (the expanded words are already that
        instruction's A fragments) by the activation tile it loads from the stage (`ldmatrix`), and frees the stage
        by its own threads' arrivals (the `empty` barrier counts every MMA thread): no warpgroup sync, and the one
        barrier of the K loop is the MMA warps' own that Triton puts before each stage's wait."""
        MMA2: gl.constexpr = _mma2_layout(num_warps)
        AL2: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA2, k_width=2)
        BL2: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA2, k_width=2)
        acc_a = gl.zeros([BN, BT], gl.float32, MMA2)
        acc_b = gl.zeros([BN, BT], gl.float32, MMA2)
        for i in range(k_tiles):
            s = hpws.wait_stage(ready, i, STAGES)
            x = x_s.index(s).permute((1, 0)).load(BL2)
            opa = gl.convert_layout(hpws.operand(wa_s, sa_s, s, BN, LARGE, num_warps)[0], AL2, assert_trivial=True)
            if GATED:
                opb = gl.convert_layout(hpws.operand(wb_s, sb_s, s, BN, LARGE, num_warps)[0], AL2,
                                        assert_trivial=True)
            acc_a = mma_v2(opa, x, acc_a)
            if GATED:
                acc_b = mma_v2(opb, x, acc_b)
            # the MMAs have read their operands: this thread's loads from the stage are done
            _cp.mbarrier_arrive(empty.index(s), increment_count=False)
        return acc_a, acc_b

    @gluon.jit
    def _mma_partition(wa_s, sa_s, wb_s, sb_s, x_s, ready, empty, k_tiles, out_ptr, ws_ptr, cnt_ptr, sorted_ptr,
                       weight_ptr, row0, nrows, pid_b, pid_n, tile, sid, num_blocks, n_out, stride_out, clamp,
                       BN: gl.constexpr, BT: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                       GATED: gl.constexpr, HAS_CLAMP: gl.constexpr, LARGE: gl.constexpr, SYNC_MMA: gl.constexpr,
                       num_warps: gl.constexpr):
        """The MMA warps: the slice's sums, then (SPLIT 1, or the tile's last slice to arrive, after adding the
        slices' partials in slice order) the epilogue: L1's SwiGLU into the block's activation rows, L2's BF16
        rows into their slots."""
        ACC: gl.constexpr = _acc_layout(num_warps, SYNC_MMA, BT)
        if SYNC_MMA:
            acc_a, acc_b = _mma2_loop(wa_s, sa_s, wb_s, sb_s, x_s, ready, empty, k_tiles, BN, BT, STAGES, GATED,
                                      LARGE, num_warps)
        else:
            acc_a, acc_b = _mma_loop(wa_s, sa_s, wb_s, sb_s, x_s, ready, empty, k_tiles, BN, BT, STAGES, GATED,
                                     LARGE, num_warps)
        last = True
        if SPLIT > 1:
            width = n_out * BN * (2 if GATED else 1)  # a workspace row: L1 the gate then the up sums
            t = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC))
            ok = (t < nrows)[None, :]
            n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
            ws = ws_ptr + (pid_b * BT + t)[None, :].to(gl.int64) * width + n[:, None]
            split_stride = num_blocks.to(gl.int64) * BT * width
            gl.store(ws + sid * split_stride, acc_a, mask=ok)
            if GATED:
                gl.store(ws + sid * split_stride + n_out * BN, acc_b, mask=ok)
            last = last_to_arrive(cnt_ptr + tile, SPLIT)
            if last:
                acc_a = gl.zeros([BN, BT], gl.float32, ACC)
                acc_b = gl.zeros([BN, BT], gl.float32, ACC)
                for s in range(SPLIT):  # slice order: the Triton decode kernels' sums, bit for bit
                    acc_a += gl.load(ws + s * split_stride, mask=ok, other=0.0, cache_modifier=".cg")
                    if GATED:
                        acc_b += gl.load(ws + s * split_stride + n_out * BN, mask=ok, other=0.0, cache_modifier=".cg")
        if last:
            if GATED:
                hp.l1_store(acc_a, acc_b, out_ptr, sorted_ptr, weight_ptr, row0, 0, nrows, pid_b * BT, pid_n * BN,
                             stride_out, clamp, HAS_CLAMP, ACC)
            else:
                hp.l2_store(acc_a, out_ptr, sorted_ptr, row0, 0, nrows, pid_n * BN, stride_out, ACC)

    @gluon.jit
    def decode_ws_kernel(
        x_ptr, w_desc, s_desc, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr,
        out_ptr, ws_ptr, cnt_ptr,
        n_rows, k_dim, num_topk, num_local, stride_x, stride_out, clamp,
        GATED: gl.constexpr, HAS_CLAMP: gl.constexpr, BT: gl.constexpr, BN: gl.constexpr, SPLIT: gl.constexpr,
        STAGES: gl.constexpr, LARGE: gl.constexpr, SYNC_MMA: gl.constexpr, num_warps: gl.constexpr,
    ):
        """One GEMM of a decode batch for (block, N tile) `program_id(0)` and K slice `program_id(1)`: L1 (GATED,
        `n_rows` = 2I weight rows over K = hidden, the tokens' rows gathered) or L2 (`n_rows` = hidden over K =
        intermediate, L1's activation rows in block order)."""
        G: gl.constexpr = BN // 16
        n_out = (n_rows // 2 if GATED else n_rows) // BN
        tile = gl.program_id(0)
        sid = gl.program_id(1)
        pid_b = tile // n_out
        pid_n = tile % n_out
        expert = gl.load(block_expert_ptr + pid_b)
        if expert < num_local:
            row0 = gl.load(block_row_ptr + pid_b)
            nrows = gl.load(block_end_ptr + pid_b) - row0
            k_tiles = k_dim // (64 * SPLIT)
            num_g = n_rows // 16
            wa_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 128], w_desc.layout)
            sa_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, 8 * G], s_desc.layout)
            if GATED:
                wb_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 128], w_desc.layout)
                sb_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, 8 * G], s_desc.layout)
            else:  # not read
                wb_s = wa_s
                sb_s = sa_s
            x_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, 64], hp.x_tile_layout())
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES):
                mbarrier.init(ready.index(s), count=1 + 32 * _PRODUCER_WARPS)  # the TMA bytes' and each copier's
                mbarrier.init(empty.index(s), count=32 * num_warps if SYNC_MMA else 1)  # each MMA thread, or one
            wa_row0 = expert * (k_dim // 64) * num_g + pid_n * G
            wb_row0 = wa_row0 + n_rows // 32  # L1's up rows: I further
            gl.warp_specialize([
                (_mma_partition, (wa_s, sa_s, wb_s, sb_s, x_s, ready, empty, k_tiles, out_ptr, ws_ptr, cnt_ptr,
                                  sorted_ptr, weight_ptr, row0, nrows, pid_b, pid_n, tile, sid,
                                  gl.num_programs(0) // n_out, n_out, stride_out, clamp, BN, BT, SPLIT, STAGES, GATED,
                                  HAS_CLAMP, LARGE, SYNC_MMA, num_warps)),
                (_copy_partition, (w_desc, s_desc, wa_s, sa_s, wb_s, sb_s, x_s, ready, empty, x_ptr, sorted_ptr,
                                   stride_x, row0, nrows, pid_b * BT, num_topk, sid * k_tiles, k_tiles, num_g,
                                   wa_row0, wb_row0, BT, STAGES, GATED)),
            ], [_PRODUCER_WARPS], [hpws.PRODUCER_REGS])


# The register cap where the config sets none: a program is 8 warps (the 4 MMA warps and the producer's warpgroup at
# 24 registers a thread), so 64 fits 4 programs per SM and leaves the MMA warps 104 (48: 5 per SM, 72); uncapped,
# ptxas takes 255 and one program fills an SM.
DEFAULT_REGISTERS = {"maxnreg": 64}


def decode_ws_forward(x, routed, weights, experts, out, act, ws1, ws2, counters, s1w, s2w, *, num_topk: int,
                      clamp: float | None, config) -> None:
    """`decode.decode_forward`'s L1 and L2 as the warp-specialized kernels (`KernelConfig.decode_ws`): the same
    activation rows, workspaces, counters and outputs; `s1w` / `s2w` the scale bytes as int32 words."""
    if unavailable_reason is not None:
        raise RuntimeError(f"KernelConfig(decode_ws={config.decode_ws}) runs the warp-specialized decode kernels, but "
                           f"{unavailable_reason}: use decode_ws=0 (the Triton decode kernels)")
    sorted_slots, block_expert, block_row, block_end = routed
    hidden, inter, num_local = experts.hidden, experts.intermediate, experts.num_local_experts
    nblocks, bt = block_expert.numel(), config.block_t
    if config.decode_ws == 1 and (inter // 64 // config.l2_split) % 2:
        raise ValueError(f"the wgmma decode L2 (decode_ws=1) takes its K tiles in pairs: intermediate {inter} in "
                         f"{config.l2_split} slices leaves an odd number of 64-deep tiles per slice; halve l2_split "
                         f"or use decode_ws=2 (mma.sync, any number)")
    common = dict(BT=bt, STAGES=config.num_stages, LARGE=experts.large_scales, SYNC_MMA=config.decode_ws == 2,
                  num_warps=config.num_warps)
    w_desc, s_desc = hpws.weight_descriptors(experts.w1, s1w, config.l1_n)
    decode_ws_kernel[(nblocks * (inter // config.l1_n), config.l1_split)](
        x, w_desc, s_desc, sorted_slots, weights, block_expert, block_row, block_end, act, ws1, counters,
        2 * inter, hidden, num_topk, num_local, x.stride(0), act.stride(0), 0.0 if clamp is None else clamp,
        GATED=True, HAS_CLAMP=clamp is not None, BN=config.l1_n, SPLIT=config.l1_split, **common,
        **(config.launch_registers() or DEFAULT_REGISTERS),
    )
    w_desc, s_desc = hpws.weight_descriptors(experts.w2, s2w, config.l2_n)
    decode_ws_kernel[(nblocks * (hidden // config.l2_n), config.l2_split)](
        act, w_desc, s_desc, sorted_slots, weights, block_expert, block_row, block_end, out, ws2, counters,
        hidden, inter, num_topk, num_local, act.stride(0), out.stride(0), 0.0,
        GATED=False, HAS_CLAMP=False, BN=config.l2_n, SPLIT=config.l2_split, **common,
        **(config.launch_registers("L2") or DEFAULT_REGISTERS),
    )
