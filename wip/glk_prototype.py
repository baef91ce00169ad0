"""Prototype: Gluon L2 with async register-A wgmma."""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait, fence_async_shared
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from planc.runtime.megamoe import triton_backend as tb

_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared  # renamed in Triton 3.9
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # renamed in Triton 3.7
EXPAND: gl.constexpr = gl.constexpr(tb._EXPAND_PTX.value)


@triton.constexpr_function
def _words_layout(num_warps):
    return gl.BlockedLayout([1, 1, 4], [1, 32, 1], [num_warps, 1, 1], [2, 1, 0])


@gluon.jit
def _fp4_offsets(g0, num_g, G: gl.constexpr, WL: gl.constexpr):
    g = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
    blk = g0 + g
    w_off = (blk[:, None, None] * 32 + lane[None, :, None]) * 4 + j[None, None, :]
    s_off = blk[:, None] * 8 + (lane // 4)[None, :]
    return w_off, s_off


@gluon.jit
def _bf16_halves(o):
    lo = (o & 0xFFFF).to(gl.uint16).to(gl.bfloat16, bitcast=True)
    hi = ((o >> 16) & 0xFFFF).to(gl.uint16).to(gl.bfloat16, bitcast=True)
    return gl.join(lo, hi)


@gluon.jit
def _per_j(lo, hi):
    p = gl.join(lo, hi)  # [G, 32, 2]
    p = gl.join(p, p)  # [G, 32, jh, jl]
    return gl.reshape(p, (p.shape[0], p.shape[1], 4))


@gluon.jit
def _expand(w, sw, BN: gl.constexpr, AL: gl.constexpr):
    G: gl.constexpr = BN // 16
    p0 = _per_j((sw & 0xFF) * 0x00800080 + 0x3F003F00, ((sw >> 8) & 0xFF) * 0x00800080 + 0x3F003F00)
    p1 = _per_j(((sw >> 16) & 0xFF) * 0x00800080 + 0x3F003F00, ((sw >> 24) & 0xFF) * 0x00800080 + 0x3F003F00)
    p0 = gl.convert_layout(p0, w.type.layout, assert_trivial=True)
    p1 = gl.convert_layout(p1, w.type.layout, assert_trivial=True)
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        EXPAND, "=r,=r,=r,=r,r,r,r", [w, p0, p1], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True, pack=1)
    c = gl.join(gl.join(_bf16_halves(o0), _bf16_halves(o1)), gl.join(_bf16_halves(o2), _bf16_halves(o3)))
    c = gl.reshape(c, (G, 8, 4, 4, 2, 2, 2))  # g r q j k1 k8 m8
    c = gl.permute(c, (0, 6, 1, 3, 5, 2, 4))  # g m8 r j k8 q k1
    return gl.convert_layout(gl.reshape(c, (BN, 64)), AL, assert_trivial=True)


@gluon.jit
def _l2_kernel(
    a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
    hidden, inter, num_local,
    stride_a, stride_we, stride_se, stride_out,
    BT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    FENCE: gl.constexpr = True, LATE: gl.constexpr = False,
):
    BK: gl.constexpr = 64
    G: gl.constexpr = BN // 16
    WL: gl.constexpr = _words_layout(num_warps)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    num_n = hidden // BN
    pid = gl.program_id(0)
    pid_b = pid // num_n
    pid_n = pid % num_n
    expert = gl.load(block_expert_ptr + pid_b)
    if expert >= num_local:
        return
    w_base = w_ptr + expert.to(gl.int64) * stride_we
    s_base = s_ptr + expert.to(gl.int64) * stride_se
    num_g = hidden // 16
    w_off, s_off = _fp4_offsets(pid_n * G, num_g, G, WL)
    rows = pid_b * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
    x_ptrs = a_ptr + rows[:, None].to(gl.int64) * stride_a + gl.arange(0, BK, layout=gl.SliceLayout(0, XL))[None, :]

    xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK], XS)
    k_tiles = inter // BK
    for s in gl.static_range(STAGES - 2):
        _async_load(xs.index(s), x_ptrs + gl.minimum(s, k_tiles - 1) * BK)
        cp.commit_group()
    step = num_g * 128
    w = gl.load(w_base + w_off)
    sw = gl.load(s_base + s_off)
    w1 = gl.load(w_base + gl.minimum(1, k_tiles - 1) * step + w_off)
    sw1 = gl.load(s_base + gl.minimum(1, k_tiles - 1) * (num_g * 8) + s_off)
    acc = gl.zeros([BN, BT], gl.float32, MMA)
    a_prev = gl.zeros([BN, BK], gl.bfloat16, AL)
    for i in range(k_tiles):
        kn = gl.minimum(i + 2, k_tiles - 1)
        w2 = gl.load(w_base + kn * step + w_off)
        sw2 = gl.load(s_base + kn * (num_g * 8) + s_off)
        a = _expand(w, sw, BN, AL)
        cp.wait_group(STAGES - 3)
        if FENCE:
            fence_async_shared()
            _cta_barrier()
        nxt = i + STAGES - 2
        if not LATE:
            _async_load(xs.index(nxt % STAGES), x_ptrs + gl.minimum(nxt, k_tiles - 1) * BK)
            cp.commit_group()
        acc = warpgroup_mma(a, xs.index(i % STAGES).permute((1, 0)), acc, is_async=True)
        acc, a_prev, a = warpgroup_mma_wait(1, deps=(acc, a_prev, a))
        if LATE:
            _async_load(xs.index(nxt % STAGES), x_ptrs + gl.minimum(nxt, k_tiles - 1) * BK)
            cp.commit_group()
        a_prev = a
        w, sw, w1, sw1 = w1, sw1, w2, sw2
    acc = warpgroup_mma_wait(0, deps=(acc,))
    cp.wait_group(0)

    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    orow = pid_b * BT + gl.arange(0, BT, layout=OL)
    row_ok = orow < gl.load(block_end_ptr + pid_b) - gl.load(block_row_ptr + pid_b) + pid_b * BT
    slot = gl.load(sorted_ptr + gl.load(block_row_ptr + pid_b) + gl.arange(0, BT, layout=OL), mask=row_ok, other=0)
    offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    out_ptrs = out_ptr + slot[None, :].to(gl.int64) * stride_out + offs_n[:, None]
    gl.store(out_ptrs, acc.to(gl.bfloat16), mask=row_ok[None, :])


_swiglu_requant = tb._swiglu_requant


@gluon.jit
def _l1_kernel(
    x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
    hidden, inter, num_topk, num_local,
    stride_x, stride_we, stride_se, stride_out,
    clamp,
    HAS_CLAMP: gl.constexpr, BT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    BK: gl.constexpr = 64
    G: gl.constexpr = BN // 16
    WL: gl.constexpr = _words_layout(num_warps)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    num_n = inter // BN
    pid = gl.program_id(0)
    pid_b = pid // num_n
    pid_n = pid % num_n
    expert = gl.load(block_expert_ptr + pid_b)
    if expert >= num_local:
        return
    row0 = gl.load(block_row_ptr + pid_b)
    nrows = gl.load(block_end_ptr + pid_b) - row0
    w_base = w_ptr + expert.to(gl.int64) * stride_we
    s_base = s_ptr + expert.to(gl.int64) * stride_se
    num_g = inter // 8
    wg_off, sg_off = _fp4_offsets(pid_n * G, num_g, G, WL)
    wu_off, su_off = _fp4_offsets(pid_n * G + inter // 16, num_g, G, WL)
    t_x = gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
    slot_x = gl.load(sorted_ptr + row0 + t_x, mask=t_x < nrows, other=0)
    x_ptrs = (x_ptr + (slot_x // num_topk)[:, None].to(gl.int64) * stride_x
              + gl.arange(0, BK, layout=gl.SliceLayout(0, XL))[None, :])

    xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK], XS)
    k_tiles = hidden // BK
    for s in gl.static_range(STAGES - 2):
        _async_load(xs.index(s), x_ptrs + gl.minimum(s, k_tiles - 1) * BK)
        cp.commit_group()
    step = num_g * 128
    sstep = num_g * 8
    gw = gl.load(w_base + wg_off)
    gs = gl.load(s_base + sg_off)
    uw = gl.load(w_base + wu_off)
    us = gl.load(s_base + su_off)
    k1 = gl.minimum(1, k_tiles - 1)
    gw1 = gl.load(w_base + k1 * step + wg_off)
    gs1 = gl.load(s_base + k1 * sstep + sg_off)
    uw1 = gl.load(w_base + k1 * step + wu_off)
    us1 = gl.load(s_base + k1 * sstep + su_off)
    acc_g = gl.zeros([BN, BT], gl.float32, MMA)
    acc_u = gl.zeros([BN, BT], gl.float32, MMA)
    a_u = gl.zeros([BN, BK], gl.bfloat16, AL)
    for i in range(k_tiles):
        kn = gl.minimum(i + 2, k_tiles - 1)
        gw2 = gl.load(w_base + kn * step + wg_off)
        gs2 = gl.load(s_base + kn * sstep + sg_off)
        uw2 = gl.load(w_base + kn * step + wu_off)
        us2 = gl.load(s_base + kn * sstep + su_off)
        a_g = _expand(gw, gs, BN, AL)
        cp.wait_group(STAGES - 3)
        fence_async_shared()
        _cta_barrier()
        nxt = i + STAGES - 2
        _async_load(xs.index(nxt % STAGES), x_ptrs + gl.minimum(nxt, k_tiles - 1) * BK)
        cp.commit_group()
        xb = xs.index(i % STAGES).permute((1, 0))
        acc_g = warpgroup_mma(a_g, xb, acc_g, is_async=True)
        acc_g, acc_u, a_g, a_u = warpgroup_mma_wait(1, deps=(acc_g, acc_u, a_g, a_u))
        a_u = _expand(uw, us, BN, AL)
        acc_u = warpgroup_mma(a_u, xb, acc_u, is_async=True)
        acc_g, acc_u, a_g, a_u = warpgroup_mma_wait(1, deps=(acc_g, acc_u, a_g, a_u))
        gw, gs, uw, us, gw1, gs1, uw1, us1 = gw1, gs1, uw1, us1, gw2, gs2, uw2, us2
    acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
    cp.wait_group(0)

    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    t = gl.arange(0, BT, layout=OL)
    row_ok = t < nrows
    slot = gl.load(sorted_ptr + row0 + t, mask=row_ok, other=0)
    topw = gl.load(weight_ptr + slot, mask=row_ok, other=0.0)
    q = _swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP, BN, BT)
    q = gl.convert_layout(q, MMA)
    offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    out_rows = pid_b * BT + t
    gl.store(out_ptr + out_rows[None, :].to(gl.int64) * stride_out + offs_n[:, None], q)


@gluon.jit
def _x_tiles(x_ptr, row_ids, ok, stride_x, XL: gl.constexpr):
    """Pointers [R, 64] to the K-0 activation tile of rows `row_ids` (rows not ok read row 0)."""
    r = gl.where(ok, row_ids, 0)
    return x_ptr + r[:, None].to(gl.int64) * stride_x + gl.arange(0, 64, layout=gl.SliceLayout(0, XL))[None, :]


@gluon.jit
def _l2_tail_body(a_ptr, w_base, s_base, w_off, s_off, num_g, inter, stride_a, row0_out, nrows,
                  BT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, EXTRA: gl.constexpr,
                  num_warps: gl.constexpr):
    BK: gl.constexpr = 64
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    MMA16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 16, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    AL16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA16, k_width=2)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    t = gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
    x0 = _x_tiles(a_ptr, row0_out + t, t < BT, stride_a, XL)
    t2 = gl.arange(0, 32, layout=gl.SliceLayout(1, XL))
    x1 = _x_tiles(a_ptr, row0_out + BT + t2, t2 < 32, stride_a, XL)
    xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK], XS)
    xt = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 32, BK], XS)
    k_tiles = inter // BK
    for s in gl.static_range(STAGES - 2):
        ks = gl.minimum(s, k_tiles - 1) * BK
        _async_load(xs.index(s), x0 + ks)
        if EXTRA > 0:
            _async_load(xt.index(s), x1 + ks)
        cp.commit_group()
    step = num_g * 128
    w = gl.load(w_base + w_off)
    sw = gl.load(s_base + s_off)
    w1 = gl.load(w_base + gl.minimum(1, k_tiles - 1) * step + w_off)
    sw1 = gl.load(s_base + gl.minimum(1, k_tiles - 1) * (num_g * 8) + s_off)
    acc = gl.zeros([BN, BT], gl.float32, MMA)
    acc1 = gl.zeros([BN, 16], gl.float32, MMA16)
    acc2 = gl.zeros([BN, 16], gl.float32, MMA16)
    a_prev = gl.zeros([BN, BK], gl.bfloat16, AL)
    for i in range(k_tiles):
        kn = gl.minimum(i + 2, k_tiles - 1)
        w2 = gl.load(w_base + kn * step + w_off)
        sw2 = gl.load(s_base + kn * (num_g * 8) + s_off)
        a = _expand(w, sw, BN, AL)
        cp.wait_group(STAGES - 3)
        nxt = i + STAGES - 2
        kx = gl.minimum(nxt, k_tiles - 1) * BK
        _async_load(xs.index(nxt % STAGES), x0 + kx)
        if EXTRA > 0:
            _async_load(xt.index(nxt % STAGES), x1 + kx)
        cp.commit_group()
        acc = warpgroup_mma(a, xs.index(i % STAGES).permute((1, 0)), acc, is_async=True)
        if EXTRA > 0:
            a16 = gl.convert_layout(a, AL16, assert_trivial=True)
            tail = xt.index(i % STAGES)
            acc1 = warpgroup_mma(a16, tail.slice(0, 16).permute((1, 0)), acc1, is_async=True)
            if EXTRA > 1:
                acc2 = warpgroup_mma(a16, tail.slice(16, 16).permute((1, 0)), acc2, is_async=True)
        acc, acc1, acc2, a_prev, a = warpgroup_mma_wait(1 + EXTRA, deps=(acc, acc1, acc2, a_prev, a))
        a_prev = a
        w, sw, w1, sw1 = w1, sw1, w2, sw2
    acc, acc1, acc2 = warpgroup_mma_wait(0, deps=(acc, acc1, acc2))
    cp.wait_group(0)
    return acc, acc1, acc2


@gluon.jit
def _l2_store(acc, out_ptr, sorted_ptr, row0, t0, nrows, offs0, stride_out, R: gl.constexpr, L: gl.constexpr):
    t = t0 + gl.arange(0, R, layout=gl.SliceLayout(0, L))
    ok = t < nrows
    slot = gl.load(sorted_ptr + row0 + t, mask=ok, other=0)
    offs_n = offs0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, L))
    gl.store(out_ptr + slot[None, :].to(gl.int64) * stride_out + offs_n[:, None], acc.to(gl.bfloat16), mask=ok[None, :])


@gluon.jit
def _l2_tail_kernel(
    a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
    hidden, inter, num_local,
    stride_a, stride_we, stride_se, stride_out,
    BT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """Blocks of BT + 32 rows: BT-row MMA plus 0-2 16-row MMAs for the rows past BT."""
    G: gl.constexpr = BN // 16
    WL: gl.constexpr = _words_layout(num_warps)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    MMA16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 16, 16])
    num_n = hidden // BN
    pid = gl.program_id(0)
    pid_b = pid // num_n
    pid_n = pid % num_n
    expert = gl.load(block_expert_ptr + pid_b)
    if expert >= num_local:
        return
    row0 = gl.load(block_row_ptr + pid_b)
    nrows = gl.load(block_end_ptr + pid_b) - row0
    w_base = w_ptr + expert.to(gl.int64) * stride_we
    s_base = s_ptr + expert.to(gl.int64) * stride_se
    num_g = hidden // 16
    w_off, s_off = _fp4_offsets(pid_n * G, num_g, G, WL)
    row0_out = pid_b * (BT + 32)
    offs0 = pid_n * BN
    if nrows <= BT:
        acc, acc1, acc2 = _l2_tail_body(a_ptr, w_base, s_base, w_off, s_off, num_g, inter, stride_a, row0_out,
                                        nrows, BT, BN, STAGES, 0, num_warps)
        _l2_store(acc, out_ptr, sorted_ptr, row0, 0, nrows, offs0, stride_out, BT, MMA)
    elif nrows <= BT + 16:
        acc, acc1, acc2 = _l2_tail_body(a_ptr, w_base, s_base, w_off, s_off, num_g, inter, stride_a, row0_out,
                                        nrows, BT, BN, STAGES, 1, num_warps)
        _l2_store(acc, out_ptr, sorted_ptr, row0, 0, nrows, offs0, stride_out, BT, MMA)
        _l2_store(acc1, out_ptr, sorted_ptr, row0, BT, nrows, offs0, stride_out, 16, MMA16)
    else:
        acc, acc1, acc2 = _l2_tail_body(a_ptr, w_base, s_base, w_off, s_off, num_g, inter, stride_a, row0_out,
                                        nrows, BT, BN, STAGES, 2, num_warps)
        _l2_store(acc, out_ptr, sorted_ptr, row0, 0, nrows, offs0, stride_out, BT, MMA)
        _l2_store(acc1, out_ptr, sorted_ptr, row0, BT, nrows, offs0, stride_out, 16, MMA16)
        _l2_store(acc2, out_ptr, sorted_ptr, row0, BT + 16, nrows, offs0, stride_out, 16, MMA16)


@gluon.jit
def _l1_tail_body(x_ptr, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, hidden, stride_x,
                  sorted_ptr, row0, nrows, num_topk,
                  BT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, EXTRA: gl.constexpr,
                  num_warps: gl.constexpr):
    BK: gl.constexpr = 64
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    MMA16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 16, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    AL16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA16, k_width=2)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    t = gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
    slot0 = gl.load(sorted_ptr + row0 + t, mask=t < nrows, other=0)
    x0 = _x_tiles(x_ptr, slot0 // num_topk, t < nrows, stride_x, XL)
    t2 = BT + gl.arange(0, 32, layout=gl.SliceLayout(1, XL))
    slot1 = gl.load(sorted_ptr + row0 + t2, mask=t2 < nrows, other=0)
    x1 = _x_tiles(x_ptr, slot1 // num_topk, t2 < nrows, stride_x, XL)
    xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK], XS)
    xt = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 32, BK], XS)
    k_tiles = hidden // BK
    for s in gl.static_range(STAGES - 2):
        ks = gl.minimum(s, k_tiles - 1) * BK
        _async_load(xs.index(s), x0 + ks)
        if EXTRA > 0:
            _async_load(xt.index(s), x1 + ks)
        cp.commit_group()
    step = num_g * 128
    sstep = num_g * 8
    gw = gl.load(w_base + wg_off)
    gs = gl.load(s_base + sg_off)
    uw = gl.load(w_base + wu_off)
    us = gl.load(s_base + su_off)
    k1 = gl.minimum(1, k_tiles - 1)
    gw1 = gl.load(w_base + k1 * step + wg_off)
    gs1 = gl.load(s_base + k1 * sstep + sg_off)
    uw1 = gl.load(w_base + k1 * step + wu_off)
    us1 = gl.load(s_base + k1 * sstep + su_off)
    g0 = gl.zeros([BN, BT], gl.float32, MMA)
    u0 = gl.zeros([BN, BT], gl.float32, MMA)
    g1 = gl.zeros([BN, 16], gl.float32, MMA16)
    u1 = gl.zeros([BN, 16], gl.float32, MMA16)
    g2 = gl.zeros([BN, 16], gl.float32, MMA16)
    u2 = gl.zeros([BN, 16], gl.float32, MMA16)
    a_u = gl.zeros([BN, BK], gl.bfloat16, AL)
    for i in range(k_tiles):
        kn = gl.minimum(i + 2, k_tiles - 1)
        gw2 = gl.load(w_base + kn * step + wg_off)
        gs2 = gl.load(s_base + kn * sstep + sg_off)
        uw2 = gl.load(w_base + kn * step + wu_off)
        us2 = gl.load(s_base + kn * sstep + su_off)
        a_g = _expand(gw, gs, BN, AL)
        cp.wait_group(STAGES - 3)
        nxt = i + STAGES - 2
        kx = gl.minimum(nxt, k_tiles - 1) * BK
        _async_load(xs.index(nxt % STAGES), x0 + kx)
        if EXTRA > 0:
            _async_load(xt.index(nxt % STAGES), x1 + kx)
        cp.commit_group()
        xb = xs.index(i % STAGES).permute((1, 0))
        tail = xt.index(i % STAGES)
        g0 = warpgroup_mma(a_g, xb, g0, is_async=True)
        if EXTRA > 0:
            g1 = warpgroup_mma(gl.convert_layout(a_g, AL16, assert_trivial=True), tail.slice(0, 16).permute((1, 0)), g1, is_async=True)
            if EXTRA > 1:
                g2 = warpgroup_mma(gl.convert_layout(a_g, AL16, assert_trivial=True), tail.slice(16, 16).permute((1, 0)), g2, is_async=True)
        g0, g1, g2, u0, u1, u2, a_g, a_u = warpgroup_mma_wait(1 + EXTRA, deps=(g0, g1, g2, u0, u1, u2, a_g, a_u))
        a_u = _expand(uw, us, BN, AL)
        u0 = warpgroup_mma(a_u, xb, u0, is_async=True)
        if EXTRA > 0:
            u1 = warpgroup_mma(gl.convert_layout(a_u, AL16, assert_trivial=True), tail.slice(0, 16).permute((1, 0)), u1, is_async=True)
            if EXTRA > 1:
                u2 = warpgroup_mma(gl.convert_layout(a_u, AL16, assert_trivial=True), tail.slice(16, 16).permute((1, 0)), u2, is_async=True)
        g0, g1, g2, u0, u1, u2, a_g, a_u = warpgroup_mma_wait(1 + EXTRA, deps=(g0, g1, g2, u0, u1, u2, a_g, a_u))
        gw, gs, uw, us, gw1, gs1, uw1, us1 = gw1, gs1, uw1, us1, gw2, gs2, uw2, us2
    g0, g1, g2, u0, u1, u2 = warpgroup_mma_wait(0, deps=(g0, g1, g2, u0, u1, u2))
    cp.wait_group(0)
    return g0, g1, g2, u0, u1, u2


@gluon.jit
def _l1_store(acc_g, acc_u, out_ptr, sorted_ptr, weight_ptr, row0, t0, nrows, out_row0, offs0, stride_out, clamp,
              HAS_CLAMP: gl.constexpr, R: gl.constexpr, L: gl.constexpr):
    BN: gl.constexpr = acc_g.shape[0]
    t = t0 + gl.arange(0, R, layout=gl.SliceLayout(0, L))
    ok = t < nrows
    slot = gl.load(sorted_ptr + row0 + t, mask=ok, other=0)
    topw = gl.load(weight_ptr + slot, mask=ok, other=0.0)
    q = gl.convert_layout(_swiglu_requant(acc_g, acc_u, topw, ok, clamp, HAS_CLAMP, BN, R), L)
    offs_n = offs0 + gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    gl.store(out_ptr + (out_row0 + t)[None, :].to(gl.int64) * stride_out + offs_n[:, None], q)


@gluon.jit
def _l1_tail_kernel(
    x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
    hidden, inter, num_topk, num_local,
    stride_x, stride_we, stride_se, stride_out,
    clamp,
    HAS_CLAMP: gl.constexpr, BT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    G: gl.constexpr = BN // 16
    WL: gl.constexpr = _words_layout(num_warps)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BT, 16])
    MMA16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 16, 16])
    num_n = inter // BN
    pid = gl.program_id(0)
    pid_b = pid // num_n
    pid_n = pid % num_n
    expert = gl.load(block_expert_ptr + pid_b)
    if expert >= num_local:
        return
    row0 = gl.load(block_row_ptr + pid_b)
    nrows = gl.load(block_end_ptr + pid_b) - row0
    w_base = w_ptr + expert.to(gl.int64) * stride_we
    s_base = s_ptr + expert.to(gl.int64) * stride_se
    num_g = inter // 8
    wg_off, sg_off = _fp4_offsets(pid_n * G, num_g, G, WL)
    wu_off, su_off = _fp4_offsets(pid_n * G + inter // 16, num_g, G, WL)
    out_row0 = pid_b * (BT + 32)
    offs0 = pid_n * BN
    if nrows <= BT:
        g0, g1, g2, u0, u1, u2 = _l1_tail_body(x_ptr, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, hidden,
                                               stride_x, sorted_ptr, row0, nrows, num_topk, BT, BN, STAGES, 0, num_warps)
        _l1_store(g0, u0, out_ptr, sorted_ptr, weight_ptr, row0, 0, nrows, out_row0, offs0, stride_out, clamp, HAS_CLAMP, BT, MMA)
    elif nrows <= BT + 16:
        g0, g1, g2, u0, u1, u2 = _l1_tail_body(x_ptr, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, hidden,
                                               stride_x, sorted_ptr, row0, nrows, num_topk, BT, BN, STAGES, 1, num_warps)
        _l1_store(g0, u0, out_ptr, sorted_ptr, weight_ptr, row0, 0, nrows, out_row0, offs0, stride_out, clamp, HAS_CLAMP, BT, MMA)
        _l1_store(g1, u1, out_ptr, sorted_ptr, weight_ptr, row0, BT, nrows, out_row0, offs0, stride_out, clamp, HAS_CLAMP, 16, MMA16)
    else:
        g0, g1, g2, u0, u1, u2 = _l1_tail_body(x_ptr, w_base, s_base, wg_off, sg_off, wu_off, su_off, num_g, hidden,
                                               stride_x, sorted_ptr, row0, nrows, num_topk, BT, BN, STAGES, 2, num_warps)
        _l1_store(g0, u0, out_ptr, sorted_ptr, weight_ptr, row0, 0, nrows, out_row0, offs0, stride_out, clamp, HAS_CLAMP, BT, MMA)
        _l1_store(g1, u1, out_ptr, sorted_ptr, weight_ptr, row0, BT, nrows, out_row0, offs0, stride_out, clamp, HAS_CLAMP, 16, MMA16)
        _l1_store(g2, u2, out_ptr, sorted_ptr, weight_ptr, row0, BT + 16, nrows, out_row0, offs0, stride_out, clamp, HAS_CLAMP, 16, MMA16)
