"""The FP4 weight layout the Triton kernels read: `shuffle_fp4` reorders e2m1 codes and UE8M0 exponent bytes into
the Hopper MMA's register fragments; `PackedExperts` holds one rank's experts in it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planc.kernels.megamoe.quant import float_to_ue8m0_bytes

# The weight layout the kernels read (`shuffle_fp4`, once per experts tensor: the same bytes in this order, still
# e2m1 codes with UE8M0 exponent bytes, 4 bits per weight). It is the register fragment of the Hopper MMA (A operand,
# BF16, 16x16): one int32 word holds the 8 weights one thread of a warp owns in one 16x16 tile, and one thread's 4
# words (4 consecutive K tiles) are 16 contiguous bytes, so a warp reads 512 contiguous bytes and each thread gets
# exactly its operand registers (no shuffle through shared memory).
# Matrix [N, K] (N rows: output channels; K: the reduced dimension), N % 16 == 0, K % 64 == 0:
#   row n = 16 g + 8 m8 + r,  K index k = 64 kc + 16 j + 8 k8 + 2 q + k1   (r < 8, q < 4, j < 4, m8/k8/k1 < 2)
#   word (kc, g, r, q, j), at int32 offset (((kc * N/16 + g) * 8 + r) * 4 + q) * 4 + j, holds the 8 weights
#   (m8, k8, k1); output t = 2 m8 + k8 of the expansion is the BF16 pair (k1 = 0 low half, 1 high half).
#   Each code's sign goes to bit 15 and its three magnitude bits to bits 8..6 of its half (e2m1 value x 2**-126 as a
#   BF16) after a rotation of the word: output 0 by 0, 1 by 4, 2 by 10; output 3 takes its m0 bits from a rotation by
#   6 and the others from a rotation by 14 (`_ROTATIONS`), so 13 instructions expand 8 weights (`jit._EXPAND_PTX`).
#   Scales: one int32 per (kc, g, r) at offset (kc * N/16 + g) * 8 + r: byte 2 m8 + jh is the UE8M0 exponent of row
#   16 g + 8 m8 + r for K [64 kc + 32 jh, +32).
_ROTATIONS = (0, 4, 10)


def _placed_bits(codes: torch.Tensor, t: int, k1: int) -> torch.Tensor:
    """int64 e2m1 codes -> their bits where the word stores them for output t, half k1."""
    out = torch.zeros_like(codes)
    for shift, target in ((3, 15), (2, 8), (1, 7), (0, 6)):
        pos = target + 16 * k1
        rot = _ROTATIONS[t] if t < 3 else (6 if target == 6 else 14)
        out |= ((codes >> shift) & 1) << ((pos - rot) % 32)
    return out


def shuffle_fp4(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 uint8 ``[E, N, K/2]`` (low nibble = even K) and UE8M0 bytes ``[E, N, K/32]`` -> the kernels' layout:
    words int32 ``[E, N, K/8]`` and scale bytes uint8 ``[E, N, K/32]`` (the same bytes per expert, in the order above;
    the shapes only keep the sizes). One expert at a time, on the tensors' device."""
    e, n, kh = packed.shape
    k = 2 * kh
    if n % 16 or k % 64:
        raise ValueError(f"the Triton layout needs N % 16 == 0 and K % 64 == 0, got N={n}, K={k}")
    g, kcs = n // 16, k // 64
    words = torch.empty((e, n, k // 8), dtype=torch.int32, device=packed.device)
    sbytes = torch.empty((e, n, k // 32), dtype=torch.uint8, device=packed.device)
    for i in range(e):
        b = packed[i].to(torch.int64)
        codes = torch.stack([b & 0xF, b >> 4], dim=-1).view(g, 2, 8, kcs, 4, 2, 4, 2)  # g m8 r kc j k8 q k1
        codes = codes.permute(3, 0, 2, 6, 4, 1, 5, 7)  # kc g r q j m8 k8 k1
        w = torch.zeros(codes.shape[:5], dtype=torch.int64, device=packed.device)
        for m8 in range(2):
            for k8 in range(2):
                for k1 in range(2):
                    w |= _placed_bits(codes[..., m8, k8, k1], 2 * m8 + k8, k1)
        words[i] = (w - ((w >> 31) << 32)).to(torch.int32).view(n, k // 8)
        sbytes[i] = scales[i].view(g, 2, 8, kcs, 2).permute(3, 0, 2, 1, 4).reshape(n, k // 32)
    return words, sbytes


@dataclass(frozen=True)
class PackedExperts:
    """FP4 experts in the kernels' layout (`shuffle_fp4`): views of the tensors that hold it (the runtime shuffles an
    experts module's parameters in place)."""

    w1: torch.Tensor  # int32 [E, 2I, H/8]: gate|up words (rows [gate | up], as in the module)
    s1: torch.Tensor  # uint8 [E, 2I, H/32]: their UE8M0 exponent bytes, in the layout's order
    w2: torch.Tensor  # int32 [E, H, I/8]
    s2: torch.Tensor  # uint8 [E, H, I/32]
    # A scale byte above 128 (a weight above 12) would overflow the merged factor 2**(s-1): two multiplies then.
    large_scales: bool = False

    @classmethod
    def from_params(cls, gate_up, gate_up_scale, down, down_scale) -> "PackedExperts":
        """Shuffled copies of FP4 experts in the module layout (tests and benchmarks)."""
        w1, s1 = shuffle_fp4(gate_up.contiguous().view(torch.uint8), exponent_bytes(gate_up_scale))
        w2, s2 = shuffle_fp4(down.contiguous().view(torch.uint8), exponent_bytes(down_scale))
        return cls(w1, s1, w2, s2, has_large_scales(s1, s2))

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1] // 2

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.w1, self.s1, self.w2, self.s2))


def has_large_scales(*scales: torch.Tensor) -> bool:
    """Whether any UE8M0 byte is above 128 (one host read: at install, never in a forward)."""
    return any(bool((s > 128).any()) for s in scales if s.numel())


def exponent_bytes(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales as uint8 exponent bytes: a view for float8_e8m0fnu/uint8, a 4x smaller copy for float32."""
    if scale.dtype == torch.uint8:
        return scale.contiguous()
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.contiguous().view(torch.uint8)
    return float_to_ue8m0_bytes(scale).contiguous()


def size_problem(hidden: int, inter: int) -> str | None:
    """None when the kernels take these sizes (multiples of 64: the weight layout's K block), else why not."""
    if hidden % 64 or inter % 64:
        return f"hidden ({hidden}) and intermediate ({inter}) sizes must be multiples of 64 (its weight layout)"
    return None
