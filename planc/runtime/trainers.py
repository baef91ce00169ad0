"""What Hugging Face Trainer (TRL's SFTTrainer too) and Accelerate read to leave a planc model's distribution to planc.

transformers shards a model itself with `from_pretrained(distributed_config=DistributedConfig(...))` and
marks it so that its `Trainer` does not wrap it again: `model.is_distributed_loading_by_transformers`
(Trainer then prepares it with `accelerator.prepare_model(model, evaluation_mode=True)`: no DDP, no
device move; reshards FSDP2 units before building the optimizer; defers FSDP2's gradient reduction over
accumulation micro-batches with `set_requires_gradient_sync`), `model.tp_size` (its data-parallel world
is `world // tp_size`; above 1 it hands accelerate a `ParallelismConfig`) and
`model.config.distributed_config` (`dp_size`, `dp_replicate_size`). A planc model is sharded by its plan
in the same sense, so `planc.apply` / `planc.load` describe it the same way, as their last install step:
nothing for users to set. `tests/train/test_trainers.py` pins this contract against the installed
transformers and accelerate.

The description: `tp_size` the plan's, `ep_size` the plan's, and every data-parallel replica one FSDP
rank (`fsdp_size = dp_size`, `dp_replicate_size = 1`): planc's `replicate` and `fsdp` both reduce over
the dp ranks as one group, and both answer `set_requires_gradient_sync` (torch's `replicate` is FSDP2
based). Trainer's own checkpoints of such a model are refused upstream ("Resuming is not supported for
models sharded at load time"); planc's checkpoints go through `planc.save` (docs/train.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan


def declare_to_trainers(model: nn.Module, compiled: CompiledPlan) -> None:
    """Mark `model` as transformers marks a model it sharded at load time (see the module doc)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "is_distributed_loading_by_transformers"):
        return  # not a transformers PreTrainedModel of a version with this contract: nothing reads it
    from transformers.distributed import DistributedConfig

    p = compiled.parallel
    # the attributes DistributedMixin.maybe_distribute_model sets on a model transformers shards itself
    model.__dict__["_is_distributed_loading_by_transformers"] = True
    model.__dict__["_tp_size"] = p.tp_size
    config.distributed_config = DistributedConfig(tp_size=p.tp_size, fsdp_size=p.dp_size, dp_replicate_size=1,
                                                  ep_size=p.ep_size)


__all__ = ["declare_to_trainers"]
