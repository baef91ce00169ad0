"""Pure-PyTorch Mega MoE: DeepGEMM's `fp8_fp4_mega_moe` computation, step by step, on CPU or any GPU.

Why it exists: the kernel runs only on SM100; this backend gives every other machine (and the tests) the
same arithmetic and the same communication pattern, at reference speed. Numerics (docs/megamoe.md):

1. x -> FP8 e4m3 with UE8M0 scales per 32 along hidden (staged into the shared buffer).
2. Dispatch: the staged rows of every rank are all-gathered; each rank keeps the (token, slot) pairs whose
   global expert it owns (`e // E_loc == rank`); `-1` slots are skipped.
3. L1: grouped GEMM per local expert, FP32 accumulate, rounded to BF16 once.
4. Clamp in BF16 (`gate <= c`, `-c <= up <= c`), then FP32 ``a = silu(gate) * up * topk_weight``: the
   routing weight is applied *before* the requantization.
5. Requantize ``a`` to FP8 per 32 intermediate channels (the kernel's cast: no 1e-4 floor).
6. L2: grouped GEMM, FP32 accumulate, rounded to BF16.
7. Combine: the slot outputs go back to the token's rank (all-to-all); there
   ``y = bf16(sum_j fp32(o_j))`` over valid slots in ascending j, starting at 0 (no valid slot -> 0).

Dequantized FP8/FP4 values are exact in BF16 and their products exact in FP32, so on GPU the grouped
GEMMs run in BF16 with FP32 accumulation (torch's grouped_mm) and on CPU in FP32: both are the kernel's
math up to accumulation order. No per-token Python loops and no host syncs (graph-capturable on CUDA).

Collective contract: every rank of the group calls with a token count in the same power-of-two bucket
(the exchange is padded to it); `MegaMoeEP` gives every rank the same count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from planc.kernels.megamoe.buffers import BufferKey, get_buffer, next_power_of_two
from planc.kernels.megamoe.quant import (
    GRAN,
    dequantize_fp4_batched,
    float_to_ue8m0_bytes,
    quantize_fp8,
    requantize_fp8_like_kernel,
    ue8m0_to_float,
)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def compute_dtype_for(device: torch.device) -> torch.dtype:
    """BF16 operands with FP32 accumulation on GPU (exact for dequantized FP8/FP4), FP32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class ReferenceBuffer:
    """Plain-tensor twin of DeepGEMM's `SymmBuffer` input views (x, x_sf, topk_idx, topk_weights).

    `x_sf` holds one UE8M0 exponent byte per 32 hidden elements; the kernel's buffer packs the same
    bytes four to an int32.
    """

    def __init__(self, capacity: int, hidden: int, num_topk: int, device: torch.device):
        self.num_max_tokens_per_rank = capacity
        self.x = torch.empty((capacity, hidden), dtype=torch.float8_e4m3fn, device=device)
        self.x_sf = torch.empty((capacity, hidden // GRAN), dtype=torch.uint8, device=device)
        self.topk_idx = torch.empty((capacity, num_topk), dtype=torch.int64, device=device)
        self.topk_weights = torch.empty((capacity, num_topk), dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.x, self.x_sf, self.topk_idx, self.topk_weights))

    def destroy(self) -> None:
        """Drop the tensors (their memory goes back to the allocator); the buffer is unusable afterwards."""
        del self.x, self.x_sf, self.topk_idx, self.topk_weights


@dataclass
class DequantizedExperts:
    """The local experts' FP4 weights dequantized once, kept in the compute dtype (cached per module)."""

    gate_up: torch.Tensor  # [E_loc, 2I, H]
    down: torch.Tensor  # [E_loc, H, I]

    @classmethod
    def from_fp4(cls, gate_up, gate_up_scale, down, down_scale, dtype=None) -> "DequantizedExperts":
        dtype = dtype or compute_dtype_for(gate_up.device)
        return cls(
            dequantize_fp4_batched(gate_up, gate_up_scale, dtype),
            dequantize_fp4_batched(down, down_scale, dtype),
        )

    @property
    def num_local_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden(self) -> int:
        return self.gate_up.shape[2]

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]


def _group_rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return group.rank(), group.size()


def _group_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by expert, `w [E, N, K]`, `offs` = end row of each expert -> x @ w[e].T per group.

    Rows past `offs[-1]` are left undefined (the caller masks them).
    """
    if _grouped_mm is not None:
        return _grouped_mm(x, w.transpose(1, 2), offs=offs)
    # torch without grouped_mm: one GEMM per expert (this path syncs to read the offsets).
    out = torch.zeros((x.shape[0], w.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e].T
        start = end
    return out


def local_experts_forward(
    x_fp8: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: DequantizedExperts,
    *,
    first_expert: int,
    activation_clamp: float | None,
    num_experts: int | None = None,
) -> torch.Tensor:
    """Steps 3-6 for every (token, slot) whose expert is in ``[first_expert, first_expert + E_loc)``.

    Inputs are the gathered rows: ``x_fp8 [M, H]``, ``x_sf`` UE8M0 bytes ``[M, H/32]``, ``topk_idx`` and
    ``topk_weights [M, K]``. Returns BF16 ``[M, K, H]``: each owned slot's L2 output, zeros elsewhere.
    `num_experts` (the layer's global expert count) is what a kernel backend sizes its tiles by (the rows each local
    expert receives); the arithmetic here does not depend on it.
    """
    m, k = topk_idx.shape
    num_local = experts.num_local_experts
    inter = experts.intermediate
    dtype = experts.gate_up.dtype
    device = x_fp8.device

    e = topk_idx.reshape(-1)
    local = (e >= first_expert) & (e < first_expert + num_local)
    local_id = torch.where(local, e - first_expert, num_local)  # non-local slots sort to the tail
    order = torch.argsort(local_id, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(0, local_id, torch.ones_like(local_id, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_local], 0, dtype=torch.int32)
    valid = local[order].unsqueeze(1)

    rows = order // k
    x_rows = x_fp8.view(torch.uint8)[rows].view(torch.float8_e4m3fn)  # gather as bytes: portable
    hidden = x_fp8.shape[1]
    x_scales = ue8m0_to_float(x_sf[rows]).to(dtype).unsqueeze(2)
    x = (x_rows.to(dtype).view(m * k, hidden // GRAN, GRAN) * x_scales).flatten(1)

    h = _group_gemm(x, experts.gate_up, offs).to(torch.bfloat16)  # L1, rounded to BF16 once
    gate, up = h[:, :inter], h[:, inter:]
    if activation_clamp is not None:
        c = float(torch.tensor(activation_clamp, dtype=torch.bfloat16))  # the kernel's bf16 constant
        gate = gate.clamp(max=c)
        up = up.clamp(min=-c, max=c)
    g = gate.float()
    silu = g / (1.0 + torch.exp(-g))
    a = silu * up.float() * topk_weights.reshape(-1)[order].float().unsqueeze(1)
    a = torch.where(valid, a, 0.0)  # rows past the last expert are undefined: keep them out of the cast

    q, sf = requantize_fp8_like_kernel(a)
    a_q = (q.to(dtype).view(m * k, inter // GRAN, GRAN) * sf.to(dtype).unsqueeze(2)).flatten(1)
    o = _group_gemm(a_q, experts.down, offs).to(torch.bfloat16)  # L2, rounded to BF16
    o = torch.where(valid, o, torch.zeros((), dtype=o.dtype, device=device))

    out = torch.empty_like(o)
    out.index_copy_(0, order, o)
    return out.view(m, k, experts.hidden)


def combine(slot_outputs: torch.Tensor) -> torch.Tensor:
    """``[n, K, H]`` BF16 slot outputs (zeros for skipped slots) -> ``bf16(sum_j fp32(o_j))`` in slot order."""
    acc = torch.zeros(slot_outputs.shape[0], slot_outputs.shape[2], dtype=torch.float32, device=slot_outputs.device)
    for j in range(slot_outputs.shape[1]):
        acc = acc + slot_outputs[:, j].float()
    return acc.to(torch.bfloat16)


def stage(buf: ReferenceBuffer, hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
          rows: int) -> None:
    """Step 1, what the caller does for the kernel: the first ``n`` buffer rows get the FP8 tokens and their
    routing, rows ``[n, rows)`` are padding (zero tokens, skipped slots) for the exchange."""
    n = hidden_states.shape[0]
    x_fp8, x_sf = quantize_fp8(hidden_states)
    buf.x[:n].copy_(x_fp8)
    buf.x_sf[:n].copy_(float_to_ue8m0_bytes(x_sf))
    buf.topk_idx[:n].copy_(topk_idx)
    buf.topk_weights[:n].copy_(topk_weights)
    buf.topk_idx[n:rows].fill_(-1)
    buf.topk_weights[n:rows].fill_(0.0)
    if rows > n:
        buf.x[n:rows].view(torch.uint8).zero_()
        buf.x_sf[n:rows].zero_()


def reference_mega_moe(
    hidden_states: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    experts,
    *,
    num_experts: int,
    group=None,
    activation_clamp: float | None = None,
    max_tokens_per_rank: int | None = None,
    local_forward=local_experts_forward,
    backend: str = "reference",
    combine_fn=None,
    stage_fn=None,
) -> torch.Tensor:
    """One Mega MoE layer on this rank's tokens; BF16 ``[n, H]``.

    ``topk_idx`` holds global expert ids (``-1`` = unused slot); this rank owns experts
    ``[rank * E_loc, (rank + 1) * E_loc)``. ``group=None`` is a single process owning every expert.
    The staging buffer comes from the shared cache (`buffers.get_buffer`). `local_forward` computes
    steps 3-6 for the gathered rows (signature of `local_experts_forward`; the Triton backend passes its
    kernels and its packed FP4 `experts`); staging, dispatch and combine are shared, keyed by `backend`.
    `combine_fn` and `stage_fn` replace `combine` and `stage` with the same arithmetic (the Triton backend's
    one-kernel versions).
    """
    rank, size = _group_rank_size(group)
    n, hidden = hidden_states.shape
    num_topk = topk_idx.shape[1]
    if num_experts % size:
        raise ValueError(f"{num_experts} experts do not divide over {size} EP ranks")
    if experts.num_local_experts != num_experts // size:
        raise ValueError(
            f"this rank holds {experts.num_local_experts} experts, but {num_experts} global experts over "
            f"{size} ranks means {num_experts // size} per rank"
        )
    device = hidden_states.device

    key = BufferKey(
        backend, group.group_name if group is not None else "single",
        hidden, num_topk, num_experts, experts.intermediate,
    )

    def allocate(capacity):
        buf = ReferenceBuffer(capacity, hidden, num_topk, device)
        return buf, buf.nbytes, buf.destroy

    buf = get_buffer(key, n, group=group, allocate=allocate, max_tokens_per_rank=max_tokens_per_rank, device=device)
    rows = n if size == 1 else min(next_power_of_two(n), buf.num_max_tokens_per_rank)

    (stage_fn or stage)(buf, hidden_states, topk_idx, topk_weights, rows)
    staged = (buf.x[:rows].view(torch.uint8), buf.x_sf[:rows], buf.topk_idx[:rows], buf.topk_weights[:rows])
    gathered: tuple[torch.Tensor, ...] | list[torch.Tensor]
    if size == 1:
        gathered = staged
    else:  # dispatch: every rank sees every rank's staged rows
        gathered = []
        for t in staged:
            out = torch.empty((size * rows, *t.shape[1:]), dtype=t.dtype, device=device)
            _all_gather_single(out, t.contiguous(), group=group)
            gathered.append(out)
    gx, gsf, gidx, gw = gathered

    slots = local_forward(
        gx.view(torch.float8_e4m3fn), gsf, gidx, gw, experts,
        first_expert=rank * experts.num_local_experts, activation_clamp=activation_clamp, num_experts=num_experts,
    )  # [size * rows, K, H]: my experts' outputs for everyone's tokens

    if size > 1:  # combine: each token's slot outputs go back to its rank
        received = torch.empty_like(slots)
        dist.all_to_all_single(received, slots, group=group)
        # Each slot has exactly one owner, the others sent zeros: this sum is exact.
        slots = received.view(size, rows, num_topk, hidden).float().sum(0)
    return (combine_fn or combine)(slots[:n])
