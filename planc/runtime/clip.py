"""`planc.clip_grad_norm_`: the exact global gradient norm of a planc model, whatever meshes its parameters live on.

A planc model mixes plain parameters (router, norms: replicated), DTensors on the TP mesh, on the EP
mesh, and under `training:` on meshes that add the dp dims. torch's `clip_grad_norm_` runs one foreach
norm over all of them and fails ("got mixed torch.Tensor and DTensor", or meshes that differ). As in
torchtitan's `dist_utils.clip_grad_norm_`: gradients are grouped by mesh (and the mesh dims they are
sharded over), each group's norm computed by `torch.nn.utils.get_total_norm` on the local shards and
reduced over the sharded dims (a replicated dim counted once), and the groups combined (`sum of
norm**p`, then `**(1/p)`; `max` for inf). Every rank returns the same norm and scales its local gradients by the same coefficient.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from planc.errors import PlancError


class ClipGradError(PlancError, RuntimeError):
    """torch.nn.utils.clip_grad_norm_ on parameters it cannot combine (a planc model): use planc.clip_grad_norm_."""


def _parameters(model_or_params: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]]) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return list(model_or_params.parameters())
    if isinstance(model_or_params, torch.Tensor):
        return [model_or_params]
    return list(model_or_params)


def _sharded(placement: Any) -> bool:
    """Shard, or `_StridedShard` (packed_colwise under FSDP), which is not a Shard to torch's `is_shard()`."""
    return placement.is_shard() or isinstance(placement, _StridedShard)


def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of every gradient together, each counted once over its mesh (a plain tensor, same on every rank).

    Gradients are grouped by mesh and by the mesh dims they are sharded over; a group's norm is taken on the local
    shards and reduced over those dims only (a replicated dim counted once), one scalar all-reduce per dim. This is
    what a DTensor norm does, without DTensor's redistribute of stacked norms, which logs a warning about
    sequential collectives on every multi-dim mesh, each call. A gradient placed otherwise (Partial) goes through
    DTensor's own norm.
    """
    inf = norm_type == float("inf")
    local_groups: dict[Any, tuple[Any, tuple[int, ...], list[torch.Tensor]]] = {}  # (mesh id, sharded dims) -> (mesh, dims, local tensors)
    dtensor_groups: dict[int, list[torch.Tensor]] = {}  # mesh id -> DTensors (placements other than Shard / Replicate)
    for g in grads:
        if not isinstance(g, DTensor):
            local_groups.setdefault(None, (None, (), []))[2].append(g)
        elif all(_sharded(p) or p.is_replicate() for p in g.placements):
            dims = tuple(i for i, p in enumerate(g.placements) if _sharded(p))
            local_groups.setdefault((id(g.device_mesh), dims), (g.device_mesh, dims, []))[2].append(g.to_local())
        else:
            dtensor_groups.setdefault(id(g.device_mesh), []).append(g)
    norms = []
    for mesh, dims, members in local_groups.values():
        n = torch.nn.utils.get_total_norm(members, norm_type, foreach=None).float()
        if dims:
            n = n.clone() if inf else n.pow(norm_type)
            for dim in dims:
                dist.all_reduce(n, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group(dim))
            n = n if inf else n.pow(1.0 / norm_type)
        norms.append(n)
    for members in dtensor_groups.values():
        n = torch.nn.utils.get_total_norm(members, norm_type, foreach=None)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).float())
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    if inf:
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(model_or_params: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a planc model (or its parameters) in place to a global norm of `max_norm`.

    Returns the total norm before clipping: the norm of the full, unsharded gradients of the whole
    model (sharded parameters counted once, replicated ones once), equal on every rank. Call it on every
    rank (it reduces over the meshes). `norm_type` any p > 0 or `inf`.
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in _parameters(model_or_params) if p.grad is not None]
    norm = total_norm(grads, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise ClipGradError(
            f"planc.clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite ({norm.item()}); "
            "the step would write NaN/inf into the parameters. Pass error_if_nonfinite=False to clip anyway."
        )
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}  # one foreach multiply per device and dtype, on the local tensors (as torch's clip does)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), locals_ in by_kind.items():
        torch._foreach_mul_(locals_, coef.to(device=device, dtype=dtype))
    return norm


_MIXED = ("mixed torch.Tensor and DTensor", "DTensor", "device mesh", "DeviceMesh")


def guard_torch_clip_grad_norm() -> None:
    """Make torch.nn.utils.clip_grad_norm_ on a planc model fail with a ClipGradError that names
    planc.clip_grad_norm_ instead of torch's mixed-tensor error (installed once, by planc.apply; any other
    call behaves exactly as before: the wrapper only translates a failure on parameters with DTensors)."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    original = clip_grad.clip_grad_norm_
    if getattr(original, "_planc_guard", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_guarded(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        try:
            return original(params, max_norm, *args, **kwargs)
        except (RuntimeError, NotImplementedError, ValueError, AssertionError) as e:
            if any(isinstance(p, DTensor) for p in params) and any(m in str(e) for m in _MIXED):
                raise ClipGradError(
                    "torch.nn.utils.clip_grad_norm_ cannot combine the gradients of a planc model (plain tensors "
                    f"and DTensors on several device meshes: {str(e).splitlines()[0][:160]}). Call "
                    "planc.clip_grad_norm_(model, max_norm, norm_type) instead: it computes the exact global norm "
                    "over every mesh and clips in place."
                ) from None
            raise

    clip_grad_norm_guarded._planc_guard = True  # type: ignore[attr-defined]  # a mark on the function, as ep/base does
    clip_grad.clip_grad_norm_ = clip_grad_norm_guarded
    utils.clip_grad_norm_ = clip_grad_norm_guarded


__all__ = ["ClipGradError", "clip_grad_norm_", "guard_torch_clip_grad_norm", "total_norm"]
