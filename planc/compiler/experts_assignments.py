"""The experts part of a CompiledPlan: the EP strategy and one ExpertsAssignment per experts module, checked as
they are built (coverage, divisibility, each tensor's rule, Mega MoE)."""

from __future__ import annotations

from typing import Optional

from planc.compiler.checks.experts import check_experts_params
from planc.compiler.checks.megamoe import check_megamoe
from planc.compiler.compiled import ExpertsAssignment
from planc.compiler.context import PlanRule, key_where, Resolution
from planc.compiler.units import human_bytes
from planc.spec.ep import EPStrategy, resolve_ep
from planc.spec.styles import EXPERTS_MODULE_STYLES
from planc.compiler import rule_examples as ex
from planc.lint.registry import compile_rule


EXPERTS_UNCOVERED = compile_rule(
    "PLC602", "experts-without-rule", "an experts module has no EP or TP rule while a size is > 1",
    "Experts with no rule are replicated: every rank holds every expert, usually most of the model. Shard "
    "them by expert (`grouped_gemm` + `ep_dispatch_experts` in ep_plan) or by feature (`moe_tp_experts` in "
    "tp_plan with `packed_colwise`/`rowwise` on their parameters).",
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n" + ex.ATTN + ex.HEAD,
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n" + ex.ATTN + ex.HEAD + ex.MOE_TP,
)
EXPERTS_NOT_DIVISIBLE = compile_rule(
    "PLC606", "experts-not-divisible", "the expert count is not a multiple of `ep_size`",
    "Each EP rank holds `num_experts / ep_size` experts. The hint lists sizes from the joint solver "
    "(`planc.spec.sizes.solve_sizes`) under which the plan compiles against this model.",
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1, ep_size: 3, dp_size: 3}\n" + ex.EP,
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1, ep_size: 2, dp_size: 2}\n" + ex.EP,
)


def resolve_strategy(c: Resolution, ep_experts: set[str]) -> Optional[EPStrategy]:
    # Mega MoE experts always run behind MegaMoeEP (it hands the kernel its process group), even at ep_size 1.
    if not ep_experts and not c.megamoe:
        return None
    return resolve_ep(c.plan.experts, c.parallel)  # lint (PLC400-402) has refused the plans it raises for


def experts_assignments(
    c: Resolution, final: dict[str, PlanRule], strategy: Optional[EPStrategy]
) -> list[ExpertsAssignment]:
    walk, out = c.walk, []
    sharding = c.active["tp"] or c.active["ep"]
    for m in walk.experts:
        info = m.experts
        assert info is not None  # walk.experts: the modules with experts
        rule = final.get(m.fqn)
        mode = EXPERTS_MODULE_STYLES.get(rule.style) if rule is not None else None
        if mode is None and sharding:
            table = "ep_plan" if c.active["ep"] else "tp_plan"
            c.problems.add(
                EXPERTS_UNCOVERED,
                f"experts module {m.class_name} has no EP or TP rule: with tp_size={c.tp}, ep_size={c.ep} "
                f"every rank would hold all {info.num_experts} experts "
                f"({human_bytes(sum(walk.params[p].nbytes for p in m.params), digits=1)} per layer)",
                key_where(c.loaded, (table,)),
                "shard them by expert: ep_plan `<path>.experts.{gate_up_proj,down_proj}: grouped_gemm` and "
                "`<path>.experts: ep_dispatch_experts` (or moe_tp_experts in tp_plan)",
                m.fqn,
            )
        check_experts_params(c, m, mode, final)
        if mode == "ep" and info.num_experts % c.ep:
            c.problems.add(
                EXPERTS_NOT_DIVISIBLE,
                f"{info.num_experts} experts cannot be split evenly over ep_size={c.ep} ranks",
                key_where(c.loaded, ("parallel", "ep_size")),
                c.sizes_hint(f"no sizes on {c.parallel.world_size} ranks split {info.num_experts} experts evenly "
                             "and pass the other checks: launch another number of ranks, or shard the experts with "
                             "`moe_tp_experts` in tp_plan and `ep_size: 1`"),
                m.fqn,
            )
        if c.megamoe:
            check_megamoe(c, m)
        out.append(
            ExpertsAssignment(
                fqn=m.fqn,
                strategy=strategy if mode == "ep" or c.megamoe else None,
                num_experts=info.num_experts,
                num_local_experts=info.num_experts // c.ep if mode == "ep" else info.num_experts,
                top_k=info.top_k,
                hidden_size=info.hidden_size,
                intermediate_size=info.intermediate_size,
                has_gate=info.has_gate,
                is_fp4=info.is_fp4,
                mode=mode,
                is_transposed=info.is_transposed,
                dispatch=info.dispatch,
            )
        )
    return out
