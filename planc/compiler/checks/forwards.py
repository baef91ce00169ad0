"""Forwards that must take the sharded parameters.

A TP style on a parameter makes it a DTensor slice. Only the forwards planc wraps (styles with
`local_forward` in the styles table) compute on local shards; any other forward would mix the DTensor
with plain tensors at the first call. A model class that cannot switch its experts kernel
(transformers' `_can_set_experts_implementation()`) runs only its own forward, and experts that take
every token pre-scaled (`forward(hidden_states)`, Llama 4) have no routed ids to dispatch.
"""

from __future__ import annotations

from planc.compiler.checks.targets import WRONG_TARGET
from planc.compiler.context import PlanRule, Resolution
from planc.compiler.compiled import Assignment
from planc.compiler.walk import generic_path
from planc.spec.styles import STYLE, dispatches_experts
from planc.lint.registry import compile_rule


_GRANITE_SWA = (
    "version: 1\nmodel: {type: granitemoe_swa}\nparallel: {tp_size: 2}\ntp_plan:\n"
    "  model.layers.*.self_attn.{q,k,v}_proj: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n"
    "  model.layers.*.self_attn.sinks: colwise\n"
    "  model.layers.*.block_sparse_moe.experts.gate_up_proj: packed_colwise\n"
    "  model.layers.*.block_sparse_moe.experts.down_proj: rowwise\n"
    "  model.layers.*.block_sparse_moe.experts: moe_tp_experts\n"
)
BARE_PARAM_UNWRAPPED = compile_rule(
    "PLC623", "sharded-parameter-of-unwrapped-module",
    "a TP style shards a bare parameter of a module whose forward planc does not wrap",
    "A TP style on a parameter makes it a DTensor slice; only the forwards planc wraps (styles with "
    "`local_forward` in `planc.spec.styles`) compute on local shards. Any other forward (attention `sinks`, "
    "a shared experts `[n, I, H]` tensor) would mix the DTensor with plain tensors at the first call. Write "
    "`local_params` on the module when its children already reduce the output (per-head parameters sharded "
    "with their heads), `all_reduce` when its output is a partial sum, or delete the rule.",
    _GRANITE_SWA, _GRANITE_SWA + "  model.layers.*.self_attn: local_params\n",
)
EXPERTS_IMPL_FIXED = compile_rule(
    "PLC624", "experts-implementation-fixed",
    "an experts kernel other than `eager` for a model class that cannot switch its experts implementation",
    "Some model classes run only their own experts forward (transformers' "
    "`_can_set_experts_implementation()` is false: llama4; longcat_flash before transformers 5.25): `grouped_mm` "
    "or Mega MoE cannot be installed on them. `implementation: eager` keeps the model's forward, which the EP "
    "strategies and TP styles wrap.",
    "version: 1\nmodel: {type: llama4_text}\nparallel: {tp_size: 1}\nexperts: {implementation: grouped_mm}\n",
    "version: 1\nmodel: {type: llama4_text}\nparallel: {tp_size: 1}\nexperts: {implementation: eager}\n",
)


def check_bare_parameters(c: Resolution, assignments: list[Assignment], final: dict[str, PlanRule]) -> None:
    """PLC623: a sharded parameter whose module's forward planc does not wrap."""
    if not c.active["tp"]:
        return
    walk = c.walk
    module_style = {a.fqn: a.style for a in assignments if a.target == "module"}
    for a in assignments:
        spec = STYLE.get(a.style)
        if a.target != "parameter" or spec is None or spec.mesh != "tp" or not spec.shards:
            continue
        owner = walk.params[a.fqn].owner
        owner_spec = STYLE.get(module_style.get(owner, ""))
        if owner_spec is not None and owner_spec.local_forward:
            continue
        info = walk.modules[owner]
        gowner = generic_path(owner)
        rule = final[a.fqn]
        c.problems.add(
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


def check_experts_implementation(c: Resolution, where_impl: str) -> None:
    """PLC624: an experts kernel the model class cannot switch to."""
    walk, impl, row = c.walk, c.plan.experts.implementation, c.plan.experts.implementation_row
    # the class's own forward needs no switch; Mega MoE gets planc's own forward, no switch either
    if walk.can_switch_experts is not False or row.class_forward or row.megamoe or not walk.experts:
        return
    c.problems.add(
        EXPERTS_IMPL_FIXED,
        f"{walk.model_class} cannot switch its experts implementation (transformers: "
        f"`{walk.model_class} does not support setting experts implementation`), so `{impl}` cannot be installed",
        where_impl,
        "write `experts: {implementation: eager}`: the model's own experts forward runs, and the EP strategies "
        "and TP styles wrap it",
    )


def check_dense_experts(c: Resolution, final: dict[str, PlanRule]) -> None:
    """PLC613: ep_dispatch_experts on experts that take every token pre-scaled (Llama 4) when the EP group does not
    hold one batch. Such experts have no routed (token, expert) pairs to dispatch: each rank runs its own experts
    on every token of the batch its EP group shares and the outputs are gathered, so ep_size must equal tp_size."""
    for m in c.walk.experts:
        rule = final.get(m.fqn)
        if m.experts is None or m.experts.dispatch != "dense" or rule is None or not dispatches_experts(rule.style) or c.ep == c.tp:
            continue
        c.problems.add(
            WRONG_TARGET,
            f"{generic_path(m.fqn)} ({m.class_name}) runs forward(hidden_states) on every token pre-scaled by its "
            f"router score; with no routed pairs to dispatch, expert parallelism runs each rank's experts on the "
            f"batch its EP group shares, which needs ep_size == tp_size (got ep_size {c.ep}, tp_size {c.tp})",
            rule.source.where,
            f"set `ep_size: {c.tp}`, or shard these experts tensor-parallel in tp_plan: "
            f"`{generic_path(m.fqn)}.gate_up_proj: packed_rowwise`, `{generic_path(m.fqn)}.down_proj: colwise`, "
            f"`{generic_path(m.fqn)}: moe_tp_experts`, with `ep_size: 1`",
            m.fqn,
        )
