"""Style rules: style names that do not exist, or that belong to the other rule table."""

from __future__ import annotations

from typing import Iterator

from planc.lint.context import LintContext
from planc.lint.diagnostic import Diagnostic
from planc.lint.registry import Rule, register, rule
from planc.lint.suggest import did_you_mean
from planc.spec.styles import ALL_STYLES, EP_STYLES, REMOVED_STYLES, TABLE_STYLES, TP_STYLES

UNKNOWN_STYLE = "PLC310"
EP_STYLE_IN_TP = "PLC311"
TP_STYLE_IN_EP = "PLC312"
EXTENSION_NOT_LOADED = "PLC313"

_HEAD = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2, ep_size: 2}\n"
_EP = (
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
)
# a project's own styles are registered rows (planc.spec.extensions): the views are read at each check
REGISTER_HINT = ("a style of your own is a registered row: name the module that calls `planc.register_tp_style` in "
                 "pyproject.toml's [tool.planc] extensions (docs/extending.md)")


def _known(style: str) -> bool:
    """Valid somewhere, or removed: PLC311/PLC312/PLC320 report those more precisely."""
    return style in ALL_STYLES or style in REMOVED_STYLES


@rule(
    UNKNOWN_STYLE, "unknown-style", "A style name that does not exist", needs_plan=False,
    bad=_HEAD + "tp_plan:\n  model.layers.*.self_attn.o_proj: row_wise\n" + _EP,
    good=_HEAD + "tp_plan:\n  model.layers.*.self_attn.o_proj: rowwise\n" + _EP,
)
def check_unknown(ctx: LintContext) -> Iterator[Diagnostic]:
    """Styles are transformers' vocabulary (>= 5.23): `colwise`, `rowwise`, `packed_colwise`,
    `embedding_rowwise`, `grouped_gemm`, `ep_dispatch_experts`, ... (`planc rules PLC310` and
    docs/plan-format.md list them). The hint suggests the closest style valid in that table."""
    for table in ("tp_plan", "ep_plan"):
        valid = list(TABLE_STYLES[table])
        for pattern, style in ctx.table(table):
            if _known(style):
                continue
            guess = did_you_mean(style, valid) or did_you_mean(style, ALL_STYLES)
            hint = f"did you mean `{guess}`?" if guess else f"{table} styles: {', '.join(valid)}" + (
                f"; {REGISTER_HINT}" if table == "tp_plan" else "")
            yield ctx.diag(UNKNOWN_STYLE, f"unknown style `{style}` in {table}", hint, (table, pattern), at_value=True,
                           fix=guess if guess in valid else None)


@rule(
    EP_STYLE_IN_TP, "ep-style-in-tp-plan", "An expert-parallel style in `tp_plan`", needs_plan=False,
    bad=_HEAD + "tp_plan:\n  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n",
    good=_HEAD + _EP,
)
def check_ep_in_tp(ctx: LintContext) -> Iterator[Diagnostic]:
    """`grouped_gemm` and `ep_dispatch_experts` shard over the EP group, which only `ep_plan` rules
    use. In `tp_plan` they would be sharded over the TP group with the wrong size."""
    for pattern, style in ctx.table("tp_plan"):
        if style in EP_STYLES:
            yield ctx.diag(
                EP_STYLE_IN_TP, f"`{style}` is an expert-parallel style, but this rule is in tp_plan",
                f"move `{pattern}: {style}` to ep_plan", ("tp_plan", pattern), at_value=True,
            )


@rule(
    TP_STYLE_IN_EP, "tp-style-in-ep-plan", "A tensor-parallel style in `ep_plan`", needs_plan=False,
    bad=_HEAD + "tp_plan:\n  model.layers.*.self_attn.{q,k,v}_proj: colwise\n" + _EP
    + "  model.layers.*.self_attn.o_proj: rowwise\n",
    good=_HEAD + "tp_plan:\n  model.layers.*.self_attn.{q,k,v}_proj: colwise\n"
    "  model.layers.*.self_attn.o_proj: rowwise\n" + _EP,
)
def check_tp_in_ep(ctx: LintContext) -> Iterator[Diagnostic]:
    """`ep_plan` takes `grouped_gemm` (experts parameters), `ep_dispatch_experts` (the experts
    module) and `replicate`. Tensor-parallel styles shard over the TP group and belong in `tp_plan`.
    (`moe_tp_experts` in ep_plan is reported by PLC320 with its migration.)"""
    for pattern, style in ctx.table("ep_plan"):
        if style in TP_STYLES and style not in TABLE_STYLES["ep_plan"] and style != "moe_tp_experts":
            yield ctx.diag(
                TP_STYLE_IN_EP, f"`{style}` is a tensor-parallel style, but this rule is in ep_plan",
                f"move `{pattern}: {style}` to tp_plan; ep_plan takes {', '.join(TABLE_STYLES['ep_plan'])}",
                ("ep_plan", pattern), at_value=True,
            )


register(Rule(
    EXTENSION_NOT_LOADED, "extension-not-loaded", "A module named in `[tool.planc] extensions` failed to import",
    "pyproject.toml's `[tool.planc] extensions` lists the project's own modules that register TP styles and EP\n"
    "strategies (`planc.register_tp_style`, `planc.register_ep_strategy`; docs/extending.md). Lint imports them so\n"
    "that a plan naming a registered style is checked like one naming planc's own; a module that fails to import\n"
    "is reported at the config's `extensions` line, on every plan linted, and its styles stay unknown (PLC310).",
    family="styles", needs_plan=False,
))
