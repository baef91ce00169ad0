"""Differentiable collectives on plain tensors: what the TP styles and the EP runtimes exchange.

They live apart from the meshes because TP styles and EP runtimes both need them, with backwards of their own:
DTensor's `Replicate` backward averages where MoE needs a sum (each rank's expert shard contributes a partial
gradient to the shared input), and `all_to_all_single` has no public autograd form. The split helpers
(`shard_sizes`, `shard_bounds`) cut the way DTensor's `Shard` does, so a plain slice and a DTensor agree.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

Group = Optional[dist.ProcessGroup]  # None: the default group


def _run(fn: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    """`fn.apply(*args)`: torch leaves `Function.apply` untyped; every Function here returns one tensor."""
    return cast(torch.Tensor, fn.apply(*args))  # type: ignore[no-untyped-call]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group forward; identity backward (the loss downstream is replicated).

    Only used when a gradient flows: the input may be saved by the op that produced it, so it is
    reduced on a copy. Without autograd, `all_reduce_sum` reduces in place instead.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; sum the gradient over the group backward (each rank's grad is partial)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def needs_grad(x: torch.Tensor) -> bool:
    """A gradient flows through `x` in this call (grad mode on and `x` requires grad)."""
    return torch.is_grad_enabled() and x.requires_grad


def to_local(x: Any) -> Any:
    """This rank's plain tensor of `x`: a DTensor's local shard (differentiable), anything else as is."""
    return x.to_local() if isinstance(x, DTensor) else x


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial outputs -> their sum on every rank (identity backward).

    `x` must be a fresh intermediate the caller gives up (an experts or matmul output): when no
    gradient flows through it, it is reduced in place and returned, as transformers'
    `_AllReduceForward` does; with autograd it is reduced on a copy.
    """
    if dist.get_world_size(group) == 1:
        return x
    if not needs_grad(x):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x
    return _run(_AllReduceSum, x, group)


def all_reduce_grad(x: torch.Tensor, group: Group) -> torch.Tensor:
    """A replicated input whose gradient each rank only computes in part: sum it in backward."""
    if dist.get_world_size(group) == 1 or not needs_grad(x):
        return x
    return _run(_AllReduceGrad, x, group)


def shard_bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of rank `rank`'s slice of a dim of `size` split `torch.chunk`-style over `world`
    ranks, the way DTensor's `Shard` splits it (the last ranks may hold less, or nothing)."""
    chunk = -(-size // world)
    start = min(rank * chunk, size)
    return start, min(chunk, size - start)


def _gather(x: torch.Tensor, group: Group, sizes: Sequence[int], dim: int) -> torch.Tensor:
    """Concatenate every rank's slice along `dim` (rank r's is `sizes[r]` wide; uneven and empty slices padded)."""
    dim = dim % x.ndim
    width = max(sizes)
    if x.shape[dim] != width:  # uneven shards: pad to the widest, trim after
        pad = [0, 0] * (x.ndim - 1 - dim) + [0, width - x.shape[dim]]
        x = torch.nn.functional.pad(x, pad)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x, group=group)
    if any(s != width for s in sizes):
        parts = [p.narrow(dim, 0, s) for p, s in zip(parts, sizes)]
    return torch.cat(parts, dim=dim)


def _slice(x: torch.Tensor, group: Group, sizes: Sequence[int], dim: int) -> torch.Tensor:
    rank = dist.get_rank(group)
    return x.narrow(dim, sum(sizes[:rank]), sizes[rank])


class _AllGather(torch.autograd.Function):
    """Concatenate the ranks' shards along `dim` forward; keep this rank's slice of the gradient backward
    (the gathered output is replicated, so every rank's gradient of it is the same)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, sizes: Sequence[int], dim: int) -> torch.Tensor:
        ctx.group, ctx.sizes, ctx.dim = group, sizes, dim
        return _gather(x, group, sizes, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _slice(grad, ctx.group, ctx.sizes, ctx.dim), None, None, None


class _Split(torch.autograd.Function):
    """Keep this rank's slice of a replicated tensor along `dim` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, sizes: Sequence[int], dim: int) -> torch.Tensor:
        ctx.group, ctx.sizes, ctx.dim = group, sizes, dim
        return _slice(x, group, sizes, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.group, ctx.sizes, ctx.dim), None, None, None


def all_gather_dim(x: torch.Tensor, group: Group, sizes: Sequence[int], dim: int = -1) -> torch.Tensor:
    """This rank's shard along `dim` (`sizes[rank]` wide) -> the concatenation of every rank's, in rank order
    (differentiable: backward keeps this rank's slice). Uneven and empty shards are fine."""
    if dist.get_world_size(group) == 1:
        return x
    if not needs_grad(x):
        return _gather(x, group, sizes, dim)
    return _run(_AllGather, x, group, tuple(sizes), dim)


def split_dim(x: torch.Tensor, group: Group, sizes: Sequence[int], dim: int = -1) -> torch.Tensor:
    """A replicated tensor -> this rank's slice along `dim` (`sizes[rank]` wide; backward all-gathers the gradient)."""
    if dist.get_world_size(group) == 1:
        return x
    if not needs_grad(x):
        return _slice(x, group, sizes, dim)
    return _run(_Split, x, group, tuple(sizes), dim)


def shard_sizes(size: int, world: int) -> list[int]:
    """Every rank's length of a dim of `size` split like DTensor's `Shard` (see `shard_bounds`)."""
    return [shard_bounds(size, r, world)[1] for r in range(world)]


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                group: Group) -> torch.Tensor:
        ctx.splits, ctx.group = (list(output_splits), list(input_splits)), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Group
               ) -> torch.Tensor:
    """Send `input_splits[r]` rows of `x` to rank r, receive `output_splits[r]` from it (differentiable)."""
    return _run(_AllToAll, x, output_splits, input_splits, group)
