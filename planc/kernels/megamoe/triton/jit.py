"""The `@triton.jit` code of the Triton Mega MoE kernels: the FP4 expansion, the numerics (BF16 and e4m3 rounding,
the SwiGLU epilogue), routing, staging, the combine and both GEMMs. Launched by `routing` and `forward`; the
expansion and epilogue are also called from the Gluon kernels (`hopper_prefill`)."""

from __future__ import annotations

from planc.kernels.megamoe.triton.target import tl, triton

if triton is not None:

    # One word (8 weights, `shuffle_fp4`) -> its 4 BF16 pairs times their UE8M0 scales: rotate, mask (the sign to bit
    # 15 and the magnitude bits to 8..6 of each half: the e2m1 value times 2**-126, 0.5 a BF16 subnormal, which BF16
    # arithmetic keeps), then one exact BF16x2 multiply by 2**126 * scale = 2**(s-1) ($5: row half m8 = 0, $6: m8 = 1).
    # 13 instructions per 8 weights.
    _EXPAND_BITS = """
    and.b32 $0, $4, 0x81C081C0;
    shf.l.wrap.b32 r1, $4, $4, 4;
    and.b32 $1, r1, 0x81C081C0;
    shf.l.wrap.b32 r2, $4, $4, 10;
    and.b32 $2, r2, 0x81C081C0;
    shf.l.wrap.b32 r3, $4, $4, 6;
    shf.l.wrap.b32 r4, $4, $4, 14;
    and.b32 r3, r3, 0x00400040;
    and.b32 r4, r4, 0x81808180;
    or.b32 $3, r3, r4;"""
    _EXPAND_SCALE = """
    mul.rn.bf16x2 $0, $0, $5;
    mul.rn.bf16x2 $1, $1, $5;
    mul.rn.bf16x2 $2, $2, $6;
    mul.rn.bf16x2 $3, $3, $6;
    }"""
    _EXPAND_PTX: tl.constexpr = tl.constexpr("""{
    .reg .b32 r1, r2, r3, r4;""" + _EXPAND_BITS + _EXPAND_SCALE)
    # The same with the 2**126 as its own multiply, for scale bytes above 128 (2**(s-1) would overflow BF16).
    _EXPAND_PTX_LARGE: tl.constexpr = tl.constexpr("""{
    .reg .b32 r1, r2, r3, r4, c;
    mov.b32 c, 0x7E807E80;""" + _EXPAND_BITS + """
    mul.rn.bf16x2 $0, $0, c;
    mul.rn.bf16x2 $1, $1, c;
    mul.rn.bf16x2 $2, $2, c;
    mul.rn.bf16x2 $3, $3, c;""" + _EXPAND_SCALE)

    @triton.jit
    def _rotl(w, k: tl.constexpr):
        return (w << k) | ((w >> (32 - k)) & ((1 << k) - 1))

    @triton.jit
    def bf16_halves(o):
        """int32 BF16 pairs -> [..., 2] BF16 (low half first)."""
        lo = (o & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = ((o >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.join(lo, hi)

    @triton.jit
    def _f32_halves(o, sf):
        """Interpreter: int32 pairs of e2m1 x 2**-126 BF16 bits -> [..., 2] FP32 values times 2**126 * sf (exact)."""
        lo = ((o & 0xFFFF) << 16).to(tl.float32, bitcast=True) * 8.507059173023462e37 * sf
        hi = (o & -65536).to(tl.float32, bitcast=True) * 8.507059173023462e37 * sf
        return tl.join(lo, hi)

    @triton.jit
    def scale_factors(sw, LARGE: tl.constexpr):
        """Scale words (4 UE8M0 bytes: row half m8, K half jh at byte 2 m8 + jh) -> the BF16x2 factors that
        `_EXPAND_PTX` multiplies by, per byte: 2**(s-1) = 2**126 * 2**(s-127), exact for s <= 128; with LARGE,
        2**(s-127) (`_EXPAND_PTX_LARGE` multiplies by 2**126 first)."""
        bias: tl.constexpr = 0 if LARGE else 0x3F003F00
        return ((sw & 0xFF) * 0x00800080 + bias, ((sw >> 8) & 0xFF) * 0x00800080 + bias,
                ((sw >> 16) & 0xFF) * 0x00800080 + bias, ((sw >> 24) & 0xFF) * 0x00800080 + bias)

    @triton.jit
    def expand_words(w, p0, p1, LARGE: tl.constexpr):
        """Words -> 4 int32 BF16 pairs each (`_EXPAND_PTX`); p0 / p1: the factors of row halves m8 = 0 / 1."""
        if LARGE:
            return tl.inline_asm_elementwise(
                _EXPAND_PTX_LARGE, "=r,=r,=r,=r,r,r,r", [w, p0, p1], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True, pack=1)
        return tl.inline_asm_elementwise(
            _EXPAND_PTX, "=r,=r,=r,=r,r,r,r", [w, p0, p1], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1)

    @triton.jit
    def _per_j(lo, hi):
        """[KC, G, 32] values for K halves jh = 0, 1 -> [KC, G, 32, 4] by j = 2 jh + jl."""
        p = tl.join(lo, hi)
        p = tl.broadcast_to(p[:, :, :, :, None], (p.shape[0], p.shape[1], p.shape[2], 2, 2))
        return tl.reshape(p, (p.shape[0], p.shape[1], p.shape[2], 4))

    @triton.jit
    def _fp4_offsets(g0, num_g, BN: tl.constexpr, BK: tl.constexpr):
        """int32 offsets (in words, and in scale words) of the [BN, BK] tile of rows 16*g0.. at K 0 in the
        `shuffle_fp4` layout (`num_g` = N / 16 row groups); the tile at K 64*kc starts kc * num_g * 128 words (kc *
        num_g * 8 scale words) further. Every thread reads 16 contiguous bytes per 64 K of one 16-row group: its own
        MMA operand registers. Computed once per program: the K loop only moves a scalar base. The words are
        addressed as 128 contiguous words per group and reshaped after the load (`_fp4_load`): Triton then loads them
        in the MMA operand's own layout (a 16-row group per warp, 4 words per lane), which the register-prefetch loop
        carries from one iteration to the next; with [KC, G, 32, 4] offsets Triton 3.5 and 3.6 loaded them in another
        layout and moved every expanded tile through shared memory."""
        G: tl.constexpr = BN // 16
        KC: tl.constexpr = BK // 64
        blk = tl.arange(0, KC)[:, None] * num_g + g0 + tl.arange(0, G)[None, :]  # [KC, G]
        lane = tl.arange(0, 32)  # 4 r + q
        w_off = blk[:, :, None] * 128 + tl.arange(0, 128)[None, None, :]
        s_off = blk[:, :, None] * 8 + (lane // 4)[None, None, :]
        return w_off, s_off  # [KC, G, 128] words (32 lanes x 4), [KC, G, 32] scale words

    @triton.jit
    def _fp4_tile(w_base, s_base, w_off, s_off, kc, num_g, BN: tl.constexpr, BK: tl.constexpr, LARGE: tl.constexpr,
                  INTERPRET: tl.constexpr):
        """The [BN, BK] weight tile at K 64*kc (`_fp4_offsets`) as BF16 (FP32 under the interpreter, whose dot
        multiplies BF16 operands as integers), each weight times its UE8M0 scale, exact: expanded in the registers
        its words were loaded into."""
        w, sw = _fp4_load(w_base, s_base, w_off, s_off, kc, num_g)
        return _fp4_expand(w, sw, BN, BK, LARGE, INTERPRET)

    @triton.jit
    def _fp4_load(w_base, s_base, w_off, s_off, kc, num_g):
        """The words ``[KC, G, 32, 4]`` and scale words ``[KC, G, 32]`` of the tile at K 64*kc (`_fp4_offsets`)."""
        step = kc * num_g  # int32: offsets within one expert stay below 2**31 (`stride_we` words)
        w = tl.load(w_base + step * 128 + w_off)
        return tl.reshape(w, (w.shape[0], w.shape[1], 32, 4)), tl.load(s_base + step * 8 + s_off)

    @triton.jit
    def _fp4_expand(w, sw, BN: tl.constexpr, BK: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr):
        """`_fp4_load`'s words and scale words -> the [BN, BK] BF16 tile (see `_fp4_tile`)."""
        G: tl.constexpr = BN // 16
        KC: tl.constexpr = BK // 64
        if INTERPRET:
            m: tl.constexpr = -2118090304  # 0x81C081C0
            o0 = w & m
            o1 = _rotl(w, 4) & m
            o2 = _rotl(w, 10) & m
            o3 = (_rotl(w, 6) & 0x00400040) | (_rotl(w, 14) & -2122284672)  # 0x81808180
            f0 = _per_j(((sw & 0xFF) << 23).to(tl.float32, bitcast=True),
                        (((sw >> 8) & 0xFF) << 23).to(tl.float32, bitcast=True))  # 2**(s-127), m8 = 0
            f1 = _per_j((((sw >> 16) & 0xFF) << 23).to(tl.float32, bitcast=True),
                        (((sw >> 24) & 0xFF) << 23).to(tl.float32, bitcast=True))
            a0 = _f32_halves(o0, f0)
            a1 = _f32_halves(o1, f0)
            a2 = _f32_halves(o2, f1)
            a3 = _f32_halves(o3, f1)
        else:
            s00, s01, s10, s11 = scale_factors(sw, LARGE)
            o0, o1, o2, o3 = expand_words(w, _per_j(s00, s01), _per_j(s10, s11), LARGE)
            a0 = bf16_halves(o0)
            a1 = bf16_halves(o1)
            a2 = bf16_halves(o2)
            a3 = bf16_halves(o3)
        c = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [KC, G, 32, j, k1, k8, m8]
        c = tl.reshape(c, (KC, G, 8, 4, 4, 2, 2, 2))  # [KC, G, r, q, j, k1, k8, m8]
        c = tl.permute(c, (1, 7, 2, 0, 4, 6, 3, 5))  # [g, m8, r, kc, j, k8, q, k1]: rows, then K in order
        return tl.reshape(c, (BN, BK))

    @triton.jit
    def _local_ids(idx_ptr, i, num_slots, first, num_local):
        """Slots i -> their local expert, `num_local` for -1, other ranks' experts and padding (i >= num_slots)."""
        e = tl.load(idx_ptr + i, mask=i < num_slots, other=-1).to(tl.int32)
        local = (e >= first) & (e < first + num_local) & (i < num_slots)
        return tl.where(local, e - first, num_local)

    @triton.jit
    def route_kernel(idx_ptr, sorted_ptr, blocks_ptr, scratch_ptr, num_slots, first, num_local, num_blocks,
                      BS: tl.constexpr, BE: tl.constexpr, BB: tl.constexpr, BT: tl.constexpr, LOG_BE: tl.constexpr):
        """`routing.route` in one program: a stable sort by (local expert, slot) of unique keys, the per-expert counts
        (a histogram; other ranks' experts, -1 and padding fall in bin `num_local`), their prefix sums, and the
        blocks (`_route_blocks`)."""
        i = tl.arange(0, BS)
        lid = _local_ids(idx_ptr, i, num_slots, first, num_local)
        key = tl.sort(lid * BS + i)
        tl.store(sorted_ptr + i, key % BS, mask=i < num_slots)
        _route_blocks(tl.histogram(lid, BE), blocks_ptr, scratch_ptr, num_local, num_blocks, BE, BB, BT, LOG_BE)

    @triton.jit
    def _route_blocks(counts, blocks_ptr, scratch_ptr, num_local, num_blocks, BE: tl.constexpr, BB: tl.constexpr,
                      BT: tl.constexpr, LOG_BE: tl.constexpr):
        """The block arrays of `routing.route` from the per-bin counts [BE] (bins past the local experts ignored): per
        block a binary search of the block-count prefix sums (kept in `scratch`) for its expert."""
        ex = tl.arange(0, BE)
        counts = tl.where(ex < num_local, counts, 0)
        starts = tl.cumsum(counts, 0) - counts
        nblk = (counts + BT - 1) // BT
        bend_cum = tl.cumsum(nblk, 0)
        tl.store(scratch_ptr + ex, bend_cum)
        tl.store(scratch_ptr + BE + ex, starts)
        tl.store(scratch_ptr + 2 * BE + ex, counts)
        tl.debug_barrier()

        b = tl.arange(0, BB)
        lo = tl.zeros((BB,), dtype=tl.int32)
        hi = tl.zeros((BB,), dtype=tl.int32) + num_local
        for _ in tl.static_range(LOG_BE + 1):  # first expert whose cumulative block count exceeds b
            mid = (lo + hi) // 2
            v = tl.load(scratch_ptr + tl.minimum(mid, BE - 1))
            go_right = (v <= b) & (lo < hi)
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(go_right | (lo >= hi), hi, mid)
        expert = lo
        ec = tl.minimum(expert, num_local - 1)
        cum = tl.load(scratch_ptr + ec)
        st = tl.load(scratch_ptr + BE + ec)
        cnt = tl.load(scratch_ptr + 2 * BE + ec)
        first_block = cum - (cnt + BT - 1) // BT
        ok = b < num_blocks
        tl.store(blocks_ptr + b, tl.where(expert < num_local, expert, num_local), mask=ok)
        tl.store(blocks_ptr + num_blocks + b, st + (b - first_block) * BT, mask=ok)
        tl.store(blocks_ptr + 2 * num_blocks + b, st + cnt, mask=ok)

    @triton.jit
    def route_count_kernel(idx_ptr, counts_ptr, num_slots, first, num_local, CH: tl.constexpr, BE: tl.constexpr):
        """`routing.route_chunked`, step 1 of 3: chunk c's per-bin counts (`route_kernel`'s bins) into row c of
        `counts` [chunks, BE]."""
        c = tl.program_id(0)
        lid = _local_ids(idx_ptr, c * CH + tl.arange(0, CH), num_slots, first, num_local)
        tl.store(counts_ptr + c * BE + tl.arange(0, BE), tl.histogram(lid, BE))

    @triton.jit
    def route_offsets_kernel(counts_ptr, delta_ptr, blocks_ptr, scratch_ptr, num_chunks, num_local, num_blocks,
                             BE: tl.constexpr, BB: tl.constexpr, BT: tl.constexpr, LOG_BE: tl.constexpr):
        """Step 2, one program: where each chunk's slots of each bin go. A bin's slots are sorted bin by bin, chunk by
        chunk within a bin, so chunk c's run of bin b starts at (the slots of bins < b) + (bin b's slots in chunks <
        c); `delta` [chunks, BE] holds that minus the run's start in the chunk's own sorted order (what step 3 adds
        to a sorted position). Then the blocks from the bins' totals (`_route_blocks`)."""
        ex = tl.arange(0, BE)
        total = tl.zeros((BE,), dtype=tl.int32)
        for c in range(num_chunks):
            total += tl.load(counts_ptr + c * BE + ex)
        run = tl.cumsum(total, 0) - total  # bin b's first sorted position, then past each chunk's run
        for c in range(num_chunks):
            cnt = tl.load(counts_ptr + c * BE + ex)
            tl.store(delta_ptr + c * BE + ex, run - (tl.cumsum(cnt, 0) - cnt))
            run += cnt
        _route_blocks(total, blocks_ptr, scratch_ptr, num_local, num_blocks, BE, BB, BT, LOG_BE)

    @triton.jit
    def route_scatter_kernel(idx_ptr, delta_ptr, sorted_ptr, num_slots, first, num_local, CH: tl.constexpr,
                             BE: tl.constexpr):
        """Step 3: chunk c's slots sorted by (bin, slot) in the chunk (`route_kernel`'s keys), each stored at its
        position in the chunk's order plus its bin's `delta` (padding sorts last: past `num_slots`, not stored)."""
        c = tl.program_id(0)
        j = tl.arange(0, CH)
        lid = _local_ids(idx_ptr, c * CH + j, num_slots, first, num_local)
        key = tl.sort(lid * CH + j)
        pos = j + tl.load(delta_ptr + c * BE + key // CH)
        tl.store(sorted_ptr + pos, c * CH + key % CH, mask=pos < num_slots)

    @triton.jit
    def combine_kernel(slots_ptr, out_ptr, hidden, stride_t, stride_k,
                        NUM_TOPK: tl.constexpr, BH: tl.constexpr):
        """`reference.combine` in one kernel: ``bf16(0 + fp32(o_0) + fp32(o_1) + ...)`` in slot order."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BH + tl.arange(0, BH)
        ok = offs < hidden
        acc = tl.zeros((BH,), dtype=tl.float32)
        for j in tl.static_range(NUM_TOPK):
            acc = acc + tl.load(slots_ptr + t * stride_t + j * stride_k + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * hidden + offs, bf16_rne(acc), mask=ok)

    @triton.jit
    def bf16_rne(x):
        """FP32 -> BF16 with round-to-nearest-even, from bits (the GPU's cast; the interpreter's truncates)."""
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _round_e4m3(v):
        """Round-to-nearest-even onto the e4m3 grid (|v| <= 448 already), bit for bit as the hardware cast."""
        mag = tl.abs(v)
        bits = mag.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        sub = (mag + 16384.0) - 16384.0  # multiples of 2**-9 below 2**-6, RNE by the FP32 add
        r = tl.where(mag < 0.015625, sub, normal)
        return tl.where(v < 0, -r, r)

    @triton.jit
    def _e4m3_bits(v):
        """FP32 (|v| <= 448) -> its e4m3 byte, RNE as the hardware cast (the sign from v: -0.0 -> 0x80, as torch)."""
        mag = tl.abs(_round_e4m3(v))
        mbits = mag.to(tl.int32, bitcast=True)
        normal = (((mbits >> 23) - 120) << 3) | ((mbits >> 20) & 7)
        sub = (mag * 512.0).to(tl.int32)  # multiples of 2**-9 below 2**-6
        return (tl.where(mag < 0.015625, sub, normal) | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)

    @triton.jit
    def _pow2_ceil_exponent(x):
        """The biased FP32 exponent of the smallest power of two >= x (x >= 0, FP32): the UE8M0 byte of a scale
        rounded up, as `quant.quantize_fp8` and `quant.requantize_fp8_like_kernel` round it (callers clamp it)."""
        bits = x.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def stage_kernel(x_ptr, idx_ptr, w_ptr, q_ptr, sf_ptr, idx_out_ptr, w_out_ptr, n, hidden, stride_x,
                      NUM_TOPK: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr):
        """`reference.stage` for one buffer row and BH channels: `quant.quantize_fp8` (amax floored at 1e-4, scale
        rounded up to a power of two, RNE to e4m3) into the FP8 bytes and UE8M0 bytes, and (first program of the
        row) its routing; rows past `n` are padding: zero bytes, slots -1, weights 0."""
        row = tl.program_id(0)
        valid = row < n
        col = tl.program_id(1) * BH + tl.arange(0, BH)
        ok = col < hidden
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + col, mask=col < tl.where(valid, hidden, 0),
                    other=0.0).to(tl.float32)
        g = tl.reshape(x, (BH // 32, 32))
        amax = tl.maximum(tl.max(tl.abs(g), axis=1), 1e-4)
        e = tl.minimum(tl.maximum(_pow2_ceil_exponent(tl.div_rn(amax, 448.0)), 1), 254)
        sf_inv = tl.div_rn(1.0, (e << 23).to(tl.float32, bitcast=True))  # exact: a power of two
        q = tl.reshape(_e4m3_bits(g * sf_inv[:, None]), (BH,))
        tl.store(q_ptr + row.to(tl.int64) * hidden + col, tl.where(valid, q, 0), mask=ok)
        grp = tl.program_id(1) * (BH // 32) + tl.arange(0, BH // 32)
        tl.store(sf_ptr + row.to(tl.int64) * (hidden // 32) + grp, tl.where(valid, e, 0).to(tl.uint8),
                 mask=grp < hidden // 32)
        if tl.program_id(1) == 0:
            j = tl.arange(0, BK)
            jk = j < NUM_TOPK
            mine = j < tl.where(valid, NUM_TOPK, 0)
            idx = tl.load(idx_ptr + row * NUM_TOPK + j, mask=mine, other=-1)
            w = tl.load(w_ptr + row * NUM_TOPK + j, mask=mine, other=0.0)
            tl.store(idx_out_ptr + row * NUM_TOPK + j, idx, mask=jk)
            tl.store(w_out_ptr + row * NUM_TOPK + j, w, mask=jk)

    @triton.jit
    def dequant_x_kernel(q_ptr, sf_ptr, out_ptr, hidden, idx_ptr, slots_ptr, first, num_local, stride_slots,
                         BH: tl.constexpr, NUM_TOPK: tl.constexpr, BK: tl.constexpr, ZERO: tl.constexpr):
        """FP8 bytes times their UE8M0 scales -> BF16 (exact: an e4m3 value times a power of two), for one row and
        BH channels: what L1 reads; ZERO: also zeros in those channels of the row's slots on no local expert
        (`zero_other_slots`)."""
        row = tl.program_id(0).to(tl.int64)
        dequant_x_chunk(q_ptr, sf_ptr, out_ptr, row, tl.program_id(1), hidden, BH)
        if ZERO:
            zero_other_slots(idx_ptr, slots_ptr, row, tl.program_id(1), first, num_local, hidden, stride_slots,
                             NUM_TOPK, BK, BH)

    @triton.jit
    def zero_other_slots(idx_ptr, slots_ptr, row, chunk, first, num_local, hidden, stride_slots,
                         NUM_TOPK: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr):
        """Zeros in channels [chunk * BH, +BH) of token `row`'s slot outputs (``[M*K, H]`` BF16) whose expert is not
        local (-1 and other ranks' experts: the combine adds every slot). L2 writes each local slot whole, so with
        this the slot output needs no fill of its own (a memset of the whole ``[M*K, H]``: ~0.1 ms at 4096 V4
        tokens)."""
        j = tl.arange(0, BK)
        e = tl.load(idx_ptr + row * NUM_TOPK + j, mask=j < NUM_TOPK, other=first)
        other = (j < NUM_TOPK) & ((e < first) | (e >= first + num_local))
        col = chunk * BH + tl.arange(0, BH)
        ptrs = slots_ptr + (row * NUM_TOPK + j)[:, None] * stride_slots + col[None, :]
        tl.store(ptrs, tl.zeros((BK, BH), dtype=tl.bfloat16), mask=other[:, None] & (col < hidden)[None, :])

    @triton.jit
    def dequant_x_chunk(q_ptr, sf_ptr, out_ptr, row, chunk, hidden, BH: tl.constexpr):
        """`dequant_x_kernel`'s arithmetic for channels [chunk * BH, +BH) of `row` (int64)."""
        col = chunk * BH + tl.arange(0, BH)
        ok = col < hidden
        b = tl.load(q_ptr + row * hidden + col, mask=ok, other=0).to(tl.int32)
        s = tl.load(sf_ptr + row * (hidden // 32) + col // 32, mask=ok, other=0).to(tl.int32)
        v = e4m3_value(b)
        tl.store(out_ptr + row * hidden + col, bf16_rne(v * (s << 23).to(tl.float32, bitcast=True)), mask=ok)

    @triton.jit
    def e4m3_value(b):
        """e4m3 bytes (int32 0..255) -> their FP32 values (exact)."""
        e = (b >> 3) & 15
        normal = (((b & 0x80) << 24) | ((e + 120) << 23) | ((b & 7) << 20)).to(tl.float32, bitcast=True)
        sub = (b & 7).to(tl.float32) * 0.001953125
        return tl.where(e == 0, tl.where((b & 0x80) != 0, -sub, sub), normal)

    @triton.jit
    def swiglu(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP: tl.constexpr):
        """FP32 gate/up sums ``[BN, BT]`` -> round to BF16 once, clamp, ``silu(gate) * up * topw`` in FP32 (rows
        past the block's end: 0)."""
        gate = bf16_rne(acc_g).to(tl.float32)
        up = bf16_rne(acc_u).to(tl.float32)
        if HAS_CLAMP:  # `clamp` is already a BF16 value: clamping the BF16 numbers in FP32 is exact
            gate = tl.minimum(gate, clamp)
            up = tl.minimum(tl.maximum(up, -clamp), clamp)
        silu = tl.div_rn(gate, 1.0 + tl.exp(-gate))
        a = silu * up * topw[None, :]
        return tl.where(row_ok[None, :], a, 0.0)

    @triton.jit
    def swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP: tl.constexpr, BN: tl.constexpr,
                        BT: tl.constexpr):
        """L1's epilogue on FP32 gate/up sums ``[BN, BT]``: `swiglu`, then the kernel's FP8 requantization per 32
        channels (`quant.requantize_fp8_like_kernel`), as the exact BF16 values of the FP8 numbers."""
        a = swiglu(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP)

        a3 = tl.reshape(a, (BN // 32, 32, BT))
        amax = tl.max(tl.abs(a3), axis=1)  # [BN/32, BT]
        e = _pow2_ceil_exponent(amax * (1.0 / 448.0))  # biased: the scale is 2**(e - 127)
        sf = (e << 23).to(tl.float32, bitcast=True)
        sf_inv = (tl.minimum(tl.maximum(254 - e, 0), 254) << 23).to(tl.float32, bitcast=True)
        q = a3 * sf_inv[:, None, :]
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        q = _round_e4m3(q) * sf[:, None, :]
        return tl.reshape(q, (BN, BT)).to(tl.bfloat16)  # exact: an e4m3 value times a power of two

    @triton.jit
    def last_to_arrive(cnt_ptr, contributors):
        """Count this program's arrival at its output tile (after its partial sums are stored) and say whether it is
        the last of the tile's `contributors` (the split, or the stream-K schedule's count for the tile): then every
        other contributor's partials are visible to it (release by each, acquire by the last) and it puts the
        counter back to 0 for the next launch. The split-K decode kernels' protocol, Triton's and Gluon's
        (`decode`, `hopper_decode`)."""
        tl.debug_barrier()  # every thread's partial-sum stores come before the release below
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        last = arrived == contributors - 1
        if last:
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
        return last

    @triton.jit
    def tile_ids(num_n):
        """(block, N tile, number of blocks) of this program in a 1-D grid whose N tiles of one block are neighbours:
        the programs running at once then read a few experts' weights in whole K slabs and share their rows (V4 at
        4096 tokens: 11.8 against 12.8 ms with blocks as neighbours; decode batches within run-to-run spread)."""
        pid = tl.program_id(0)
        return pid // num_n, pid % num_n, tl.num_programs(0) // num_n

    @triton.jit
    def _block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT: tl.constexpr):
        """The BT sorted rows of block `pid_b` (`routing.route`): which are real, and the (token, slot) index of
        each."""
        rows = tl.load(block_row_ptr + pid_b) + tl.arange(0, BT)
        row_ok = rows < tl.load(block_end_ptr + pid_b)
        return row_ok, tl.load(sorted_ptr + rows, mask=row_ok, other=0)

    @triton.jit
    def l1_swiglu_kernel(
        x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr, ws_ptr,
        hidden, inter, num_topk, num_local,
        stride_x, stride_we, stride_se, stride_out,
        clamp,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LARGE: tl.constexpr,
        INTERPRET: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    ):
        """L1 of one block of rows and BN gate (and as many up) columns, over the hidden slice `program_id(1)` of
        SPLIT: with SPLIT 1 it ends with the SwiGLU epilogue, else it writes its FP32 sums to `ws` for
        `l1_reduce_kernel` (split-K: more programs streaming weights when a batch has few blocks)."""
        pid_b, pid_n, num_blocks = tile_ids(inter // BN)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert >= num_local:
            return
        row_ok, slot = _block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT)
        token = slot // num_topk

        offs_n = pid_n * BN + tl.arange(0, BN)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        num_g = inter // 8  # 2I rows in groups of 16
        wg_off, sg_off = _fp4_offsets(pid_n * (BN // 16), num_g, BN, BK)  # gate rows
        wu_off, su_off = _fp4_offsets(pid_n * (BN // 16) + inter // 16, num_g, BN, BK)  # up rows
        x_ptrs = x_ptr + token[None, :].to(tl.int64) * stride_x + tl.arange(0, BK)[:, None]  # [BK, BT]

        acc_g = tl.zeros((BN, BT), dtype=tl.float32)
        acc_u = tl.zeros((BN, BT), dtype=tl.float32)
        k_tiles = hidden // (SPLIT * BK)
        k_first = tl.program_id(1) * k_tiles * BK
        if PREFETCH:  # `REGISTER_PREFETCH`: the next K tile's bytes load into registers while this one computes
            gw, gs = _fp4_load(w_base, s_base, wg_off, sg_off, k_first // 64, num_g)
            uw, us = _fp4_load(w_base, s_base, wu_off, su_off, k_first // 64, num_g)
            x_next = tl.load(x_ptrs + k_first, mask=row_ok[None, :], other=0.0)
            for i in tl.range(0, k_tiles, num_stages=1):
                x, gw0, gs0, uw0, us0 = x_next, gw, gs, uw, us
                k_next = k_first + tl.minimum(i + 1, k_tiles - 1) * BK  # the last iteration reloads its own tile
                gw, gs = _fp4_load(w_base, s_base, wg_off, sg_off, k_next // 64, num_g)
                uw, us = _fp4_load(w_base, s_base, wu_off, su_off, k_next // 64, num_g)
                x_next = tl.load(x_ptrs + k_next, mask=row_ok[None, :], other=0.0)
                if INTERPRET:
                    x = x.to(tl.float32)
                acc_g = tl.dot(_fp4_expand(gw0, gs0, BN, BK, LARGE, INTERPRET), x, acc_g)
                acc_u = tl.dot(_fp4_expand(uw0, us0, BN, BK, LARGE, INTERPRET), x, acc_u)
        else:  # Triton's software pipeline: cp.async into NUM_STAGES shared-memory buffers
            for k0 in tl.range(k_first, k_first + k_tiles * BK, BK, num_stages=NUM_STAGES):
                x = tl.load(x_ptrs + k0, mask=row_ok[None, :], other=0.0)
                if INTERPRET:
                    x = x.to(tl.float32)
                kc = k0 // 64
                acc_g = tl.dot(_fp4_tile(w_base, s_base, wg_off, sg_off, kc, num_g, BN, BK, LARGE, INTERPRET), x,
                               acc_g)
                acc_u = tl.dot(_fp4_tile(w_base, s_base, wu_off, su_off, kc, num_g, BN, BK, LARGE, INTERPRET), x,
                               acc_u)

        out_rows = pid_b * BT + tl.arange(0, BT)
        if SPLIT == 1:
            topw = tl.load(weight_ptr + slot, mask=row_ok, other=0.0)
            q = swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP, BN, BT)
            tl.store(out_ptr + out_rows[None, :].to(tl.int64) * stride_out + offs_n[:, None], q)
        else:
            ws = (ws_ptr + tl.program_id(1).to(tl.int64) * num_blocks * BT * 2 * inter
                  + out_rows[None, :].to(tl.int64) * (2 * inter) + offs_n[:, None])
            tl.store(ws, acc_g, mask=row_ok[None, :])
            tl.store(ws + inter, acc_u, mask=row_ok[None, :])

    @triton.jit
    def l1_reduce_kernel(
        ws_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        inter, num_local, stride_out, clamp,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Split-K L1's second half: the SPLIT partial sums of one block and BN columns, added in split order, then
        the SwiGLU epilogue (`swiglu_requant`)."""
        pid_b, pid_n, num_blocks = tile_ids(inter // BN)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert >= num_local:
            return
        row_ok, slot = _block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT)
        offs_n = pid_n * BN + tl.arange(0, BN)
        out_rows = pid_b * BT + tl.arange(0, BT)
        ws = ws_ptr + out_rows[None, :].to(tl.int64) * (2 * inter) + offs_n[:, None]
        split_stride = num_blocks.to(tl.int64) * BT * 2 * inter
        acc_g = tl.zeros((BN, BT), dtype=tl.float32)
        acc_u = tl.zeros((BN, BT), dtype=tl.float32)
        for i in tl.static_range(SPLIT):
            acc_g += tl.load(ws + i * split_stride, mask=row_ok[None, :], other=0.0)
            acc_u += tl.load(ws + i * split_stride + inter, mask=row_ok[None, :], other=0.0)
        topw = tl.load(weight_ptr + slot, mask=row_ok, other=0.0)
        q = swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP, BN, BT)
        tl.store(out_ptr + out_rows[None, :].to(tl.int64) * stride_out + offs_n[:, None], q)

    @triton.jit
    def l2_kernel(
        a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        hidden, inter, num_local,
        stride_a, stride_we, stride_se, stride_out,
        BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr,
        NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    ):
        pid_b, pid_n, _ = tile_ids(hidden // BN)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert >= num_local:
            return
        row_ok, slot = _block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT)

        offs_n = pid_n * BN + tl.arange(0, BN)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        a_rows = pid_b * BT + tl.arange(0, BT)
        a_ptrs = a_ptr + a_rows[None, :].to(tl.int64) * stride_a + tl.arange(0, BK)[:, None]  # [BK, BT]

        acc = tl.zeros((BN, BT), dtype=tl.float32)
        num_g = hidden // 16
        w_off, s_off = _fp4_offsets(pid_n * (BN // 16), num_g, BN, BK)
        if PREFETCH:  # as in L1
            k_tiles = inter // BK
            w, sw = _fp4_load(w_base, s_base, w_off, s_off, 0, num_g)
            x_next = tl.load(a_ptrs)
            for i in tl.range(0, k_tiles, num_stages=1):
                x, w0, sw0 = x_next, w, sw
                k_next = tl.minimum(i + 1, k_tiles - 1) * BK
                w, sw = _fp4_load(w_base, s_base, w_off, s_off, k_next // 64, num_g)
                x_next = tl.load(a_ptrs + k_next)
                if INTERPRET:
                    x = x.to(tl.float32)
                acc = tl.dot(_fp4_expand(w0, sw0, BN, BK, LARGE, INTERPRET), x, acc)
        else:
            for k0 in tl.range(0, inter, BK, num_stages=NUM_STAGES):
                x = tl.load(a_ptrs + k0)
                if INTERPRET:
                    x = x.to(tl.float32)
                acc = tl.dot(_fp4_tile(w_base, s_base, w_off, s_off, k0 // 64, num_g, BN, BK, LARGE, INTERPRET), x,
                             acc)

        out_ptrs = out_ptr + slot[None, :].to(tl.int64) * stride_out + offs_n[:, None]
        tl.store(out_ptrs, bf16_rne(acc), mask=row_ok[None, :])  # L2 rounded to BF16
