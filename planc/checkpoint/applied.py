"""The plan planc.apply (or planc.load) left on a model: what save, export and load_optimizer start from."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from planc.errors import CheckpointError

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan
    from planc.runtime.mesh import Groups


def applied_plan(model: nn.Module, what: str) -> tuple[CompiledPlan, Groups]:
    """(CompiledPlan, Groups) of a model planc.apply installed a plan on; a clear error otherwise."""
    compiled = getattr(model, "_planc_plan", None)
    groups = getattr(model, "_planc_groups", None)
    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(
            f"{what}: torch.distributed is not initialized; call it on every rank of the world the model was "
            "applied in (torchrun, or init_process_group)."
        )
    if compiled is None or groups is None:
        raise CheckpointError(
            f"{what}: {type(model).__name__} has no plan installed (no `_planc_plan`). planc.save and planc.export "
            "write models that planc.apply or planc.load sharded; save an unsharded model with save_pretrained."
        )
    return compiled, groups


__all__ = ["applied_plan"]
