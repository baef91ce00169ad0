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
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from planc.errors import ApplyError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: nn.Module, compiled) -> list[nn.Module]:
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


def expert_grad_scale(groups) -> float:
    """efsdp / dp: what turns FSDP's average over the experts' holders into the global-batch mean (module doc)."""
    holders = groups.efsdp_mesh.size() if groups.efsdp_mesh is not None else 1
    return holders / groups.dp_size


def install_data_parallel(model: nn.Module, compiled, groups) -> Optional[str]:
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
    holders = groups.efsdp_mesh.size() if groups.efsdp_mesh is not None else 1
    mixed = compiled.training is not None and compiled.training.mixed_precision is not None
    if groups.dp_size == 1 and holders == 1 and not mixed:
        return None  # one replica and nothing to shard: FSDP2 over one rank would only add copies to each step
    layers = decoder_layers(model, compiled)
    if not layers:
        raise ApplyError(
            f"planc.runtime.data_parallel: found no decoder layers in {type(model).__name__} to wrap for "
            f"`data_parallel: {mode}` (planc wraps each item of the nn.ModuleList holding the experts' layers)."
        )
    wrap, kwargs = _wrapper(compiled)
    wrapped = []
    for i, layer in enumerate(layers):
        layer_kwargs = dict(kwargs)
        if shards:  # torchtitan's "default" policy: the last layer's parameters stay for backward
            layer_kwargs["reshard_after_forward"] = i < len(layers) - 1
        for experts in (m for m in layer.modules() if m in ep_experts):
            wrapped.append(wrap(experts, mesh=groups.efsdp_mesh, **layer_kwargs))
        wrapped.append(wrap(layer, mesh=groups.dp_mesh, **layer_kwargs))
    root_kwargs = dict(kwargs, reshard_after_forward=False) if shards else kwargs
    wrapped.append(wrap(model, mesh=groups.dp_mesh, **root_kwargs))
    if groups.dp_mesh.device_type == "cpu":
        # gloo has no AVG / PREMUL_SUM reductions: sum, then FSDP divides by the group size itself
        for module in wrapped:
            module.set_force_sum_reduction_for_comms(True)
    return mode


def _wrapper(compiled):
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


__all__ = ["decoder_layers", "expert_grad_scale", "install_data_parallel"]
