"""Checks of experts modules: every tensor sharded the way the experts module runs (EP or TP), per-expert
tensors of modules inside experts (`nested_expert_owner`)."""

from __future__ import annotations

from typing import Optional

from planc.compiler.context import PlanRule, Resolution
from planc.compiler.walk import ModelWalk, ModuleInfo, generic_path
from planc.spec.styles import STYLE, splits_by_expert
from planc.compiler import rule_examples as ex
from planc.lint.registry import compile_rule


EXPERTS_PARTIAL = compile_rule(
    "PLC615", "experts-partly-sharded", "an experts parameter left whole under EP, or sharded without its module rule",
    "Under EP every experts tensor must be sharded by expert (`grouped_gemm`): a whole tensor would be indexed "
    "with local expert ids. That includes a per-expert tensor of a module inside the experts (leading dim = the "
    "experts count: ergo's `experts.post_expert_norm.weight`). Under `moe_tp_experts`, gate_up/down must be "
    "feature-sharded.",
    ex.GOOD.replace("{gate_up_proj,down_proj}", "gate_up_proj"), ex.GOOD,
)


def nested_expert_owner(walk: ModelWalk, fqn: str) -> Optional[ModuleInfo]:
    """The experts module (ModuleInfo) that parameter `fqn` is a per-expert tensor of, from a module inside it
    (ergo's `experts.post_expert_norm.weight` [E, H]: the experts' forward indexes it with the expert ids it runs):
    the nearest experts ancestor of its owner when the tensor's leading dim is that module's experts count; None
    for a parameter of an experts module itself, or of any other module."""
    p = walk.params.get(fqn)
    if p is None or not p.shape:
        return None
    owner = p.owner
    while owner:
        owner = owner.rpartition(".")[0]
        m = walk.modules.get(owner)
        if m is not None and m.experts is not None:
            return m if p.shape[0] == m.experts.num_experts else None
    return None


def nested_expert_params(walk: ModelWalk, m: ModuleInfo) -> list[str]:
    """The per-expert tensors of modules inside experts module `m` (see `nested_expert_owner`)."""
    prefix = m.fqn + "."
    return [f for f, p in walk.params.items()
            if p.owner.startswith(prefix) and getattr(nested_expert_owner(walk, f), "fqn", None) == m.fqn]


def check_experts_params(c: Resolution, m: ModuleInfo, mode: Optional[str], final: dict[str, PlanRule]) -> None:
    info = m.experts
    assert info is not None  # called for experts modules
    nested = nested_expert_params(c.walk, m)
    for pfqn in [*m.params, *nested]:
        r = final.get(pfqn)
        name = pfqn[len(m.fqn) + 1:]
        if pfqn in nested:
            what = (f"{name}, a per-expert tensor (leading dim {info.num_experts}, the experts count) inside "
                    "expert-parallel experts,")
        else:
            what = f"{name} of expert-parallel experts"
        if mode == "ep" and (r is None or not splits_by_expert(r.style)):
            c.problems.add(
                EXPERTS_PARTIAL,
                f"{what} is not sharded by expert"
                + (f" (it has `{r.style}`)" if r else "")
                + ": every rank would index a full tensor with its local expert ids",
                final[m.fqn].source.where,
                f"add `{generic_path(m.fqn)}.{name}: grouped_gemm` to ep_plan",
                pfqn,
            )
        elif mode == "tp" and name in ("gate_up_proj", "up_proj", "down_proj") and (
            r is None or not _splits_over_tp(r.style)
        ):
            want = "rowwise" if name == "down_proj" else ("packed_colwise" if name == "gate_up_proj" else "colwise")
            c.problems.add(
                EXPERTS_PARTIAL,
                f"{name} of tensor-parallel experts (moe_tp_experts) is not sharded: the all-reduced output "
                "would count every expert tp_size times",
                final[m.fqn].source.where,
                f"add `{generic_path(m.fqn)}.{name}: {want}` to tp_plan",
                pfqn,
            )
        elif mode != "ep" and r is not None and splits_by_expert(r.style) and c.active["ep"]:
            c.problems.add(
                EXPERTS_PARTIAL,
                f"{name} is sharded by expert (grouped_gemm) but its experts module has no "
                "`ep_dispatch_experts`: the forward would run local experts with global ids",
                r.source.where,
                f"add `{generic_path(m.fqn)}: ep_dispatch_experts` to ep_plan",
                pfqn,
            )


def _splits_over_tp(style: str) -> bool:
    spec = STYLE.get(style)
    return spec is not None and spec.mesh == "tp" and spec.shards
