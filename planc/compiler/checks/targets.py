"""Checks of the plan against the model as a whole: model type, sizes, installable styles, targets, tied weights.

Each check reads the `Resolver` and reports through `c.problems` with the module path, the plan
position and what to write instead.
"""

from __future__ import annotations

from planc.compiler.checks.experts import nested_expert_owner
from planc.compiler.context import PlanRule, key_where, Resolution
from planc.compiler.walk import generic_path
from planc.spec.sizes import check_sizes as _check_sizes
from planc.spec.styles import ALL_STYLES, EXPERTS_MODULE_STYLES, PARAMETER_STYLES, RUNTIME_STYLES
from planc.compiler import rule_examples as ex
from planc.lint.registry import compile_rule


CONFLICTING_RULES = compile_rule(
    "PLC603", "two-styles-on-one-target", "two rules give one target different styles, or a rule names a tied parameter",
    "A parameter takes one style. Two rules that both match it (in one table or across tables) would shard it "
    "twice; a rule on one of two tied names would shard a tensor the other name reads whole.",
    ex.TOP + "tp_plan:\n" + ex.ATTN + "  model.layers.1.self_attn.q_proj: rowwise\n" + ex.HEAD + ex.EP, ex.GOOD,
)
STYLE_NOT_INSTALLABLE = compile_rule(
    "PLC605", "style-not-installed", "a style planc's runtime does not install",
    "transformers knows more styles than planc installs (`planc.spec.styles`, rows with `runtime`). planc "
    "refuses such a rule instead of silently skipping it; `replicate` keeps the module whole.",
    ex.TOP + "tp_plan:\n" + ex.ATTN + ex.HEAD + "  model.norm: sequence_parallel\n" + ex.EP, ex.GOOD,
)
MODEL_TYPE_MISMATCH = compile_rule(
    "PLC607", "model-type-mismatch", "`model.type` differs from the model's `config.model_type`",
    "A plan's paths and sizes are written for one family; compiling it against another is almost always the "
    "wrong file.",
    ex.GOOD.replace("type: mixtral", "type: qwen3_moe"), ex.GOOD,
)
WRONG_TARGET = compile_rule(
    "PLC613", "style-on-wrong-target", "a style on the wrong kind of target",
    "`grouped_gemm` shards the expert dimension of an experts parameter (or of a per-expert tensor of a module "
    "inside the experts, such as a per-expert norm); `ep_dispatch_experts` and `moe_tp_experts` hook an experts "
    "module's forward. On anything else they cannot run.",
    ex.GOOD.replace("model.layers.*.mlp.experts: ep_dispatch_experts", "model.layers.*.mlp.gate: ep_dispatch_experts"),
    ex.GOOD,
)


def check_model_type(c: Resolution) -> None:
    want, have = c.plan.model.type, c.walk.model_type
    if have is not None and want != have:
        c.problems.add(
            MODEL_TYPE_MISMATCH,
            f"the plan is written for `model.type: {want}`, but this model's config.model_type is `{have}` "
            f"({c.walk.model_class})",
            key_where(c.loaded, ("model", "type")),
            f"write `model: {{type: {have}}}` if the rules fit this model, or compile the plan against a "
            f"`{want}` model",
        )


def check_sizes(c: Resolution) -> None:
    """`planc.spec.sizes.check_sizes`, the function lint and the runtime call. Plans reach the compiler
    linted, so this only fires for a `LoadedPlan` built in code; the codes are lint's (PLC500-502)."""
    p = c.parallel
    for problem in _check_sizes(p.tp_size, p.ep_size, p.dp_size):
        c.problems.add(problem.code, problem.message, key_where(c.loaded, problem.key), problem.hint)


def check_style(c: Resolution, rule: PlanRule) -> None:
    """A style lint accepts (current, in the right table) that planc's runtime does not install."""
    style = rule.style
    if style not in RUNTIME_STYLES:
        c.problems.add(
            STYLE_NOT_INSTALLABLE,
            f"planc's runtime does not install style `{style}` ({ALL_STYLES.get(style, 'unknown')}); transformers "
            "would, planc refuses instead of skipping it",
            rule.source.where,
            f"use one of the installable styles ({', '.join(sorted(RUNTIME_STYLES))}), or `replicate` to keep "
            "the module whole on every rank",
        )


def check_targets(c: Resolution, rule: PlanRule) -> None:
    walk, style = c.walk, rule.style
    for fqn in rule.targets:
        if fqn in walk.params:
            owner = walk.modules[walk.params[fqn].owner]
            if style in EXPERTS_MODULE_STYLES:
                c.problems.add(
                    WRONG_TARGET,
                    f"`{style}` hooks an experts module's forward, but `{rule.pattern_text}` matches a parameter",
                    rule.source.where,
                    f"write `{style}` on the experts module (`{generic_path(owner.fqn)}`)",
                    fqn,
                )
            elif style in PARAMETER_STYLES and owner.experts is None and nested_expert_owner(walk, fqn) is None:
                c.problems.add(
                    WRONG_TARGET,
                    f"`{style}` shards the expert dimension, but `{generic_path(fqn)}` belongs to {owner.class_name}, "
                    "which is not an experts module",
                    rule.source.where,
                    "use `grouped_gemm` only on the parameters of experts modules (gate_up_proj, down_proj, ...) and "
                    "on per-expert tensors of modules inside them (leading dim = the experts count); dense layers "
                    "take TP styles in tp_plan",
                    fqn,
                )
        else:
            module = walk.modules[fqn]
            if style in PARAMETER_STYLES:
                names = ", ".join(p.rsplit(".", 1)[-1] for p in module.params) or "none"
                c.problems.add(
                    WRONG_TARGET,
                    f"`{style}` is a parameter style, but `{rule.pattern_text}` matches the module {generic_path(fqn)} "
                    f"({module.class_name})",
                    rule.source.where,
                    f"write one rule per parameter (`{rule.pattern_text}.{{...}}`; its parameters: {names}) and "
                    "`ep_dispatch_experts` on the module",
                    fqn,
                )
            elif style in EXPERTS_MODULE_STYLES and module.experts is None:
                c.problems.add(
                    WRONG_TARGET,
                    f"`{style}` needs an experts module (forward(hidden_states, top_k_index, top_k_weights) with "
                    f"gate_up_proj/down_proj), but {generic_path(fqn)} is a {module.class_name}",
                    rule.source.where,
                    "point the rule at the `experts` child of the MoE block, e.g. `model.layers.*.mlp.experts`",
                    fqn,
                )


def check_tied(c: Resolution, final: dict[str, PlanRule]) -> None:
    by_tensor: dict[int, list[str]] = {}
    for p in c.walk.params.values():
        by_tensor.setdefault(p.tensor_id, []).append(p.fqn)
    for fqns in by_tensor.values():
        if len(fqns) < 2:
            continue
        # Any rule on a tied name treats the names separately: a name without a rule would read the
        # shard as the whole tensor, and two rules would shard the one tensor twice.
        ruled = [f for f in fqns if f in final]
        if not ruled:
            continue
        listing = ", ".join(f"{f} ({final[f].style if f in final else 'no rule'})" for f in fqns)
        c.problems.add(
            CONFLICTING_RULES,
            f"tied parameters share one tensor but the plan treats them separately: {listing}",
            final[ruled[-1]].source.where,
            "a tied tensor stays whole: delete "
            + " and ".join(dict.fromkeys(f"`{final[f].pattern_text}`" for f in ruled))
            + ", or untie the weights (`tie_word_embeddings: false` in the config)",
            ruled[-1],
        )
