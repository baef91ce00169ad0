"""Removed styles: names older plans used, reported with the form that replaces them."""

from __future__ import annotations

from typing import Iterator

from planc.lint.context import TABLES, LintContext
from planc.lint.diagnostic import Diagnostic
from planc.lint.registry import rule
from planc.spec.styles import REMOVED_STYLES

REMOVED_STYLE = "PLC320"

MOE_TP_EXPERTS_IN_EP = (
    "expert parallelism is `ep_dispatch_experts` on the experts module plus `grouped_gemm` on its "
    "parameters; `moe_tp_experts` (every rank a slice of every expert) belongs in tp_plan"
)

_HEAD = "version: 1\nmodel: {type: deepseek_v4}\nparallel: {tp_size: 2, ep_size: 2}\n"


@rule(
    REMOVED_STYLE, "removed-style", "A removed style (`megamoe_router`, `megamoe_experts`, `ep_router`, ...)",
    needs_plan=False,
    bad=_HEAD + "experts: {implementation: deepgemm_megamoe}\nep_plan:\n"
    "  model.layers.*.mlp.gate: megamoe_router\n  model.layers.*.mlp.experts: megamoe_experts\n",
    good=_HEAD + "experts: {implementation: deepgemm_megamoe}\nep_plan:\n"
    "  model.layers.*.mlp.experts: ep_dispatch_experts\n",
)
def check_removed(ctx: LintContext) -> Iterator[Diagnostic]:
    """Older plans selected Mega MoE and EP routing through styles. Now the experts rule is always
    `ep_dispatch_experts`, no router rule is needed (the EP implementation remaps expert ids
    itself, and Mega MoE takes global ids), and `experts.implementation: deepgemm_megamoe` selects
    Mega MoE. `moe_tp_experts` inside `ep_plan` is reported too: it is a tensor-parallel style.
    `planc migrate` rewrites these."""
    for table in TABLES:
        for pattern, style in ctx.table(table):
            if style in REMOVED_STYLES:
                what, hint = "removed style", REMOVED_STYLES[style]
            elif table == "ep_plan" and style == "moe_tp_experts":
                what, hint = "style not valid in ep_plan", MOE_TP_EXPERTS_IN_EP
            else:
                continue
            fix = f"; `planc migrate {ctx.path} --write` rewrites it" if ctx.path else "; `planc migrate` rewrites it"
            yield ctx.diag(REMOVED_STYLE, f"{what} `{style}` in {table}", hint + fix, (table, pattern), at_value=True)


def has_removed_ep_styles(ctx: LintContext) -> bool:
    """The ep_plan uses styles PLC320 reports: rules that depend on the current form wait for `planc migrate`."""
    return any(style in REMOVED_STYLES or style == "moe_tp_experts" for _, style in ctx.table("ep_plan"))
