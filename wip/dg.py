import os, sys, torch
sys.path.insert(0, os.getcwd())
from tests.megamoe.test_triton_gpu import gpu_weights, staged, GLUON, TRITON_64
from planc.runtime.megamoe.quant import calc_diff, quantize_experts_fp4
from planc.runtime.megamoe.reference import DequantizedExperts, local_experts_forward
from planc.runtime.megamoe.triton_backend import PackedExperts, triton_local_experts_forward, route
import dataclasses
q = quantize_experts_fp4(*gpu_weights())
params = (q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj, q.down_proj_scale_inv)
packed, deq = PackedExperts.from_params(*params), DequantizedExperts.from_fp4(*params)
print("SYNC", os.environ.get("GL_SYNC"))
for cfg_name, cfg in (("g8s6", GLUON),):
    for n in (1, 7, 129, 400, -300):
        x, sf, idx, w = staged(abs(n), abs(n), masked=0.1 if n > 0 else 0.0)
        if n < 0:
            idx = torch.full_like(idx, 5)
        G = [triton_local_experts_forward(x, sf, idx, w, packed, first_expert=0, activation_clamp=None, config=cfg) for _ in range(3)]
        T = triton_local_experts_forward(x, sf, idx, w, packed, first_expert=0, activation_clamp=None, config=TRITON_64)
        R = local_experts_forward(x, sf, idx, w, deq, first_expert=0, activation_clamp=None)
        g = G[0]
        bad = (g != T).any(-1).flatten()
        _, bexp, brow, bend = route(idx, first_expert=0, num_local_experts=32, block_t=96)
        print(f"{cfg_name} T={n}: diff(G,R)={calc_diff(g.float(), R.float()):.2e} diff(T,R)={calc_diff(T.float(), R.float()):.2e} "
              f"G==T {torch.equal(g, T)} bad slots {int(bad.sum())}/{bad.numel()} det {all(torch.equal(g, o) for o in G[1:])} "
              f"nan {int(g.isnan().sum())} maxabs G {g.float().abs().max().item():.3g} T {T.float().abs().max().item():.3g}")
