"""What an applied model refuses, with an error that says what to call instead.

- `model.save_pretrained(dir)`: transformers' saver cannot write planc's DTensor shards (it crashed on
  rank 0 after creating the folder: "Attempted to access the data pointer on an invalid python
  storage") and a rank-0-only call would hang a collective gather. It is refused before anything is
  written, pointing to `planc.export` (hub layout) and `planc.save` (sharded). `push_to_hub` goes
  through `save_pretrained`, so it is refused the same way, and so are transformers' `Trainer.save_model`
  and its checkpoints with `save_only_model=True` (on every rank: Trainer calls it on every rank of a
  model sharded at load time); the message names the Trainer recipe.
- `copy.deepcopy(model or any of its modules)`: process groups cannot be copied ("cannot pickle
  'ProcessGroup'"), and worse, the installed forwards are closures over the original modules, so a
  copy that did succeed would compute with the original's weights. Refused with the alternatives.

Both are instance attributes (`save_pretrained`, `__deepcopy__`: `copy.deepcopy` and attribute lookup
find them on the instance before the class), set by install's `step_mark_applied`, so a rollback,
which restores every module's `__dict__`, removes them with the rest of the install.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from torch import nn

from planc.errors import CheckpointError


def _refuse_save_pretrained(model: nn.Module) -> Callable[..., NoReturn]:
    def save_pretrained(*args: Any, **kwargs: Any) -> NoReturn:
        raise CheckpointError(
            f"{type(model).__name__}.save_pretrained cannot write a model planc sharded: its parameters are "
            "DTensor shards of a plan and transformers' saver would write a folder without correct weights. "
            "Nothing was written. Call, on every rank, planc.export(model, dir) for hub-layout safetensors that "
            "AutoModelForCausalLM.from_pretrained(dir) loads, or planc.save(model, dir) for a sharded checkpoint "
            "that planc.load(dir, plan) reads back under any plan or sizes. Under transformers' Trainer "
            "(trainer.save_model, save_strategy with save_only_model=True), which cannot resume a model sharded at "
            "load time: pass save_strategy='no', call planc.save(model, dir, optimizer=trainer.optimizer) on every "
            "rank, and resume with planc.load + planc.load_optimizer (docs/train.md, \"Hugging Face Trainer\")."
        )

    return save_pretrained


def _refuse_deepcopy(module: nn.Module, path: str) -> Callable[[Any], NoReturn]:
    def __deepcopy__(memo: Any) -> NoReturn:
        raise CheckpointError(
            f"copy.deepcopy of a module planc installed a plan on ({path or '<model>'}: "
            f"{type(module).__name__}) is not supported: its process groups cannot be copied, and its installed "
            "forwards are bound to the original modules, so a copy would compute with the original's weights. "
            "For another sharded copy, build the model again and planc.apply it (or planc.save, then planc.load); "
            "for an unsharded copy, planc.export and from_pretrained; deepcopy the model before planc.apply."
        )

    return __deepcopy__


def guard_applied_model(model: nn.Module) -> None:
    """Refuse `save_pretrained` on the model and `copy.deepcopy` on it and every submodule (see module doc)."""
    if hasattr(model, "save_pretrained"):
        model.__dict__["save_pretrained"] = _refuse_save_pretrained(model)
    for path, module in model.named_modules():
        module.__dict__["__deepcopy__"] = _refuse_deepcopy(module, path)


__all__ = ["guard_applied_model"]
