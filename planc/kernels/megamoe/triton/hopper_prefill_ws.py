"""`hopper_prefill`'s L2 with its copies in a warp of their own: TMA into a ring of shared-memory stages.

Why: the profile of the cp.async kernels (docs/benchmarks.md) shows L2's four MMA warps waiting on
their own copies, CTA barriers and proxy fences (the tensor pipe busy 39% of L2's time at 89 instructions per K
tile per warp): every warp issues, waits for and fences its share of each stage. Here one producer warp
(`gl.warp_specialize`) issues each K tile's weight words, scale words and activation tiles as TMA copies that
complete on the stage's `ready` mbarrier, and the four MMA warps only wait on that barrier, expand and multiply, then
free the stage on its `empty` mbarrier once the wgmma that read it is retired: no CTA barrier in the K loop, and the
copies' addresses leave the MMA warps.

The expansion, the MMA order (K tiles in pairs, each operand expanded while the other multiplies) and the epilogue
are `hopper_prefill`'s, so the outputs are the same bits (`tests/kernels/megamoe/test_triton_gpu.py`). Picked by
`KernelConfig(gluon=2)`, with its own register cap (`l2_maxnreg`: a program is 8 warps, the producer's warpgroup
holding 24 registers a thread, and the MMA warps the rest). L1 stays `hopper_prefill`'s: its activation rows are
gathered by token, which Hopper's TMA cannot load, and the same split on activations sorted into block rows first
(one `index_select`) ran within -1% / +4% of it under Triton 3.6 and 4-18% slower under 3.7.1.
"""

from __future__ import annotations

from planc.kernels.megamoe.triton import hopper_prefill as hp

# None when this Triton has what the kernel needs (warp specialization, TMA descriptors: 3.6-3.9 checked), else why
# not: `config.pick_config` then picks the cp.async L2 (`device_config` passes this).
unavailable_reason: str | None = "this Triton has no Gluon (Triton >= 3.5 has it)"
if hp.gluon is not None:
    try:
        import triton
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        unavailable_reason = None if hasattr(gl, "warp_specialize") else "this Triton's Gluon has no warp_specialize"
    except ImportError as e:  # pragma: no cover - an older Gluon
        unavailable_reason = f"this Triton's Gluon lacks what the warp-specialized L2 needs ({e})"

if unavailable_reason is None:
    # Renamed in Triton 3.9 (3.6 name on the right; 3.9 keeps it only to raise).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # Registers per thread of the producer warp's warpgroup; the MMA warps get the rest of the launch's cap.
    PRODUCER_REGS = gl.constexpr(24)

    @triton.constexpr_function
    def _scale_layout(num_warps):
        """[G, 8, 4]: lane 4 r + q holds scale word r of its warp's row group (q: the 4 lanes that share it), so
        that a [G, 8] load broadcast over q is the words' [G, 32] scale layout (`hopper_prefill`'s `_fp4_offsets`)."""
        return gl.BlockedLayout([1, 1, 1], [1, 8, 4], [num_warps, 1, 1], [2, 1, 0])

    @gluon.jit
    def _scales(s_tile, WL: gl.constexpr, num_warps: gl.constexpr):
        """The stage's [G, 8] scale words -> [G, 32] in the words' scale layout (each word read by 4 lanes)."""
        L3: gl.constexpr = _scale_layout(num_warps)
        s8 = s_tile.load(gl.SliceLayout(2, L3))
        s = gl.broadcast(gl.expand_dims(s8, 2), gl.zeros([s8.shape[0], 8, 4], gl.int32, L3))[0]
        s = gl.reshape(s, (s8.shape[0], 32))
        return gl.convert_layout(s, gl.SliceLayout(2, WL), assert_trivial=True)

    @gluon.jit
    def wait_stage(ready, i, STAGES: gl.constexpr):
        """Wait for K tile i's copies; returns its stage."""
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        return s

    @gluon.jit
    def operand(w_s, s_s, s, BN: gl.constexpr, LARGE: gl.constexpr, num_warps: gl.constexpr):
        """Stage s's weight tile expanded to the wgmma A operand (`hopper_prefill.expand_operand`)."""
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = hp.words_layout(num_warps)
        MMA: gl.constexpr = hp.mma_layout(num_warps, 64)
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        words = w_s.index(s).reshape((G, 32, 4)).load(WL)
        return hp.expand_operand(words, _scales(s_s.index(s).reshape((G, 8)), WL, num_warps), BN, LARGE, AL)

    @gluon.jit
    def release_stage(empty, i, STAGES: gl.constexpr):
        """Free K tile i's stage for the producer: its MMAs are retired and its words are in registers. The proxy
        fence orders this partition's shared-memory reads (generic proxy) before the producer's next TMA writes of
        the stage (async proxy), as Triton's warp-specialization tutorial does; without it the H200 gives the same
        bits and times within noise."""
        fence_async_shared()
        mbarrier.arrive(empty.index(i % STAGES), count=1)

    @gluon.jit
    def _l2_mma_loop(w_s, s_s, x_s, xt_s, ready, empty, k_tiles, BN: gl.constexpr, STAGES: gl.constexpr,
                     EXTRA: gl.constexpr, LARGE: gl.constexpr, num_warps: gl.constexpr):
        """FP32 sums of the block's rows over all K tiles: `hopper_prefill`'s `_gemm` (GATED off) fed by the ring."""
        MMA: gl.constexpr = hp.mma_layout(num_warps, 64)
        MMA16: gl.constexpr = hp.mma_layout(num_warps, 16)
        AL16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA16, k_width=2)
        WL: gl.constexpr = hp.words_layout(num_warps)
        G: gl.constexpr = BN // 16
        a0 = gl.zeros([BN, 64], gl.float32, MMA)
        a1 = gl.zeros([BN, 16], gl.float32, MMA16)
        a2 = gl.zeros([BN, 16], gl.float32, MMA16)
        WZ = gl.zeros([G, 32, 4], gl.int32, WL)
        pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3 = WZ, WZ, WZ, WZ, WZ, WZ, WZ, WZ
        for i in range(0, k_tiles, 2):
            # K tile i: expand and issue while tile i - 1's MMAs run; once they are retired, free its stage.
            s = wait_stage(ready, i, STAGES)
            opa, pa0, pa1, pa2, pa3 = operand(w_s, s_s, s, BN, LARGE, num_warps)
            a0, a1, a2, _a16 = hp.issue_mma(opa, x_s.index(s).permute((1, 0)), xt_s.index(s), a0, a1, a2, AL16, EXTRA)
            a0, a1, a2, pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3 = warpgroup_mma_wait(
                1 + EXTRA, deps=(a0, a1, a2, pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3))
            if i > 0:
                release_stage(empty, i - 1, STAGES)
            # K tile i + 1 (k_tiles is even), into the same accumulators.
            t = wait_stage(ready, i + 1, STAGES)
            opb, pb0, pb1, pb2, pb3 = operand(w_s, s_s, t, BN, LARGE, num_warps)
            a0, a1, a2, _b16 = hp.issue_mma(opb, x_s.index(t).permute((1, 0)), xt_s.index(t), a0, a1, a2, AL16, EXTRA)
            a0, a1, a2, pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3 = warpgroup_mma_wait(
                1 + EXTRA, deps=(a0, a1, a2, pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3))
            release_stage(empty, i, STAGES)
        a0, a1, a2 = warpgroup_mma_wait(0, deps=(a0, a1, a2))
        return a0, a1, a2

    @gluon.jit
    def _l2_mma_block(w_s, s_s, x_s, xt_s, ready, empty, k_tiles, out_ptr, sorted_ptr, row0, nrows, offs0, stride_out,
                      BN: gl.constexpr, STAGES: gl.constexpr, EXTRA: gl.constexpr, LARGE: gl.constexpr,
                      num_warps: gl.constexpr):
        """One loop body and its stores (`hopper_prefill`'s `_l2_block`): the sums never leave the branch that made
        them, which ptxas needs to keep the wgmma asynchronous (a merge of accumulators serializes them, C7515)."""
        a0, a1, a2 = _l2_mma_loop(w_s, s_s, x_s, xt_s, ready, empty, k_tiles, BN, STAGES, EXTRA, LARGE,
                                  num_warps)
        hp.l2_stores(a0, a1, a2, out_ptr, sorted_ptr, row0, nrows, offs0, stride_out, EXTRA, num_warps)

    @gluon.jit
    def _l2_mma_partition(w_s, s_s, x_s, xt_s, ready, empty, k_tiles, out_ptr, sorted_ptr, row0, nrows, offs0,
                          stride_out, BN: gl.constexpr, STAGES: gl.constexpr, LARGE: gl.constexpr, ROWS: gl.constexpr,
                          num_warps: gl.constexpr):
        """The default partition: one loop body per tail count, as `hopper_prefill.l2_kernel` picks them."""
        if nrows <= 64:
            _l2_mma_block(w_s, s_s, x_s, xt_s, ready, empty, k_tiles, out_ptr, sorted_ptr, row0, nrows, offs0,
                          stride_out, BN, STAGES, 0, LARGE, num_warps)
        elif ROWS == 80:  # a compile-time branch: no two-tail body
            _l2_mma_block(w_s, s_s, x_s, xt_s, ready, empty, k_tiles, out_ptr, sorted_ptr, row0, nrows, offs0,
                          stride_out, BN, STAGES, 1, LARGE, num_warps)
        elif nrows <= 80:
            _l2_mma_block(w_s, s_s, x_s, xt_s, ready, empty, k_tiles, out_ptr, sorted_ptr, row0, nrows, offs0,
                          stride_out, BN, STAGES, 1, LARGE, num_warps)
        else:
            _l2_mma_block(w_s, s_s, x_s, xt_s, ready, empty, k_tiles, out_ptr, sorted_ptr, row0, nrows, offs0,
                          stride_out, BN, STAGES, 2, LARGE, num_warps)

    @gluon.jit
    def _l2_copy_partition(a_desc, at_desc, w_desc, s_desc, w_s, s_s, x_s, xt_s, ready, empty, k_tiles, num_g, w_row0,
                           a_row0, nrows, STAGES: gl.constexpr):
        """The producer warp: each K tile's weight words, scale words and activation tiles (the tail rows only when
        the block has rows past 64) into the next free stage, complete on its `ready` barrier."""
        G: gl.constexpr = w_desc.block_type.shape[0]
        tail = nrows > 64
        nbytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes + a_desc.block_type.nbytes
        tail_bytes: gl.constexpr = at_desc.block_type.nbytes
        for i in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a new barrier passes phase 1 at once
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes + tail_bytes, pred=tail)
            mbarrier.expect(bar, nbytes, pred=nrows <= 64)
            row = w_row0 + i * num_g  # the tile's first row group: words [G, 128], scale words [1, 8 G]
            tma_load(w_desc, [row, 0], bar, w_s.index(s))
            tma_load(s_desc, [row // G, 0], bar, s_s.index(s))
            tma_load(a_desc, [a_row0, i * 64], bar, x_s.index(s))
            tma_load(at_desc, [a_row0 + 64, i * 64], bar, xt_s.index(s), pred=tail)

    @gluon.jit
    def l2_ws_kernel(
        a_desc, at_desc, w_desc, s_desc, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        hidden, inter, num_local, stride_out,
        BN: gl.constexpr, STAGES: gl.constexpr, LARGE: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """`hopper_prefill.l2_kernel` with its copies in a producer warp."""
        G: gl.constexpr = BN // 16
        pid_b, pid_n, expert, row0, nrows = hp.program_block(block_expert_ptr, block_row_ptr, block_end_ptr,
                                                             hidden // BN)
        if expert < num_local:
            k_tiles = inter // 64
            num_g = hidden // 16
            w_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 128], w_desc.layout)
            s_s = gl.allocate_shared_memory(gl.int32, [STAGES, 1, 8 * G], s_desc.layout)
            x_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, 64], a_desc.layout)
            xt_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROWS - 64, 64], at_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES):
                mbarrier.init(ready.index(s), count=1)
                mbarrier.init(empty.index(s), count=1)
            w_row0 = expert * k_tiles * num_g + pid_n * G
            a_row0 = pid_b * ROWS
            gl.warp_specialize([
                (_l2_mma_partition, (w_s, s_s, x_s, xt_s, ready, empty, k_tiles, out_ptr, sorted_ptr, row0, nrows,
                                     pid_n * BN, stride_out, BN, STAGES, LARGE, ROWS, num_warps)),
                (_l2_copy_partition, (a_desc, at_desc, w_desc, s_desc, w_s, s_s, x_s, xt_s, ready, empty, k_tiles,
                                      num_g, w_row0, a_row0, nrows, STAGES)),
            ], [1], [PRODUCER_REGS])


def tma_layouts() -> tuple:
    """The shared-memory layouts the copies write: activation tiles 128-byte swizzled (what wgmma reads), words and
    scale words as they are (each lane reads its own 16 bytes, conflict-free)."""
    return hp.x_tile_layout(), gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def weight_descriptors(w, sw, bn: int) -> tuple:
    """The TMA descriptors of one GEMM's weights: the words [G, 128] of one K tile's row groups and their scale words
    [1, 8 G] (`layout.shuffle_fp4`: per expert, K tile, row group, 128 words and 8 scale words)."""
    g = bn // 16
    _, plain = tma_layouts()
    words = w.view(-1, 128)  # views: the parameters are contiguous (a copy would be a second weight tensor)
    scales = sw.view(-1, 8 * g)
    return (TensorDescriptor.from_tensor(words, [g, 128], plain),
            TensorDescriptor.from_tensor(scales, [1, 8 * g], plain))


def descriptors(x, w, sw, *, rows: int, bn: int) -> tuple:
    """The TMA descriptors of one GEMM's operands: the activation tile's 64 and `rows - 64` rows, then
    `weight_descriptors`."""
    x_layout, _ = tma_layouts()
    return (TensorDescriptor.from_tensor(x, [64, 64], x_layout),
            TensorDescriptor.from_tensor(x, [rows - 64, 64], x_layout),
            *weight_descriptors(w, sw, bn))


def l2(act, w2, s2, sorted_slots, block_expert, block_row, block_end, out, *, hidden, large, config):
    """`hopper_prefill.l2` with the copies in a producer warp (`config.gluon == 2`)."""
    if unavailable_reason is not None:
        raise RuntimeError(f"KernelConfig(gluon=2) runs the warp-specialized L2, but {unavailable_reason}: use "
                           f"gluon=1 (the cp.async L2) or leave the config to `device_config`")
    inter, num_local = act.shape[1], w2.shape[0]
    a_desc, at_desc, w_desc, s_desc = descriptors(act, w2, s2, rows=config.block_t, bn=config.l2_n)
    l2_ws_kernel[(block_expert.numel() * (hidden // config.l2_n),)](
        a_desc, at_desc, w_desc, s_desc, sorted_slots, block_expert, block_row, block_end, out,
        hidden, inter, num_local, out.stride(0),
        BN=config.l2_n, STAGES=config.num_stages, LARGE=large, ROWS=config.block_t,
        num_warps=config.num_warps, **config.launch_registers("L2"),
    )
