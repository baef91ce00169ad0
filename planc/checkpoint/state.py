"""The tensors a checkpoint holds, as torch.distributed.checkpoint must see them.

Three things make an applied model's `state_dict()` unfit for DCP as is:

- `_StridedShard` (planc's `packed_colwise`: rank r holds gate_r | up_r): DCP's DTensor hooks describe
  every local shard as one contiguous chunk, which is wrong for a strided one (see transformers'
  `distributed/checkpoint.py::_redistribute_state_dict`). Such tensors are redistributed to the plain
  `Shard` of the same dim before a save, and loaded through one (then redistributed back).
- Buffers `grouped_gemm` sharded by expert stay plain local slices (`planc.runtime.ep.base`): wrapped as
  DTensors `Shard(0)` over the EP mesh so DCP sees their global shape.
- Non-persistent buffers (rotary `inv_freq`) are not in a state dict; planc.save stores them too, so a
  model built on `meta` gets exactly the values the saved one ran with, for any family.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Iterator, Optional, TypeGuard

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from planc.errors import CheckpointError
from planc.spec.styles import splits_by_expert

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan
    from planc.runtime.mesh import Groups


def has_strided(t: object) -> TypeGuard[DTensor]:
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def dcp_layout(t: DTensor) -> DTensor:
    """`t` with every `_StridedShard` redistributed to the `Shard` of the same dim (a collective over its mesh)."""
    placements = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements)
    with _exact_all_gathers_unwarned():
        return t.redistribute(placements=placements)


class _AllGatherOrderWarning(logging.Filter):
    """Drops torch's "N sequential all_gather operations ... may give inconsistent results between ranks due to
    different reduction orders" (logged on every rank when FSDP's `_StridedShard` over dp and a TP `Shard` are
    gathered one mesh dim after the other). All-gathers only copy: there is no reduction whose order could differ,
    so for dcp_layout, which never sees a `Partial`, the warning is a false alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.funcName == "_warn_flatten_optimization_not_possible" and "all_gather" in args)


@contextlib.contextmanager
def _exact_all_gathers_unwarned() -> Iterator[None]:
    """Silences only _AllGatherOrderWarning's records, only while dcp_layout gathers; torch's warn-once record of
    them is undone after, so a later redistribution that does reduce still warns."""
    from torch.distributed.tensor import _redistribute

    logger, quiet = logging.getLogger(_redistribute.__name__), _AllGatherOrderWarning()
    warned = getattr(_redistribute, "_warned_flatten_issues", None)
    before = set(warned) if isinstance(warned, set) else None
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
        if before is not None and isinstance(warned, set):
            warned.intersection_update(before)


def expert_sharded_buffers(model: nn.Module, compiled: Optional[CompiledPlan], groups: Optional[Groups]) -> dict[str, tuple[nn.Module, str]]:
    """fqn -> (module, name) of the buffers `grouped_gemm` sharded by expert (plain local slices)."""
    if compiled is None or groups is None or groups.ep_size == 1:
        return {}
    modules = dict(model.named_modules())
    out: dict[str, tuple[nn.Module, str]] = {}
    for a in compiled.assignments:
        if a.target == "parameter" and splits_by_expert(a.style):
            owner, _, name = a.fqn.rpartition(".")
            module = modules.get(owner)
            if module is not None and name in module._buffers:
                out[a.fqn] = (module, name)
    return out


def ep_buffer_dtensor(local: Optional[torch.Tensor], groups: Groups) -> DTensor:
    """A plain local expert slice as the DTensor `Shard(0)` over the EP mesh it was cut from."""
    assert local is not None  # a buffer `expert_sharded_buffers` found
    shape = torch.Size((local.shape[0] * groups.ep_size, *local.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, groups.ep_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def named_non_persistent_buffers(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(fqn, owner, name, tensor) of every non-persistent buffer (torch keeps them out of state_dict)."""
    for prefix, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            t = module._buffers.get(name)
            if t is not None:
                yield (f"{prefix}.{name}" if prefix else name), module, name, t


def refuse_unsavable(model: nn.Module, compiled: CompiledPlan, what: str) -> None:
    """Layouts planc cannot write yet, refused before anything is written."""
    megamoe = compiled.experts_settings.megamoe
    if compiled.experts_implementation.megamoe and megamoe and megamoe.quantize == "fp4":
        raise CheckpointError(
            f"{what}: the plan quantizes the experts to FP4 at apply time (`experts.megamoe.quantize: fp4`), so "
            "the model holds per-rank FP4 tensors planc cannot describe to a checkpoint yet. Save the model "
            "before applying that plan (apply it to a model from planc.load), or use a plan without "
            "`quantize: fp4`."
        )
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
            raise CheckpointError(
                f"{what}: {name} is a DTensor with a Partial placement (not reduced); reduce it first."
            )


def save_state(model: nn.Module, compiled: CompiledPlan, groups: Groups) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors planc.save writes (a collective: strided shards are redistributed) and the keys of the
    non-persistent buffers among them."""
    state = model.state_dict()
    for fqn, (module, name) in expert_sharded_buffers(model, compiled, groups).items():
        state[fqn] = ep_buffer_dtensor(module._buffers[name], groups)
    for key, t in state.items():
        if has_strided(t):
            state[key] = dcp_layout(t)
    extra = []
    for fqn, _, _, t in named_non_persistent_buffers(model):
        state[fqn] = t
        extra.append(fqn)
    return state, extra


__all__ = [
    "dcp_layout",
    "ep_buffer_dtensor",
    "expert_sharded_buffers",
    "has_strided",
    "named_non_persistent_buffers",
    "refuse_unsavable",
    "save_state",
]
