"""The FP8 path's GEMMs for Hopper in Gluon: FP4 weights expanded to e4m3 in registers by byte-table lookups, FP8
async wgmma, FP32 promotion per 128-deep K block overlapped with the next block's MMA.

Why: the plain-Triton FP8 kernels (`fp8`, `KernelConfig(fp8=1 or 2)`) wait for every FP8 MMA before promoting its
partial sum, and stage the expanded weights through shared memory or spill; they ran 4.4-8.1x slower than the BF16
path. Here (`KernelConfig(fp8=3)`), written as the BF16 Gluon kernels (`hopper_prefill`):

- swap-AB: the weight rows are the wgmma's M (L1: 128 gate and 128 up rows, 8 warps; L2: 16 rows per warp) and the
  block's 64 rows its N, from shared memory;
- the weights are in the FP8 layout (`layout.shuffle_fp4_e4m3`): each int32 word is 8 codes of one (row, 32-group),
  turned into two A-operand registers of 4 e4m3 bytes by two `prmt` lookups in the group's 8-entry table
  (e4m3(|code| x 2**(s - ref + 1)), RNE below e4m3's normal range as the numerics say: one of the 17 rows of
  `layout.e4m3_tables`, picked by the group's index in its row's scale word and computed from it in registers,
  `table_words`) and one OR of the sign bits each: 7 instructions per 8 weights;
- each 128-deep K block's wgmma writes a fresh FP32 block sum and is waited for one step later: the promotion
  (acc += part x sw x sx) of one block runs while the next block's MMA does, and the next operand is expanded then
  too (L1: gate and up blocks alternate; L2: K blocks in pairs);
- words and activation tiles stream through a `num_stages` cp.async ring as in `hopper_prefill`; the scale words
  (one int32 per row and K block) and the activations' block scales are loaded from global memory (L2-resident).

`KernelConfig(fp8=6)` runs the same kernels with ROW_SCALED: one scale per row of each operand, so nothing is
promoted (`accumulated_sums`: every K block's wgmma accumulates into the same registers, and one stays in flight
across iterations as in the BF16 kernels), the scales applied in the epilogue; 128-row blocks fit there too, and
80-row ones: a 64-row MMA and a 16-row one on the same expanded operand (an expert of 65-80 rows expands its weights
once, not twice as in two 64-row blocks).

Numerics: `fp8`'s module docstring (per-128 block scales on both operands, promotion in FP32, L1 rounded to BF16 once,
the SwiGLU epilogue, L1's output cast per (row, 128 channels)), with the K order of `layout.fp8_k_order` inside each
128 block (a permutation of the same products). Gluon has no CPU interpreter: CI compiles these kernels for sm_90
(`tests/kernels/megamoe/test_hopper_fp8_compile.py`); `test_triton_gpu.py` checks them against the float64 emulation.
"""

from __future__ import annotations

import torch

from planc.kernels.megamoe.triton import hopper_prefill as hp

if hp.gluon is not None:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from planc.kernels.megamoe.triton.jit import _e4m3_bits, _pow2_ceil_exponent, bf16_rne, swiglu

    async_load = hp.async_load
    _cta_barrier = hp._cta_barrier

    # A word (8 codes, `layout.shuffle_fp4_e4m3`) and its table -> A registers h = 0 (codes 0-3) and h = 1 (4-7).
    _EXPAND_E4M3_PTX: gl.constexpr = gl.constexpr("""{
    .reg .b32 m, t;
    and.b32 m, $2, 0x77777777;
    prmt.b32 $0, $3, $4, m;
    and.b32 t, $2, 0x80808080;
    or.b32 $0, $0, t;
    shr.u32 m, m, 16;
    prmt.b32 $1, $3, $4, m;
    shl.b32 t, $2, 4;
    and.b32 t, t, 0x80808080;
    or.b32 $1, $1, t;
    }""")

    # A group's table row t (`layout.e4m3_tables`: the e4m3 bytes of the 8 e2m1 magnitudes times 2**(1 - t)) -> its
    # low and high word, computed from t: rows 0-6 (every nonzero magnitude a normal e4m3) are row 0's bytes with t
    # subtracted from each nonzero byte's exponent, two multiply-adds; a row past 6 (magnitudes in e4m3's subnormal
    # range) is converted by `cvt` (RNE, as the table), behind a branch that only a warp with such a lane takes.
    _TABLE_PTX: gl.constexpr = gl.constexpr("""{
    .reg .pred p, q;
    .reg .b32 f, z, a1, a3, a4, a5, a6, a7;
    .reg .b16 h0, h1, h2, h3;
    mad.lo.u32 $0, $2, 0xF7F7F800, 0x44403800;
    mad.lo.u32 $1, $2, 0xF7F7F7F8, 0x54504C48;
    setp.gt.u32 p, $2, 6;
    vote.sync.any.pred q, p, 0xffffffff;
    @!q bra.uni TABLE_NORMAL_${:uid};
    mad.lo.u32 f, $2, 0xFF800000, 0x40000000;
    mov.b32 z, 0;
    mul.f32 a1, f, 0f3F000000;
    mul.f32 a3, f, 0f3FC00000;
    mul.f32 a4, f, 0f40000000;
    mul.f32 a5, f, 0f40400000;
    mul.f32 a6, f, 0f40800000;
    mul.f32 a7, f, 0f40C00000;
    cvt.rn.satfinite.e4m3x2.f32 h0, a1, z;
    cvt.rn.satfinite.e4m3x2.f32 h1, a3, f;
    cvt.rn.satfinite.e4m3x2.f32 h2, a5, a4;
    cvt.rn.satfinite.e4m3x2.f32 h3, a7, a6;
    @p mov.b32 $0, {h0, h1};
    @p mov.b32 $1, {h2, h3};
    TABLE_NORMAL_${:uid}:
    }""")

    @triton.constexpr_function
    def words_layout(num_warps):
        """[G, sh, lane, sl, m8]: the words of one 128-deep K block, row group g in warp g (mod num_warps); a lane
        holds its 8 words (2 x 16 contiguous bytes)."""
        return gl.BlockedLayout([1, 2, 1, 2, 2], [1, 1, 32, 1, 1], [num_warps, 1, 1, 1, 1], [4, 3, 2, 1, 0])

    @triton.constexpr_function
    def mma_layout(num_warps, n):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 32])

    @triton.constexpr_function
    def sx_layout(num_warps):
        """[rows] block scales of the activations (cp.async, 4 bytes a thread)."""
        return gl.BlockedLayout([1], [32], [num_warps], [0])

    @triton.constexpr_function
    def x_tile_layout():
        """The e4m3 activation tiles in shared memory as the FP8 wgmma's B operand reads them: 128-byte swizzled."""
        return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)

    @triton.constexpr_function
    def _x_layout(num_warps):
        """[rows, 128] e4m3 activation tiles: 16 contiguous bytes a thread (cp.async)."""
        return gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])

    @triton.constexpr_function
    def _xt_layout(num_warps):
        """[16, 128] e4m3 tail tiles (80-row blocks' rows 64-79): each byte copied by one thread (cp.async), 64 /
        num_warps contiguous bytes a thread."""
        return gl.BlockedLayout([1, 64 // num_warps], [16 // num_warps, 2 * num_warps], [num_warps, 1], [1, 0])

    @gluon.jit
    def _bytes(d):
        """int32 words [...] -> [..., 4] int8 (byte i of each word at i)."""
        c = gl.join(d, d)
        c = gl.join(c, c)
        c = gl.reshape(c, c.shape[:-2] + [4])
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [c], dtype=gl.int8, is_pure=True, pack=4)

    @gluon.jit
    def expand_e4m3(w, lo, hi):
        """Words [G, 2, 32, 2, 2] and their groups' tables [G, 32, 2] (`lane_tables`) -> the e4m3 A registers, two int32
        tensors of the words' shape (h = 0: codes 0-3, h = 1: codes 4-7; `operand` makes them the wgmma's operand). An
        async wgmma reads its operand registers until it is waited for, and ptxas reuses a register once PTX no longer
        uses it: the caller passes these to that wait."""
        lo = gl.expand_dims(gl.expand_dims(lo, 1), 3)
        hi = gl.expand_dims(gl.expand_dims(hi, 1), 3)
        lo, _ = gl.broadcast(lo, w)
        hi, _ = gl.broadcast(hi, w)
        return gl.inline_asm_elementwise(_EXPAND_E4M3_PTX, "=r,=r,r,r,r", [w, lo, hi], dtype=(gl.int32, gl.int32),
                                         is_pure=True, pack=1)

    @gluon.jit
    def operand(d0, d1, AL: gl.constexpr):
        """The A registers of `expand_e4m3` as the [16 G, 128] e4m3 wgmma operand in layout AL (a renaming)."""
        G: gl.constexpr = d0.shape[0]
        b = gl.join(_bytes(d0), _bytes(d1))  # [g, sh, lane, sl, m8, i, h]
        b = gl.reshape(b, (G, 2, 8, 4, 2, 2, 4, 2))  # g sh r q sl m8 i h
        b = gl.permute(b, (0, 5, 2, 1, 4, 7, 3, 6))  # g m8 r sh sl h q i: rows, then the MMA's K
        a = gl.reshape(b, (16 * G, 128)).to(gl.float8e4nv, bitcast=True)
        return gl.convert_layout(a, AL, assert_trivial=True)

    @triton.constexpr_function
    def scale_layout(num_warps):
        """[G, 8, 4, 2]: lane 4 r + q holds the scale words of rows 16 g + r and + 8 (m8), g its warp's group."""
        return gl.BlockedLayout([1, 1, 1, 2], [1, 8, 4, 1], [num_warps, 1, 1, 1], [3, 2, 1, 0])

    @gluon.jit
    def _scale_offsets(n0, G: gl.constexpr, num_warps: gl.constexpr):
        """int32 offsets [G, 8, 2] of the scale words of rows n0 + 16 g + 8 m8 + r (a K block's, in row order)."""
        SL: gl.constexpr = gl.SliceLayout(2, scale_layout(num_warps))
        g = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, SL)))
        r = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, SL)))
        m8 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
        return n0 + g[:, None, None] * 16 + m8[None, None, :] * 8 + r[None, :, None]

    @gluon.jit
    def row_scales(s_tile, BN: gl.constexpr, L: gl.constexpr):
        """A stage's scale words [G, 2, 8] (rows 16 g + 8 m8 + r, in order) -> the weight block scales 2**(ref - 128)
        of its rows [BN] in layout L (ref: the scale word's low byte)."""
        return ref_scale(s_tile.reshape([BN]).load(L) & 0xFF)

    @gluon.jit
    def ref_scale(ref):
        """UE8M0 bytes -> 2**(ref - 128) in FP32 (subnormal below ref 2)."""
        bits = gl.where(ref >= 2, (ref - 1) << 23, 0x800000 >> (2 - gl.minimum(ref, 2)))
        return bits.to(gl.float32, bitcast=True)

    @gluon.jit
    def lane_tables(s_s, s, G: gl.constexpr, WL: gl.constexpr, num_warps: gl.constexpr):
        """Stage s's scale words (`_scale_tile`, read as [G, 8, 2]: r, m8) -> the e4m3 tables (`layout.e4m3_tables`,
        low and high word) of each lane's 32-group, [G, 32, 2] in the expansion's layout: lane 4 r + q, rows
        16 g + 8 m8 + r, the table row t_q of the row's scale word."""
        L4: gl.constexpr = scale_layout(num_warps)
        s8 = _scale_tile(s_s, s, G).permute((0, 2, 1)).load(gl.SliceLayout(2, L4))
        sw = gl.broadcast(gl.expand_dims(s8, 2), gl.zeros([G, 8, 4, 2], gl.int32, L4))[0]
        q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
        t = (sw >> (8 + 5 * q)[None, None, :, None]) & 31
        t = gl.convert_layout(gl.reshape(t, (G, 32, 2)), gl.SliceLayout(1, gl.SliceLayout(3, WL)), assert_trivial=True)
        return table_words(t)

    @gluon.jit
    def table_words(t):
        """Table rows t (int32, any layout) -> their low and high words (`_TABLE_PTX`), in registers: a table load in
        every K block waits behind the stage copies queued in the same load/store unit, between the scale words and
        the MMA (Nsight Compute: the largest stall of the row-scaled L1 at 4096 tokens)."""
        return gl.inline_asm_elementwise(_TABLE_PTX, "=r,=r,r", [t], dtype=(gl.int32, gl.int32), is_pure=True,
                                         pack=1)

    @gluon.jit
    def _word_offsets(g0, num_g, G: gl.constexpr, WL: gl.constexpr):
        """int32 offsets [G, 2, 32, 2, 2] of the words of row groups g0.. at K block 0 (block kb: kb * num_g * 256
        further)."""
        L4: gl.constexpr = gl.SliceLayout(4, WL)  # g sh lane sl
        L3: gl.constexpr = gl.SliceLayout(3, L4)  # g sh lane
        g = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        sh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        sl = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
        m8 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WL)))))
        base = ((g0 + g)[:, None, None] * 2 + sh[None, :, None]) * 32 + lane[None, None, :]  # [G, 2, 32]
        return ((base[:, :, :, None] * 2 + sl[None, None, None, :]) * 2)[:, :, :, :, None] \
            + m8[None, None, None, None, :]

    @gluon.jit
    def _issue(kb, k_blocks, wa_ptrs, wb_ptrs, step, sa_ptrs, sb_ptrs, n_rows, x_ptrs, sx_ptrs, total_rows, wa_s, wb_s,
               sa_s, sb_s, x_s, sx_s, xt_ptrs, xt_s, stage, GATED: gl.constexpr, ROW_SCALED: gl.constexpr,
               TAIL: gl.constexpr):
        """cp.async K block `kb` (the last one again past the end) into stage `stage`: the words and scale words of
        one or two operands, the activation tile, its 16-row tail (TAIL) and (not ROW_SCALED) its block scales; one
        commit group."""
        k = gl.minimum(kb, k_blocks - 1)
        async_load(wa_s.index(stage), wa_ptrs + k * step)
        async_load(sa_s.index(stage), sa_ptrs + k * n_rows)
        if GATED:
            async_load(wb_s.index(stage), wb_ptrs + k * step)
            async_load(sb_s.index(stage), sb_ptrs + k * n_rows)
        async_load(x_s.index(stage), x_ptrs + k * 128)
        if TAIL:
            async_load(xt_s.index(stage), xt_ptrs + k * 128)
        if not ROW_SCALED:
            async_load(sx_s.index(stage), sx_ptrs + k * total_rows)
        _cp.commit_group()

    @gluon.jit
    def _gemm(x_ptrs, sx_ptrs, total_rows, w_base, s_base, wa_off, wb_off, na0, nb0, n_rows, num_g, k_blocks,
              BN: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr,
              ROW_SCALED: gl.constexpr, num_warps: gl.constexpr, xt_ptrs=None, TAIL: gl.constexpr = False):
        """FP32 sums [BN, ROWS] of operand a (rows na0..; and b, rows nb0.., when GATED) times the block's
        activations (`promoted_sums`; ROW_SCALED: `accumulated_sums`, not scaled), fed by a cp.async ring: per K block
        a stage holds the words, the scale words (one per row), the activation tile and (not ROW_SCALED) its block
        scales. TAIL (ROW_SCALED only): also the 16 rows after them (`xt_ptrs`), in a tile and sums [BN, 16] of their
        own (returned after a's and b's)."""
        G: gl.constexpr = BN // 16
        XS: gl.constexpr = x_tile_layout()
        WS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[4, 3, 2, 1, 0])
        SS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
        S1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        wa_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 2, 32, 2, 2], WS)
        sa_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 2, 8], SS)
        if GATED:
            wb_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 2, 32, 2, 2], WS)
            sb_s = gl.allocate_shared_memory(gl.int32, [STAGES, G, 2, 8], SS)
        else:
            wb_s = wa_s
            sb_s = sa_s
        x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, ROWS, 128], XS)
        if ROW_SCALED:  # not read: no activation block scales
            sx_s = x_s
        else:
            sx_s = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], S1)
        if TAIL:
            xt_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 16, 128], XS)
        else:  # not read
            xt_s = x_s
            xt_ptrs = x_ptrs
        step = num_g * 256
        wa_ptrs = w_base + wa_off
        wb_ptrs = w_base + wb_off
        s_off = _scale_offsets(0, G, num_warps)
        sa_ptrs = s_base + na0 + gl.permute(s_off, (0, 2, 1))
        sb_ptrs = s_base + nb0 + gl.permute(s_off, (0, 2, 1))
        for s in gl.static_range(STAGES - 2):
            _issue(s, k_blocks, wa_ptrs, wb_ptrs, step, sa_ptrs, sb_ptrs, n_rows, x_ptrs, sx_ptrs, total_rows, wa_s,
                   wb_s, sa_s, sb_s, x_s, sx_s, xt_ptrs, xt_s, s, GATED, ROW_SCALED, TAIL)
        ring = (wa_ptrs, wb_ptrs, step, sa_ptrs, sb_ptrs, n_rows, x_ptrs, sx_ptrs, total_rows, wa_s, wb_s, sa_s, sb_s,
                x_s, sx_s, xt_ptrs, xt_s)
        if ROW_SCALED:
            sums = accumulated_sums(ring, wa_s, sa_s, wb_s, sb_s, x_s, xt_s, k_blocks, BN, ROWS, STAGES, GATED, TAIL,
                                    num_warps)
        else:
            sums = promoted_sums(ring, _ring_acquire, _ring_stage, _ring_release, _ring_drain, wa_s, sa_s, wb_s, sb_s,
                                 x_s, sx_s, k_blocks, BN, ROWS, STAGES, GATED, num_warps)
        return sums

    @gluon.jit
    def _ring_acquire(ring, kb, k_blocks, PAST_END: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr):
        """The cp.async ring's stage of K block kb (past the end: the last block's again), its copies landed, and the
        next block's issued (`_ring_wait`, then `_ring_refill`: `hopper_prefill._next_tile`'s order)."""
        st = _ring_wait(kb, STAGES)
        _ring_refill(ring, kb, k_blocks, STAGES, GATED, False, False)
        return st

    @gluon.jit
    def _ring_wait(kb, STAGES: gl.constexpr):
        """Wait for K block kb's copies and for every warp to pass the MMAs of block kb - 2 (CTA barrier). Returns
        kb's stage."""
        _cp.wait_group(STAGES - 3)
        _cta_barrier()
        return kb % STAGES

    @gluon.jit
    def _ring_refill(ring, kb, k_blocks, STAGES: gl.constexpr, GATED: gl.constexpr, ROW_SCALED: gl.constexpr,
                     TAIL: gl.constexpr):
        """After `_ring_wait(kb)`: issue block kb + STAGES - 2 into the stage of block kb - 2 (its MMAs retired, its
        scales read; ROW_SCALED: stages without activation block scales; TAIL: with the tail tiles), then fence for
        the MMAs of block kb."""
        wa_ptrs, wb_ptrs, step, sa_ptrs, sb_ptrs, n_rows, x_ptrs, sx_ptrs, total_rows, wa_s, wb_s, sa_s, sb_s, x_s, \
            sx_s, xt_ptrs, xt_s = ring
        nxt = kb + STAGES - 2
        _issue(nxt, k_blocks, wa_ptrs, wb_ptrs, step, sa_ptrs, sb_ptrs, n_rows, x_ptrs, sx_ptrs, total_rows, wa_s,
               wb_s, sa_s, sb_s, x_s, sx_s, xt_ptrs, xt_s, nxt % STAGES, GATED, ROW_SCALED, TAIL)
        fence_async_shared()

    @gluon.jit
    def _ring_read(ring, w_s, s_s, kb, k_blocks, G: gl.constexpr, WL: gl.constexpr, STAGES: gl.constexpr,
                   GATED: gl.constexpr, TAIL: gl.constexpr, num_warps: gl.constexpr):
        """The row-scaled stages' acquire (`accumulated_sums`): wait for K block kb (`_ring_wait`), read its table
        rows and words of operand (w_s, s_s), then refill (`_ring_refill`): issued first, the copies of block
        kb + STAGES - 2 queue ahead of those reads in the load/store unit. Returns (stage, low and high table words,
        words)."""
        st = _ring_wait(kb, STAGES)
        lo, hi = lane_tables(s_s, st, G, WL, num_warps)
        words = _words(w_s, st, WL)
        _ring_refill(ring, kb, k_blocks, STAGES, GATED, True, TAIL)
        return st, lo, hi, words

    @gluon.jit
    def _ring_stage(ring, kb, STAGES: gl.constexpr):
        return kb % STAGES

    @gluon.jit
    def _ring_release(ring, kb, STAGES: gl.constexpr):
        """Nothing: a stage is reused once every warp has passed the CTA barrier of a later block (`_ring_wait`)."""

    @gluon.jit
    def _ring_drain(ring):
        _cp.wait_group(0)

    @gluon.jit
    def _words(w_s, s, WL: gl.constexpr):
        """Stage s's words as the expansion reads them, [G, 2, 32, 2, 2] (`fp8=3`'s stages have that shape; `fp8=4`'s
        [G, 256] TMA boxes are reshaped)."""
        G: gl.constexpr = w_s.shape[1]
        return w_s.index(s).reshape((G, 2, 32, 2, 2)).load(WL)

    @gluon.jit
    def _scale_tile(s_s, s, G: gl.constexpr):
        """Stage s's scale words as [G, 2, 8] (rows 16 g + 8 m8 + r; `fp8=4`'s [1, 16 G] TMA boxes reshaped)."""
        return s_s.index(s).reshape((G, 2, 8))

    @gluon.jit
    def _rows(t_s, s, N: gl.constexpr):
        """Stage s's first N activation rows (tiles [ROWS, 128]) or their scales (rows [ROWS])."""
        return t_s.index(s).slice(0, N)

    @gluon.jit
    def block_scales(s_s, sx_s, s, BN: gl.constexpr, N: gl.constexpr, num_warps: gl.constexpr):
        """Stage s's scales of one operand's 128-deep K block: the weight rows' [BN] and the activation rows' [N],
        in the layouts of a promotion ``acc += part * (sw[:, None] * sx[None, :])``."""
        MMA: gl.constexpr = mma_layout(num_warps, N)
        return (row_scales(_scale_tile(s_s, s, BN // 16), BN, gl.SliceLayout(1, MMA)),
                _rows(sx_s, s, N).load(gl.SliceLayout(0, MMA)))

    @gluon.jit
    def promoted_sums(ring, acquire: gl.constexpr, stage_of: gl.constexpr, release: gl.constexpr,
                      drain: gl.constexpr, wa_s, sa_s, wb_s, sb_s, x_s, sx_s, k_blocks, BN: gl.constexpr,
                      N: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, num_warps: gl.constexpr):
        """The K loop of every FP8 Gluon GEMM: FP32 sums [BN, N] of operand a (and b when GATED) times the stages'
        activation tiles, promoted per 128-deep K block. GATED: a and b alternate (each expanded and promoted while
        the other multiplies); else K blocks in pairs into one sum (returned as a, b unused).

        The ring that feeds the stages is the caller's (`ring`, a tuple its functions read): `acquire(ring, kb,
        k_blocks, PAST_END, STAGES, GATED)` waits for K block kb (PAST_END: kb may be k_blocks, then the last block's
        again) and returns its stage, `stage_of(ring, kb, STAGES)` names it, `release(ring, kb, STAGES)` frees it
        once its last read is done, `drain(ring)` ends the ring's copies. The stages: words [G, 2, 32, 2, 2] or
        [G, 256], scale words [G, 2, 8] or [1, BN], activation tiles [ROWS, 128] and their scales [ROWS] (N of the
        ROWS read)."""
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = words_layout(num_warps)
        MMA: gl.constexpr = mma_layout(num_warps, N)
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
        SWL: gl.constexpr = gl.SliceLayout(1, MMA)
        SXL: gl.constexpr = gl.SliceLayout(0, MMA)
        acc_a = gl.zeros([BN, N], gl.float32, MMA)
        acc_b = gl.zeros([BN, N], gl.float32, MMA)
        pa = gl.zeros([BN, N], gl.float32, MMA)
        pb = gl.zeros([BN, N], gl.float32, MMA)
        swb = gl.zeros([BN], gl.float32, SWL)
        STEP: gl.constexpr = 1 if GATED else 2
        st = acquire(ring, 0, k_blocks, False, STAGES, GATED)
        lo, hi = lane_tables(sa_s, st, G, WL, num_warps)
        ka0, ka1 = expand_e4m3(_words(wa_s, st, WL), lo, hi)
        # One iteration: a's block multiplies while b's last block sum is promoted and b's operand expanded; b's block
        # multiplies while a's sum is promoted and the next a operand expanded (from the next stage). Each block sum is
        # read while the other operand's wgmma is in flight, but never across the loop's back edge: there ptxas
        # cannot tell which group a wait retired and serializes every wgmma of the kernel (C7514), so the iteration
        # ends waiting for b. The wait after each promotion pins it before the next MMA into the same registers (sunk
        # below it, the block sum would need a copy, which reads a wgmma's accumulator in flight).
        for i in range(0, k_blocks, STEP):
            x_t = _rows(x_s, st, N).permute((1, 0))
            pa = warpgroup_mma(operand(ka0, ka1, AL), x_t, pa, use_acc=False, is_async=True)
            pa, pb, ka0, ka1 = warpgroup_mma_wait(1, deps=(pa, pb, ka0, ka1))
            # b's last block sum (block i - 1: its MMAs retired in iteration i - 1, and its activation scales are its
            # stage's last read); the next b operand's shared-memory reads go first, so that their latency passes
            # under the promotion
            sxb = _rows(sx_s, stage_of(ring, gl.maximum(i - 1, 0), STAGES), N).load(SXL)
            if i > 0:
                release(ring, i - 1, STAGES)
            if GATED:
                lo, hi = lane_tables(sb_s, st, G, WL, num_warps)
                wb = _words(wb_s, st, WL)
                acc_b = warpgroup_mma_wait(1, deps=(acc_b + pb * (swb[:, None] * sxb[None, :]),))
                swb = row_scales(_scale_tile(sb_s, st, G), BN, SWL)
                kb0, kb1 = expand_e4m3(wb, lo, hi)
            else:
                acc_a = warpgroup_mma_wait(1, deps=(acc_a + pb * (swb[:, None] * sxb[None, :]),))
                st = acquire(ring, i + 1, k_blocks, False, STAGES, GATED)
                x_t = _rows(x_s, st, N).permute((1, 0))
                lo, hi = lane_tables(sa_s, st, G, WL, num_warps)
                swb = row_scales(_scale_tile(sa_s, st, G), BN, SWL)
                kb0, kb1 = expand_e4m3(_words(wa_s, st, WL), lo, hi)
            pb = warpgroup_mma(operand(kb0, kb1, AL), x_t, pb, use_acc=False, is_async=True)
            pa, pb, ka0, ka1, kb0, kb1 = warpgroup_mma_wait(1, deps=(pa, pb, ka0, ka1, kb0, kb1))
            swa, sxa = block_scales(sa_s, sx_s, stage_of(ring, i, STAGES), BN, N, num_warps)
            if not GATED:
                release(ring, i, STAGES)  # (L2) block i: its MMA retired, its scales read
            # the next a operand (past the end: the last block's again, never multiplied): its stage's reads go out
            # before a's promotion
            st = acquire(ring, i + STEP, k_blocks, True, STAGES, GATED)
            lo, hi = lane_tables(sa_s, st, G, WL, num_warps)
            wa = _words(wa_s, st, WL)
            acc_a = warpgroup_mma_wait(1, deps=(acc_a + pa * (swa[:, None] * sxa[None, :]),))
            ka0, ka1 = expand_e4m3(wa, lo, hi)
            pb, kb0, kb1, ka0, ka1 = warpgroup_mma_wait(0, deps=(pb, kb0, kb1, ka0, ka1))
        # b's last block
        drain(ring)
        sxb = _rows(sx_s, stage_of(ring, k_blocks - 1, STAGES), N).load(SXL)
        release(ring, k_blocks - 1, STAGES)
        if GATED:
            acc_b += pb * (swb[:, None] * sxb[None, :])
        else:
            acc_a += pb * (swb[:, None] * sxb[None, :])
        return acc_a, acc_b

    @gluon.jit
    def _row_scaled_mma(a, x_t, xt_s, acc, acc_t, AL16: gl.constexpr, TAIL: gl.constexpr):
        """acc += a @ x_t, and (TAIL) acc_t += a @ the 16-row tail tile `xt_s`, asynchronously (one commit group
        each). The tail's operand is a's registers in the 16-column MMA's layout (a renaming: A's layout does not
        depend on N), so keeping a's expanded registers alive keeps it alive."""
        acc = warpgroup_mma(a, x_t, acc, is_async=True)
        if TAIL:
            acc_t = warpgroup_mma(gl.convert_layout(a, AL16, assert_trivial=True), xt_s.permute((1, 0)), acc_t,
                                  is_async=True)
        return acc, acc_t

    @gluon.jit
    def accumulated_sums(ring, wa_s, sa_s, wb_s, sb_s, x_s, xt_s, k_blocks,
                         BN: gl.constexpr, N: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr,
                         TAIL: gl.constexpr, num_warps: gl.constexpr):
        """The K loop of the row-scaled FP8 GEMMs (`KernelConfig(fp8=6)`): the sums [BN, N] of operand a (and b when
        GATED) times the stages' activation tiles, every K block's FP8 wgmma accumulating into the same FP32
        registers (one scale per weight row and per activation row, applied by the caller). Nothing reads an
        accumulator in the loop, so a wgmma stays in flight across iterations as in the BF16 kernels
        (`hopper_prefill._gemm`): per iteration expand a (the last b multiplying), issue a, wait for b, expand b (L2:
        the next K block) while a multiplies, issue b, wait for a; each K block's stage by `_ring_read`. TAIL: each
        expanded operand also multiplies the stage's 16-row tail tile (`xt_s`) into sums [BN, 16] of its own, returned
        after a's and b's (a block of 80 rows: one expansion for all of them)."""
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = words_layout(num_warps)
        MMA: gl.constexpr = mma_layout(num_warps, N)
        MMA16: gl.constexpr = mma_layout(num_warps, 16)
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
        AL16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA16, k_width=4)
        W: gl.constexpr = 1 + TAIL  # commit groups per operand's MMAs
        acc_a = gl.zeros([BN, N], gl.float32, MMA)
        acc_b = gl.zeros([BN, N], gl.float32, MMA)
        tail_a = gl.zeros([BN, 16], gl.float32, MMA16)
        tail_b = gl.zeros([BN, 16], gl.float32, MMA16)
        WZ = gl.zeros([G, 2, 32, 2, 2], gl.int32, WL)
        # the operand registers of the MMAs in flight, kept alive through each wait (`expand_e4m3`)
        pa0, pa1, pb0, pb1 = WZ, WZ, WZ, WZ
        for i in range(0, k_blocks, 1 if GATED else 2):
            st, lo, hi, wa = _ring_read(ring, wa_s, sa_s, i, k_blocks, G, WL, STAGES, GATED, TAIL, num_warps)
            x_t = _rows(x_s, st, N).permute((1, 0))
            pa0, pa1 = expand_e4m3(wa, lo, hi)
            acc_a, tail_a = _row_scaled_mma(operand(pa0, pa1, AL), x_t, xt_s.index(st), acc_a, tail_a, AL16, TAIL)
            acc_a, acc_b, tail_a, tail_b, pa0, pa1, pb0, pb1 = warpgroup_mma_wait(
                W, deps=(acc_a, acc_b, tail_a, tail_b, pa0, pa1, pb0, pb1))
            if GATED:
                lo, hi = lane_tables(sb_s, st, G, WL, num_warps)
                pb0, pb1 = expand_e4m3(_words(wb_s, st, WL), lo, hi)
                acc_b, tail_b = _row_scaled_mma(operand(pb0, pb1, AL), x_t, xt_s.index(st), acc_b, tail_b, AL16, TAIL)
            else:  # K block i + 1 (k_blocks is even), into a's accumulators
                st, lo, hi, wb = _ring_read(ring, wa_s, sa_s, i + 1, k_blocks, G, WL, STAGES, GATED, TAIL, num_warps)
                pb0, pb1 = expand_e4m3(wb, lo, hi)
                acc_a, tail_a = _row_scaled_mma(operand(pb0, pb1, AL), _rows(x_s, st, N).permute((1, 0)),
                                                xt_s.index(st), acc_a, tail_a, AL16, TAIL)
            acc_a, acc_b, tail_a, tail_b, pa0, pa1, pb0, pb1 = warpgroup_mma_wait(
                W, deps=(acc_a, acc_b, tail_a, tail_b, pa0, pa1, pb0, pb1))
        acc_a, acc_b, tail_a, tail_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b, tail_a, tail_b))
        _cp.wait_group(0)
        return acc_a, acc_b, tail_a, tail_b

    @gluon.jit
    def weight_row_scales(s_base, n0, BN: gl.constexpr, L: gl.constexpr):
        """The row scales 2**(ref - 128) [BN] of rows n0.. in layout L, from their row-scaled scale words (every K
        block's holds the row's ref; K block 0's are read)."""
        return ref_scale(gl.load(s_base + n0 + gl.arange(0, BN, layout=L)) & 0xFF)

    @gluon.jit
    def _l1_block(x8_ptr, xs_ptr, w_base, s_base, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b,
                  pid_n, row0, nrows, hidden, inter, num_topk, total_rows, clamp, HAS_CLAMP: gl.constexpr,
                  N: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr, ROW_SCALED: gl.constexpr,
                  num_warps: gl.constexpr, TAIL: gl.constexpr = False):
        """L1 of the block's first N rows (of ROWS; TAIL: and the 16 after them): the K loop, the SwiGLU epilogue and
        the output's cast (rows past these are the expert's none, and L2 reads only these: the same branch on the
        same rows). With 4 warps (64 channels, half a scale block) the SwiGLU output goes out in FP32 to `a32` and
        `fp8.l1_out_blocks` casts it; ROW_SCALED (`xs`: one scale per token [M]) it always does, for
        `fp8.l1_out_rows`."""
        BN: gl.constexpr = 16 * num_warps
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = words_layout(num_warps)
        num_g = inter // 8  # 2I rows in groups of 16
        wg_off = _word_offsets(pid_n * G, num_g, G, WL)
        wu_off = _word_offsets(pid_n * G + inter // 16, num_g, G, WL)
        x_ptrs = _token_rows(x8_ptr, sorted_ptr, row0, nrows, num_topk, hidden, 0, N, _x_layout(num_warps))
        if TAIL:
            xt_ptrs = _token_rows(x8_ptr, sorted_ptr, row0, nrows, num_topk, hidden, N, 16, _xt_layout(num_warps))
        else:  # not read
            xt_ptrs = x_ptrs
        # the stages' activation block scales, by block row (not read when ROW_SCALED: `xs` is then one per token)
        sx_ptrs = xs_ptr + pid_b * ROWS + gl.arange(0, N, layout=sx_layout(num_warps))
        sums = _gemm(x_ptrs, sx_ptrs, total_rows, w_base, s_base, wg_off, wu_off, pid_n * BN, inter + pid_n * BN,
                     2 * inter, num_g, hidden // 128, BN, N, STAGES, True, ROW_SCALED, num_warps, xt_ptrs, TAIL)
        acc_g = sums[0]
        acc_u = sums[1]
        if ROW_SCALED:
            sx_tok = _token_scales(xs_ptr, sorted_ptr, row0, nrows, num_topk, 0, N, num_warps)
            acc_g = _row_scaled(acc_g, sx_tok, s_base, pid_n * BN)
            acc_u = _row_scaled(acc_u, sx_tok, s_base, inter + pid_n * BN)
        l1_epilogue(acc_g, acc_u, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0, nrows, inter,
                    total_rows, clamp, HAS_CLAMP, N, ROWS, num_warps, ROW_SCALED)
        if TAIL:
            sx_tok = _token_scales(xs_ptr, sorted_ptr, row0, nrows, num_topk, N, 16, num_warps)
            tail_g = _row_scaled(sums[2], sx_tok, s_base, pid_n * BN)
            tail_u = _row_scaled(sums[3], sx_tok, s_base, inter + pid_n * BN)
            l1_epilogue(tail_g, tail_u, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0, nrows,
                        inter, total_rows, clamp, HAS_CLAMP, 16, ROWS, num_warps, True, N)

    @gluon.jit
    def _token_rows(x8_ptr, sorted_ptr, row0, nrows, num_topk, hidden, T0: gl.constexpr, R: gl.constexpr,
                    L: gl.constexpr):
        """Pointers [R, 128] to K block 0 of the tokens of the block's rows T0.. in layout L (rows past the expert's
        end read token 0: finite, never stored)."""
        t = T0 + gl.arange(0, R, layout=gl.SliceLayout(1, L))
        ok = t < nrows
        slot = gl.load(sorted_ptr + row0 + t, mask=ok, other=0)
        token = gl.where(ok, slot // num_topk, 0).to(gl.int64)
        return x8_ptr + token[:, None] * hidden + gl.arange(0, 128, layout=gl.SliceLayout(0, L))[None, :]

    @gluon.jit
    def _row_scaled(acc, sx, s_base, n0):
        """Row-scaled sums [BN, R] of weight rows n0.. -> their values: times each weight row's scale and each
        activation row's, `sx` [R] (in the sums' column layout)."""
        BN: gl.constexpr = acc.shape[0]
        L: gl.constexpr = acc.type.layout
        return acc * (weight_row_scales(s_base, n0, BN, gl.SliceLayout(1, L))[:, None] * sx[None, :])

    @gluon.jit
    def _token_scales(xs_ptr, sorted_ptr, row0, nrows, num_topk, T0: gl.constexpr, R: gl.constexpr,
                      num_warps: gl.constexpr):
        """The row scales [R] of the tokens of the block's rows T0.. (`xs`: one per token, `fp8.x_rows`), in the
        column layout of R-wide sums (rows past the expert's end: token 0's, never stored)."""
        t = T0 + gl.arange(0, R, layout=gl.SliceLayout(0, mma_layout(num_warps, R)))
        slot = gl.load(sorted_ptr + row0 + t, mask=t < nrows, other=0)
        return gl.load(xs_ptr + slot // num_topk)

    @gluon.jit
    def l1_activation(acc_g, acc_u, sorted_ptr, weight_ptr, row0, nrows, clamp, HAS_CLAMP: gl.constexpr,
                      N: gl.constexpr, num_warps: gl.constexpr, T0: gl.constexpr = 0):
        """L1's sums [BN, N] of the block's N rows from T0 -> their SwiGLU output in FP32 (`jit.swiglu`)."""
        tc = T0 + gl.arange(0, N, layout=gl.SliceLayout(0, mma_layout(num_warps, N)))
        okc = tc < nrows
        slotc = gl.load(sorted_ptr + row0 + tc, mask=okc, other=0)
        topw = gl.load(weight_ptr + slotc, mask=okc, other=0.0)
        return swiglu(acc_g, acc_u, topw, okc, clamp, HAS_CLAMP)

    @gluon.jit
    def l1_cast_store(a, amax, out_ptr, out_rows, offs, inter):
        """SwiGLU outputs [BN, N] -> e4m3 bytes into `out` with the scale of their (row, 128 channels) block, whose
        largest magnitude per row is `amax` [N] (no floor: an all-zero block gets sf 0); returns the scales' exponent
        bits [N] (the scale is `(e << 23)` as FP32)."""
        e = gl.minimum(_pow2_ceil_exponent(amax * (1.0 / 448.0)), 254)
        sf_inv = (gl.minimum(gl.maximum(254 - e, 0), 254) << 23).to(gl.float32, bitcast=True)
        q = _e4m3_bits(gl.minimum(gl.maximum(a * sf_inv[None, :], -448.0), 448.0))
        gl.store(out_ptr + out_rows[None, :].to(gl.int64) * inter + offs[:, None], q)
        return e

    @gluon.jit
    def l1_epilogue(acc_g, acc_u, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr, pid_b, pid_n, row0, nrows, inter,
                    total_rows, clamp, HAS_CLAMP: gl.constexpr, N: gl.constexpr, ROWS: gl.constexpr,
                    num_warps: gl.constexpr, TO_A32: gl.constexpr = False, T0: gl.constexpr = 0):
        """L1's sums [BN, N] of the block's N rows from T0 -> the SwiGLU output of its 16 x num_warps channels: with 8
        warps (128 channels, a scale block) cast to e4m3 per (row, 128 channels) into `out` and `outs`; with 4 (or
        TO_A32) in FP32 to `a32`, for `fp8.l1_out_blocks` (or `l1_out_rows`) to cast."""
        BN: gl.constexpr = 16 * num_warps
        MMA: gl.constexpr = mma_layout(num_warps, N)
        a = l1_activation(acc_g, acc_u, sorted_ptr, weight_ptr, row0, nrows, clamp, HAS_CLAMP, N, num_warps, T0)
        out_rows = pid_b * ROWS + T0 + gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
        offs = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
        if TO_A32:  # the block's rows only (`fp8.l1_out_rows` casts no others, and L2's columns past them are dropped)
            ok = (out_rows < pid_b * ROWS + nrows)[None, :]
            gl.store(a32_ptr + out_rows[None, :].to(gl.int64) * inter + offs[:, None], a, mask=ok)
        elif BN < 128:
            gl.store(a32_ptr + out_rows[None, :].to(gl.int64) * inter + offs[:, None], a)
        else:
            e = l1_cast_store(a, gl.max(gl.abs(a), axis=0), out_ptr, out_rows, offs, inter)
            gl.store(outs_ptr + pid_n * total_rows + out_rows, (e << 23).to(gl.float32, bitcast=True))

    @gluon.jit
    def l1_kernel(
        x8_ptr, xs_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr,
        out_ptr, outs_ptr, a32_ptr, hidden, inter, num_topk, num_local, total_rows, stride_we, stride_se, clamp,
        HAS_CLAMP: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
        ROW_SCALED: gl.constexpr = False,
    ):
        """L1 of one block of up to ROWS rows and 16 x num_warps gate (and as many up) channels in FP8, the SwiGLU
        epilogue, and (with 8 warps: 128 channels) the output's e4m3 cast per (row, 128 channels):
        `fp8.fp8_l1_kernel`'s numerics. A block of at most half ROWS rows (an expert's last) runs an MMA half as
        wide. ROW_SCALED: the row-scaled numerics (`fp8` docstring; `fp8.l1_out_rows` casts the FP32 output); 80-row
        blocks (ROW_SCALED only) run a 64-row MMA, and a 16-row one where the block has more rows."""
        pid_b, pid_n, expert, row0, nrows = hp.program_block(block_expert_ptr, block_row_ptr, block_end_ptr,
                                                             inter // (16 * num_warps))
        if expert < num_local:
            w_base = w_ptr + expert.to(gl.int64) * stride_we
            s_base = s_ptr + expert.to(gl.int64) * stride_se
            gl.static_assert(ROWS != 80 or ROW_SCALED, "80-row blocks are the row-scaled kernels' (fp8=6)")
            if ROWS == 80:  # a compile-time branch: 80-row blocks are 64 rows and a tail
                if nrows > 64:
                    _l1_block(x8_ptr, xs_ptr, w_base, s_base, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr,
                              pid_b, pid_n, row0, nrows, hidden, inter, num_topk, total_rows, clamp, HAS_CLAMP, 64,
                              ROWS, STAGES, ROW_SCALED, num_warps, True)
                else:
                    _l1_block(x8_ptr, xs_ptr, w_base, s_base, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr,
                              pid_b, pid_n, row0, nrows, hidden, inter, num_topk, total_rows, clamp, HAS_CLAMP, 64,
                              ROWS, STAGES, ROW_SCALED, num_warps)
            elif ROWS > 32 and nrows <= ROWS // 2:
                _l1_block(x8_ptr, xs_ptr, w_base, s_base, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr,
                          pid_b, pid_n, row0, nrows, hidden, inter, num_topk, total_rows, clamp, HAS_CLAMP, ROWS // 2, ROWS,
                          STAGES, ROW_SCALED, num_warps)
            else:
                _l1_block(x8_ptr, xs_ptr, w_base, s_base, sorted_ptr, weight_ptr, out_ptr, outs_ptr, a32_ptr,
                          pid_b, pid_n, row0, nrows, hidden, inter, num_topk, total_rows, clamp, HAS_CLAMP, ROWS, ROWS,
                          STAGES, ROW_SCALED, num_warps)

    @gluon.jit
    def _l2_block(a8_ptr, as_ptr, w_base, s_base, sorted_ptr, out_ptr, pid_b, pid_n, row0, nrows, hidden,
                  inter, total_rows, stride_out, N: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr,
                  ROW_SCALED: gl.constexpr, num_warps: gl.constexpr, TAIL: gl.constexpr = False):
        """L2 of the block's first N rows (of ROWS; TAIL: and the 16 after them)."""
        BN: gl.constexpr = 16 * num_warps
        G: gl.constexpr = BN // 16
        WL: gl.constexpr = words_layout(num_warps)
        num_g = hidden // 16
        w_off = _word_offsets(pid_n * G, num_g, G, WL)
        a_ptrs = _block_rows(a8_ptr, pid_b * ROWS, inter, N, _x_layout(num_warps))
        if TAIL:
            at_ptrs = _block_rows(a8_ptr, pid_b * ROWS + N, inter, 16, _xt_layout(num_warps))
        else:  # not read
            at_ptrs = a_ptrs
        sx_ptrs = as_ptr + pid_b * ROWS + gl.arange(0, N, layout=sx_layout(num_warps))
        sums = _gemm(a_ptrs, sx_ptrs, total_rows, w_base, s_base, w_off, w_off, pid_n * BN, pid_n * BN,
                     hidden, num_g, inter // 128, BN, N, STAGES, False, ROW_SCALED, num_warps, at_ptrs, TAIL)
        acc = sums[0]
        if ROW_SCALED:
            acc = _row_scaled(acc, _block_scales(as_ptr, pid_b * ROWS, N, num_warps), s_base, pid_n * BN)
        l2_epilogue(acc, sorted_ptr, out_ptr, pid_n, row0, nrows, stride_out, N, num_warps)
        if TAIL:
            tail = _row_scaled(sums[2], _block_scales(as_ptr, pid_b * ROWS + N, 16, num_warps), s_base,
                               pid_n * BN)
            l2_epilogue(tail, sorted_ptr, out_ptr, pid_n, row0, nrows, stride_out, 16, num_warps, N)

    @gluon.jit
    def _block_scales(as_ptr, r0, R: gl.constexpr, num_warps: gl.constexpr):
        """The row scales [R] of L1's output rows r0.. (`fp8.l1_out_rows`, by block row), in the column layout of
        R-wide sums."""
        return gl.load(as_ptr + r0 + gl.arange(0, R, layout=gl.SliceLayout(0, mma_layout(num_warps, R))))

    @gluon.jit
    def _block_rows(a8_ptr, r0, inter, R: gl.constexpr, L: gl.constexpr):
        """Pointers [R, 128] to K block 0 of L1's output rows r0.. in layout L."""
        rows = (r0 + gl.arange(0, R, layout=gl.SliceLayout(1, L))).to(gl.int64)
        return a8_ptr + rows[:, None] * inter + gl.arange(0, 128, layout=gl.SliceLayout(0, L))[None, :]

    @gluon.jit
    def l2_epilogue(acc, sorted_ptr, out_ptr, pid_n, row0, nrows, stride_out, N: gl.constexpr,
                    num_warps: gl.constexpr, T0: gl.constexpr = 0):
        """L2's sums [BN, N] of the block's N rows from T0, rounded to BF16 into their slots' rows."""
        BN: gl.constexpr = 16 * num_warps
        MMA: gl.constexpr = mma_layout(num_warps, N)
        tc = T0 + gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
        okc = tc < nrows
        slot = gl.load(sorted_ptr + row0 + tc, mask=okc, other=0)
        offs = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
        gl.store(out_ptr + slot[None, :].to(gl.int64) * stride_out + offs[:, None], bf16_rne(acc), mask=okc[None, :])

    @gluon.jit
    def l2_kernel(
        a8_ptr, as_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        hidden, inter, num_local, total_rows, stride_we, stride_se, stride_out,
        ROWS: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr, ROW_SCALED: gl.constexpr = False,
    ):
        """L2 of one block of up to ROWS rows and 16 x num_warps hidden columns in FP8; BF16 outputs to their slots.
        A block of at most half ROWS rows runs an MMA half as wide. ROW_SCALED: the row-scaled numerics; 80-row blocks
        (ROW_SCALED only) as `l1_kernel`'s."""
        pid_b, pid_n, expert, row0, nrows = hp.program_block(block_expert_ptr, block_row_ptr, block_end_ptr,
                                                             hidden // (16 * num_warps))
        if expert < num_local:
            w_base = w_ptr + expert.to(gl.int64) * stride_we
            s_base = s_ptr + expert.to(gl.int64) * stride_se
            gl.static_assert(ROWS != 80 or ROW_SCALED, "80-row blocks are the row-scaled kernels' (fp8=6)")
            if ROWS == 80:
                if nrows > 64:
                    _l2_block(a8_ptr, as_ptr, w_base, s_base, sorted_ptr, out_ptr, pid_b, pid_n, row0, nrows,
                              hidden, inter, total_rows, stride_out, 64, ROWS, STAGES, ROW_SCALED, num_warps, True)
                else:
                    _l2_block(a8_ptr, as_ptr, w_base, s_base, sorted_ptr, out_ptr, pid_b, pid_n, row0, nrows,
                              hidden, inter, total_rows, stride_out, 64, ROWS, STAGES, ROW_SCALED, num_warps)
            elif ROWS > 32 and nrows <= ROWS // 2:
                _l2_block(a8_ptr, as_ptr, w_base, s_base, sorted_ptr, out_ptr, pid_b, pid_n, row0, nrows,
                          hidden, inter, total_rows, stride_out, ROWS // 2, ROWS, STAGES, ROW_SCALED, num_warps)
            else:
                _l2_block(a8_ptr, as_ptr, w_base, s_base, sorted_ptr, out_ptr, pid_b, pid_n, row0, nrows,
                          hidden, inter, total_rows, stride_out, ROWS, ROWS, STAGES, ROW_SCALED, num_warps)


def l1_channels(config) -> int:
    """The channels an L1 program covers: 16 x num_warps (fewer than a 128-channel scale block on 4 warps: the
    output then goes out in FP32 for `fp8.l1_out_blocks` to cast)."""
    return 16 * config.num_warps


def l1(x8, xs, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, act_s, *, clamp, num_topk,
       config, a32=None, row_scaled=False):
    """L1 into `act` (e4m3 bytes [R, I], R block rows) and `act_s` (their FP32 scales [I/128, R]), blocks of
    `config.block_t` rows, 16 x `config.num_warps` channels a program; `xs`: the activations' scales in block-row
    order [H/128, R] (`block_row_scales`). With 4 warps the SwiGLU output goes to `a32` (FP32 [R, I]) instead, for
    `fp8.l1_out_blocks` to cast. `row_scaled` (`KernelConfig(fp8=6)`): one scale per row of each operand (`xs`
    one per token [M, 1] as `fp8.x_rows` gives them, `s1` the row-scaled scale words), the output always to `a32`,
    for `fp8.l1_out_rows`."""
    hidden, inter, num_local = x8.shape[1], w1.shape[1] // 2, w1.shape[0]
    bn = l1_channels(config)
    l1_kernel[(block_expert.numel() * (inter // bn),)](
        x8, xs, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, act_s,
        act_s if a32 is None else a32,
        hidden, inter, num_topk, num_local, act.shape[0], w1.stride(0), s1.stride(0), 0.0 if clamp is None else clamp,
        HAS_CLAMP=clamp is not None, ROWS=config.block_t, STAGES=config.num_stages, num_warps=config.num_warps,
        ROW_SCALED=row_scaled, **config.launch_registers(),
    )


def l2(act, act_s, w2, s2, sorted_slots, block_expert, block_row, block_end, out, *, config, row_scaled=False):
    """L2 from `act` (scales `act_s` [I/128, R]; `row_scaled`: [1, R], and `s2` row-scaled) into the slot rows of
    `out` (hidden tiles of `config.l2_n` rows, l2_n / 16 warps)."""
    inter, hidden, num_local = act.shape[1], w2.shape[1], w2.shape[0]
    l2_kernel[(block_expert.numel() * (hidden // config.l2_n),)](
        act, act_s, w2, s2, sorted_slots, block_expert, block_row, block_end, out,
        hidden, inter, num_local, act.shape[0], w2.stride(0), s2.stride(0), out.stride(0),
        ROWS=config.block_t, STAGES=config.num_stages, num_warps=config.l2_n // 16, ROW_SCALED=row_scaled,
        **config.launch_registers("L2"),
    )


def block_row_scales(xs, sorted_slots, block_row, block_end, *, num_topk, block_t):
    """The activations' scales per (token, 128 channels) ``[T, H/128]`` -> ``[H/128, R]`` by block row (rows past a
    block's end take token 0's: finite, never stored): the L1 kernel loads a block's scales of one K block as one
    contiguous row."""
    rows = block_row[:, None] + torch.arange(block_t, device=xs.device)[None, :]
    ok = rows < block_end[:, None]
    slot = sorted_slots[rows.clamp(max=max(sorted_slots.numel() - 1, 0))]
    token = ((slot // num_topk) * ok).reshape(-1)  # not torch.where(.., 0): its scalar is a fill kernel on the device
    return xs[token].t().contiguous()
