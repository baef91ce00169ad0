"""planc: compile declarative tensor- and expert-parallel plans for Mixture-of-Experts models.

The public API is imported lazily so that `import planc` (and `planc lint`) never pulls in torch.
Every function that takes a model and a plan takes them in that order: `compile(model, plan)`,
`apply(model, plan)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Union

if TYPE_CHECKING:
    import os
    from pathlib import Path

    from torch import nn

    from planc.compiler.compiled import CompiledPlan
    from planc.lint.diagnostic import Diagnostic
    from planc.lint.plan_loader import PlanSource
    from planc.spec.loaded_plan import LoadedPlan
    from planc.verification.report import VerifyReport

from planc.lint.registry import register_rule_modules as _register_rule_modules
from planc.version import __version__

# The compiler registers its rules beside its checks; lint may not import it, so this layer names them to the
# registry, which imports them only for the whole list (`planc rules`), never for `planc lint`.
_register_rule_modules("planc.compiler.rules")

__all__ = [
    "load_plan", "lint_paths", "compile", "apply", "load", "save", "load_optimizer", "export", "destroy_megamoe_buffers",
    "clip_grad_norm_", "no_sync", "distribute_adapters", "device_mesh", "register_tp_style", "register_ep_strategy",
    "verify", "__version__",
]


def load_plan(source: "PlanSource", *, parallel: "Optional[Mapping[str, int]]" = None) -> "LoadedPlan":
    """Load, lint and validate a plan (path, YAML string, mapping, Plan or LoadedPlan); PlanError if it is invalid.
    `parallel` runs it at other sizes, e.g. `{"tp_size": 2, "ep_size": 2}`, linted again at those sizes."""
    from planc.lint.plan_loader import load_plan as _load

    return _load(source, parallel=parallel)


def lint_paths(paths: "Union[str, os.PathLike[str], Iterable[Union[str, os.PathLike[str]]]]", *,
               strict: bool = False) -> "list[Diagnostic]":
    """Lint plan files or directories; returns the sorted Diagnostics (never raises on bad input)."""
    from planc.lint.runner import lint_paths as _lint

    return _lint(paths, strict=strict)


def register_tp_style(row: Any, runtime: Any) -> None:
    """Add a TP style of your own: its row (`planc.spec.styles.Style`, section "tp", runtime=True) and its runtime
    object (a `planc.runtime.tp_styles.TPStyle` instance, or its import path `"pkg.module:Name"`, imported where
    the plan is applied: lint stays torch-free) in one call. Plans then name it in tp_plan; lint, compile, explain,
    apply and verify treat it like planc's own. Refused with ExtensionError: a name of planc's own, a name already
    registered otherwise, a row planc cannot install, an object that is not the row's. `planc.apply` checks again on
    the TP mesh that the object shards as the row says, and that every rank registered the same. For `planc lint`
    and pre-commit, name the module that makes this call in pyproject.toml's `[tool.planc] extensions`
    (docs/extending.md)."""
    from planc.spec.extensions import register_tp_style as _register

    _register(row, runtime, origin=_caller(), check=_runtime_check(runtime))


def register_ep_strategy(row: Any, runtime: Any) -> None:
    """Add an EP strategy of your own: its row (`planc.spec.choices.EPStrategyRow`) and its runtime (a subclass of
    `planc.runtime.ep.EPRuntime`, or its import path `"pkg.module:Name"`) in one call; plans name it in
    `experts.ep_implementation`. Checked and refused as `register_tp_style` is (docs/extending.md)."""
    from planc.spec.extensions import register_ep_strategy as _register

    _register(row, runtime, origin=_caller(), check=_runtime_check(runtime))


def _caller() -> str:
    """The module that called the public registration function (named in messages)."""
    import sys

    return str(sys._getframe(2).f_globals.get("__name__", "<unknown>"))


def _runtime_check(runtime: Any) -> Any:
    """The check of a runtime object against its row (an import path is checked where the plan is applied)."""
    if isinstance(runtime, str):
        return None
    from planc.runtime.extensions import check_runtime

    return check_runtime


def compile(model: Any, plan: "PlanSource") -> "CompiledPlan":  # shadows the builtin: the verb is the API
    """Resolve `plan` against `model` (never changes it) and return the CompiledPlan; CompileError lists
    every problem. `compile(plan, model)`, the old order, still works with a DeprecationWarning."""
    from planc.compiler.resolve import compile_plan
    from planc.lint.plan_loader import load_plan as _load

    model, plan = _model_and_plan(model, plan, "planc.compile")
    return compile_plan(model, _load(plan))


def _model_and_plan(first: Any, second: Any, caller: str) -> tuple[Any, Any]:
    """`(model, plan)` from a call in the one argument order, or in the old `(plan, model)` order with a
    DeprecationWarning (a model, anything with `named_modules`, is never a plan source: the order is unambiguous).
    Only here, at the public face: inside planc the order is always (model, plan)."""
    if callable(getattr(first, "named_modules", None)) or not callable(getattr(second, "named_modules", None)):
        return first, second
    import warnings

    warnings.warn(
        f"{caller}(plan, model) is deprecated: write {caller}(model, plan), the order planc.apply takes",
        DeprecationWarning,
        stacklevel=3,
    )
    return second, first


def apply(model: Any, plan: "PlanSource", *, mesh: Optional[Any] = None,
          parallel: "Optional[Mapping[str, int]]" = None) -> "CompiledPlan":
    """Compile `plan` against `model`, then shard and install it on every rank (all or nothing);
    `parallel` runs the plan at other sizes (see load_plan)."""
    from planc.runtime import install

    install.require_distributed("planc.apply")
    # without a caller's mesh, a plan refused at sizes the launched world does not fit says the world's sizes first
    loaded = install.load_plan_on_every_rank(plan, parallel=parallel, what="planc.apply",
                                             world_model=model if mesh is None else None)
    return install.apply(model, loaded, mesh=mesh)


def load(source: "Union[str, os.PathLike[str]]", plan: "PlanSource", *, dtype: Optional[Any] = None,
         device: Optional[Any] = None, mesh: Optional[Any] = None,
         parallel: "Optional[Mapping[str, int]]" = None, dequantize: Optional[bool] = None,
         trust_checkpoint_code: bool = False) -> "nn.Module":
    """Load the checkpoint directory `source` sharded by `plan`: every rank reads only its own shards.

    Returns the applied model (as `from_pretrained` returns one); its CompiledPlan is `model._planc_plan`.
    `parallel` runs the plan at other sizes, as for `apply`. `dequantize` (FP8 block-scaled checkpoints): keep
    FP8 (False) or dequantize each shard as it is read (True); default: as transformers decides (docs/load.md).
    A planc.save checkpoint is read as data, through an allow-list (no code in it runs; docs/security.md);
    `trust_checkpoint_code=True` reads one planc cannot read so with torch's own unpickler, and warns.
    """
    from planc.checkpoint.load import load as _load
    from planc.runtime import install

    install.require_distributed("planc.load")
    loaded = install.load_plan_on_every_rank(plan, parallel=parallel, what="planc.load")
    return _load(source, loaded, dtype=dtype, device=device, mesh=mesh, dequantize=dequantize,
                 trust_checkpoint_code=trust_checkpoint_code)


def save(model: nn.Module, directory: Union[str, os.PathLike[str]], *, optimizer: Optional[Any] = None) -> Path:
    """Write an applied model as a sharded checkpoint (torch.distributed.checkpoint, every rank its own shards)
    with its plan beside it; `planc.load` reads it back under any plan or sizes. Call on every rank.
    `optimizer`: its state is saved too, sharded like the model, for `planc.load_optimizer`.
    The directory is replaced only once the new checkpoint is complete."""
    from planc.checkpoint.save import save as _save

    return _save(model, directory, optimizer=optimizer)


def load_optimizer(model: nn.Module, optimizer: Any, directory: Union[str, os.PathLike[str]], *,
                   trust_checkpoint_code: bool = False) -> None:
    """Restore `optimizer` (built over `model`'s parameters) from a checkpoint `planc.save(..., optimizer=)` wrote,
    under any plan or sizes (`model` from `planc.load` of that checkpoint). Call on every rank. The state is read
    as data (docs/security.md); `trust_checkpoint_code=True` reads it with torch's own unpickler, and warns."""
    from planc.checkpoint.optimizer import load_optimizer as _load_optimizer

    _load_optimizer(model, optimizer, directory, trust_checkpoint_code=trust_checkpoint_code)


def export(model: nn.Module, directory: Union[str, os.PathLike[str]], *, max_shard_size: Union[int, str] = "5GB") -> Path:
    """Write an applied model as consolidated hub-layout safetensors (transformers' reverse weight conversion),
    one tensor group at a time, that plain `from_pretrained(directory)` loads. Call on every rank."""
    from planc.checkpoint.export import export as _export

    return _export(model, directory, max_shard_size=max_shard_size)


def clip_grad_norm_(model: Any, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> Any:
    """Clip the gradients of a planc model in place to a global norm of `max_norm`; returns the total norm of
    its full (unsharded) gradients, the same on every rank, over any mix of TP, EP and data-parallel meshes
    (`norm_type` any p > 0 or inf). torch.nn.utils.clip_grad_norm_ cannot combine those meshes."""
    from planc.runtime.clip import clip_grad_norm_ as _clip

    return _clip(model, max_norm, norm_type, error_if_nonfinite)


def no_sync(model: Any) -> Any:
    """A context manager for gradient accumulation: backward inside it accumulates local gradients without the
    data-parallel reduction; the next backward outside reduces them all. Works at every dp size (docs/train.md)."""
    from planc.runtime.data_parallel import no_sync as _no_sync

    return _no_sync(model)


def distribute_adapters(model: Any) -> Any:
    """After peft's get_peft_model on a planc model, before building the optimizer (every rank): the LoRA adapters
    at their full size, sharded like their base layers and trained by the plan's data parallelism; returns
    `model`. LoRA on routed experts is refused (docs/train.md, "LoRA with PEFT")."""
    from planc.runtime.adapters import distribute_adapters as _distribute

    return _distribute(model)


def device_mesh(model: Any, view: Optional[str] = None) -> Any:
    """The root DeviceMesh planc built for an applied model, or one of its views: `dp` (this rank's data-parallel
    replicas: `get_local_rank()` is the replica to feed), `tp`, `ep`, `efsdp` (the ranks holding the same experts).
    docs/train.md draws them; `CompiledPlan.mesh_dims` gives the root's sizes and names without torch."""
    groups = getattr(model, "_planc_groups", None)
    if groups is None:
        from planc.errors import ApplyError

        raise ApplyError(f"planc.device_mesh: {type(model).__name__} was not applied by planc.apply or planc.load")
    return groups.root if view is None else groups.view(view)


def verify(build: Any = None, plan: "Optional[PlanSource]" = None, *, parallel: "Optional[Mapping[str, int]]" = None,
           train: bool = False, dtype: Optional[str] = None, **options: Any) -> "VerifyReport":
    """Run `plan` at its own sizes on CPU gloo ranks against the unsharded model and return a VerifyReport (`.ok`,
    `.stages`, `.first_divergence`). `build`: `"pkg.module:function"` or a module-level callable returning a fresh,
    seeded nn.Module; or `model=DIR` / `model_type=T` in `options` (default: the plan's model type). Options:
    `trust_remote_code`, `overrides` (config values), `shrink` (default True), `seed`, `memory`, `kernels` (the Mega
    MoE kernel stages: None runs them on a CUDA GPU when there is one). docs/verify.md."""
    from planc.verification import verify as _verify

    return _verify(build, plan, parallel=parallel, train=train, dtype=dtype, **options)


def destroy_megamoe_buffers() -> None:
    """Free every shared Mega MoE buffer; the next forward allocates again."""
    from planc.runtime.megamoe import destroy_megamoe_buffers as _destroy

    _destroy()
