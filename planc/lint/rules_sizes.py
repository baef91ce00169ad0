"""Size rules: an EP group size that does not fit the TP groups and the world."""

from __future__ import annotations

from planc.lint.registry import rule

EP_NOT_MULTIPLE_OF_TP = "PLC500"
EP_NOT_DIVIDING_WORLD = "PLC501"

_TOP = "version: 1\nmodel: {type: mixtral}\n"
_EP = (
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
)


@rule(
    EP_NOT_MULTIPLE_OF_TP, "ep-size-not-multiple-of-tp", "`ep_size` is not a multiple of `tp_size`",
    bad=_TOP + "parallel: {tp_size: 4, ep_size: 6, dp_size: 3}\nexperts: {ep_implementation: all_to_all}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 4, ep_size: 4, dp_size: 3}\nexperts: {ep_implementation: all_to_all}\n" + _EP,
)
def check_multiple_of_tp(ctx):
    """An EP group is `ep_size` consecutive ranks and must be made of whole TP groups, so that
    every rank of a TP group sees the same experts. `ep_size: 1` (no EP) is always fine."""
    p = ctx.plan.parallel
    if p.ep_size > 1 and p.ep_size % p.tp_size:
        yield ctx.diag(
            EP_NOT_MULTIPLE_OF_TP,
            f"ep_size {p.ep_size} is not a multiple of tp_size {p.tp_size}",
            f"use an ep_size that is a multiple of {p.tp_size} (e.g. `ep_size: {p.tp_size}`), or `ep_size: 1`",
            ("parallel", "ep_size"), at_value=True,
        )


@rule(
    EP_NOT_DIVIDING_WORLD, "ep-size-not-dividing-world", "`ep_size` does not divide `tp_size * dp_size`",
    bad=_TOP + "parallel: {tp_size: 2, ep_size: 4, dp_size: 3}\nexperts: {ep_implementation: all_to_all}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 2, ep_size: 4, dp_size: 4}\nexperts: {ep_implementation: all_to_all}\n" + _EP,
)
def check_divides_world(ctx):
    """The world (`tp_size * dp_size` ranks) is cut into EP groups of `ep_size` ranks; a remainder
    would leave ranks without an EP group."""
    p = ctx.plan.parallel
    world = p.world_size
    if p.ep_size > 1 and world % p.ep_size:
        divisors = [d for d in range(p.tp_size, world + 1, p.tp_size) if world % d == 0 and d > 1]
        yield ctx.diag(
            EP_NOT_DIVIDING_WORLD,
            f"ep_size {p.ep_size} does not divide the world size tp_size*dp_size = {world}",
            f"use an ep_size among {divisors[:6]}, or change dp_size" if divisors else "set `ep_size: 1`",
            ("parallel", "ep_size"), at_value=True,
        )
