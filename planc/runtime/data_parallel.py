"""The plan's `dp` replicas train: `training.data_parallel` installed after TP/EP, as torchtitan's `apply_fsdp`.

What "correct" means: after `loss.backward()` on every rank (each dp replica its own micro-batch, each
loss the mean over it), every gradient equals that of the mean loss over the global batch.

- Dense parameters: each replica's gradient is its own loss's, so they are averaged over `dp`.
- EP-sharded experts: rank r's experts are held by the `efsdp` ranks (world / ep, one per EP group),
  and an EP group spans ep / tp replicas whose tokens the all_to_all already brought to the experts,
  so each holder's gradient is the *sum* over those replicas' losses (all_reduce: ep == tp, one
  replica). The global gradient is the sum over the holders divided by dp. FSDP2 averages over the
  mesh it reduces on (efsdp), so the experts' local weights scale their gradient by efsdp / dp in the
  EP forward (`grad_scale`, identity forward): average(efsdp) x efsdp / dp = sum / dp, for every
  strategy and layout (it is 1 whenever ep == tp).

Both modes are torch's FSDP2 machinery, so the gradient reduction is bucketed per wrapped module and
overlapped with backward: `replicate` is `torch.distributed._composable.replicate_with_fsdp.replicate`
(all-reduce), `fsdp` is `fully_shard` (reduce-scatter; parameters, gradients and optimizer state
sharded). Units as torchtitan: each experts module over `efsdp` (so that the layer's unit never sees a
parameter on the EP mesh), each decoder layer over `dp`, then the root over `dp`.

FSDP2 needs one original dtype per unit. transformers keeps some modules in fp32 inside a bf16 model
(`_keep_in_fp32_modules`: DeepSeek-V3's and GLM-4.5's router weight), so every module whose own
parameters are of another dtype than the rest of its unit becomes a unit of its own first (as
torchtitan and VeOmni do), with a mixed-precision policy that leaves its dtype as it is: the fp32
router stays fp32, in the parameters, the optimizer state and the forward.

Parameters added after the wrap (PEFT adapters, planc.runtime.adapters) become units of their own in the same mode
(`install_adapter_units`), so they are reduced, accumulated (no_sync) and sharded as the rest.

A unit that keeps its parameters unsharded after its forward (the root and the last layer under fsdp,
every unit under replicate: backward needs them) leaves the unsharded tensors registered in the model
until a backward reshards them. After a forward with autograd off (an eval, `generate()`) no backward
comes, so each unit reshards itself at the end of such a forward: `model.parameters()` is the sharded
set again. After a forward with autograd on, the unsharded tensors stay registered for the backward
(resharding would cost an all-gather in it), so an optimizer built before that backward holds them and
they never receive a gradient. Each unit remembers, at its first such forward, which sharded parameter
each of its unsharded tensors stands for (FSDP2 keeps one unsharded tensor per parameter for the model's
life), and a step pre-hook common to all optimizers (torch's `register_optimizer_step_pre_hook`)
puts the sharded parameter in the optimizer's place, with its state: every parameter trains whatever
ran before the optimizer was built.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from planc.errors import ApplyError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from planc.compiler.compiled import CompiledPlan
    from planc.runtime.mesh import Groups

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: nn.Module, compiled: CompiledPlan) -> list[nn.Module]:
    """The decoder layers: every item of each `nn.ModuleList` that holds an experts module's layer (DeepSeek's
    dense first layers too), else the modules of the classes transformers never splits (`_no_split_modules`)."""
    modules = dict(model.named_modules())
    lists: list[str] = []
    for e in compiled.experts:
        parts = e.fqn.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:i])
            if parts[i].isdigit() and isinstance(modules.get(parent), nn.ModuleList):
                if parent not in lists:
                    lists.append(parent)
                break
    if lists:
        return [layer for name in lists for layer in modules[name]]
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def expert_grad_scale(groups: Groups) -> float:
    """efsdp / dp: what turns FSDP's average over the experts' holders into the global-batch mean (module doc)."""
    holders = groups.efsdp_mesh.size() if groups.efsdp_mesh is not None else 1
    return holders / groups.dp_size


def install_data_parallel(model: nn.Module, compiled: CompiledPlan, groups: Groups) -> Optional[str]:
    """Wrap `model` for `compiled.data_parallel`; returns the mode installed, or None (nothing to do: one
    replica and no mixed precision, or experts that cannot train)."""
    if any(e.strategy is not None and e.strategy.inference_only for e in compiled.experts):
        return None  # Mega MoE: inference only (a plan that declares `training:` is refused by PLC700)
    modules = dict(model.named_modules())
    ep_experts = [modules[e.fqn] for e in compiled.experts if e.mode == "ep" and groups.ep_size > 1]
    scale = expert_grad_scale(groups)
    for experts in ep_experts:
        experts._planc_grad_scale = scale
    mode, shards = compiled.data_parallel, compiled.data_parallel_mode.shards_parameters
    if groups.tp_size > 1:
        _before_every_step()  # the replicated parameters stay plain beside TP's DTensors where nothing wraps them
    if not compiled.data_parallel_wraps:
        return None  # one replica and nothing to shard: FSDP2 over one rank would only add copies to each step
    layers = decoder_layers(model, compiled)
    if not layers:
        raise ApplyError(
            f"planc.runtime.data_parallel: found no decoder layers in {type(model).__name__} to wrap for "
            f"`data_parallel: {mode}` (planc wraps each item of the nn.ModuleList holding the experts' layers)."
        )
    wrap, kwargs = _wrapper(compiled)
    names = {m: n for n, m in model.named_modules()}
    wrapped: list[Any] = []  # FSDPModule: the wrapped modules

    def unit(module: nn.Module, mesh: Optional[DeviceMesh], unit_kwargs: dict[str, Any]) -> None:
        for odd in dtype_odd_modules(module, names, wrapped):  # their own units first: one dtype per unit
            wrapped.append(wrap(odd, mesh=mesh, **dict(unit_kwargs, **_keep_dtype(unit_kwargs))))
        wrapped.append(wrap(module, mesh=mesh, **unit_kwargs))

    for i, layer in enumerate(layers):
        layer_kwargs = dict(kwargs)
        if shards:  # torchtitan's "default" policy: the last layer's parameters stay for backward
            layer_kwargs["reshard_after_forward"] = i < len(layers) - 1
        for experts in (m for m in layer.modules() if m in ep_experts):
            unit(experts, groups.efsdp_mesh, layer_kwargs)
        unit(layer, groups.dp_mesh, layer_kwargs)
    root_kwargs = dict(kwargs, reshard_after_forward=False) if shards else kwargs
    unit(model, groups.dp_mesh, root_kwargs)
    _finish_units(wrapped, groups)
    return mode


def install_adapter_units(model: nn.Module, adapters: list[nn.Module], compiled: CompiledPlan, groups: Groups) -> None:
    """Parameters added after `install_data_parallel` (PEFT adapters, planc.runtime.adapters): each module in
    `adapters` a unit of its own over `dp`, in the plan's mode, keeping its dtype (peft keeps adapters in fp32
    inside a bf16 model). Nothing where `install_data_parallel` wrapped nothing (one replica)."""
    from torch.distributed.fsdp import FSDPModule

    if not adapters or not any(isinstance(m, FSDPModule) for m in model.modules()):
        return
    wrap, kwargs = _wrapper(compiled)
    kwargs = dict(kwargs, **_keep_dtype(kwargs))
    _finish_units([wrap(module, mesh=groups.dp_mesh, **kwargs) for module in adapters], groups)


def _finish_units(wrapped: list[Any], groups: Groups) -> None:
    """What every unit planc wraps gets: resharded after a no-grad forward; sum reductions on gloo."""
    for module in wrapped:
        module._planc_sharded = _own_parameters(module)  # every unit is sharded here: nothing ran yet
        module.register_forward_hook(_after_unit_forward)
    _before_every_step()
    if groups.dp_mesh.device_type == "cpu":
        # gloo has no AVG / PREMUL_SUM reductions: sum, then FSDP divides by the group size itself
        for module in wrapped:
            module.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation: backward inside this block adds to the local gradients without reducing them over
    the data-parallel replicas; the first backward after it reduces everything accumulated. At every dp size: a
    model planc did not wrap (one replica) has nothing to reduce, so the block changes nothing there."""
    from torch.distributed.fsdp import FSDPModule

    if getattr(model, "_planc_groups", None) is None:
        raise ApplyError(f"planc.no_sync: {type(model).__name__} was not applied by planc.apply or planc.load")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


_SHARDED_OF: dict[int, nn.Parameter] = {}  # id of an unsharded tensor FSDP2 registers -> the sharded parameter
_STEP_HOOK: list[Any] = []


def _after_unit_forward(module: Any, args: Any, output: Any) -> None:
    """After a forward that no backward follows (no_grad, inference_mode: an eval, generate()), put the unit's
    sharded parameters back; after the first forward with autograd on, remember which sharded parameter each
    unsharded tensor left registered stands for (module doc)."""
    if not torch.is_grad_enabled():
        module.reshard()
    elif "_planc_unsharded_seen" not in module.__dict__:
        module._planc_unsharded_seen = True
        for key, param in _own_parameters(module).items():
            sharded = module._planc_sharded.get(key)
            if sharded is not None and param is not sharded and id(param) not in _SHARDED_OF:
                _SHARDED_OF[id(param)] = sharded
                weakref.finalize(param, _SHARDED_OF.pop, id(param), None)  # the id is free before it is reused


def _own_parameters(unit: nn.Module) -> dict[tuple[int, str], nn.Parameter]:
    """Every parameter under `unit`, keyed by (its module, its name there): stable when modules are moved, as PEFT
    moves a wrapped layer under `base_layer`."""
    return {(id(m), name): p for m in unit.modules() for name, p in m.named_parameters(recurse=False)}


def sharded_in_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Put each planc model's sharded parameter where `optimizer` holds an unsharded tensor FSDP2 had registered
    when the optimizer was built (a forward with autograd on and no backward yet), with its state."""
    if not _SHARDED_OF:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        for i, param in enumerate(params):
            sharded = _SHARDED_OF.get(id(param))
            if sharded is not None:
                params[i] = sharded
                if param in optimizer.state:
                    optimizer.state[sharded] = optimizer.state.pop(param)


def settle_sharded(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Before reading or writing optimizer state by parameter name (planc.save, planc.load_optimizer): every unit
    of `model` sharded (FSDP2's public `reshard`) and `optimizer` over the sharded parameters, whatever forward
    ran last."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    sharded_in_optimizer(optimizer)


def loop_over_mixed_groups(optimizer: torch.optim.Optimizer) -> None:
    """With one replica nothing wraps the parameters TP leaves whole (norms, routers): they stay plain tensors beside
    the DTensors TP shards, and torch's foreach optimizers (the default on CUDA) refuse the mix ("got mixed
    torch.Tensor and DTensor"). Such a parameter group steps tensor by tensor (`foreach=False`)."""
    for group in optimizer.param_groups:
        if group.get("foreach") is not False and "foreach" in group and not group.get("fused"):
            if len({isinstance(p, DTensor) for p in group["params"]}) > 1:
                group["foreach"] = False


def _before_every_step() -> None:
    """One step pre-hook for every optimizer of the process (registered once): `sharded_in_optimizer`, then
    `loop_over_mixed_groups`."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            sharded_in_optimizer(optimizer)
            loop_over_mixed_groups(optimizer)

        _STEP_HOOK.append(register_optimizer_step_pre_hook(before_step))


def dtype_odd_modules(unit: nn.Module, names: dict[nn.Module, str], wrapped: list[Any]) -> list[nn.Module]:
    """The modules of `unit` (outside units already `wrapped`) whose own parameters are all of another dtype
    than the unit's main one (the one holding most elements): each must be a unit of its own. A module
    whose own parameters mix dtypes cannot be split off: ApplyError naming it."""
    taken = {id(m) for w in wrapped for m in w.modules()}  # their parameters belong to their own units
    inside = [m for m in unit.modules() if m is unit or id(m) not in taken]
    by_dtype: dict[torch.dtype, int] = {}
    for m in inside:
        for p in m.parameters(recurse=False):
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    if len(by_dtype) < 2:
        return []
    main = max(by_dtype, key=lambda d: by_dtype[d])
    odd = []
    for m in inside:
        dtypes = {p.dtype for p in m.parameters(recurse=False)}
        if len(dtypes) > 1:
            raise ApplyError(
                f"planc.runtime.data_parallel: module `{names.get(m, type(m).__name__)}` holds parameters of "
                f"{sorted(str(d) for d in dtypes)}; FSDP2 (training.data_parallel) needs one dtype per unit and "
                "cannot split a module's own parameters. Load the model in one dtype (e.g. dtype=torch.float32), "
                "or keep that module's parameters in one dtype."
            )
        if dtypes and main not in dtypes:
            odd.append(m)
    if unit in odd:
        raise ApplyError(
            f"planc.runtime.data_parallel: `{names.get(unit, type(unit).__name__)}` holds its own parameters in "
            f"{sorted(str(d) for d in {p.dtype for p in unit.parameters(recurse=False)})}, its submodules mostly in "
            f"{main}; FSDP2 needs one dtype per unit. Load the model in one dtype (e.g. dtype=torch.float32)."
        )
    return odd


def _keep_dtype(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs that leave a dtype-odd unit's compute dtype as it is (a plan's `param_dtype` casts the rest)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = kwargs.get("mp_policy")
    if policy is None or policy.param_dtype is None:
        return {}
    return {"mp_policy": MixedPrecisionPolicy(reduce_dtype=policy.reduce_dtype)}


def _wrapper(compiled: CompiledPlan) -> tuple[Callable[..., Any], dict[str, Any]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not compiled.data_parallel_mode.shards_parameters:
        try:
            from torch.distributed._composable.replicate_with_fsdp import replicate
        except ImportError:
            raise ApplyError(
                f"planc.runtime.data_parallel: `data_parallel: replicate` with dp_size > 1 uses torch's FSDP2-based "
                f"replicate (torch.distributed._composable.replicate_with_fsdp), which torch {torch.__version__} "
                "lacks. Upgrade torch, or write `training: {data_parallel: fsdp}`."
            ) from None
        return replicate, {}
    mp = compiled.training.mixed_precision if compiled.training is not None else None
    policy = (
        MixedPrecisionPolicy(param_dtype=_DTYPES[mp.param_dtype], reduce_dtype=_DTYPES[mp.reduce_dtype])
        if mp is not None
        else MixedPrecisionPolicy()
    )
    return fully_shard, {"mp_policy": policy}


__all__ = ["decoder_layers", "dtype_odd_modules", "expert_grad_scale", "install_adapter_units", "install_data_parallel",
           "no_sync", "settle_sharded", "sharded_in_optimizer"]
