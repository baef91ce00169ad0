"""`fill_from_dcp(model, directory)`: read a planc.save checkpoint into a model sharded on `meta` under any plan.

The model's parameters are meta DTensors already carrying the new plan's placements (from
`step_shard_parameters` on the meta model; any sizes: saved at 2 ranks, read at 4 or 1), replicated
ones plain meta tensors. This allocates only the local shards on the target device, checks every key
and global shape against the checkpoint's metadata (the same error on every rank, before a byte is
read), and lets `torch.distributed.checkpoint.load` fill them: DCP reads, from every saved rank's
file, exactly the slices that overlap this rank's shards. Tied parameters are allocated once (the tie
survives); non-persistent buffers come from the checkpoint, where planc.save stored them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
import os
from typing import TYPE_CHECKING, Any, Collection, Iterator, Optional, Union, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from planc.checkpoint.atomic import agree
from planc.checkpoint.dcp_reader import CheckedReader, metadata_protocol, planner_for
from planc.checkpoint.keys import last_line
from planc.checkpoint.marker import is_planc_checkpoint, read_marker, saved_under
from planc.checkpoint.state import (
    dcp_layout,
    ep_buffer_dtensor,
    expert_sharded_buffers,
    has_strided,
    named_non_persistent_buffers,
)
from planc.errors import CheckpointError, PlancError
from planc.runtime.mesh import rank_device

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from planc.compiler.compiled import CompiledPlan
    from planc.runtime.mesh import Groups


def _empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialised storage for this rank's part of `t` (a DTensor keeps its mesh, placements, global shape)."""
    if isinstance(t, DTensor):
        local = torch.empty(t.to_local().shape, dtype=t.dtype, device=device)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return torch.empty(t.shape, dtype=t.dtype, device=device)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Replace every meta parameter and buffer by empty storage on `device`; a tensor shared by several
    modules (tied weights) gets one new tensor, assigned to all of them."""
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in new:
                    fresh = _empty_like(t, device)
                    if isinstance(t, nn.Parameter):
                        fresh = nn.Parameter(fresh, requires_grad=t.requires_grad)
                        fresh.__dict__.update(t.__dict__)
                    new[id(t)] = fresh
                table[name] = new[id(t)]


@contextlib.contextmanager
def dcp_failures(what: str) -> Iterator[None]:
    """torch.distributed.checkpoint's `CheckpointException` (a BaseException: `except Exception` misses it) as a
    CheckpointError naming each failed rank and the last line of its cause, never DCP's tracebacks. DCP gathers
    every rank's failure before raising, so every rank raises this together; the callers clean up and agree."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        lines = []
        for rank, failure in sorted(e.failures.items()):
            exc = failure[0] if isinstance(failure, tuple) else failure
            lines.append(f"rank {rank}: {type(exc).__name__}: {last_line(str(exc)) or exc}")
        short = any("unexpected pos" in line or "No space" in line or "too large" in line for line in lines)
        hint = (
            " A file write stopped short: the disk is full, a quota was reached or a file size limit (`ulimit -f`) "
            "applies on that rank; free space or raise the limit, then run it again." if short else ""
        )
        failed = "; ".join(lines)
        raise CheckpointError(f"{what}: torch.distributed.checkpoint failed: {failed}.{hint}") from None


def storage_problems(metadata: Metadata, directory: Path) -> list[str]:
    """Every `__<rank>_0.distcp` the metadata points into: present, and long enough for every range read from it
    (a missing or truncated rank file is refused here, naming it, before DCP reads a byte)."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if path is not None:
            ends[path] = max(ends.get(path, 0), end)
    problems: list[str] = []
    for name, end in sorted(ends.items()):
        f = directory / name
        if not f.is_file():
            problems.append(f"{f}: missing (the checkpoint's .metadata places tensors in it); copy the whole directory")
        elif f.stat().st_size < end:
            problems.append(
                f"{f}: {f.stat().st_size} bytes, but the checkpoint's .metadata reads up to byte {end}: it is "
                "truncated; copy it again"
            )
    return problems


def _targets(model: nn.Module, compiled: Optional[CompiledPlan], groups: Optional[Groups],
             saved_non_persistent: Collection[str]) -> dict[str, torch.Tensor]:
    """key -> the tensor DCP loads into, in the layout DCP can describe (see state.py)."""
    state = model.state_dict()
    for fqn, (module, name) in expert_sharded_buffers(model, compiled, groups).items():
        assert groups is not None  # expert_sharded_buffers finds none without groups
        state[fqn] = ep_buffer_dtensor(module._buffers[name], groups)
    for fqn, _, _, t in named_non_persistent_buffers(model):
        if fqn in saved_non_persistent:
            state[fqn] = t
    return state


def _check(targets: dict[str, torch.Tensor], metadata: Metadata, directory: Path, model: nn.Module,
           saved_non_persistent: Collection[str]) -> list[str]:
    """Every mismatch between the model and the checkpoint, named by key."""
    problems: list[str] = []
    saved = metadata.state_dict_metadata
    for key, t in targets.items():
        meta = saved.get(key)
        if meta is None:
            problems.append(f"{key}: the model has it, the checkpoint does not")
            continue
        if not isinstance(meta, TensorStorageMetadata):
            problems.append(f"{key}: the checkpoint stores a {type(meta).__name__}, the model a tensor")
            continue
        if tuple(meta.size) != tuple(t.shape):
            problems.append(f"{key}: checkpoint shape {tuple(meta.size)}, model shape {tuple(t.shape)} (global)")
    model_keys = set(targets)
    for key in sorted(set(saved) - model_keys - set(saved_non_persistent)):
        problems.append(f"{key}: the checkpoint has it, the model does not")
    missing_np = [fqn for fqn, *_ in named_non_persistent_buffers(model) if fqn not in saved_non_persistent]
    for fqn in missing_np:
        problems.append(f"{fqn}: a non-persistent buffer of the model the checkpoint did not store")
    return problems


def fill_from_dcp(
    model: nn.Module,
    directory: Union[str, os.PathLike[str]],
    *,
    device: Union[None, str, torch.device] = None,
    compiled: Optional[CompiledPlan] = None,
    groups: Optional[Groups] = None,
    reader: Optional[CheckedReader] = None,
) -> None:
    """Fill `model` (sharded on meta under any plan) from the planc.save checkpoint in `directory`.

    Every rank calls it. `device`: where the local shards live (default: the current CUDA device under
    NCCL, else the CPU). `compiled`/`groups`: the new plan's CompiledPlan and Groups, needed only when
    `grouped_gemm` shards buffers (they are plain local slices; default: `model._planc_plan`/`_planc_groups`).
    A dtype other than the saved one is cast as it is read. Raises `CheckpointError` on every rank, naming
    each key, when the model and the checkpoint disagree; nothing is read then. `reader`: the CheckedReader
    planc.load's checks already read the metadata with (default: a new one, planc's allow-list); DCP reads
    through it, so the metadata is read once and never by torch's unpickler.
    """
    directory = Path(directory)
    what = f"planc: reading the checkpoint {directory}"
    compiled = compiled if compiled is not None else getattr(model, "_planc_plan", None)
    groups = groups if groups is not None else getattr(model, "_planc_groups", None)
    device = rank_device(device)
    error = None
    try:
        marker = read_marker(directory)
        saved_np = set(marker.get("non_persistent_buffers", ()))
        if reader is None:  # a reader planc.load gives was opened by open_checked already
            reader = open_checked(directory, protocol=metadata_protocol(marker), trust_code=False,
                                  what="the checkpoint")
        metadata = reader.read_metadata()
        problems = _check(_targets(model, compiled, groups, saved_np), metadata, directory, model, saved_np)
        if problems:
            raise CheckpointError(
                f"{directory} ({saved_under(marker)}) "
                f"does not fit this {type(model).__name__}: {len(problems)} problem(s):\n    "
                + "\n    ".join(problems[:50])
                + ("\n    ..." if len(problems) > 50 else "")
                + "\nBuild the model from the checkpoint's own config.json."
            )
    except Exception as e:  # noqa: BLE001 - reported on every rank before any rank enters dcp.load
        error = e
    agree(error, what)

    assert reader is not None  # the ranks agreed that the metadata was read
    materialize(model, device)
    targets = _targets(model, compiled, groups, saved_np)
    strided: dict[str, DTensor] = {k: t for k, t in targets.items() if has_strided(t)}
    load_state = {k: (dcp_layout(cast(DTensor, strided[k].detach())) if k in strided else t) for k, t in targets.items()}
    with dcp_failures(what):
        dcp.load(load_state, storage_reader=reader, planner=planner_for(reader))
    with torch.no_grad():
        for key, t in strided.items():
            loaded = load_state[key]
            assert isinstance(loaded, DTensor)  # dcp_layout's
            t.to_local().copy_(loaded.redistribute(placements=t.placements).to_local())


__all__ = ["dcp_failures", "fill_from_dcp", "storage_problems", "is_planc_checkpoint", "read_marker"]


def open_checked(directory: Path, *, protocol: int, trust_code: bool, what: str) -> CheckedReader:
    """The reader of one DCP directory (a model's or its `optimizer/`), its metadata read and every `.distcp` range
    it names present: the one place a load path turns an unreadable or damaged directory into a CheckpointError.
    `what` names the state in the message ("the checkpoint", "the optimizer state")."""
    reader = CheckedReader(directory, protocol=protocol, trust_code=trust_code)
    try:
        metadata = reader.read_metadata()
    except PlancError:
        raise
    except Exception as e:  # noqa: BLE001 - torch's unpickler (trusted) raises anything
        raise CheckpointError(f"{directory / '.metadata'}: unreadable ({type(e).__name__}: {last_line(str(e))}); the "
                              "checkpoint is damaged: save it again, or copy it again.") from None
    files = storage_problems(metadata, directory)
    if files:
        raise CheckpointError(f"{directory}: {len(files)} file(s) of {what} are damaged:\n    " + "\n    ".join(files))
    return reader
