"""Checks that the sharded parameters will meet forwards that can take them, before anything is installed.

A TP style on a parameter turns it into a DTensor slice. Only the forwards planc wraps (the TP module
styles, `local_params`, `all_reduce`, the experts styles) compute on local shards; any other forward
would mix the DTensor with plain tensors and crash at the first call (`aten.add.Tensor got mixed
torch.Tensor and DTensor`). Likewise a model whose class cannot switch its experts kernel
(transformers' `_can_set_experts_implementation()`) runs only its own forward, and experts that take
every token pre-scaled (`forward(hidden_states)`, Llama 4) have no routed ids to dispatch.
Torch-free: reads the ModelWalk and the expanded assignments only.
"""

from __future__ import annotations

from planc.compiler.walk import generic_path

BARE_PARAM_UNWRAPPED = "PLC621"
EXPERTS_IMPL_FIXED = "PLC622"
WRONG_TARGET = "PLC613"

# Module styles whose installed forward runs the module on the local shards of its own parameters.
WRAPPING_MODULE_STYLES = frozenset(
    {
        "colwise", "colwise_gather_output", "rowwise", "rowwise_split_input", "packed_colwise",
        "embedding_rowwise", "local_params", "all_reduce", "moe_tp_experts", "ep_dispatch_experts",
    }
)
# Parameter styles that make a DTensor slice over the TP group.
SHARDING_PARAM_STYLES = frozenset(
    {"colwise", "colwise_gather_output", "rowwise", "rowwise_split_input", "packed_colwise", "packed_rowwise",
     "embedding_rowwise"}
)


def check_bare_parameters(resolver, assignments, final) -> None:
    """PLC621: a sharded parameter whose module's forward planc does not wrap."""
    if not resolver.active["tp"]:
        return
    walk = resolver.walk
    module_style = {a.fqn: a.style for a in assignments if a.target == "module"}
    for a in assignments:
        if a.target != "parameter" or a.style not in SHARDING_PARAM_STYLES:
            continue
        owner = walk.params[a.fqn].owner
        if module_style.get(owner) in WRAPPING_MODULE_STYLES:
            continue
        info = walk.modules[owner]
        gowner = generic_path(owner)
        rule = final[a.fqn]
        resolver.problems.add(
            BARE_PARAM_UNWRAPPED,
            f"`{a.style}` makes {generic_path(a.fqn)} a sharded DTensor, but its module {gowner} ({info.class_name}) "
            "gets no style whose forward runs on local shards: its own forward would mix the DTensor with plain "
            "tensors at the first call",
            rule.source.where,
            f"add `{gowner}: local_params` to tp_plan when its children already reduce the output (per-head "
            f"parameters such as attention sinks, sharded with their heads), or `{gowner}: all_reduce` when the "
            f"module's output is a partial sum; or delete `{rule.pattern_text}` to keep the parameter whole",
            a.fqn,
        )


def check_experts_implementation(resolver, where_impl: str) -> None:
    """PLC622: an experts kernel the model class cannot switch to."""
    walk, impl = resolver.walk, resolver.plan.experts.implementation
    if walk.can_switch_experts is not False or impl in ("eager", "deepgemm_megamoe") or not walk.experts:
        return
    resolver.problems.add(
        EXPERTS_IMPL_FIXED,
        f"{walk.model_class} cannot switch its experts implementation (transformers: "
        f"`{walk.model_class} does not support setting experts implementation`), so `{impl}` cannot be installed",
        where_impl,
        "write `experts: {implementation: eager}`: the model's own experts forward runs, and the EP strategies "
        "and TP styles wrap it",
    )


def check_dense_experts(resolver, final) -> None:
    """PLC613: ep_dispatch_experts on experts that take every token pre-scaled (no routed ids to dispatch)."""
    for m in resolver.walk.experts:
        rule = final.get(m.fqn)
        if m.experts.dispatch != "dense" or rule is None or rule.style != "ep_dispatch_experts":
            continue
        resolver.problems.add(
            WRONG_TARGET,
            f"{generic_path(m.fqn)} ({m.class_name}) runs forward(hidden_states) on every token pre-scaled by its "
            "router score; `ep_dispatch_experts` dispatches routed (token, expert) pairs and has none here",
            rule.source.where,
            f"shard these experts tensor-parallel in tp_plan: `{generic_path(m.fqn)}.gate_up_proj: packed_rowwise`, "
            f"`{generic_path(m.fqn)}.down_proj: colwise`, `{generic_path(m.fqn)}: moe_tp_experts`, with `ep_size: 1`",
            m.fqn,
        )
