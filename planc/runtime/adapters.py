"""PEFT LoRA adapters on a planc model: shaped and sharded like their base layers, trained by the plan's data parallelism.

`peft.get_peft_model` on an applied model sizes each adapter from its base layer's weight, a DTensor that planc
shards by TP and, under `fsdp`, over the dp ranks too: peft reads the full shape only on a mesh whose dims are
all named "fsdp" (`_get_in_out_features`), so here it sizes adapters for a local shard. The adapters it adds
are plain tensors that no data-parallel unit holds, initialised by each rank on its own. Renaming planc's `dp`
dim would fix only tp 1: at tp > 1 the weight's mesh also has a `tp` dim, and peft then reads the local shape
of both. `distribute_adapters` (`planc.distribute_adapters(model)`, after get_peft_model, before the optimizer)
makes the adapters what planc makes of every parameter:

- full shapes: the base layer's `in_features` / `out_features`; an adapter that peft sized for a shard is
  made again at full size with peft's own init (`reset_lora_parameters`). Then rank 0's adapters are broadcast
  to every rank, so every replica starts from one adapter, as the unsharded run does.
- tensor parallel, as the base layer: under `colwise`, `lora_B`'s rows are sharded as the base's output
  features (Shard(0) on the tp mesh) and the gradient of `lora_A`'s output is summed over tp (each rank's
  rows see only part of it); under `rowwise`, `lora_A`'s columns are sharded as the base's input features
  (Shard(1)) and its partial output is summed over tp. Both run on local tensors with planc's collectives, as
  planc's TP styles do. Linears that planc leaves whole or whose output is replicated (`replicate`,
  `colwise_gather_output`, `rowwise_split_input`, every linear at tp 1) keep whole adapters. Each style's
  `lora` column (planc.spec.styles) says which of the three it takes; a style without one is refused.
- data parallel: each adapter linear becomes a unit of the plan's `data_parallel` over the dp ranks
  (`replicate`: gradients all-reduced; `fsdp`: adapters sharded and reduce-scattered), as planc's
  `install_data_parallel` wraps the rest: gradient accumulation (`planc.no_sync`, Trainer's
  `set_requires_gradient_sync`) and clipping treat them as any other parameter, and Trainer's own sync of
  parameters added after sharding (`_sync_replicated_trainable_parameters`, which averages over every rank)
  skips them, being DTensors.

Refused, with what to write instead: LoRA on routed experts (expert-parallel or tensor-parallel experts: peft's
`target_parameters` or a module inside an experts module), on other TP styles (embeddings, MLA's kv_a_proj, ...),
non-linear LoRA layers, LoRA variants (DoRA), lora_bias, inits that read the base weight (PiSSA, OLoRA, ...) and
`lora_dropout` at tp > 1 except on rowwise layers (the TP ranks share the adapter's input and would drop
different elements of it). A training forward of a model with adapters planc has not distributed (tp or
dp > 1) raises, naming this function (`guard_adapters`); `peft_model_problem` refuses planc.apply / planc.load
on a PeftModel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from planc.errors import ApplyError
from planc.runtime.collectives import all_reduce_grad, all_reduce_sum, to_local
from planc.spec.styles import STYLE, STYLES

if TYPE_CHECKING:
    from planc.compiler.compiled import CompiledPlan
    from planc.runtime.mesh import Groups

ORDER = ("apply the plan to the base model (planc.apply or planc.load), then call peft's get_peft_model on the "
         "applied model, then planc.distribute_adapters(model) before building the optimizer (docs/train.md, "
         "\"LoRA with PEFT\")")
TARGET_INSTEAD = ("target the attention projections: target_modules=[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"] "
                  "(DeepSeek-style attention: \"q_a_proj\", \"q_b_proj\", \"kv_b_proj\", \"o_proj\"); on an MoE model "
                  "peft turns gate_proj, up_proj and down_proj, named or matched by a pattern, into the routed experts' "
                  "fused parameters")
SPLIT_DIM = {"lora_B": 0, "lora_A": 1}  # a split adapter's weight dim: lora_B's rows, lora_A's columns
PEFT_INITS = (True, False, "gaussian")  # inits that do not read the base weight


def peft_model_problem(model: nn.Module) -> Optional[str]:
    """planc.apply / planc.load on a PeftModel: the plan names the base model's modules, and peft's layers would be
    sharded as if they were the base layers. One message naming the order that works."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return (f"planc: {type(model).__name__} is a PEFT model (get_peft_model ran before planc): the plan names "
                f"the base model's modules and peft's adapter layers are not in it. Instead: {ORDER}.")
    return None


def lora_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """Every peft LoRA layer (a module holding `base_layer` and `lora_A`), with its path."""
    found: list[tuple[str, Any]] = [(path, m) for path, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    inner = {id(m.base_layer) for _, m in found}  # peft nests a wrapper per targeted parameter: the outermost
    return [(path, m) for path, m in found if id(m) not in inner]


def _planc_model(model: Any) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "_planc_groups", None) is None:
        raise ApplyError(f"planc.distribute_adapters: {type(base).__name__} was not applied by planc.apply or "
                         f"planc.load; {ORDER}.")
    return base


def _style(base_layer: Any, tp_size: int) -> Optional[str]:
    """The TP style planc installed on the base layer (None: planc left it whole); every linear is whole at tp 1."""
    return None if tp_size == 1 else getattr(base_layer.forward, "planc_style", None)


def _layout(style: Optional[str]) -> Optional[str]:
    """How the adapters of a linear with `style` are laid out (the style's `lora` column); None: they cannot be."""
    if style is None:
        return "whole"
    row = STYLE.get(style)
    return row.lora if row is not None else None


def _problem(path: str, layer: Any, experts: list[str], configs: dict[str, Any], tp_size: int) -> Optional[str]:
    """Why planc cannot distribute this LoRA layer, or None."""
    inner = layer.get_base_layer()
    where = path.removeprefix("base_model.model.")
    expert = next((e for e in experts if where == e or where.startswith(e + ".")), None)
    if expert is not None or hasattr(layer, "parameter_name"):
        return (f"{path}: LoRA on routed experts is not supported: planc shards the experts by expert or tensor "
                "parallelism, which peft's expert adapters (target_parameters) do not follow. Leave the experts out: "
                f"{TARGET_INSTEAD}.")
    if not isinstance(inner, nn.Linear) or not isinstance(getattr(layer, "lora_A", None), nn.ModuleDict):
        return (f"{path}: planc distributes LoRA on linear layers only ({type(inner).__name__} here); {TARGET_INSTEAD}.")
    style = _style(inner, tp_size)
    layout = _layout(style)
    if layout is None:
        follow = ", ".join(f"`{r.name}`" for r in STYLES if r.lora is not None)
        return (f"{path}: its base layer is tensor-parallel with `{style}`, which LoRA adapters cannot follow "
                f"(planc distributes adapters on linears it leaves whole and on {follow}); {TARGET_INSTEAD}.")
    for name in layer.lora_A:
        config = configs.get(name)
        if getattr(layer, "lora_variant", {}).get(name) is not None:
            return f"{path}: LoRA variants (DoRA, ...) are not supported on planc models; use plain LoRA (use_dora=False)."
        if getattr(layer, "lora_bias", {}).get(name):
            return f"{path}: lora_bias is not supported on planc models; use lora_bias=False."
        init = getattr(config, "init_lora_weights", True)
        if init not in PEFT_INITS:
            return (f"{path}: init_lora_weights={init!r} reads or changes the base weight, which planc shards; use "
                    f"one of {', '.join(repr(i) for i in PEFT_INITS)}.")
        dropout = layer.lora_dropout[name]
        if tp_size > 1 and layout != "lora_A" and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            return (f"{path}: lora_dropout={dropout.p} at tp_size {tp_size}: the TP ranks share this adapter's input "
                    "and each would drop other elements of it, so their shards or copies would disagree; use "
                    "lora_dropout=0.0 at tp_size > 1.")
    return None


def distribute_adapters(model: Any) -> Any:
    """Shape, shard and data-parallelise the LoRA adapters peft added to a planc model (module doc). Call on every
    rank after get_peft_model and before building the optimizer; returns `model`. Adapters already distributed
    are left as they are (call again after adding an adapter)."""
    base = _planc_model(model)
    compiled: CompiledPlan = base._planc_plan
    groups: Groups = base._planc_groups
    configs = dict(getattr(model, "peft_config", {}) or {})
    experts = [e.fqn for e in compiled.experts]
    layers = [(p, m) for p, m in lora_layers(model) if not getattr(m, "_planc_adapters", False)]
    problems = [msg for p, m in layers if (msg := _problem(p, m, experts, configs, groups.tp_size))]
    if problems:
        raise ApplyError("planc.distribute_adapters: " + "\n".join(problems))
    units: list[nn.Module] = []
    for _, layer in layers:
        inner = layer.get_base_layer()
        layout = _layout(_style(inner, groups.tp_size))
        for name in list(layer.lora_A):
            _full_size(layer, name, inner, configs[name].init_lora_weights if name in configs else True)
            for linear in (layer.lora_A[name], layer.lora_B[name]):
                for p in linear.parameters():
                    with torch.no_grad():
                        dist.broadcast(p.data, src=0)  # one adapter for every replica: rank 0's
            if layout in SPLIT_DIM:
                _shard(layer.lora_A[name], layer.lora_B[name], layout, groups.tp_mesh)
            units += [layer.lora_A[name], layer.lora_B[name]]
        layer._planc_adapters = True
    from planc.runtime.data_parallel import install_adapter_units

    install_adapter_units(base, units, compiled, groups)
    return model


def _full_size(layer: Any, name: str, inner: nn.Linear, init: Any) -> None:
    """Make the adapter of `name` again at the base layer's full size if peft sized it for a shard."""
    a, b = layer.lora_A[name], layer.lora_B[name]
    if a.in_features == inner.in_features and b.out_features == inner.out_features:
        return
    w = a.weight
    layer.in_features, layer.out_features = inner.in_features, inner.out_features
    layer.lora_A[name] = nn.Linear(inner.in_features, a.out_features, bias=False, dtype=w.dtype, device=w.device)
    layer.lora_B[name] = nn.Linear(b.in_features, inner.out_features, bias=False, dtype=w.dtype, device=w.device)
    layer.lora_A[name].requires_grad_(w.requires_grad)
    layer.lora_B[name].requires_grad_(b.weight.requires_grad)
    layer.reset_lora_parameters(name, init)


def _shard(a: nn.Linear, b: nn.Linear, layout: str, mesh: Any) -> None:
    """Shard the adapter as its base layer and run it on local tensors (module doc)."""
    group = mesh.get_group()
    sharded = b if layout == "lora_B" else a
    w = sharded._parameters["weight"]
    assert w is not None, "a LoRA linear holds its weight"
    sharded._parameters["weight"] = nn.Parameter(
        distribute_tensor(w.detach(), mesh, [Shard(SPLIT_DIM[layout])], src_data_rank=None),
        requires_grad=w.requires_grad)

    if layout == "lora_B":
        def a_forward(x: torch.Tensor) -> torch.Tensor:  # every rank's rows of B use it: its gradient is partial
            return all_reduce_grad(F.linear(x, to_local(a.weight)), group)

        def b_forward(h: torch.Tensor) -> torch.Tensor:  # this rank's output features, as the base's
            return F.linear(h, to_local(b.weight))
    else:
        def a_forward(x: torch.Tensor) -> torch.Tensor:  # this rank's input features: a partial sum
            return all_reduce_sum(F.linear(to_local(x), to_local(a.weight)), group)

        def b_forward(h: torch.Tensor) -> torch.Tensor:
            return F.linear(h, to_local(b.weight))
    a.forward = a_forward  # type: ignore[method-assign,assignment]  # an instance forward, as planc's TP styles install
    b.forward = b_forward  # type: ignore[method-assign,assignment]  # as above


def guard_adapters(model: nn.Module, tp_size: int, dp_size: int) -> None:
    """At tp or dp > 1: a training forward with LoRA adapters planc has not distributed raises (module doc)."""
    if tp_size > 1 or dp_size > 1:
        model.register_forward_pre_hook(_refuse_undistributed_adapters)


def _refuse_undistributed_adapters(model: nn.Module, args: Any) -> None:
    """Before each training forward (eval forwards and generate() skip the walk over the modules)."""
    if not model.training:
        return
    for path, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A") and not getattr(module, "_planc_adapters", False):
            raise ApplyError(
                f"planc: the PEFT LoRA layer {path} was not distributed: peft sizes an adapter for the local shard of "
                "a planc-sharded weight, and nothing keeps it equal or reduces its gradient over the data-parallel "
                "replicas, so the model would train wrongly. Call planc.distribute_adapters(model) on every rank "
                "after get_peft_model and before building the optimizer (docs/train.md, \"LoRA with PEFT\"); with "
                "TRL's SFTTrainer, pass it that model instead of peft_config.")


__all__ = ["distribute_adapters", "guard_adapters", "lora_layers", "peft_model_problem"]
