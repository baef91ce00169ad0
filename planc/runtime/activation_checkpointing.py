"""`training.activation_checkpointing: full`: each decoder layer keeps only its input for backward and recomputes
its forward there, installed by apply before the data-parallel wrap (torchtitan applies AC before FSDP too).

The wrap is transformers' own (`gradient_checkpointing_enable`, non-reentrant `torch.utils.checkpoint` around every
`GradientCheckpointingLayer`, the decoder layers): it also drops the KV cache inside a checkpointed layer, which a
plain torch wrapper would fill twice (forward and recompute). It adds no module, so parameter names, state dicts
and checkpoints stay those of the plain model. The same plan line prices it in `planc explain --train`
(`planc.compiler.peak_memory`): the memory explain predicts and the memory apply produces come from one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from planc.errors import ApplyError

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan


def install_activation_checkpointing(model: nn.Module, compiled: CompiledPlan) -> bool:
    """Checkpoint every decoder layer for `compiled.training.activation_checkpointing`; True when installed."""
    training = compiled.training
    if training is None or training.activation_checkpointing != "full":
        return False
    if any(e.strategy is not None and e.strategy.inference_only for e in compiled.experts):
        return False  # Mega MoE: inference only (a plan that declares `training:` is refused by PLC700)
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ApplyError(
            f"planc.runtime.activation_checkpointing: {type(model).__name__} does not support gradient checkpointing "
            "in transformers (`supports_gradient_checkpointing` is False). Write `activation_checkpointing: none`."
        )
    model.gradient_checkpointing_enable(  # type: ignore[operator]  # a PreTrainedModel method; torch types attributes
        gradient_checkpointing_kwargs={"use_reentrant": False})
    return True


__all__ = ["install_activation_checkpointing"]
