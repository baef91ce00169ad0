"""Triton Mega MoE experts for Hopper (and any GPU Triton runs on): FP4 weights stay packed in memory.

Why: the real kernel needs SM100 and the reference caches a dequantized BF16 copy (4x the FP4 bytes).
Here the e2m1 codes and the UE8M0 exponent bytes stay 4 bits and 1 byte per weight group in GPU memory and are
expanded to BF16 in registers, inside the GEMM; nothing else of the weights exists on the GPU. On its first forward
the backend reorders those bytes once (`shuffle_fp4`, in place of the module's parameters: same dtypes, shapes and
sizes) into the register fragments of the Hopper MMA, so each thread loads exactly its operand words (16 contiguous
bytes) and expands 8 weights in 13 instructions (`_EXPAND_PTX`), with no shuffle through shared memory.

Numerics are the reference backend's (docs/megamoe.md, steps 3-6): an FP8 value times its UE8M0 scale and
an e2m1 value times its UE8M0 scale are exact in BF16 and their product is exact in FP32, so a BF16 MMA
with FP32 accumulation over the exactly converted operands computes the reference's products; only the
order of the FP32 sums differs. L1 rounds to BF16 once; the epilogue clamps in BF16, computes
``silu(gate) * up * topk_weight`` in FP32 and requantizes per 32 intermediate channels with the kernel's
cast (no 1e-4 floor, RNE to e4m3 with saturation, emulated bit for bit); L2 rounds to BF16; the combine sums
the slots in FP32 in slot order (`combine`, one kernel, the same arithmetic as `reference.combine`).

How it is organized (the ideas of vLLM's fused_moe, triton_kernels' matmul_ogs and its Hopper MX layouts, Marlin):
- staging (`stage`: the FP8 cast of the tokens, the routing copy, the exchange padding) and the L1 input
  (`dequantize_x`) are one kernel each, the same bytes as the reference's torch ops (~20 launches at decode).
- (token, slot) pairs are sorted by local expert on the device and cut into blocks of `block_t` rows of
  one expert (`route`: one Triton program up to `FUSED_ROUTE_MAX_SLOTS` pairs, torch ops above); the grid covers an
  upper bound of blocks, so nothing reads a device value on the host (CUDA-graph capturable) and programs past
  the last block return at once.
- swap-AB: the weight rows are the MMA's M dimension and the few tokens its N dimension, so decode
  batches of 1-16 rows per expert do not waste a 64-row MMA tile. Each weight tile is expanded in registers to
  BF16 (`_fp4_tile`: inline PTX on the GPU, Triton ops under the interpreter) and meets the activations in one MMA.
- one program per (block, N tile) reads its weight slice once; at decode every SM streams weights. A 1-2 token
  batch has too few such programs, so L1 then splits the hidden dimension (`l1_split`, `_l1_reduce_kernel`).
- each program prefetches the next K tile's bytes into registers (`REGISTER_PREFETCH`, Triton >= 3.5) instead of
  staging them in shared memory through Triton's cp.async pipeline: 15-30% fewer instructions per weight.
- L1 fuses SwiGLU, the clamp, the routing weight and the FP8 requantization into its epilogue; L2 writes
  each slot's output straight to its slot.
Measured on an H200 (docs/benchmarks.md), DeepSeek-V4 layer: under Triton 3.7.1 103-106 µs at 1 token, 1.35-1.52x
the FP4 bound at 16-256 tokens (three runs) and 10.6-10.7 ms at 4096; under 3.6 108 µs, 1.46-1.59x and 11.4 ms.
On Hopper, batches of 45-80 rows per expert run `hopper_prefill`'s Gluon kernels instead: at 4096 tokens the layer
call takes 8.65 ms (Triton 3.7.1) / 8.70 ms (3.6).
Both GEMMs are issue-bound at decode (Nsight Compute: instructions issued in ~80-85% of cycles with 3-4 other warps
eligible), so what counts is instructions per weight at a given register and shared-memory budget per program: the
expansion is 13 per 8 weights; tiles with fewer instructions overall but more registers or shared-memory traffic ran
slower, keeping several wgmma in flight changed nothing, and narrower MMAs over row sub-blocks (to skip a block's
padding at prefill) cost more than they skipped (the measurements are in that file).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from planc.kernels.megamoe.quant import float_to_ue8m0_bytes

try:  # Triton ships with torch's CUDA builds; CPU CI installs it for the interpreter (TRITON_INTERPRET=1).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


def triton_unavailable_reason(device: torch.device | None) -> str | None:
    """None when the Triton backend can run on `device`, else why not."""
    if triton is None:
        return "the `triton` package is not installed (it ships with torch's CUDA builds: `pip install triton`)"
    if _interpreting():
        return None  # Triton's CPU interpreter (TRITON_INTERPRET=1 when planc was imported): runs anywhere, slowly
    if torch.version.hip is not None:  # ROCm reports `cuda` devices and capabilities such as (9, 4) on MI300
        return (f"a ROCm build of torch (HIP {torch.version.hip}): the Triton kernels are written against NVIDIA's "
                "PTX (inline conversions, wgmma)")
    if device is not None and device.type != "cuda":
        return f"the weights are on {device.type} (Triton kernels need a CUDA GPU; TRITON_INTERPRET=1 runs them on CPU)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"compute capability sm_{major}x has no BF16 MMA (the Triton backend needs sm_80 or newer)"
    return None


# The weight layout the kernels read (`shuffle_fp4`, once per module: the FP4 parameters are replaced by the same bytes
# in this order, still e2m1 codes with UE8M0 exponent bytes, 4 bits per weight). It is the register fragment of the
# Hopper MMA (A operand, BF16, 16x16): one int32 word holds the 8 weights one thread of a warp owns in one 16x16 tile,
# and one thread's 4 words (4 consecutive K tiles) are 16 contiguous bytes, so a warp reads 512 contiguous bytes and
# each thread gets exactly its operand registers (no shuffle through shared memory).
# Matrix [N, K] (N rows: output channels; K: the reduced dimension), N % 16 == 0, K % 64 == 0:
#   row n = 16 g + 8 m8 + r,  K index k = 64 kc + 16 j + 8 k8 + 2 q + k1   (r < 8, q < 4, j < 4, m8/k8/k1 < 2)
#   word (kc, g, r, q, j), at int32 offset (((kc * N/16 + g) * 8 + r) * 4 + q) * 4 + j, holds the 8 weights
#   (m8, k8, k1); output t = 2 m8 + k8 of the expansion is the BF16 pair (k1 = 0 low half, 1 high half).
#   Each code's sign goes to bit 15 and its three magnitude bits to bits 8..6 of its half (e2m1 value x 2**-126 as a
#   BF16) after a rotation of the word: output 0 by 0, 1 by 4, 2 by 10; output 3 takes its m0 bits from a rotation by
#   6 and the others from a rotation by 14 (`_ROTATIONS`), so 13 instructions expand 8 weights (`_EXPAND_PTX`).
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
    """FP4 experts in the kernels' layout (`shuffle_fp4`): views of the module's parameters once they hold it."""

    w1: torch.Tensor  # int32 [E, 2I, H/8]: gate|up words (rows [gate | up], as in the module)
    s1: torch.Tensor  # uint8 [E, 2I, H/32]: their UE8M0 exponent bytes, in the layout's order
    w2: torch.Tensor  # int32 [E, H, I/8]
    s2: torch.Tensor  # uint8 [E, H, I/32]
    # A scale byte above 128 (a weight above 12) would overflow the merged factor 2**(s-1): two multiplies then.
    large_scales: bool = False

    @classmethod
    def from_params(cls, gate_up, gate_up_scale, down, down_scale) -> "PackedExperts":
        """Shuffled copies of FP4 parameters in the module layout (tests; the runner shuffles the module once)."""
        w1, s1 = shuffle_fp4(gate_up.contiguous().view(torch.uint8), _exponent_bytes(gate_up_scale))
        w2, s2 = shuffle_fp4(down.contiguous().view(torch.uint8), _exponent_bytes(down_scale))
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


def _exponent_bytes(scale: torch.Tensor) -> torch.Tensor:
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


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes: `block_t` rows (token slots) of one expert per block; N and K tiles of each GEMM."""

    block_t: int = 16
    l1_n: int = 64  # gate columns per program (and as many up columns); multiple of 32 (requant groups)
    l1_k: int = 128
    l2_n: int = 64
    l2_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    l1_split: int = 1  # L1 split-K: hidden slices per (block, N tile), a power of two
    # Registers per thread for the L1 and L2 kernels (0: ptxas's choice). ptxas does not weigh how many programs
    # fit on an SM; a cap that it can meet without spilling buys more of them (`bench/megamoe_gpu.py --sweep`).
    maxnreg: int = 0
    # Stream the weights by register prefetch where Triton lowers it well (`REGISTER_PREFETCH`), else through
    # Triton's cp.async pipeline (then `num_stages` buffers); 0 forces the pipeline.
    prefetch: int = 1
    # 1: the Hopper kernels in Gluon (`hopper_prefill`: async wgmma, blocks of 80 or 96 rows, `num_stages` cp.async
    # stages, l1_n = l2_n = 16 * num_warps, K tiles of 64). `pick_config` picks them only on sm_90. 2: the same L1,
    # and L2 with its copies in a producer warp (`hopper_prefill_ws`: TMA, mbarriers, `num_stages` stages).
    gluon: int = 0
    # L2's register cap where it is not `maxnreg` (0: the same). The warp-specialized L2 runs 8 warps per program
    # (4 MMA warps and the producer's warpgroup at 24): 64 fits four programs per SM, the MMA warps getting 104.
    l2_maxnreg: int = 0

    # The block sizes the Gluon kernels have loop bodies for: a 64-row MMA and up to one (80) or two (96) 16-row MMAs;
    # 80-row blocks compile without the two-tail body, in fewer registers (see `_GLUON_CONFIGS`).
    GLUON_BLOCK_ROWS: ClassVar[tuple[int, ...]] = (80, 96)

    def gluon_fits(self, hidden: int, inter: int) -> bool:
        """Whether the Gluon kernels run these tiles on these shapes as they are (they do not shrink them): N tiles
        that divide, and L2's K tiles of 64 in pairs."""
        return not (inter % self.l1_n or hidden % self.l2_n or inter % 128)

    def launch_registers(self, layer: str = "L1") -> dict:
        """The launch's register cap, where the config sets one and the kernels are compiled (not interpreted)."""
        cap = self.l2_maxnreg if layer == "L2" and self.l2_maxnreg else self.maxnreg
        return {"maxnreg": cap} if cap and not _interpreting() else {}

    def fit(self, hidden: int, inter: int) -> "KernelConfig":
        """The same config with each tile shrunk to a power of two that divides its dimension (K tiles: 64 or
        more, the weight layout's K block; N tiles: 32 or more, the requantization groups)."""
        if hidden % 64 or inter % 64:
            raise ValueError(
                f"the Triton Mega MoE backend needs hidden and intermediate sizes divisible by 64 (its weight "
                f"layout), got hidden={hidden}, intermediate={inter}: use `experts.megamoe.backend: reference`"
            )

        def div(tile, dim, floor):
            tile = max(tile, floor)
            while tile > floor and dim % tile:
                tile //= 2
            return tile

        l1_k = div(self.l1_k, hidden, 64)
        split = self.l1_split
        while split > 1 and hidden % (l1_k * split):
            split //= 2
        if self.gluon:
            if not self.gluon_fits(hidden, inter):
                raise ValueError(f"the Gluon kernels' tiles ({self.l1_n}, {self.l2_n}) do not divide intermediate "
                                 f"{inter} and hidden {hidden}, or L2's K tiles do not pair (intermediate % 128): "
                                 f"`pick_config` picks them only where they do")
            if self.block_t not in self.GLUON_BLOCK_ROWS:
                raise ValueError(f"the Gluon kernels take blocks of {' or '.join(map(str, self.GLUON_BLOCK_ROWS))} "
                                 f"rows, not block_t={self.block_t}: set KernelConfig(block_t=...) to one of them")
            return self
        return dataclasses.replace(self, l1_n=div(self.l1_n, inter, 32), l1_k=l1_k, l2_n=div(self.l2_n, hidden, 32),
                                   l2_k=div(self.l2_k, inter, 64), l1_split=split)

    def cp_async_l2(self) -> "KernelConfig":
        """This Gluon config with the cp.async L2 (`hopper_prefill`) in place of the warp-specialized one, under L1's
        register cap: where this Triton cannot build the latter (`hopper_prefill_ws.unavailable_reason`)."""
        return dataclasses.replace(self, gluon=1, l2_maxnreg=0)


# Tuned on an H200 (bench/megamoe_gpu.py --sweep on the DeepSeek-V4 and the mid-size layer, under Triton 3.6 (torch
# 2.11) and 3.7.1 (torch 2.13); docs/benchmarks.md has the sweeps), keyed by the average (token, slot) rows per local
# expert, a function of the shapes only. K tiles of 64 everywhere: under Triton 3.7.1 a K-128 program holds ~125
# registers and the K-128 tiles that were tuned on 3.6 ran V4 at 16 tokens in 1437 µs against 973.
_CONFIGS = (
    # (up to this many rows per local expert on average, config)
    (16, KernelConfig(block_t=16, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=4, num_stages=4)),
    # 32-row blocks only while one block holds an average expert: at 40 rows per expert the 64-row blocks ran V4 in
    # 7461 against 9751 µs and the mid-size layer in 318 against 352 (Triton 3.7.1; 3.6 alike); at 32 rows 7275 /
    # 7261 and 228 / 253.
    (32, KernelConfig(block_t=32, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=4, num_stages=5)),
    # 64-row blocks: ptxas gives L1 175-191 registers, one program of 8 warps per SM; capped at 128 (no spill) two fit
    # (V4 at 4096 tokens: 10.7 against 11.7 ms under Triton 3.7.1, 12.3 against 14.0 under 3.6).
    (64, KernelConfig(block_t=64, l1_n=128, l1_k=64, l2_n=128, l2_k=64, num_warps=8, num_stages=4, maxnreg=128)),
    # Above 64 rows per expert 128-row blocks pad no more than 64-row ones and expand each weight half as often: at 80
    # rows V4 11874 against 13578 µs and the mid-size layer 502 against 533, at 96 rows 11850 against 14086 and 491
    # against 535 (3.7.1; 3.6 alike), at 384 rows (mid-size, 4096 tokens) 1288 against 1491. Through the pipeline:
    # with register prefetch L2 holds 148 registers instead of 123 (L1 255 either way), and the mid-size layer at
    # 4096 tokens ran 1581 against 1254 µs under 3.7.1.
    (None, KernelConfig(block_t=128, l1_n=128, l1_k=64, l2_n=128, l2_k=64, num_warps=8, num_stages=4, prefetch=0)),
)


# On Hopper, where the Gluon kernels run (`hopper_prefill`), they take the batches of 45-80 rows per local expert
# from the Triton kernels: blocks of 80 rows up to 68 rows per expert, 96 above. Experts computation, V4, µs, Triton
# 3.7.1 (torch 2.13's, which decides) / 3.6, ninth session (docs/benchmarks.md): at 48 rows (3072 tokens) 80-row
# blocks 7058 against the best Triton config's 7612 (3.7.1); at 56 rows 8209 / 7487 against 8589 / 9124; at 64
# rows 80-row and 96-row blocks within noise (80 ahead by 1-3% in three 3.7.1 runs, 3.6 split), both ~1.2x the
# Triton kernels; at 72 rows 96-row blocks 9671 against 10226 (an average expert no longer fits 80 rows); at 80 rows
# 10750 / 10662 against the 128-row Triton kernels' 11607 / 12156. Below 48 rows not re-measured with the cap (at
# 40 the uncapped 96-row kernel lost by 1.09x): the bound sits halfway. 4 warps with 64-column tiles and 4 stages
# beat 8 warps with 128 (9.0 ms at 4096 tokens) and 6 stages (9.2 ms), eighth session. Registers: L1 holds 214
# with the two-tail body of 96-row blocks (two programs per SM), 191 without it (80-row blocks); capped at 168,
# three fit (spills outside the K loops only, which the compile test checks): ptxas then serializes the 96-row L1's
# wgmma and keeps the 80-row L1's async; 96-row blocks at 4096 tokens 8041 / 8797 µs capped against 9157 / 9158
# uncapped (eighth session), 80-row blocks 8756 / 8820 against 9201 / 9099.
# L2 is the warp-specialized one (`hopper_prefill_ws`, tenth session): at 4096 tokens, 80-row blocks, 8393-8427 µs
# (3.6) / 8333 (3.7.1) with four programs per SM (64 registers, 104 for the MMA warps) against 8811-8820 / 8732 for
# the cp.async L2; three programs (80) 8520-8585, two (96) 8890; 6 stages 9216. 96-row blocks under 3.6: 8560 at 80
# registers (three programs; ptxas serializes the wgmma at 136) against 8882 at 96 (two, async) and 9073 cp.async.
_GLUON_CONFIGS = (
    (44, None),
    (68, KernelConfig(block_t=80, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=4, num_stages=4, maxnreg=168, gluon=2,
                      l2_maxnreg=64)),
    (80, KernelConfig(block_t=96, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=4, num_stages=4, maxnreg=168, gluon=2,
                      l2_maxnreg=80)),
)


def _triton_at_least(major: int, minor: int) -> bool:
    """Whether the installed Triton is `major.minor` or newer (how it lowers a loop is version-specific)."""
    try:
        found = tuple(int(v) for v in triton.__version__.split(".")[:2])
    except ValueError:  # pragma: no cover - an unparsable (source build) version: assume the newer lowering
        return True
    return found >= (major, minor)


# How the two GEMM loops stream the weights (the kernels' `PREFETCH`, per config `KernelConfig.prefetch`). Each
# program loads the next K tile's words, scale words and activations into registers while it expands and multiplies
# this one: the weights never pass through shared memory, and the loop has none of the cp.async pipeline's stage
# bookkeeping (sm_90 SASS, L1 / L2 loop per thread: 181 / 104 instructions against 245 / 150 under Triton 3.7.1, 204 /
# 110 against 239 / 152 under 3.6; decode batches are issue-bound). Same device call, V4 experts computation at 16 /
# 64 / 256 / 4096 tokens: 926 / 2489 / 3985 / 10420 µs against 1024 / 2808 / 4442 / 10847 under Triton 3.7.1, 943 /
# 2608 / 4326 / 11291 against 968 / 2708 / 4577 / 11896 under 3.6; the same bits. It needs Triton to keep the
# loop-carried words in the layout they were loaded in, the MMA operand's (`_fp4_offsets`): 3.5 and 3.6 compile the
# loop as 3.6 was measured; 3.3 and 3.4 still move part of each tile through shared memory (not measured), so they
# keep Triton's software pipeline (`num_stages` cp.async buffers; `num_stages` means nothing to the prefetch loop).
REGISTER_PREFETCH = triton is not None and _triton_at_least(3, 5)


# L1 splits its hidden dimension (`l1_split`) until there are ~8 L1 programs per SM, keeping at least 4 pipeline
# depths of K tiles per slice. One program streams weights at only a few GB/s (it waits on its loads and MMAs), so
# a 1-token batch (6 experts x I / l1_n programs) needs several per SM: V4 at 1 token, 288 programs, 1 / 2 / 4 / 8
# slices: 121 / 116 / 106 / 112 µs (Triton 3.7.1); the mid-size layer (132 programs, 32 K tiles): 39 / 33 / 34 / 36.
_L1_PROGRAMS_PER_SM = 8
_L1_MIN_SLICE_STAGES = 4
# 16-row blocks take L2 N tiles of 128 (half the programs, each expanding twice the weight rows per activation tile)
# where that still leaves at least this many L2 programs per SM. Experts computation, sustained, 16 / 64 / 256
# tokens, two sweeps per Triton on one machine (eleventh session, docs/benchmarks.md): V4 (41-163 such programs per
# SM) 860 / 2356 / 4133 and 847 / 2480 / 4075 against 880 / 2405 / 4196 and 866 / 2445 / 4107 µs (3.7.1), 914 / 2521
# / 4297 and 903 / 2599 / 4302 against 943 / 2588 / 4529 and 937 / 2666 / 4541 (3.6); V4 at 1 token (2.5 per SM)
# 104-105 against 99 µs (3.7.1, both split in 4); the mid-size layer at 16 tokens (7.8 per SM) 111-112 against
# 107-108 µs (3.7.1), 64 tokens within 1-2%.
_L2_WIDE_PROGRAMS_PER_SM = 16
_TUNED_SMS = 132  # the H200 the table was tuned on: the SM count assumed off the GPU (the interpreter)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (a cached host property: no sync); `_TUNED_SMS` off the GPU (the interpreter)."""
    if device.type != "cuda":
        return _TUNED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_config(
    num_rows: int, num_local_experts: int, hidden: int, inter: int, num_sms: int = _TUNED_SMS, gluon: bool = False,
    warp_specialized: bool = True,
) -> KernelConfig:
    """The tuned config for a batch of `num_rows` (token, slot) pairs (shapes and SM count only: no device read);
    `gluon`: the Hopper Gluon kernels can run (`hopper_prefill.gluon_unavailable_reason`); `warp_specialized`: and
    this Triton builds the warp-specialized L2 (`hopper_prefill_ws.unavailable_reason`), else the cp.async L2 runs
    under L1's register cap."""
    per_expert = num_rows / max(num_local_experts, 1)
    if gluon:
        for bound, config in _GLUON_CONFIGS:
            if per_expert <= bound:
                if config is not None and config.gluon_fits(hidden, inter):
                    return config if warp_specialized else config.cp_async_l2()
                break
    for bound, config in _CONFIGS:
        if bound is None or per_expert <= bound:
            break
    config = config.fit(hidden, inter)
    # L1 programs: row blocks (at least one per expert that gets rows) times N tiles. A prefill batch (blocks of 64
    # rows and more) must not split, even with few programs: mid-size layer at 4096 tokens, 192 blocks of 128 rows,
    # 2273 µs split in 2; at 56 / 64 / 80 rows per expert, 64 blocks of 64 rows (704 programs), 380 / 491 / 582 µs
    # split in 2 against 337 / 443 / 533 (Triton 3.7.1; 3.6 alike).
    blocks = max(min(num_rows, num_local_experts), -(-num_rows // config.block_t))
    programs = blocks * max(inter // config.l1_n, 1)
    k_tiles = hidden // config.l1_k
    split = 1
    while (config.block_t < 64 and split < 8 and programs * split < _L1_PROGRAMS_PER_SM * num_sms
           and k_tiles // (2 * split) >= _L1_MIN_SLICE_STAGES * config.num_stages):
        split *= 2
    l2_n = config.l2_n
    if config.block_t == 16 and hidden % 128 == 0 and blocks * (hidden // 128) >= _L2_WIDE_PROGRAMS_PER_SM * num_sms:
        l2_n = 128
    return dataclasses.replace(config, l1_split=split, l2_n=l2_n).fit(hidden, inter)


def device_config(num_rows: int, num_local_experts: int, hidden: int, inter: int, device: torch.device) -> KernelConfig:
    """`pick_config` for this device: its SM count and whether the Gluon kernels (and the warp-specialized L2) run on
    it (what a forward without an explicit config runs; the benchmark's sweep marks it)."""
    from planc.kernels.megamoe.triton import hopper_prefill, hopper_prefill_ws  # they import this module

    return pick_config(num_rows, num_local_experts, hidden, inter, sm_count(device),
                       gluon=hopper_prefill.gluon_unavailable_reason(device) is None,
                       warp_specialized=hopper_prefill_ws.unavailable_reason is None)


def max_blocks(num_slots: int, num_local_experts: int, block_t: int) -> int:
    """Upper bound of row blocks: every expert that gets rows adds at most one partial block."""
    return -(-num_slots // block_t) + min(num_local_experts, num_slots)


# One program does the whole routing (`_route_kernel`) up to this many (token, slot) pairs: at decode the ~30 small
# torch ops of `_route_torch` cost more than the GEMMs.
FUSED_ROUTE_MAX_SLOTS = 2048


def route(topk_idx: torch.Tensor, *, first_expert: int, num_local_experts: int, block_t: int):
    """Sort (token, slot) pairs by local expert and cut them into blocks of `block_t` rows of one expert.

    All on the device with static shapes. Returns ``(sorted_slots int32 [S], block_expert, block_row,
    block_end)``, the block arrays int32 of length `max_blocks(S, E_loc, block_t)`: block b covers sorted
    rows ``[block_row[b], block_end[b])`` of local expert ``block_expert[b]`` (``== E_loc``: no block).
    Small batches on a GPU (or under the interpreter) take one Triton program, others torch ops; same result.
    """
    num_slots = topk_idx.numel()
    if triton is not None and 0 < num_slots <= FUSED_ROUTE_MAX_SLOTS and (topk_idx.is_cuda or _interpreting()):
        return _route_fused(topk_idx, first_expert=first_expert, num_local_experts=num_local_experts, block_t=block_t)
    return _route_torch(topk_idx, first_expert=first_expert, num_local_experts=num_local_experts, block_t=block_t)


def _route_fused(topk_idx: torch.Tensor, *, first_expert: int, num_local_experts: int, block_t: int):
    device = topk_idx.device
    num_slots = topk_idx.numel()
    nb = max_blocks(num_slots, num_local_experts, block_t)
    sorted_slots = torch.empty(num_slots, dtype=torch.int32, device=device)
    blocks = torch.empty((3, nb), dtype=torch.int32, device=device)
    be = triton.next_power_of_2(num_local_experts + 1)
    scratch = torch.empty((3, be), dtype=torch.int32, device=device)
    _route_kernel[(1,)](
        topk_idx.reshape(-1), sorted_slots, blocks, scratch, num_slots, first_expert, num_local_experts, nb,
        BS=triton.next_power_of_2(num_slots), BE=be, BB=triton.next_power_of_2(nb), BT=block_t,
        LOG_BE=be.bit_length() - 1, num_warps=4,
    )
    return sorted_slots, blocks[0], blocks[1], blocks[2]


def _route_torch(topk_idx: torch.Tensor, *, first_expert: int, num_local_experts: int, block_t: int):
    """`route` in torch ops (any size, any device)."""
    device = topk_idx.device
    e = topk_idx.reshape(-1)
    num_slots = e.numel()
    local = (e >= first_expert) & (e < first_expert + num_local_experts)
    local_id = torch.where(local, e - first_expert, num_local_experts)
    sorted_slots = torch.argsort(local_id, stable=True).to(torch.int32)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local_id, torch.ones_like(local_id))
    counts = counts[:num_local_experts]
    starts = torch.cumsum(counts, 0) - counts
    blocks = (counts + block_t - 1) // block_t
    block_end_cum = torch.cumsum(blocks, 0)
    b = torch.arange(max_blocks(num_slots, num_local_experts, block_t), device=device)
    expert = torch.searchsorted(block_end_cum, b, right=True)
    valid = expert < num_local_experts
    ec = expert.clamp(max=num_local_experts - 1)
    row = starts[ec] + (b - (block_end_cum[ec] - blocks[ec])) * block_t
    end = starts[ec] + counts[ec]
    return (
        sorted_slots,
        torch.where(valid, expert, num_local_experts).to(torch.int32),
        row.to(torch.int32),
        end.to(torch.int32),
    )


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
    def _bf16_halves(o):
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
    def _scale_factors(sw, LARGE: tl.constexpr):
        """Scale words (4 UE8M0 bytes: row half m8, K half jh at byte 2 m8 + jh) -> the BF16x2 factors that
        `_EXPAND_PTX` multiplies by, per byte: 2**(s-1) = 2**126 * 2**(s-127), exact for s <= 128; with LARGE,
        2**(s-127) (`_EXPAND_PTX_LARGE` multiplies by 2**126 first)."""
        bias: tl.constexpr = 0 if LARGE else 0x3F003F00
        return ((sw & 0xFF) * 0x00800080 + bias, ((sw >> 8) & 0xFF) * 0x00800080 + bias,
                ((sw >> 16) & 0xFF) * 0x00800080 + bias, ((sw >> 24) & 0xFF) * 0x00800080 + bias)

    @triton.jit
    def _expand_words(w, p0, p1, LARGE: tl.constexpr):
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
            s00, s01, s10, s11 = _scale_factors(sw, LARGE)
            o0, o1, o2, o3 = _expand_words(w, _per_j(s00, s01), _per_j(s10, s11), LARGE)
            a0 = _bf16_halves(o0)
            a1 = _bf16_halves(o1)
            a2 = _bf16_halves(o2)
            a3 = _bf16_halves(o3)
        c = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [KC, G, 32, j, k1, k8, m8]
        c = tl.reshape(c, (KC, G, 8, 4, 4, 2, 2, 2))  # [KC, G, r, q, j, k1, k8, m8]
        c = tl.permute(c, (1, 7, 2, 0, 4, 6, 3, 5))  # [g, m8, r, kc, j, k8, q, k1]: rows, then K in order
        return tl.reshape(c, (BN, BK))

    @triton.jit
    def _route_kernel(idx_ptr, sorted_ptr, blocks_ptr, scratch_ptr, num_slots, first, num_local, num_blocks,
                      BS: tl.constexpr, BE: tl.constexpr, BB: tl.constexpr, BT: tl.constexpr, LOG_BE: tl.constexpr):
        """`route` in one program: a stable sort by (local expert, slot) of unique keys, the per-expert counts
        (a histogram; other ranks' experts, -1 and padding fall in bin `num_local`), their prefix sums, and per block
        a binary search of the block-count prefix sums (kept in `scratch`) for its expert."""
        i = tl.arange(0, BS)
        e = tl.load(idx_ptr + i, mask=i < num_slots, other=-1).to(tl.int32)
        local = (e >= first) & (e < first + num_local) & (i < num_slots)
        lid = tl.where(local, e - first, num_local)
        key = tl.sort(lid * BS + i)
        tl.store(sorted_ptr + i, key % BS, mask=i < num_slots)

        counts = tl.histogram(lid, BE)
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
    def _combine_kernel(slots_ptr, out_ptr, hidden, stride_t, stride_k,
                        NUM_TOPK: tl.constexpr, BH: tl.constexpr):
        """`reference.combine` in one kernel: ``bf16(0 + fp32(o_0) + fp32(o_1) + ...)`` in slot order."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BH + tl.arange(0, BH)
        ok = offs < hidden
        acc = tl.zeros((BH,), dtype=tl.float32)
        for j in tl.static_range(NUM_TOPK):
            acc = acc + tl.load(slots_ptr + t * stride_t + j * stride_k + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * hidden + offs, _bf16_rne(acc), mask=ok)

    @triton.jit
    def _bf16_rne(x):
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
    def _stage_kernel(x_ptr, idx_ptr, w_ptr, q_ptr, sf_ptr, idx_out_ptr, w_out_ptr, n, hidden, stride_x,
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
    def _dequant_x_kernel(q_ptr, sf_ptr, out_ptr, hidden, BH: tl.constexpr):
        """FP8 bytes times their UE8M0 scales -> BF16 (exact: an e4m3 value times a power of two), for one row and
        BH channels: what L1 reads."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BH + tl.arange(0, BH)
        ok = col < hidden
        b = tl.load(q_ptr + row * hidden + col, mask=ok, other=0).to(tl.int32)
        s = tl.load(sf_ptr + row * (hidden // 32) + col // 32, mask=ok, other=0).to(tl.int32)
        e = (b >> 3) & 15
        normal = (((b & 0x80) << 24) | ((e + 120) << 23) | ((b & 7) << 20)).to(tl.float32, bitcast=True)
        sub = (b & 7).to(tl.float32) * 0.001953125
        v = tl.where(e == 0, tl.where((b & 0x80) != 0, -sub, sub), normal)
        tl.store(out_ptr + row * hidden + col, _bf16_rne(v * (s << 23).to(tl.float32, bitcast=True)), mask=ok)

    @triton.jit
    def _swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP: tl.constexpr, BN: tl.constexpr,
                        BT: tl.constexpr):
        """L1's epilogue on FP32 gate/up sums ``[BN, BT]``: round to BF16 once, clamp, ``silu(gate) * up * topw``
        in FP32, then the kernel's FP8 requantization per 32 channels (`quant.requantize_fp8_like_kernel`), as the
        exact BF16 values of the FP8 numbers."""
        gate = _bf16_rne(acc_g).to(tl.float32)
        up = _bf16_rne(acc_u).to(tl.float32)
        if HAS_CLAMP:  # `clamp` is already a BF16 value: clamping the BF16 numbers in FP32 is exact
            gate = tl.minimum(gate, clamp)
            up = tl.minimum(tl.maximum(up, -clamp), clamp)
        silu = tl.div_rn(gate, 1.0 + tl.exp(-gate))
        a = silu * up * topw[None, :]
        a = tl.where(row_ok[None, :], a, 0.0)

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
    def _tile_ids(num_n):
        """(block, N tile, number of blocks) of this program in a 1-D grid whose N tiles of one block are neighbours:
        the programs running at once then read a few experts' weights in whole K slabs and share their rows (V4 at
        4096 tokens: 11.8 against 12.8 ms with blocks as neighbours; decode batches within run-to-run spread)."""
        pid = tl.program_id(0)
        return pid // num_n, pid % num_n, tl.num_programs(0) // num_n

    @triton.jit
    def _block_slots(sorted_ptr, block_row_ptr, block_end_ptr, pid_b, BT: tl.constexpr):
        """The BT sorted rows of block `pid_b` (`route`): which are real, and the (token, slot) index of each."""
        rows = tl.load(block_row_ptr + pid_b) + tl.arange(0, BT)
        row_ok = rows < tl.load(block_end_ptr + pid_b)
        return row_ok, tl.load(sorted_ptr + rows, mask=row_ok, other=0)

    @triton.jit
    def _l1_swiglu_kernel(
        x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr, ws_ptr,
        hidden, inter, num_topk, num_local,
        stride_x, stride_we, stride_se, stride_out,
        clamp,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LARGE: tl.constexpr,
        INTERPRET: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    ):
        """L1 of one block of rows and BN gate (and as many up) columns, over the hidden slice `program_id(1)` of
        SPLIT: with SPLIT 1 it ends with the SwiGLU epilogue, else it writes its FP32 sums to `ws` for
        `_l1_reduce_kernel` (split-K: more programs streaming weights when a batch has few blocks)."""
        pid_b, pid_n, num_blocks = _tile_ids(inter // BN)
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
            q = _swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP, BN, BT)
            tl.store(out_ptr + out_rows[None, :].to(tl.int64) * stride_out + offs_n[:, None], q)
        else:
            ws = (ws_ptr + tl.program_id(1).to(tl.int64) * num_blocks * BT * 2 * inter
                  + out_rows[None, :].to(tl.int64) * (2 * inter) + offs_n[:, None])
            tl.store(ws, acc_g, mask=row_ok[None, :])
            tl.store(ws + inter, acc_u, mask=row_ok[None, :])

    @triton.jit
    def _l1_reduce_kernel(
        ws_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        inter, num_local, stride_out, clamp,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Split-K L1's second half: the SPLIT partial sums of one block and BN columns, added in split order, then
        the SwiGLU epilogue (`_swiglu_requant`)."""
        pid_b, pid_n, num_blocks = _tile_ids(inter // BN)
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
        q = _swiglu_requant(acc_g, acc_u, topw, row_ok, clamp, HAS_CLAMP, BN, BT)
        tl.store(out_ptr + out_rows[None, :].to(tl.int64) * stride_out + offs_n[:, None], q)

    @triton.jit
    def _l2_kernel(
        a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        hidden, inter, num_local,
        stride_a, stride_we, stride_se, stride_out,
        BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LARGE: tl.constexpr, INTERPRET: tl.constexpr,
        NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    ):
        pid_b, pid_n, _ = _tile_ids(hidden // BN)
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
        tl.store(out_ptrs, _bf16_rne(acc), mask=row_ok[None, :])  # L2 rounded to BF16

def _interpreting() -> bool:
    """Whether the kernels were defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import time:
    `triton.jit` decides when it decorates)."""
    return triton is not None and type(_l2_kernel).__name__ == "InterpretedFunction"


def bf16_clamp(activation_clamp: float | None) -> float | None:
    """The kernel's clamp constant: c rounded to BF16."""
    if activation_clamp is None:
        return None
    return float(torch.tensor(activation_clamp, dtype=torch.bfloat16))


def combine(slot_outputs: torch.Tensor) -> torch.Tensor:
    """`reference.combine` (``[n, K, H]`` BF16 slot outputs -> ``bf16(sum_j fp32(o_j))`` in slot order), one kernel."""
    n, k, hidden = slot_outputs.shape
    out = torch.empty((n, hidden), dtype=torch.bfloat16, device=slot_outputs.device)
    if n == 0:
        return out
    if slot_outputs.stride(2) != 1:
        slot_outputs = slot_outputs.contiguous()
    bh = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(n, triton.cdiv(hidden, bh))](
        slot_outputs, out, hidden, slot_outputs.stride(0), slot_outputs.stride(1), NUM_TOPK=k, BH=bh, num_warps=4,
    )
    return out


def stage(buf, hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, rows: int) -> None:
    """`reference.stage` in one kernel (the same bytes): at decode its ~20 small torch ops cost more than L2."""
    n, hidden = hidden_states.shape
    if rows == 0:
        return
    if hidden_states.stride(1) != 1:
        hidden_states = hidden_states.contiguous()
    num_topk = buf.topk_idx.shape[1]
    bh = min(1024, triton.next_power_of_2(hidden))
    _stage_kernel[(rows, triton.cdiv(hidden, bh))](
        hidden_states, topk_idx.contiguous(), topk_weights.contiguous(), buf.x.view(torch.uint8), buf.x_sf,
        buf.topk_idx, buf.topk_weights, n, hidden, hidden_states.stride(0),
        NUM_TOPK=num_topk, BK=triton.next_power_of_2(num_topk), BH=bh, num_warps=4,
    )


def dequantize_x(x_fp8: torch.Tensor, x_sf: torch.Tensor) -> torch.Tensor:
    """FP8 rows ``[M, H]`` with UE8M0 bytes ``[M, H/32]`` -> the exact BF16 values L1 reads, one kernel."""
    m, hidden = x_fp8.shape
    out = torch.empty((m, hidden), dtype=torch.bfloat16, device=x_fp8.device)
    bh = min(1024, triton.next_power_of_2(hidden))
    _dequant_x_kernel[(m, triton.cdiv(hidden, bh))](
        x_fp8.contiguous().view(torch.uint8), x_sf.contiguous(), out, hidden, BH=bh, num_warps=4)
    return out


def triton_local_experts_forward(
    x_fp8: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PackedExperts,
    *,
    first_expert: int,
    activation_clamp: float | None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """`reference.local_experts_forward` on packed FP4 weights: BF16 ``[M, K, H]`` slot outputs, zeros for
    slots whose expert is not in ``[first_expert, first_expert + E_loc)``."""
    from planc.kernels.megamoe.triton import hopper_prefill, hopper_prefill_ws  # they import this module

    m, k = topk_idx.shape
    hidden, inter, num_local = experts.hidden, experts.intermediate, experts.num_local_experts
    device = x_fp8.device
    out = torch.zeros((m * k, hidden), dtype=torch.bfloat16, device=device)
    if m == 0:
        return out.view(m, k, hidden)
    cfg = config or device_config(m * k, num_local, hidden, inter, device)
    cfg = cfg.fit(hidden, inter)

    x = dequantize_x(x_fp8, x_sf)  # read by the L1 kernel by token
    weights = topk_weights.reshape(-1).float().contiguous()
    sorted_slots, block_expert, block_row, block_end = route(
        topk_idx, first_expert=first_expert, num_local_experts=num_local, block_t=cfg.block_t
    )
    nblocks = block_expert.numel()
    act = torch.empty((nblocks * cfg.block_t, inter), dtype=torch.bfloat16, device=device)
    clamp = bf16_clamp(activation_clamp)
    w1, w2 = experts.w1, experts.w2
    s1 = experts.s1.reshape(num_local, -1).view(torch.int32)  # one int32 per (K block, row group, r): `shuffle_fp4`
    s2 = experts.s2.reshape(num_local, -1).view(torch.int32)
    if cfg.gluon:
        hopper_prefill.l1(x, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, clamp=clamp,
                          num_topk=k, large=experts.large_scales, config=cfg)
        l2 = hopper_prefill_ws.l2 if cfg.gluon == 2 else hopper_prefill.l2
        l2(act, w2, s2, sorted_slots, block_expert, block_row, block_end, out, hidden=hidden,
           large=experts.large_scales, config=cfg)
        return out.view(m, k, hidden)
    interpret = _interpreting()
    split = cfg.l1_split
    ws = torch.empty((split, nblocks * cfg.block_t, 2 * inter) if split > 1 else (1,), dtype=torch.float32,
                     device=device)
    common = dict(HAS_CLAMP=clamp is not None, BT=cfg.block_t, BN=cfg.l1_n)
    regs = cfg.launch_registers()
    prefetch = bool(cfg.prefetch) and REGISTER_PREFETCH
    _l1_swiglu_kernel[(nblocks * (inter // cfg.l1_n), split)](
        x, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, ws,
        hidden, inter, k, num_local,
        x.stride(0), w1.stride(0), s1.stride(0), act.stride(0),
        0.0 if clamp is None else clamp,
        BK=cfg.l1_k, LARGE=experts.large_scales, INTERPRET=interpret, NUM_STAGES=cfg.num_stages, SPLIT=split,
        PREFETCH=prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common, **regs,
    )
    if split > 1:
        _l1_reduce_kernel[(nblocks * (inter // cfg.l1_n),)](
            ws, sorted_slots, weights, block_expert, block_row, block_end, act, inter, num_local, act.stride(0),
            0.0 if clamp is None else clamp, SPLIT=split, num_warps=4, **common,
        )
    _l2_kernel[(nblocks * (hidden // cfg.l2_n),)](
        act, w2, s2, sorted_slots, block_expert, block_row, block_end, out,
        hidden, inter, num_local,
        act.stride(0), w2.stride(0), s2.stride(0), out.stride(0),
        BT=cfg.block_t, BN=cfg.l2_n, BK=cfg.l2_k, LARGE=experts.large_scales, INTERPRET=interpret,
        NUM_STAGES=cfg.num_stages, PREFETCH=prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **cfg.launch_registers("L2"),
    )
    return out.view(m, k, hidden)
