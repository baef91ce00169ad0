"""An independent float64 emulation of the Mega MoE kernel, written from the kernel description
(docs/megamoe.md, DeepGEMM `sm100_fp8_fp4_mega_moe.cuh`), one token and one slot at a time.

It shares no code with `planc.kernels.megamoe` or `planc.runtime.megamoe`: its own e4m3 / e2m1 decoding and
rounding, its own UE8M0 scales, float64 GEMMs. Only for tests (slow by design).
"""

from __future__ import annotations

import math

import torch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> nearest bfloat16 value (ties to even), as float64, without going through float32."""
    m, e = torch.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    step = torch.ldexp(torch.ones_like(x), e - 8)  # 8 significant bits
    return torch.where(x == 0, x, torch.round(x / step) * step)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float64 -> nearest e4m3fn value (ties to even, saturating at 448), as float64."""
    ax = x.abs().clamp(max=448.0)
    e = torch.floor(torch.log2(ax.clamp(min=2.0**-9))).clamp(min=-6)  # subnormals share exponent -6
    step = torch.pow(2.0, e - 3)
    r = torch.round(ax / step) * step
    return torch.sign(x) * r.clamp(max=448.0)


def pow2_ceil(v: float) -> float:
    """Smallest power of two >= v (v > 0)."""
    m, e = math.frexp(v)  # v = m * 2**e, 0.5 <= m < 1
    return 2.0 ** (e - 1) if m == 0.5 else 2.0**e


def fp8_quant_act(x: torch.Tensor) -> torch.Tensor:
    """Activation cast (1e-4 floor on amax), returns the dequantized float64 values."""
    out = torch.empty_like(x)
    for g in range(x.shape[-1] // 32):
        chunk = x[..., g * 32:(g + 1) * 32]
        amax = max(float(chunk.abs().max()), 1e-4)
        sf = pow2_ceil(float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)))
        out[..., g * 32:(g + 1) * 32] = round_e4m3(chunk / sf) * sf
    return out


def fp8_requant(a: torch.Tensor) -> torch.Tensor:
    """The kernel's requant of the SwiGLU output: no floor, amax 0 -> zeros."""
    out = torch.zeros_like(a)
    for g in range(a.shape[-1] // 32):
        chunk = a[..., g * 32:(g + 1) * 32]
        amax = float(chunk.abs().max())
        if amax == 0:
            continue
        scaled = float(torch.tensor(amax, dtype=torch.float32) * torch.tensor(1 / 448.0, dtype=torch.float32))
        sf = pow2_ceil(scaled)
        out[..., g * 32:(g + 1) * 32] = round_e4m3(chunk / sf) * sf
    return out


def decode_fp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 [N, K/2] (low nibble = even k) + scales [N, K/32] (any dtype holding powers of two) -> float64."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(packed.shape[0], -1)
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    s = scales.float().double().repeat_interleave(32, dim=-1)
    return vals * s


def emulate(x, idx, weights, w1, w2, *, clamp=None, weight_after_requant=False):
    """x [T, H] (any float), idx [T, K] global ids (-1 skip), weights [T, K]; w1 [E, 2I, H], w2 [E, H, I] float64
    (already FP4-dequantized). Returns float64 [T, H] holding BF16 values."""
    T, K = idx.shape
    inter = w2.shape[2]
    xq = fp8_quant_act(x.double())
    y = torch.zeros(T, w2.shape[1], dtype=torch.float64)
    for t in range(T):
        acc = torch.zeros(w2.shape[1], dtype=torch.float64)
        for j in range(K):
            e = int(idx[t, j])
            if e < 0:
                continue
            h = round_bf16(w1[e] @ xq[t])
            gate, up = h[:inter], h[inter:]
            if clamp is not None:
                c = float(round_bf16(torch.tensor(float(clamp), dtype=torch.float64)))
                gate, up = gate.clamp(max=c), up.clamp(min=-c, max=c)
            w = float(torch.tensor(float(weights[t, j]), dtype=torch.float32))
            a = gate / (1 + torch.exp(-gate)) * up
            if not weight_after_requant:
                a = a * w
            o = round_bf16(w2[e] @ fp8_requant(a.unsqueeze(0))[0])
            if weight_after_requant:
                o = round_bf16(o * w)
            acc = acc + o
        y[t] = round_bf16(acc)
    return y


def moe_float64(x, idx, weights, w1, w2, *, clamp=None):
    """The plain (unquantized) SwiGLU MoE in float64: the accuracy yardstick for calc_diff."""
    T, K = idx.shape
    inter = w2.shape[2]
    x = x.double()
    y = torch.zeros(T, w2.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(idx[t, j])
            if e < 0:
                continue
            h = w1[e].double() @ x[t]
            gate, up = h[:inter], h[inter:]
            if clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
            y[t] += float(weights[t, j]) * (w2[e].double() @ (gate * torch.sigmoid(gate) * up))
    return y


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def fp8_block_cast(v: torch.Tensor, *, floor: bool, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 path's cast of one row (float64 [C]) per `block` channels (the row-scaled path: the whole row): sf =
    2**ceil(log2(fl32(amax) * fl32(1/448))), at least 2**-126 with `floor` (else 0 for an all-zero group), values
    RNE onto e4m3. Returns (e4m3 values, scales per block) in float64."""
    q = torch.zeros_like(v)
    sf = torch.zeros(v.shape[-1] // block, dtype=torch.float64)
    for b in range(v.shape[-1] // block):
        chunk = v[b * block:(b + 1) * block]
        amax = float(chunk.abs().max())
        if amax == 0 and not floor:
            continue
        scaled = _f32(_f32(amax) * _f32(1 / 448.0))
        s = max(pow2_ceil(scaled), 2.0**-126) if scaled > 0 else 2.0**-126
        sf[b] = s
        q[b * block:(b + 1) * block] = round_e4m3(chunk / s)
    return q, sf


def fp8_weights(packed: torch.Tensor, scale_bytes: torch.Tensor, *, block: int = 128) -> torch.Tensor:
    """int8 [N, K/2] e2m1 codes + UE8M0 exponent bytes [N, K/32] -> the FP8 path's weights as float64 [N, K]: per
    (row, `block` K; the row-scaled path: the whole row) ref = the largest byte, each code times 2**(s - ref + 1)
    rounded to e4m3, times 2**(ref - 128)."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).reshape(packed.shape[0], -1)
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    s = scale_bytes.long()
    n, groups = s.shape
    g = min(block, 32 * groups) // 32
    ref = s.view(n, groups // g, g).amax(dim=-1)  # [N, K/block]
    shift = (s - ref.repeat_interleave(g, dim=1)).double()
    q = round_e4m3(vals * torch.pow(2.0, shift + 1).repeat_interleave(32, dim=1))
    return q * torch.pow(2.0, ref.double() - 128).repeat_interleave(32 * g, dim=1)


def emulate_fp8(x_q, x_sf, idx, weights, fp4, *, clamp=None, rows=False):
    """The FP8 path in float64 from the staged FP8 rows (`x_q` e4m3 [T, H], `x_sf` UE8M0 bytes [T, H/32]) and the
    module-layout FP4 experts (`quant.FP4Experts`); `rows`: the row-scaled path (`KernelConfig(fp8=6)`: one scale per
    row of every operand). Returns float64 [T, H] holding BF16 values."""
    T, K = idx.shape
    hidden, inter = fp4.down_proj.shape[1], fp4.down_proj.shape[2] * 2
    bh, bi = (hidden, inter) if rows else (128, 128)
    w1 = torch.stack([fp8_weights(p, s, block=bh) for p, s in zip(fp4.gate_up_proj,
                                                                    _bytes(fp4.gate_up_proj_scale_inv))])
    w2 = torch.stack([fp8_weights(p, s, block=bi) for p, s in zip(fp4.down_proj, _bytes(fp4.down_proj_scale_inv))])
    x = x_q.double() * torch.pow(2.0, x_sf.long().double() - 127).repeat_interleave(32, dim=1)
    y = torch.zeros(T, w2.shape[1], dtype=torch.float64)
    for t in range(T):
        q, sf = fp8_block_cast(x[t], floor=True, block=bh)
        xq = q * sf.repeat_interleave(bh)
        acc = torch.zeros(w2.shape[1], dtype=torch.float64)
        for j in range(K):
            e = int(idx[t, j])
            if e < 0:
                continue
            h = round_bf16(w1[e] @ xq)
            gate, up = h[:inter], h[inter:]
            if clamp is not None:
                c = float(round_bf16(torch.tensor(float(clamp), dtype=torch.float64)))
                gate, up = gate.clamp(max=c), up.clamp(min=-c, max=c)
            a = gate / (1 + torch.exp(-gate)) * up * _f32(float(weights[t, j]))
            aq, asf = fp8_block_cast(a, floor=False, block=bi)
            acc = acc + round_bf16(w2[e] @ (aq * asf.repeat_interleave(bi)))
        y[t] = round_bf16(acc)
    return y


def _bytes(scales: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (float8_e8m0fnu, or float32 powers of two) -> their exponent bytes as int64."""
    if scales.dtype == torch.float8_e8m0fnu:
        return scales.view(torch.uint8).long()
    return (torch.log2(scales.double()).round() + 127).long()
