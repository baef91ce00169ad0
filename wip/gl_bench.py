import sys, os, time, torch
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.getcwd())
import triton
from planc.runtime.megamoe import triton_backend as tb
import glk

torch.manual_seed(0)
dev = "cuda"
E, H, I, K = 384, 7168, 3072, 6
T = int(os.environ.get("T", 4096))
w2 = torch.randint(-2**31, 2**31 - 1, (E, H, I // 8), dtype=torch.int32, device=dev)
s2b = torch.randint(118, 126, (E, H, I // 32), dtype=torch.uint8, device=dev)
s2 = s2b.reshape(E, -1).view(torch.int32)
scores = torch.randn(T, E, device=dev)
idx = torch.topk(scores, K, dim=-1).indices

def ev(fn, iters=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    ts.sort(); return ts[len(ts) // 2]

act_slot = (torch.randn(T * K, I, device=dev) * 0.5).to(torch.bfloat16)
def blocked(rows, sorted_slots, brow, bend, BT):
    nb = brow.numel()
    out = torch.zeros(nb * BT, rows.shape[1], dtype=rows.dtype, device=dev)
    t = torch.arange(BT, device=dev)
    r = brow[:, None] + t[None, :]
    ok = r < bend[:, None]
    src = sorted_slots[r.clamp(max=sorted_slots.numel() - 1)].long()
    out.view(nb, BT, -1)[ok] = rows[src[ok]]
    return out
ref_out = None
def unblock(o, sorted_slots, brow, bend, BT, bexp):
    nb = brow.numel()
    out = torch.zeros(T * K, o.shape[1], dtype=o.dtype, device=dev)
    t = torch.arange(BT, device=dev)
    r = brow[:, None] + t[None, :]
    ok = (r < bend[:, None]) & (bexp < E)[:, None]
    src = sorted_slots[r.clamp(max=sorted_slots.numel() - 1)].long()
    out[src[ok]] = o.view(nb, BT, -1)[ok]
    return out
for BT in (64, 128):
    sorted_slots, bexp, brow, bend = tb.route(idx, first_expert=0, num_local_experts=E, block_t=BT)
    nb = bexp.numel()
    act = blocked(act_slot, sorted_slots, brow, bend, BT)
    out_t = torch.zeros(T * K, H, dtype=torch.bfloat16, device=dev)
    out_g = torch.zeros_like(out_t)
    def tri(BN=128, regs=128):
        tb._l2_kernel[(nb * (H // BN),)](act, w2, s2, sorted_slots, bexp, brow, bend, out_t, H, I, E,
            act.stride(0), w2.stride(0), s2.stride(0), out_t.stride(0), BT=BT, BN=BN, BK=64, LARGE=False,
            INTERPRET=False, NUM_STAGES=4, PREFETCH=BT == 64, num_warps=8, num_stages=4, **({"maxnreg": regs} if BT == 64 else {}))
    def glu(ST=4, BN=128, **kw):
        glk._l2_kernel[(nb * (H // BN),)](act, w2, s2, sorted_slots, bexp, brow, bend, out_g, H, I, E,
            act.stride(0), w2.stride(0), s2.stride(0), out_g.stride(0), BT=BT, BN=BN, STAGES=ST, num_warps=BN // 16, **kw)
    t_t = ev(tri)
    res = {"triton": t_t}
    for st in (4, 6):
        for bn in (128, 64):
          for fence in (True, False):
            try:
                res[f"gluon st{st} bn{bn} fence{int(fence)}"] = ev(lambda: glu(st, bn, FENCE=fence))
                if not fence:
                    glu(st, bn, FENCE=fence); tri(); torch.cuda.synchronize(); print("   nofence equal", torch.equal(out_t, out_g))
            except Exception as e:
                print("gluon st", st, type(e).__name__, str(e)[:300])
    tri(); glu(); torch.cuda.synchronize()
    d = (out_t.float() - out_g.float()).abs()
    rel = d.max().item() / out_t.float().abs().max().item()
    same = torch.equal(out_t, out_g)
    flops = 2 * nb * BT * H * I
    ref_out = out_t.clone() if ref_out is None else ref_out
    print(f"L2 T={T} BT={BT} blocks={nb}: " + ", ".join(f"{k} {v:.1f} us ({flops / v / 1e6:.0f} TFLOP/s padded)" for k, v in res.items()) + f"; bit-equal {same}, max rel diff {rel:.2e}")

# L2 with tails
for ST in (4, 6):
    sorted_slots, bexp, brow, bend = tb.route(idx, first_expert=0, num_local_experts=E, block_t=96)
    nb = bexp.numel()
    act = blocked(act_slot, sorted_slots, brow, bend, 96)
    out_g = torch.zeros_like(ref_out)
    def glt(BN=128):
        glk._l2_tail_kernel[(nb * (H // BN),)](act, w2, s2, sorted_slots, bexp, brow, bend, out_g, H, I, E,
            act.stride(0), w2.stride(0), s2.stride(0), out_g.stride(0), BT=64, BN=BN, STAGES=ST, num_warps=BN // 16)
    for bn in (128, 64):
        us = ev(lambda: glt(bn))
        out_g.zero_(); glt(bn); torch.cuda.synchronize()
        print(f"L2 tail T={T} blocks of 96: {nb}, st{ST} bn{bn}: {us:.1f} us; equal to triton BT=64: {torch.equal(out_g, ref_out)}")

# L1
w1 = torch.randint(-2**31, 2**31 - 1, (E, 2 * I, H // 8), dtype=torch.int32, device=dev)
s1 = torch.randint(118, 126, (E, 2 * I, H // 32), dtype=torch.uint8, device=dev).reshape(E, -1).view(torch.int32)
x = (torch.randn(T, H, device=dev) * 0.5).to(torch.bfloat16)
wts = torch.rand(T * K, device=dev)
for BT in (64, 128):
    sorted_slots, bexp, brow, bend = tb.route(idx, first_expert=0, num_local_experts=E, block_t=BT)
    nb = bexp.numel()
    o_t = torch.zeros(nb * BT, I, dtype=torch.bfloat16, device=dev)
    o_g = torch.zeros_like(o_t)
    ws = torch.empty(1, device=dev)
    def tri(BN=128):
        tb._l1_swiglu_kernel[(nb * (I // BN), 1)](x, w1, s1, sorted_slots, wts, bexp, brow, bend, o_t, ws,
            H, I, K, E, x.stride(0), w1.stride(0), s1.stride(0), o_t.stride(0), 10.0,
            HAS_CLAMP=True, BT=BT, BN=BN, BK=64, LARGE=False, INTERPRET=False, NUM_STAGES=4, SPLIT=1,
            PREFETCH=BT == 64, num_warps=8, num_stages=4, **({"maxnreg": 128} if BT == 64 else {}))
    def glu(ST=4, BN=128, **kw):
        glk._l1_kernel[(nb * (I // BN),)](x, w1, s1, sorted_slots, wts, bexp, brow, bend, o_g,
            H, I, K, E, x.stride(0), w1.stride(0), s1.stride(0), o_g.stride(0), 10.0,
            HAS_CLAMP=True, BT=BT, BN=BN, STAGES=ST, num_warps=BN // 16, **kw)
    res = {"triton": ev(tri)}
    for st in (4, 6):
        for bn, kw in ((128, {}), (128, {"maxnreg": 128}), (128, {"maxnreg": 168}), (64, {}), (64, {"maxnreg": 168})):
            try:
                res[f"gluon st{st} bn{bn} {kw}"] = ev(lambda: glu(st, bn, **kw))
            except Exception as e:
                print("gluon", st, kw, type(e).__name__, str(e)[:300])
    tri(); glu(); torch.cuda.synchronize()
    d = (o_t.float() - o_g.float()).abs()
    same = torch.equal(o_t, o_g)
    nd = (o_t != o_g).sum().item()
    flops = 2 * nb * BT * H * 2 * I
    print(f"L1 T={T} BT={BT} blocks={nb}: " + ", ".join(f"{k} {v:.1f} us ({flops / v / 1e6:.0f})" for k, v in res.items()) + f"; bit-equal {same} ({nd} differ of {o_t.numel()}), max abs diff {d.max().item():.3e}")
    if BT == 64:
        ref_l1 = unblock(o_t, sorted_slots, brow, bend, BT, bexp)

# L1 with tails
sorted_slots, bexp, brow, bend = tb.route(idx, first_expert=0, num_local_experts=E, block_t=96)
nb = bexp.numel()
o_g = torch.zeros(nb * 96, I, dtype=torch.bfloat16, device=dev)
def glt1(ST=4, BN=128, **kw):
    glk._l1_tail_kernel[(nb * (I // BN),)](x, w1, s1, sorted_slots, wts, bexp, brow, bend, o_g,
        H, I, K, E, x.stride(0), w1.stride(0), s1.stride(0), o_g.stride(0), 10.0,
        HAS_CLAMP=True, BT=64, BN=BN, STAGES=ST, num_warps=BN // 16, **kw)
for st in (4, 6):
    for bn, kw in ((128, {}), (64, {}), (64, {"maxnreg": 168})):
        try:
            us = ev(lambda: glt1(st, bn, **kw))
            o_g.zero_(); glt1(st, bn, **kw); torch.cuda.synchronize()
            got = unblock(o_g, sorted_slots, brow, bend, 96, bexp)
            print(f"L1 tail T={T} blocks of 96: {nb}, st{st} bn{bn} {kw}: {us:.1f} us; equal to triton BT=64: {torch.equal(got, ref_l1)} ({(got != ref_l1).sum().item()} differ)")
        except Exception as e:
            print("L1 tail", st, bn, kw, type(e).__name__, str(e)[:300])
