"""Mega MoE number formats: FP8 e4m3 activations and FP4 e2m1 weights, both with UE8M0 scales per 32.

Everything here is plain PyTorch (CPU or GPU) and follows DeepGEMM's own casts
(`deep_gemm/utils/math.py` at the pinned commit, see docs/megamoe.md) bit for bit, so the reference
backend and the weights handed to the real kernel are the same numbers.

Formats
- UE8M0 scale: an unsigned power-of-two exponent byte, value ``2 ** (byte - 127)``.
- FP8 activation: ``float8_e4m3fn [m, n]`` + one UE8M0 scale per 32 consecutive elements along n.
- FP4 weight: e2m1 codes packed two per ``int8`` byte, **low nibble = even index, high nibble = odd
  index**, shape ``[m, n // 2]``, + one UE8M0 scale per 32 consecutive elements along n.

FP4 experts on a transformers experts module (the storage planc installs and reads; the same names
and shapes as transformers' ``FP8Experts(expert_dtype="fp4")``, so FP4 checkpoints load as is):

    gate_up_proj            int8                [E, 2I, H // 2]   rows [gate (I) | up (I)]
    gate_up_proj_scale_inv  float8_e8m0fnu      [E, 2I, H // 32]  (float32 powers of two accepted)
    down_proj               int8                [E, H, I // 2]
    down_proj_scale_inv     float8_e8m0fnu      [E, H, I // 32]

``gate_up_proj.dtype == torch.int8`` is what marks experts as FP4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRAN = 32  # elements per UE8M0 scale, along the reduction dimension
FP8_MAX = 448.0
FP4_MAX = 6.0
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # ties round down in magnitude

# The scale dtype planc stores on experts modules: one byte, exact for every power of two.
SCALE_DTYPE = getattr(torch, "float8_e8m0fnu", torch.float32)


def _groups(x: torch.Tensor) -> torch.Tensor:
    m, n = x.shape
    if n % GRAN:
        raise ValueError(f"the quantized dimension must be a multiple of {GRAN}, got {n}")
    return x.view(m, n // GRAN, GRAN)


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round positive float32 values up to a power of two, exponent byte clamped to [1, 254]."""
    bits = x.abs().float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).ne(0).int()
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (exponent bytes as uint8, float8_e8m0fnu, or float32 powers of two) -> float32."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.int32) << 23).view(torch.float32)
    return scale.float()


def float_to_ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """float32 powers of two -> exponent bytes (uint8)."""
    return (scale.float().view(torch.int32) >> 23).to(torch.uint8)


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """float32 powers of two [..., k] -> DeepGEMM's packed int32 [..., k // 4] (byte j of int i = group 4i+j)."""
    if scale.size(-1) % 4:
        raise ValueError(f"packing UE8M0 scales needs a multiple of 4 groups, got {scale.size(-1)}")
    return float_to_ue8m0_bytes(scale).contiguous().view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's packed int32 UE8M0 scales -> float32 powers of two."""
    return ue8m0_to_float(packed.contiguous().view(torch.uint8))


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation cast as DeepGEMM's `per_token_cast_to_fp8(use_ue8m0=True, gran_k=32)`.

    Per 32 elements: ``sf = ceil_ue8m0(max(amax, 1e-4) / 448)``, ``q = e4m3(x / sf)``.
    Returns ``(float8_e4m3fn [m, n], float32 scales [m, n // 32])``.
    """
    g = _groups(x)
    amax = g.abs().float().amax(dim=2).clamp(min=1e-4)
    sf = ceil_to_ue8m0(amax / FP8_MAX)
    q = (g.float() * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn)
    return q.view(x.shape), sf


def requantize_fp8_like_kernel(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's in-epilogue FP8 cast of the SwiGLU output (`math::get_e4m3_sf_and_sf_inv`).

    Unlike the activation cast it has no 1e-4 floor: ``scaled = amax * fl(1/448)``, exponent
    ``e = ceil(log2(scaled))`` read from the float bits, ``sf = 2**e``, ``q = satfinite_e4m3(a * 2**-e)``.
    An all-zero group gets sf 0 (byte 0) and q 0. Returns ``(float8_e4m3fn, float32 scales)``.
    """
    g = _groups(a.float())
    amax = g.abs().amax(dim=2)
    scaled = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    bits = scaled.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + (bits & 0x7FFFFF).ne(0).int()
    sf = ((e + 127).clamp(min=0) << 23).view(torch.float32)
    sf_inv = ((127 - e).clamp(min=0, max=254) << 23).view(torch.float32)
    q = (g * sf_inv.unsqueeze(2)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(a.shape), sf


def _apply_scales(values: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    return (_groups(values) * ue8m0_to_float(sf).unsqueeze(2)).view(values.shape)


def dequantize_fp8(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """FP8 values [m, n] x per-32 scales [m, n // 32] -> float32 (exact)."""
    return _apply_scales(q.float(), sf)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight cast as DeepGEMM's `per_token_cast_to_fp4(use_ue8m0=True, gran_k=32)`.

    Per 32 elements: ``sf = ceil_ue8m0(max(amax, 1e-4) / 6)``, nearest e2m1 code of ``w / sf`` (ties
    toward zero), two codes per byte with the even index in the low nibble.
    Returns ``(int8 [m, n // 2], float32 scales [m, n // 32])``.
    """
    m, n = w.shape
    g = _groups(w)
    amax = g.abs().float().amax(dim=2).clamp(min=1e-4)
    sf = ceil_to_ue8m0(amax / FP4_MAX)
    scaled = (g.float() * (1.0 / sf.unsqueeze(2))).view(m, n)
    mag = scaled.abs()
    code = torch.zeros_like(scaled, dtype=torch.int32)
    for boundary in _FP4_BOUNDARIES:
        code += (mag > boundary).int()
    code = code | (((scaled < 0) & (code != 0)).int() << 3)
    pairs = code.view(m, n // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed, sf


def dequantize_fp4(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [m, n // 2] x per-32 scales [m, n // 32] -> float32 [m, n] (exact)."""
    m, half = packed.shape
    b = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).view(m, 2 * half)
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=packed.device)
    value = table[codes & 0x7]
    value = torch.where((codes & 0x8).ne(0), -value, value)
    return _apply_scales(value, sf)


@dataclass(frozen=True)
class FP4Experts:
    """FP4 expert weights in planc's module layout (see the module docstring)."""

    gate_up_proj: torch.Tensor  # int8 [E, 2I, H // 2]
    gate_up_proj_scale_inv: torch.Tensor  # SCALE_DTYPE [E, 2I, H // 32]
    down_proj: torch.Tensor  # int8 [E, H, I // 2]
    down_proj_scale_inv: torch.Tensor  # SCALE_DTYPE [E, H, I // 32]


def quantize_fp4_batched(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (int8 [E, N, K // 2], SCALE_DTYPE [E, N, K // 32]), one expert at a time (bounded memory)."""
    e, n, k = w.shape
    packed = torch.empty((e, n, k // 2), dtype=torch.int8, device=w.device)
    scales = torch.empty((e, n, k // GRAN), dtype=SCALE_DTYPE, device=w.device)
    for i in range(e):
        p, s = quantize_fp4(w[i])
        packed[i] = p
        scales[i] = s.to(SCALE_DTYPE)
    return packed, scales


def dequantize_fp4_batched(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(int8 [E, N, K // 2], scales [E, N, K // 32]) -> [E, N, K] in `dtype` (exact for float32 and bfloat16)."""
    e, n, half = packed.shape
    out = torch.empty((e, n, 2 * half), dtype=dtype, device=packed.device)
    for i in range(e):
        out[i] = dequantize_fp4(packed[i], scales[i]).to(dtype)
    return out


def quantize_experts_fp4(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> FP4Experts:
    """bf16/fp32 experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) -> FP4 + UE8M0."""
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"expected gate_up_proj [E, 2I, H] and down_proj [E, H, I], got {tuple(gate_up_proj.shape)} "
            f"and {tuple(down_proj.shape)}"
        )
    e, two_i, h = gate_up_proj.shape
    if down_proj.shape != (e, h, two_i // 2):
        raise ValueError(
            f"down_proj must be [E, H, I] = [{e}, {h}, {two_i // 2}] to match gate_up_proj "
            f"{tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)} (transposed experts are not supported)"
        )
    w1, s1 = quantize_fp4_batched(gate_up_proj.detach())
    w2, s2 = quantize_fp4_batched(down_proj.detach())
    return FP4Experts(w1, s1, w2, s2)


def dequantize_experts_fp4(experts: FP4Experts, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4Experts -> (gate_up_proj [E, 2I, H], down_proj [E, H, I]) in `dtype`."""
    return (
        dequantize_fp4_batched(experts.gate_up_proj, experts.gate_up_proj_scale_inv, dtype),
        dequantize_fp4_batched(experts.down_proj, experts.down_proj_scale_inv, dtype),
    )


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity metric: ``1 - 2 sum(xy) / sum(x^2 + y^2)`` in float64 (0 = identical)."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)
