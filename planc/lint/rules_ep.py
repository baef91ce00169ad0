"""EP rules: experts implementation vs EP strategy, EP rules vs EP size, TP rules on EP experts.

The strategy combinations are checked by calling the compiler's own `resolve_ep`, so `planc lint`
and `planc.compile` accept and reject exactly the same settings, with the same message and hint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

from planc.lint.context import LintContext
from planc.lint.diagnostic import WARNING, Diagnostic
from planc.lint.registry import rule
from planc.spec.pairings import MEGAMOE_BF16_BACKEND, MEGAMOE_EP_EXPERTS, MEGAMOE_EXPERTS_EP, MEGAMOE_SETTINGS
from planc.spec.patterns import Pattern, PatternError

if TYPE_CHECKING:
    from planc.spec.ep import EPResolutionError

MEGAMOE_OTHER_EP = MEGAMOE_EXPERTS_EP.code  # PLC400
MEGAMOE_EP_OTHER_EXPERTS = MEGAMOE_EP_EXPERTS.code  # PLC401
SHARED_BATCH = "PLC402"
MEGAMOE_BLOCK = MEGAMOE_SETTINGS.code  # PLC403
MISSING_DISPATCH = "PLC404"
DISPATCH_WITHOUT_EP = "PLC405"
TP_ON_EP_EXPERTS = "PLC406"
MEGAMOE_BF16 = MEGAMOE_BF16_BACKEND.code  # PLC407

_TOP = "version: 1\nmodel: {type: deepseek_v4}\n"
_EP = (
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
)


def _resolution(ctx: LintContext) -> Optional[tuple[str, EPResolutionError]]:
    """(code, EPResolutionError) when resolve_ep refuses the plan's experts settings, else None."""
    from planc.spec.ep import EPResolutionError, resolve_ep

    codes = {
        EPResolutionError.MEGAMOE_OTHER_EP: MEGAMOE_OTHER_EP,
        EPResolutionError.MEGAMOE_EP_OTHER_EXPERTS: MEGAMOE_EP_OTHER_EXPERTS,
        EPResolutionError.SHARED_BATCH: SHARED_BATCH,
    }
    try:
        resolve_ep(ctx.plan.experts, ctx.plan.parallel)
    except EPResolutionError as err:
        return codes[err.kind], err
    return None


def _emit(ctx: LintContext, code: str) -> Iterator[Diagnostic]:
    found = _resolution(ctx)
    if found is None or found[0] != code:
        return
    err = found[1]
    keypath = tuple(err.field.split("."))
    if code == SHARED_BATCH and not ctx.written(keypath):  # `auto` by default: blame what chose Mega MoE
        keypath = ("experts", "implementation")
    yield ctx.diag(code, str(err), err.hint, keypath, at_value=True)


@rule(
    MEGAMOE_OTHER_EP, "megamoe-needs-megamoe-ep", "Mega MoE experts with another `ep_implementation`",
    bad=_TOP + "parallel: {tp_size: 8, ep_size: 8}\n"
    "experts: {implementation: deepgemm_megamoe, ep_implementation: all_to_all}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 8, ep_size: 8}\n"
    "experts: {implementation: deepgemm_megamoe, ep_implementation: auto}\n" + _EP,
)
def check_megamoe_other_ep(ctx: LintContext) -> Iterator[Diagnostic]:
    """`experts.implementation: deepgemm_megamoe` is a fused kernel that does its own dispatch and
    combine over the EP group; it runs only under the MegaMoeEP strategy. Write
    `ep_implementation: auto` (which resolves to it) or `deepgemm_megamoe`."""
    yield from _emit(ctx, MEGAMOE_OTHER_EP)


@rule(
    MEGAMOE_EP_OTHER_EXPERTS, "megamoe-ep-needs-megamoe-experts",
    "`ep_implementation: deepgemm_megamoe` with other experts",
    bad=_TOP + "parallel: {tp_size: 8, ep_size: 8}\n"
    "experts: {implementation: grouped_mm, ep_implementation: deepgemm_megamoe}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 8, ep_size: 8}\n"
    "experts: {implementation: deepgemm_megamoe, ep_implementation: deepgemm_megamoe}\n" + _EP,
)
def check_megamoe_ep_other_experts(ctx: LintContext) -> Iterator[Diagnostic]:
    """The MegaMoeEP strategy calls the Mega MoE kernel: it needs
    `experts.implementation: deepgemm_megamoe`. For other experts pick `auto`, `all_to_all` or
    `all_reduce`."""
    yield from _emit(ctx, MEGAMOE_EP_OTHER_EXPERTS)


@rule(
    SHARED_BATCH, "shared-batch-needs-ep-equal-tp",
    "`all_reduce` or Mega MoE with `ep_size != tp_size`",
    bad=_TOP + "parallel: {tp_size: 4, ep_size: 8, dp_size: 2}\n"
    "experts: {implementation: grouped_mm, ep_implementation: all_reduce}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 4, ep_size: 8, dp_size: 2}\n"
    "experts: {implementation: grouped_mm, ep_implementation: all_to_all}\n" + _EP,
)
def check_shared_batch(ctx: LintContext) -> Iterator[Diagnostic]:
    """`all_reduce` and `deepgemm_megamoe` (written, or what `auto` resolves to for Mega MoE experts)
    need every rank of the EP group to hold the same batch, which is the case only when the EP group
    is the TP group (`ep_size == tp_size`). Otherwise use `all_to_all` (or `auto`, which then picks
    it), or make the sizes equal."""
    yield from _emit(ctx, SHARED_BATCH)


@rule(
    MEGAMOE_BLOCK, "megamoe-block-without-megamoe", "A `megamoe:` block without Mega MoE experts",
    bad=_TOP + "parallel: {tp_size: 8, ep_size: 8}\n"
    "experts:\n  implementation: grouped_mm\n  megamoe: {backend: reference}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 8, ep_size: 8}\n"
    "experts:\n  implementation: deepgemm_megamoe\n  megamoe: {backend: reference}\n" + _EP,
)
def check_megamoe_block(ctx: LintContext) -> Iterator[Diagnostic]:
    """The `experts.megamoe` settings (backend, buffer size, clamp, quantization) only apply to
    `implementation: deepgemm_megamoe`; with other experts they would be ignored silently."""
    experts = ctx.plan.experts
    if MEGAMOE_SETTINGS.violated(ctx.plan.model_dump(exclude_none=True)):
        yield ctx.diag(
            MEGAMOE_BLOCK,
            f"`experts.megamoe` settings have no effect with implementation `{experts.implementation}`",
            "set `experts.implementation: deepgemm_megamoe`, or delete the `megamoe:` block",
            MEGAMOE_SETTINGS.key, at_value=True,  # where the schema reports it too
        )


@rule(
    MEGAMOE_BF16, "megamoe-bf16-math-backend", "`megamoe.math: bf16` with `backend: deep_gemm`",
    bad=_TOP + "parallel: {tp_size: 8, ep_size: 8}\n"
    "experts:\n  implementation: deepgemm_megamoe\n  megamoe: {backend: deep_gemm, math: bf16}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 8, ep_size: 8}\n"
    "experts:\n  implementation: deepgemm_megamoe\n  megamoe: {backend: triton, math: bf16}\n" + _EP,
)
def check_megamoe_bf16_backend(ctx: LintContext) -> Iterator[Diagnostic]:
    """`math: bf16` asks for BF16 MMAs at every batch (one layout of the FP4 experts held, the BF16 path's
    numerics); DeepGEMM's kernel multiplies in FP8 only. `auto` then passes deep_gemm over; a plan that names it
    would get neither."""
    if MEGAMOE_BF16_BACKEND.violated(ctx.plan.model_dump(exclude_none=True)):
        yield ctx.diag(
            MEGAMOE_BF16,
            "`experts.megamoe.backend: deep_gemm` multiplies in FP8, but `math: bf16` asks for BF16 MMAs",
            "write `backend: triton` (or `reference`, or `auto`), or `math: auto`",
            MEGAMOE_BF16_BACKEND.key, at_value=True,
        )


def _dispatch_rules(ctx: LintContext) -> list[str]:
    return [p for p, s in ctx.table("ep_plan") if s == "ep_dispatch_experts"]


@rule(
    MISSING_DISPATCH, "missing-ep-dispatch", "`ep_size > 1` without an `ep_dispatch_experts` rule",
    bad=_TOP + "parallel: {tp_size: 2, ep_size: 2}\n"
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n",
    good=_TOP + "parallel: {tp_size: 2, ep_size: 2}\n" + _EP,
)
def check_missing_dispatch(ctx: LintContext) -> Iterator[Diagnostic]:
    """With `ep_size > 1` each rank holds only its slice of the experts, so the experts forward must
    be replaced by the EP implementation (`ep_dispatch_experts` on the experts module). Without it
    tokens would be routed to experts the rank does not have."""
    from planc.lint.rules_removed import has_removed_ep_styles

    # a plan with removed styles gets PLC320, whose fix (`planc migrate`) writes the dispatch rule: not reported twice
    if ctx.plan.parallel.ep_size > 1 and not _dispatch_rules(ctx) and not has_removed_ep_styles(ctx):
        params = [p for p, s in ctx.table("ep_plan") if s == "grouped_gemm" and "." in p]
        module = params[0].rsplit(".", 1)[0] if params else "model.layers.*.mlp.experts"
        yield ctx.diag(
            MISSING_DISPATCH,
            f"ep_size is {ctx.plan.parallel.ep_size} but no ep_plan rule uses `ep_dispatch_experts`",
            f"add `{module}: ep_dispatch_experts` to ep_plan, or set `ep_size: 1`",
            ("parallel", "ep_size"), at_value=True,
        )


@rule(
    DISPATCH_WITHOUT_EP, "ep-dispatch-without-ep", "`ep_dispatch_experts` with `ep_size == 1`",
    severity=WARNING,
    bad=_TOP + "parallel: {tp_size: 2}\nep_plan:\n  model.layers.*.mlp.experts: ep_dispatch_experts\n",
    good=_TOP + "parallel: {tp_size: 2, ep_size: 2}\n" + _EP,
)
def check_dispatch_without_ep(ctx: LintContext) -> Iterator[Diagnostic]:
    """With `ep_size: 1` there is no EP group: the rule installs a dispatch over one rank, which
    only costs time. Set `parallel.ep_size`, or remove the rule. A warning: `--strict` fails on it."""
    if ctx.plan.parallel.ep_size == 1:
        for pattern in _dispatch_rules(ctx):
            yield ctx.diag(
                DISPATCH_WITHOUT_EP,
                "`ep_dispatch_experts` with ep_size 1: there is no EP group to dispatch over",
                "set `parallel.ep_size` to the EP group size, or remove this rule",
                ("ep_plan", pattern),
            )


def _alternatives(parsed: Pattern | PatternError) -> tuple[tuple[str, ...], ...]:
    return () if isinstance(parsed, PatternError) else parsed.alternatives  # errors: reported by PLC300


def _unify(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return len(a) == len(b) and all(x == "*" or y == "*" or x == y for x, y in zip(a, b))


@rule(
    TP_ON_EP_EXPERTS, "tp-rule-on-ep-experts", "A `tp_plan` rule on experts that `ep_plan` shards",
    bad=_TOP + "parallel: {tp_size: 2, ep_size: 2}\n"
    "tp_plan:\n  model.layers.*.mlp.experts.gate_up_proj: packed_colwise\n" + _EP,
    good=_TOP + "parallel: {tp_size: 2, ep_size: 2}\n"
    "tp_plan:\n  model.layers.*.mlp.shared_experts.gate_proj: colwise\n" + _EP,
)
def check_tp_on_ep_experts(ctx: LintContext) -> Iterator[Diagnostic]:
    """With `ep_size > 1` the experts module named by an `ep_dispatch_experts` rule, and every
    parameter and submodule below it, is sharded over the EP group by `ep_plan`. A `tp_plan` rule
    that can match the same module or one of its parameters would shard it a second time. Remove the
    tp_plan rule, or use tensor-parallel experts (`moe_tp_experts` in tp_plan) with `ep_size: 1`."""
    if ctx.plan.parallel.ep_size <= 1:
        return
    covered = []  # (alternative, ep pattern, is_module)
    for pattern, style, parsed in ctx.patterns("ep_plan"):
        if style in ("ep_dispatch_experts", "grouped_gemm"):
            covered += [(alt, pattern, style == "ep_dispatch_experts") for alt in _alternatives(parsed)]
    for pattern, _style, parsed in ctx.patterns("tp_plan"):
        for alt in _alternatives(parsed):
            hit = next(
                (ep for ep_alt, ep, is_module in covered
                 if _unify(alt[: len(ep_alt)] if is_module else alt, ep_alt)),
                None,
            )
            if hit is not None:
                yield ctx.diag(
                    TP_ON_EP_EXPERTS,
                    f"tp_plan rule `{pattern}` can match experts that ep_plan shards (`{hit}`)",
                    "remove this tp_plan rule (ep_plan shards the experts over the EP group), "
                    "or set `ep_size: 1` and use `moe_tp_experts` for tensor-parallel experts",
                    ("tp_plan", pattern),
                )
                break

