"""The shared Mega MoE buffer cache: one buffer per EP group and MoE shape, reused by every layer.

Why shared: the real kernel's symmetric buffer is a collective allocation of several GB; the layers of a
model run one after another, so one buffer per (group, shape) serves all of them. Why power-of-two
sizes: a growing batch then reallocates a few times (once per bucket reached), not at every new size,
for at most twice the memory. The reference backend uses the same cache with plain tensors, so the
caching logic is exercised on CPU.

Allocation is collective: every rank of the group must reach the same bucket at the same call (the
`MegaMoeEP` runtime guarantees it: every rank gets the same slice size). Growing frees the smaller buffer
first (after a device sync and a group barrier, so no rank still reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BufferKey:
    """What a buffer is shared by. `backend` keeps reference and kernel buffers apart."""

    backend: str
    group_name: str
    hidden: int
    num_topk: int
    num_experts: int  # global
    intermediate: int


@dataclass(frozen=True)
class BufferStats:
    """Counters for tests and benchmarks: `allocations` only ever grows (destroy does not reset it)."""

    allocations: int
    live_buffers: int
    live_bytes: int


@dataclass
class _Entry:
    buffer: Any
    capacity: int  # tokens per rank the buffer was asked for (the kernel may round it up)
    nbytes: int
    destroy: Callable[[], None]
    group: Any = None  # the EP group: every rank passes a barrier on it before the buffer is freed


_BUFFERS: dict[BufferKey, _Entry] = {}
_ALLOCATIONS = 0


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def capacity_for(num_tokens: int, max_tokens_per_rank: int | None) -> int:
    """Tokens per rank to allocate for: the plan's fixed size when it fits, else the next power of two."""
    if max_tokens_per_rank is not None and num_tokens <= max_tokens_per_rank:
        return max_tokens_per_rank
    return next_power_of_two(num_tokens)


def _barrier(group) -> None:
    if group is not None and dist.is_initialized() and group.size() > 1:
        dist.barrier(group=group)


def get_buffer(
    key: BufferKey,
    num_tokens: int,
    *,
    group,
    allocate: Callable[[int], tuple[Any, int, Callable[[], None]]],
    max_tokens_per_rank: int | None = None,
    device: torch.device | None = None,
) -> Any:
    """The cached buffer for `key` holding at least `num_tokens` tokens per rank.

    `allocate(capacity) -> (buffer, nbytes, destroy)` makes a new one (collectively). A buffer too small
    for `num_tokens` is freed and replaced by one for `capacity_for(num_tokens, max_tokens_per_rank)`.
    """
    global _ALLOCATIONS
    entry = _BUFFERS.get(key)
    if entry is not None and entry.capacity >= num_tokens:
        return entry.buffer
    if entry is not None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        _barrier(group)
        del _BUFFERS[key]
        entry.destroy()
        del entry
    capacity = capacity_for(num_tokens, max_tokens_per_rank)
    buffer, nbytes, destroy = allocate(capacity)
    _BUFFERS[key] = _Entry(buffer, capacity, nbytes, destroy, group)
    _ALLOCATIONS += 1
    return buffer


def destroy_megamoe_buffers() -> None:
    """Free every Mega MoE buffer of every EP group. Call it on every rank, before the process groups are
    destroyed; the model keeps working (the next forward allocates again)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    entries = list(_BUFFERS.values())
    _BUFFERS.clear()
    for entry in entries:
        _barrier(entry.group)  # no rank may still read a peer's symmetric buffer (DeepGEMM's test does the same)
        entry.destroy()


def buffer_stats() -> BufferStats:
    return BufferStats(
        allocations=_ALLOCATIONS,
        live_buffers=len(_BUFFERS),
        live_bytes=sum(e.nbytes for e in _BUFFERS.values()),
    )
