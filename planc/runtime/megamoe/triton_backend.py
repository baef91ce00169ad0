"""Triton Mega MoE experts for Hopper (and any GPU Triton runs on): FP4 weights stay packed in memory.

Why: the real kernel needs SM100 and the reference caches a dequantized BF16 copy (4x the FP4 bytes).
Here the e2m1 codes (two per byte) and the UE8M0 exponent bytes are read as stored on the experts module
and expanded to BF16 in registers, inside the GEMM; nothing else of the weights exists on the GPU.

Numerics are the reference backend's (docs/megamoe.md, steps 3-6): an FP8 value times its UE8M0 scale and
an e2m1 value times its UE8M0 scale are exact in BF16 and their product is exact in FP32, so a BF16 MMA
with FP32 accumulation over the exactly converted operands computes the reference's products; only the
order of the FP32 sums differs. L1 rounds to BF16 once; the epilogue clamps in BF16, computes
``silu(gate) * up * topk_weight`` in FP32 and requantizes per 32 intermediate channels with the kernel's
cast (no 1e-4 floor, RNE to e4m3 with saturation, emulated bit for bit); L2 rounds to BF16.

How it is organized (the ideas of vLLM's fused_moe and triton_kernels' matmul_ogs):
- (token, slot) pairs are sorted by local expert on the device and cut into blocks of `block_t` rows of
  one expert (`route`); the grid covers an upper bound of blocks, so nothing reads a device value on the
  host (CUDA-graph capturable) and programs past the last block return at once.
- swap-AB: the weight rows are the MMA's M dimension and the few tokens its N dimension, so decode
  batches of 1-16 rows per expert do not waste a 64-row MMA tile. `tl.dot_scaled` (e2m1 weights with
  their UE8M0 scales x BF16 activations) expands each weight tile in registers.
- one program per (block, N tile) reads its weight slice once; at decode every SM streams weights.
- L1 fuses SwiGLU, the clamp, the routing weight and the FP8 requantization into its epilogue; L2 writes
  each slot's output straight to its slot (the combine is the shared `reference.combine`).
Measured on an H200 (docs/benchmarks.md): ~41 µs per touched expert (~0.86 TB/s of weights) whatever the
rows per expert, which points at the weight expansion, not HBM or the MMA; the memory bound is not reached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planc.runtime.megamoe.quant import GRAN, float_to_ue8m0_bytes

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
    if device is not None and device.type != "cuda":
        return f"the weights are on {device.type} (Triton kernels need a CUDA GPU; TRITON_INTERPRET=1 runs them on CPU)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"compute capability sm_{major}x has no BF16 MMA (the Triton backend needs sm_80 or newer)"
    return None


@dataclass(frozen=True)
class PackedExperts:
    """Views of the module's FP4 parameters, as stored (no copy for float8_e8m0fnu scales)."""

    w1: torch.Tensor  # uint8 view of int8 [E, 2I, H/2]: e2m1 codes, low nibble = even index; rows [gate | up]
    s1: torch.Tensor  # uint8 [E, 2I, H/32]: UE8M0 exponent bytes
    w2: torch.Tensor  # uint8 view of int8 [E, H, I/2]
    s2: torch.Tensor  # uint8 [E, H, I/32]

    @classmethod
    def from_params(cls, gate_up, gate_up_scale, down, down_scale) -> "PackedExperts":
        return cls(
            gate_up.contiguous().view(torch.uint8), _exponent_bytes(gate_up_scale),
            down.contiguous().view(torch.uint8), _exponent_bytes(down_scale),
        )

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


def _exponent_bytes(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales as uint8 exponent bytes: a view for float8_e8m0fnu/uint8, a 4x smaller copy for float32."""
    if scale.dtype == torch.uint8:
        return scale.contiguous()
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.contiguous().view(torch.uint8)
    return float_to_ue8m0_bytes(scale).contiguous()


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

    def fit(self, hidden: int, inter: int) -> "KernelConfig":
        """The same config with each tile shrunk to a power of two that divides its dimension."""

        def div(tile, dim, floor):
            while tile > floor and dim % tile:
                tile //= 2
            if dim % tile:
                raise ValueError(
                    f"the Triton Mega MoE backend needs hidden and intermediate sizes divisible by {floor}, "
                    f"got hidden={hidden}, intermediate={inter}: use `experts.megamoe.backend: reference`"
                )
            return tile

        return KernelConfig(
            self.block_t, div(self.l1_n, inter, 32), div(self.l1_k, hidden, 32), div(self.l2_n, hidden, 32),
            div(self.l2_k, inter, 32), self.num_warps, self.num_stages,
        )


# Tuned on an H200 (bench/megamoe_gpu.py --sweep, DeepSeek-V4 layer; docs/benchmarks.md has the sweep),
# keyed by the average (token, slot) rows per local expert, a function of the shapes only.
_CONFIGS = (
    # (up to this many rows per local expert on average, config)
    (0.05, KernelConfig(block_t=16, l1_n=32, l1_k=256, l2_n=32, l2_k=256, num_warps=4, num_stages=3)),
    (16, KernelConfig(block_t=16, l1_n=128, l1_k=128, l2_n=128, l2_k=128, num_warps=8, num_stages=4)),
    (128, KernelConfig(block_t=64, l1_n=128, l1_k=64, l2_n=128, l2_k=64, num_warps=8, num_stages=3)),
    (None, KernelConfig(block_t=128, l1_n=128, l1_k=64, l2_n=128, l2_k=64, num_warps=8, num_stages=3)),
)


def pick_config(num_rows: int, num_local_experts: int, hidden: int, inter: int) -> KernelConfig:
    """The tuned config for a batch of `num_rows` (token, slot) pairs (shape only: no device read)."""
    per_expert = num_rows / max(num_local_experts, 1)
    for bound, config in _CONFIGS:
        if bound is None or per_expert <= bound:
            return config.fit(hidden, inter)
    raise AssertionError("unreachable: the last config has no bound")


def max_blocks(num_slots: int, num_local_experts: int, block_t: int) -> int:
    """Upper bound of row blocks: every expert that gets rows adds at most one partial block."""
    return -(-num_slots // block_t) + min(num_local_experts, num_slots)


def route(topk_idx: torch.Tensor, *, first_expert: int, num_local_experts: int, block_t: int):
    """Sort (token, slot) pairs by local expert and cut them into blocks of `block_t` rows of one expert.

    All on the device with static shapes. Returns ``(sorted_slots int32 [S], block_expert, block_row,
    block_end)``, the block arrays int32 of length `max_blocks(S, E_loc, block_t)`: block b covers sorted
    rows ``[block_row[b], block_end[b])`` of local expert ``block_expert[b]`` (``== E_loc``: no block).
    """
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
    def _l1_swiglu_kernel(
        x_ptr, w_ptr, s_ptr, sorted_ptr, weight_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        hidden, inter, num_topk, num_local,
        stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_out,
        clamp,
        HAS_CLAMP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert >= num_local:
            return
        row0 = tl.load(block_row_ptr + pid_b)
        row_end = tl.load(block_end_ptr + pid_b)
        rows = row0 + tl.arange(0, BT)
        row_ok = rows < row_end
        slot = tl.load(sorted_ptr + rows, mask=row_ok, other=0)
        token = slot // num_topk

        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_h = tl.arange(0, BK // 2)
        offs_g = tl.arange(0, BK // 32)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        wg_ptrs = w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_h[None, :]
        wu_ptrs = wg_ptrs + inter.to(tl.int64) * stride_wn
        sg_ptrs = s_base + offs_n[:, None].to(tl.int64) * stride_sn + offs_g[None, :]
        su_ptrs = sg_ptrs + inter.to(tl.int64) * stride_sn
        x_ptrs = x_ptr + token[None, :].to(tl.int64) * stride_x + tl.arange(0, BK)[:, None]  # [BK, BT]

        acc_g = tl.zeros((BN, BT), dtype=tl.float32)
        acc_u = tl.zeros((BN, BT), dtype=tl.float32)
        for k0 in range(0, hidden, BK):
            x = tl.load(x_ptrs + k0, mask=row_ok[None, :], other=0.0)
            acc_g = tl.dot_scaled(tl.load(wg_ptrs + k0 // 2), tl.load(sg_ptrs + k0 // 32), "e2m1", x, None, "bf16",
                                  acc_g)
            acc_u = tl.dot_scaled(tl.load(wu_ptrs + k0 // 2), tl.load(su_ptrs + k0 // 32), "e2m1", x, None, "bf16",
                                  acc_u)

        gate = _bf16_rne(acc_g).to(tl.float32)  # L1 rounded to BF16 once
        up = _bf16_rne(acc_u).to(tl.float32)
        if HAS_CLAMP:  # `clamp` is already a BF16 value: clamping the BF16 numbers in FP32 is exact
            gate = tl.minimum(gate, clamp)
            up = tl.minimum(tl.maximum(up, -clamp), clamp)
        topw = tl.load(weight_ptr + slot, mask=row_ok, other=0.0)
        silu = tl.div_rn(gate, 1.0 + tl.exp(-gate))
        a = silu * up * topw[None, :]
        a = tl.where(row_ok[None, :], a, 0.0)

        # The kernel's requantization per 32 intermediate channels (quant.requantize_fp8_like_kernel).
        a3 = tl.reshape(a, (BN // 32, 32, BT))
        amax = tl.max(tl.abs(a3), axis=1)  # [BN/32, BT]
        scaled = amax * (1.0 / 448.0)
        sbits = scaled.to(tl.int32, bitcast=True)
        e = ((sbits >> 23) & 0xFF) - 127 + ((sbits & 0x7FFFFF) != 0).to(tl.int32)
        sf = (tl.maximum(e + 127, 0) << 23).to(tl.float32, bitcast=True)
        sf_inv = (tl.minimum(tl.maximum(127 - e, 0), 254) << 23).to(tl.float32, bitcast=True)
        q = a3 * sf_inv[:, None, :]
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        q = _round_e4m3(q) * sf[:, None, :]
        q = tl.reshape(q, (BN, BT)).to(tl.bfloat16)  # exact: an e4m3 value times a power of two

        out_rows = pid_b * BT + tl.arange(0, BT)
        out_ptrs = out_ptr + out_rows[None, :].to(tl.int64) * stride_out + offs_n[:, None]
        tl.store(out_ptrs, q)

    @triton.jit
    def _l2_kernel(
        a_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, block_row_ptr, block_end_ptr, out_ptr,
        inter, num_local,
        stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_out,
        BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_b)
        if expert >= num_local:
            return
        row0 = tl.load(block_row_ptr + pid_b)
        row_end = tl.load(block_end_ptr + pid_b)
        rows = row0 + tl.arange(0, BT)
        row_ok = rows < row_end
        slot = tl.load(sorted_ptr + rows, mask=row_ok, other=0)

        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_h = tl.arange(0, BK // 2)
        offs_g = tl.arange(0, BK // 32)
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_h[None, :]
        s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None].to(tl.int64) * stride_sn + offs_g[None, :]
        a_rows = pid_b * BT + tl.arange(0, BT)
        a_ptrs = a_ptr + a_rows[None, :].to(tl.int64) * stride_a + tl.arange(0, BK)[:, None]  # [BK, BT]

        acc = tl.zeros((BN, BT), dtype=tl.float32)
        for k0 in range(0, inter, BK):
            acc = tl.dot_scaled(tl.load(w_ptrs + k0 // 2), tl.load(s_ptrs + k0 // 32), "e2m1", tl.load(a_ptrs + k0),
                                None, "bf16", acc)

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
    m, k = topk_idx.shape
    hidden, inter, num_local = experts.hidden, experts.intermediate, experts.num_local_experts
    device = x_fp8.device
    out = torch.zeros((m * k, hidden), dtype=torch.bfloat16, device=device)
    if m == 0:
        return out.view(m, k, hidden)
    cfg = config or pick_config(m * k, num_local, hidden, inter)
    cfg = cfg.fit(hidden, inter)

    # x as exact BF16 (an e4m3 value times a power of two), read by the L1 kernel by token.
    scales = (x_sf.to(torch.int32) << 23).view(torch.float32).to(torch.bfloat16)
    x = (x_fp8.to(torch.bfloat16).view(m, hidden // GRAN, GRAN) * scales.unsqueeze(2)).view(m, hidden)
    weights = topk_weights.reshape(-1).float().contiguous()
    sorted_slots, block_expert, block_row, block_end = route(
        topk_idx, first_expert=first_expert, num_local_experts=num_local, block_t=cfg.block_t
    )
    nblocks = block_expert.numel()
    act = torch.empty((nblocks * cfg.block_t, inter), dtype=torch.bfloat16, device=device)
    clamp = bf16_clamp(activation_clamp)
    w1, s1, w2, s2 = experts.w1, experts.s1, experts.w2, experts.s2
    _l1_swiglu_kernel[(nblocks, inter // cfg.l1_n)](
        x, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act,
        hidden, inter, k, num_local,
        x.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), act.stride(0),
        0.0 if clamp is None else clamp,
        HAS_CLAMP=clamp is not None, BT=cfg.block_t, BN=cfg.l1_n, BK=cfg.l1_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _l2_kernel[(nblocks, hidden // cfg.l2_n)](
        act, w2, s2, sorted_slots, block_expert, block_row, block_end, out,
        inter, num_local,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
        BT=cfg.block_t, BN=cfg.l2_n, BK=cfg.l2_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.view(m, k, hidden)
