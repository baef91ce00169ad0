"""The FP4 weight layout the Triton kernels read: `shuffle_fp4` reorders e2m1 codes and UE8M0 exponent bytes into
the Hopper MMA's register fragments; `PackedExperts` holds one rank's experts in it."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # The FP8 wgmma path's layout of the same experts (`e4m3`), made once on first use.
    _e4m3: list = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def from_params(cls, gate_up, gate_up_scale, down, down_scale) -> "PackedExperts":
        """Shuffled copies of FP4 experts in the module layout (tests and benchmarks)."""
        w1, s1 = shuffle_fp4(gate_up.contiguous().view(torch.uint8), exponent_bytes(gate_up_scale))
        w2, s2 = shuffle_fp4(down.contiguous().view(torch.uint8), exponent_bytes(down_scale))
        return cls(w1, s1, w2, s2, has_large_scales(s1, s2))

    def e4m3(self) -> "E4m3Experts":
        """These experts in the FP8 wgmma path's layout (`shuffle_fp4_e4m3`), reordered on the first call and kept:
        a second copy of the FP4 bytes while both paths run."""
        if not self._e4m3:
            self._e4m3.append(E4m3Experts.from_packed(self))
        return self._e4m3[0]

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

    @property
    def fp8_layout_nbytes(self) -> int:
        """The bytes of the FP8 path's copy of these experts (`e4m3`, with its row-scaled scale words), 0 until a
        batch made it."""
        return sum(e4.nbytes for e4 in self._e4m3)


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


# The FP8 wgmma path's weight layout (`hopper_fp8`): the same e2m1 codes and UE8M0 bytes in the register order of the
# Hopper FP8 wgmma's A operand, so one int32 word expands to two A registers (4 e4m3 bytes each) by two byte-table
# lookups (PTX `prmt`) and the sign bits ORed in. An 8-bit A fragment gives lane 4 r + q the K values 4 q + {0..3} and
# 16 + 4 q + {0..3} of each 32-deep MMA step; the MMA's K order inside each 128-deep block is a permutation of the
# weights' (`FP8_K_ORDER`): MMA position 32 s + 16 h + 4 q + i holds weight K 32 q + 8 s + 4 h + i, so a lane's 32
# values of a row over the 4 steps are one 32-group (one UE8M0 byte: one lookup table). The activations are stored in
# the same order (`fp8.x_blocks(permute=True)`), and L1's output channels too: the gate/up rows are reordered by it, so
# L2 reads its K in the order it needs. Matrix [N, K], N % 16 == 0, K % 128 == 0:
#   row n = 16 g + 8 m8 + r, weight K = 128 kb + 32 q + 8 s + c (s = 2 sh + sl, c < 8);
#   word (kb, g, sh, lane = 4 r + q, sl, m8) at int32 offset ((((kb N/16 + g) 2 + sh) 32 + lane) 2 + sl) 2 + m8 holds
#   codes c = 0..7: magnitude bits in nibble c's bits 0-2; the sign of code c < 4 in bit 8 c + 7 (nibble 2c + 1's bit
#   3), of code 4 + i in bit 8 i + 3; A register h (h = 0: codes 0-3, h = 1: codes 4-7) byte i is code 4 h + i.
#   Scales: int32 (kb, n) at offset kb N + n, for row n and K [128 kb, +128): bits 0-7 ref, the largest of the row's four
#   UE8M0 bytes there (the block scale is 2**(ref - 128)); bits 8 + 5 q.. (5 bits) t_q = min(ref - s_q, 16), group q's
#   row of `e4m3_tables` (its codes times 2**(1 - t_q); from t = 14 on every entry rounds to 0, so the clamp loses
#   nothing these numerics keep).
def fp8_k_order() -> torch.Tensor:
    """The weight K (0..127) at each MMA position of a 128-deep block: position 32 s + 16 h + 4 q + i <- 32 q + 8 s +
    4 h + i."""
    s, h, q, i = torch.meshgrid(*(torch.arange(n) for n in (4, 2, 4, 4)), indexing="ij")
    return (32 * q + 8 * s + 4 * h + i).reshape(128)


def _e4m3_word_bits(codes: torch.Tensor) -> torch.Tensor:
    """int64 e2m1 codes [..., 8] -> their int64 words (see above)."""
    mag, sign = codes & 7, (codes >> 3) & 1
    c = torch.arange(8, device=codes.device)
    sign_pos = torch.where(c < 4, 8 * c + 7, 8 * (c - 4) + 3)
    return ((mag << (4 * c)) | (sign << sign_pos)).sum(-1)


def shuffle_fp4_e4m3(packed: torch.Tensor, scales: torch.Tensor, *, reorder_rows: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 uint8 ``[E, N, K/2]`` and UE8M0 bytes ``[E, N, K/32]`` -> the FP8 path's layout (above): words int32
    ``[E, N, K/8]`` and scale words (as bytes) uint8 ``[E, N, K/32]`` (the same sizes). `reorder_rows`: L1's gate|up
    matrix, whose rows of each half go in `fp8_k_order` within each 128 (L1's output channels in L2's K order)."""
    e, n, kh = packed.shape
    k = 2 * kh
    if n % 16 or k % 128:
        raise ValueError(f"the FP8 layout needs N % 16 == 0 and K % 128 == 0, got N={n}, K={k}")
    if reorder_rows:
        if n % 256:
            raise ValueError(f"the FP8 L1 layout needs gate and up halves of 128-row blocks, got {n} rows")
        order = fp8_k_order().to(packed.device)
        rows = (torch.arange(n // 128, device=packed.device)[:, None] * 128 + order[None, :]).reshape(n)
        packed, scales = packed[:, rows], scales[:, rows]
    g, kbs = n // 16, k // 128
    words = torch.empty((e, n, k // 8), dtype=torch.int32, device=packed.device)
    for i in range(e):
        b = packed[i].to(torch.int64)
        codes = torch.stack([b & 0xF, b >> 4], dim=-1).view(g, 2, 8, kbs, 4, 2, 2, 8)  # g m8 r kb q sh sl c
        codes = codes.permute(3, 0, 5, 2, 4, 6, 1, 7)  # kb g sh r q sl m8 c
        w = _e4m3_word_bits(codes)
        words[i] = (w - ((w >> 31) << 32)).to(torch.int32).reshape(n, k // 8)
    sb = scales.reshape(e, n, kbs, 4).permute(0, 2, 1, 3).to(torch.int64)  # [E, kb, N, q]
    ref = sb.amax(-1)
    t = (ref[..., None] - sb).clamp(max=E4M3_TABLE_ROWS - 1)
    word = ref | (t << (8 + 5 * torch.arange(4, device=scales.device))).sum(-1)
    sbytes = word.to(torch.int32).view(torch.uint8).reshape(e, n, k // 32)
    return words, sbytes


E4M3_TABLE_ROWS = 17


def row_scaled_words(sbytes: torch.Tensor) -> torch.Tensor:
    """The FP8 layout's scale words (uint8 ``[E, N, K/32]``, int32 (kb, n) per expert) -> the row-scaled path's
    (`KernelConfig(fp8=6)`): ref the largest UE8M0 byte of the whole row (the row's one scale 2**(ref - 128)) in
    every K block's word, t_q = min(ref - s_q, 16) against it. Exact from the block words: t_q < 16 gives s_q =
    ref_block - t_q, and t_q = 16 stays 16 (ref >= ref_block)."""
    e, n, k32 = sbytes.shape
    w = sbytes.contiguous().view(torch.int32).reshape(e, k32 // 4, n).to(torch.int64) & 0xFFFFFFFF
    ref = w & 0xFF
    row = ref.amax(dim=1, keepdim=True)
    shifts = 8 + 5 * torch.arange(4, device=sbytes.device)
    t = (w[..., None] >> shifts) & 31  # [E, K/128, N, 4]
    cap = E4M3_TABLE_ROWS - 1
    t = torch.where(t >= cap, cap, (row - ref)[..., None] + t).clamp(max=cap)
    word = row | (t << shifts).sum(-1)
    return word.to(torch.int32).view(torch.uint8).reshape(e, n, k32)


def e4m3_tables(device: torch.device) -> torch.Tensor:
    """The FP8 path's lookup tables: int64 ``[17]``, row t the e4m3 bytes of the 8 e2m1 magnitudes times 2**(1 - t)
    (RNE, as the emulation rounds), byte m = magnitude code m (the kernel's `prmt` selects them by the codes)."""
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    t = torch.arange(E4M3_TABLE_ROWS, dtype=torch.float32)
    codes = (mags[None, :] * torch.pow(2.0, 1 - t)[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    return (codes << (8 * torch.arange(8))).sum(-1).to(device)


def unshuffle_fp4(words: torch.Tensor, sbytes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`shuffle_fp4` undone: the kernels' words and scale bytes -> packed e2m1 uint8 ``[E, N, K/2]`` and UE8M0 bytes
    ``[E, N, K/32]`` in the module layout (the FP8 path's layout is made from them). One expert at a time."""
    e, n, k8 = words.shape
    k = 8 * k8
    g, kcs = n // 16, k // 64
    packed = torch.empty((e, n, k // 2), dtype=torch.uint8, device=words.device)
    for x in range(e):
        w = (words[x].to(torch.int64) & 0xFFFFFFFF).view(kcs, g, 8, 4, 4)  # kc g r q j
        codes = torch.zeros((kcs, g, 8, 4, 4, 2, 2, 2), dtype=torch.int64, device=words.device)  # .. m8 k8 k1
        for m8 in range(2):
            for k8 in range(2):
                for k1 in range(2):
                    t = 2 * m8 + k8
                    for shift, target in ((3, 15), (2, 8), (1, 7), (0, 6)):
                        pos = target + 16 * k1
                        rot = _ROTATIONS[t] if t < 3 else (6 if target == 6 else 14)
                        codes[..., m8, k8, k1] |= ((w >> ((pos - rot) % 32)) & 1) << shift
        codes = codes.permute(1, 5, 2, 0, 4, 6, 3, 7).reshape(n, k)  # kc g r q j m8 k8 k1 -> g m8 r kc j k8 q k1
        packed[x] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = sbytes.view(e, kcs, g, 8, 2, 2).permute(0, 2, 4, 3, 1, 5).reshape(e, n, k // 32)
    return packed, scales.contiguous()


@dataclass(frozen=True)
class E4m3Experts:
    """FP4 experts in the FP8 path's layout (`shuffle_fp4_e4m3`): L1's gate|up rows in L2's K order."""

    w1: torch.Tensor  # int32 [E, 2I, H/8]
    s1: torch.Tensor  # uint8 [E, 2I, H/32]
    w2: torch.Tensor  # int32 [E, H, I/8]
    s2: torch.Tensor  # uint8 [E, H, I/32]
    _rows: list = field(default_factory=list, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        """These words and scale words, and the row-scaled scale words once made."""
        return sum(t.nbytes for t in (self.w1, self.s1, self.w2, self.s2, *(w for r in self._rows for w in r)))

    def row_scaled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(s1, s2) as `row_scaled_words` (the row-scaled path's scale words, beside the block ones: 1/16 of the FP4
        bytes), made on the first call, one expert at a time, and kept."""
        if not self._rows:
            words = (torch.empty_like(self.s1), torch.empty_like(self.s2))
            for out, s in zip(words, (self.s1, self.s2)):
                for i in range(s.shape[0]):
                    out[i:i + 1] = row_scaled_words(s[i:i + 1])
            self._rows.append(words)
        return self._rows[0]

    @classmethod
    def from_packed(cls, experts: PackedExperts) -> "E4m3Experts":
        """The FP8 layout of experts in the BF16 kernels' layout (the same codes and bytes, reordered), one expert at
        a time (no full-size temporaries)."""
        out = [torch.empty_like(t) for t in (experts.w1, experts.s1, experts.w2, experts.s2)]
        for i in range(experts.num_local_experts):
            sl = slice(i, i + 1)
            out[0][sl], out[1][sl] = shuffle_fp4_e4m3(*unshuffle_fp4(experts.w1[sl], experts.s1[sl]), reorder_rows=True)
            out[2][sl], out[3][sl] = shuffle_fp4_e4m3(*unshuffle_fp4(experts.w2[sl], experts.s2[sl]))
        return cls(out[0], out[1], out[2], out[3])
