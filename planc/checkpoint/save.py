"""`planc.save(model, directory)`: a sharded checkpoint of an applied model, every rank writing its own shards.

The state goes through `torch.distributed.checkpoint.save` (DCP: each rank writes `__<rank>_0.distcp`
with its local shards, replicated tensors once, the coordinator writes `.metadata` describing global
shapes and offsets), so a later `fill_from_dcp` can read it into a model sharded under any plan or
sizes: DCP reshards on load. Beside it go `config.json` (and `generation_config.json`), `plan.yaml`
and `planc.json` (`planc.checkpoint.marker`). The directory is written under a temporary
sibling name and renamed into place only after every rank finished (`atomic.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from planc.checkpoint.applied import applied_plan
from planc.checkpoint.atomic import agree, atomic_directory
from planc.checkpoint.marker import (
    MARKER,
    is_planc_checkpoint,
    marker_data,
    write_marker,
)
from planc.checkpoint.optimizer import marker_entry as optimizer_marker
from planc.checkpoint.optimizer import (
    optimizer_state,
    refuse_unsavable_optimizer,
    write_optimizer,
)
from planc.checkpoint.state import refuse_unsavable, save_state
from planc.errors import CheckpointError

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan


def _write_shards(state: dict[str, Any], directory: Path) -> None:
    """DCP writes every rank's shards and the coordinator's `.metadata` (a collective)."""
    from planc.checkpoint.dcp import dcp_failures

    with dcp_failures(f"writing {directory}"):
        dcp.save(state, checkpoint_id=str(directory))


def _write_metadata(model: nn.Module, compiled: CompiledPlan, directory: Path, non_persistent: list[str],
                    optimizer: Optional[Optimizer] = None) -> None:
    """Rank 0: config.json, generation_config.json, plan.yaml, then planc.json."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(directory)
    data = marker_data(model, compiled, non_persistent)
    if optimizer is not None:
        data["optimizer"] = optimizer_marker(model, optimizer)
    write_marker(directory, data)


def save(model: nn.Module, directory: str | os.PathLike[str], *, optimizer: Optional[Optimizer] = None) -> Path:
    """Write `model` (applied by planc.apply or planc.load) as a sharded DCP checkpoint to `directory`.

    Every rank of the model's world must call it. `directory` is replaced only once the new checkpoint
    is complete on every rank; an existing directory that is not a planc checkpoint is never replaced.
    `optimizer`: its state is written too, sharded like the model (`optimizer.py`), for
    `planc.load_optimizer`. Returns the absolute path.
    """
    what = f"planc.save({str(directory)!r})"
    compiled, groups = applied_plan(model, what)  # the same answer on every rank of an applied world
    error: Optional[CheckpointError] = None
    try:
        refuse_unsavable(model, compiled, what)
        if optimizer is not None:
            refuse_unsavable_optimizer(model, optimizer, what)
    except CheckpointError as e:
        error = e
    agree(error, what)  # every rank refuses together rather than some entering a collective alone
    state, non_persistent = save_state(model, compiled, groups)
    optimizer_sd = optimizer_state(model, optimizer) if optimizer is not None else None
    with atomic_directory(directory, what, replaceable=is_planc_checkpoint) as partial:
        _write_shards(state, partial)
        if optimizer_sd is not None:
            write_optimizer(optimizer_sd, partial)
        if dist.get_rank() == 0:
            _write_metadata(model, compiled, partial, non_persistent, optimizer)
            if not (partial / MARKER).is_file():
                raise CheckpointError(f"{what}: {MARKER} was not written to {partial}")
    return Path(directory).absolute()


__all__ = ["save"]
