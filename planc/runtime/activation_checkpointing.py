"""`training.activation_checkpointing`: one installer per row of `planc.spec.choices.ACTIVATION_CHECKPOINTING_MODES`,
run by apply before the data-parallel wrap (torchtitan applies AC before FSDP too).

`full`: each decoder layer keeps only its input for backward and recomputes its forward there. The wrap is
transformers' own (`gradient_checkpointing_enable`, non-reentrant `torch.utils.checkpoint` around every
`GradientCheckpointingLayer`, the decoder layers): it also drops the KV cache inside a checkpointed layer, which a
plain torch wrapper would fill twice (forward and recompute). It adds no module, so parameter names, state dicts
and checkpoints stay those of the plain model. The same plan line prices it in `planc explain --train`
(`planc.compiler.peak_memory`): the memory explain predicts and the memory apply produces come from one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from torch import nn

from planc.errors import ApplyError
from planc.spec.choices import ACTIVATION_CHECKPOINTING_MODES

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan


def _keep_all(model: nn.Module) -> bool:
    """`none`: every activation stays for backward; nothing to install."""
    return False


def _recompute_layers(model: nn.Module) -> bool:
    """`full`: transformers' gradient checkpointing on every decoder layer (see the module doc)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ApplyError(
            f"planc.runtime.activation_checkpointing: {type(model).__name__} does not support gradient checkpointing "
            "in transformers (`supports_gradient_checkpointing` is False). Write `activation_checkpointing: none`."
        )
    model.gradient_checkpointing_enable(  # type: ignore[operator]  # a PreTrainedModel method; torch types attributes
        gradient_checkpointing_kwargs={"use_reentrant": False})
    return True


# One installer per row of planc.spec.choices.ACTIVATION_CHECKPOINTING_MODES; True when it changed the model.
INSTALLERS: dict[str, Callable[[nn.Module], bool]] = {
    "none": _keep_all,
    "full": _recompute_layers,
}


def install_activation_checkpointing(model: nn.Module, compiled: CompiledPlan) -> bool:
    """Install the plan's `training.activation_checkpointing` row on `model`; True when something was installed."""
    training = compiled.training
    if training is None:
        return False
    if any(e.strategy is not None and e.strategy.inference_only for e in compiled.experts):
        return False  # Mega MoE: inference only (a plan that declares `training:` is refused by PLC700)
    return INSTALLERS[training.activation_checkpointing](model)


def _check_registry() -> None:
    """Fail at import if the installers and the rows drift apart (a mode with no installer, or the reverse)."""
    if set(INSTALLERS) != set(ACTIVATION_CHECKPOINTING_MODES):
        raise ImportError(
            f"planc.runtime.activation_checkpointing: installers "
            f"{sorted(set(INSTALLERS) ^ set(ACTIVATION_CHECKPOINTING_MODES))} differ from planc.spec.choices.ACTIVATION_CHECKPOINTING_MODES; add the installer or the row"
        )


_check_registry()

__all__ = ["INSTALLERS", "install_activation_checkpointing"]
