"""Routing for the Triton kernels: (token, slot) pairs sorted by local expert and cut into row blocks of one
expert, on the device with static shapes (CUDA-graph capturable)."""

from __future__ import annotations

import torch

from planc.kernels.megamoe.triton import jit, target
from planc.kernels.megamoe.triton.target import triton


def max_blocks(num_slots: int, num_local_experts: int, block_t: int) -> int:
    """Upper bound of row blocks: every expert that gets rows adds at most one partial block."""
    return -(-num_slots // block_t) + min(num_local_experts, num_slots)


# One program does the whole routing (`route_kernel`) up to this many (token, slot) pairs: at decode the ~30 small
# torch ops of `route_torch` cost more than the GEMMs. Larger batches route in chunks of as many pairs, in three
# launches (`route_chunked`), where a prefill took those ~30 ops (a sort of several kernels among them) per layer.
FUSED_ROUTE_MAX_SLOTS = 2048
ROUTE_CHUNK = 2048


def route(topk_idx: torch.Tensor, *, first_expert: int, num_local_experts: int, block_t: int):
    """Sort (token, slot) pairs by local expert and cut them into blocks of `block_t` rows of one expert.

    All on the device with static shapes. Returns ``(sorted_slots int32 [S], block_expert, block_row,
    block_end)``, the block arrays int32 of length `max_blocks(S, E_loc, block_t)`: block b covers sorted
    rows ``[block_row[b], block_end[b])`` of local expert ``block_expert[b]`` (``== E_loc``: no block).
    On a GPU small batches take one Triton program, larger ones three launches (`route_chunked`); under the
    interpreter small ones the one program (its sort of ~2048 keys takes seconds there), elsewhere torch ops; the
    same result.
    """
    num_slots = topk_idx.numel()
    kw = dict(first_expert=first_expert, num_local_experts=num_local_experts, block_t=block_t)
    if triton is not None and num_slots > 0 and (topk_idx.is_cuda or target.interpreting()):
        if num_slots <= FUSED_ROUTE_MAX_SLOTS:
            return route_fused(topk_idx, **kw)
        if topk_idx.is_cuda:
            return route_chunked(topk_idx, **kw)
    return route_torch(topk_idx, **kw)


def fused_route_launch(topk_idx: torch.Tensor, *, first_expert: int, num_local_experts: int, block_t: int):
    """The outputs of `jit.route_kernel` (sorted slots, the 3 block arrays as one tensor), and its arguments after
    `topk_idx` and its constexprs: for `route_fused` and for a kernel that routes in one of its programs
    (`decode.prologue_kernel`)."""
    device = topk_idx.device
    num_slots = topk_idx.numel()
    nb = max_blocks(num_slots, num_local_experts, block_t)
    sorted_slots = torch.empty(num_slots, dtype=torch.int32, device=device)
    blocks = torch.empty((3, nb), dtype=torch.int32, device=device)
    be = triton.next_power_of_2(num_local_experts + 1)
    scratch = torch.empty((3, be), dtype=torch.int32, device=device)
    args = (sorted_slots, blocks, scratch, num_slots, first_expert, num_local_experts, nb)
    constexprs = dict(BS=triton.next_power_of_2(num_slots), BE=be, BB=triton.next_power_of_2(nb), BT=block_t,
                      LOG_BE=be.bit_length() - 1)
    return (sorted_slots, blocks[0], blocks[1], blocks[2]), args, constexprs


def route_fused(topk_idx: torch.Tensor, *, first_expert: int, num_local_experts: int, block_t: int):
    routed, args, constexprs = fused_route_launch(topk_idx, first_expert=first_expert,
                                                  num_local_experts=num_local_experts, block_t=block_t)
    jit.route_kernel[(1,)](topk_idx.reshape(-1), *args, **constexprs, num_warps=4)
    return routed


def route_chunked(topk_idx: torch.Tensor, *, first_expert: int, num_local_experts: int, block_t: int,
                  chunk: int = ROUTE_CHUNK):
    """`route` of any size in three launches over chunks of `chunk` pairs (a power of two): each chunk's per-expert
    counts (`jit.route_count_kernel`), one program placing each chunk's run of each expert and cutting the blocks
    (`route_offsets_kernel`), each chunk's pairs sorted and stored at their places (`route_scatter_kernel`)."""
    device = topk_idx.device
    idx = topk_idx.reshape(-1)
    num_slots = idx.numel()
    chunks = -(-num_slots // chunk)
    nb = max_blocks(num_slots, num_local_experts, block_t)
    be = triton.next_power_of_2(num_local_experts + 1)
    sorted_slots = torch.empty(num_slots, dtype=torch.int32, device=device)
    blocks = torch.empty((3, nb), dtype=torch.int32, device=device)
    counts = torch.empty((2, chunks, be), dtype=torch.int32, device=device)  # the counts, then the deltas
    scratch = torch.empty((3, be), dtype=torch.int32, device=device)
    common = (num_slots, first_expert, num_local_experts)
    jit.route_count_kernel[(chunks,)](idx, counts[0], *common, CH=chunk, BE=be, num_warps=4)
    jit.route_offsets_kernel[(1,)](counts[0], counts[1], blocks, scratch, chunks, num_local_experts, nb, BE=be,
                                   BB=triton.next_power_of_2(nb), BT=block_t, LOG_BE=be.bit_length() - 1,
                                   num_warps=4)
    jit.route_scatter_kernel[(chunks,)](idx, counts[1], sorted_slots, *common, CH=chunk, BE=be, num_warps=4)
    return sorted_slots, blocks[0], blocks[1], blocks[2]


def route_torch(topk_idx: torch.Tensor, *, first_expert: int, num_local_experts: int, block_t: int):
    """`route` in torch ops (any size, any device). No op makes a tensor from a scalar or fills one (`torch.where`
    with a Python number, `zeros`, `ones_like`): on a GPU each is a kernel of its own, replayed with every graph of a
    large batch."""
    device = topk_idx.device
    e = topk_idx.reshape(-1)
    num_slots = e.numel()
    local = (e >= first_expert) & (e < first_expert + num_local_experts)
    local_id = (e - (first_expert + num_local_experts)) * local + num_local_experts  # E_loc where not local
    order = torch.argsort(local_id, stable=True)
    sorted_slots = order.to(torch.int32)
    ends = torch.searchsorted(local_id[order], torch.arange(1, num_local_experts + 1, device=device))  # each end
    counts = torch.diff(ends, prepend=ends[:1] * 0)
    starts = ends - counts
    blocks = (counts + block_t - 1) // block_t
    block_end_cum = torch.cumsum(blocks, 0)
    b = torch.arange(max_blocks(num_slots, num_local_experts, block_t), device=device)
    expert = torch.searchsorted(block_end_cum, b, right=True)  # E_loc past the last block: no block
    ec = expert.clamp(max=num_local_experts - 1)
    row = starts[ec] + (b - (block_end_cum[ec] - blocks[ec])) * block_t
    end = starts[ec] + counts[ec]
    return sorted_slots, expert.to(torch.int32), row.to(torch.int32), end.to(torch.int32)


def other_slots(topk_idx: torch.Tensor, slots: torch.Tensor, first_expert: int, num_local_experts: int) -> dict:
    """The arguments of `jit.zero_other_slots` for a pre-pass kernel over the tokens' rows (`dequant_x_kernel`,
    `fp8.x_blocks_kernel`): zeros into the ``[M*K, H]`` slot outputs `slots` where the slot's expert is not local, so
    that they start as `torch.empty` (L2 writes every local slot)."""
    k = topk_idx.shape[1]
    return dict(idx_ptr=topk_idx.contiguous(), slots_ptr=slots, first=first_expert, num_local=num_local_experts,
                stride_slots=slots.stride(0), NUM_TOPK=k, BK=triton.next_power_of_2(k), ZERO=True)


def no_slots(x_fp8: torch.Tensor) -> dict:
    """`other_slots` for a pre-pass kernel that zeroes nothing (its pointers: the FP8 rows' bytes, never touched)."""
    dummy = x_fp8.view(torch.uint8)  # as bytes: an e4m3 pointer does not compile before sm_89
    return dict(idx_ptr=dummy, slots_ptr=dummy, first=0, num_local=0, stride_slots=0, NUM_TOPK=1, BK=1, ZERO=False)
