"""Size rules: sizes beyond any cluster, and an EP group size that does not fit the TP groups and the world.

The check itself is `planc.spec.sizes.check_sizes` (the compiler and the runtime call the same
function, and its hints come from the one solver, `solve_sizes`); these rules only place its
problems in the file.
"""

from __future__ import annotations

from typing import Iterator

from planc.lint.context import LintContext
from planc.lint.diagnostic import Diagnostic
from planc.lint.registry import Rule, register, rule
from planc.spec.sizes import (
    EP_NOT_DIVIDING_WORLD,
    EP_NOT_MULTIPLE_OF_TP,
    MAX_WORLD_SIZE,
    SIZE_BEYOND_CLUSTERS,
    WORLD_MISMATCH,
    check_sizes,
)

_TOP = "version: 1\nmodel: {type: mixtral}\n"
_EP = (
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
)


def _problems(ctx: LintContext, code: str) -> Iterator[Diagnostic]:
    p = ctx.plan.parallel
    for problem in check_sizes(p.tp_size, p.ep_size, p.dp_size):
        if problem.code == code:
            yield ctx.diag(code, problem.message, problem.hint, problem.key, at_value=True)


@rule(
    EP_NOT_MULTIPLE_OF_TP, "ep-size-not-multiple-of-tp", "`ep_size` is not a multiple of `tp_size`",
    bad=_TOP + "parallel: {tp_size: 4, ep_size: 6, dp_size: 3}\nexperts: {ep_implementation: all_to_all}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 4, ep_size: 4, dp_size: 3}\nexperts: {ep_implementation: all_to_all}\n" + _EP,
)
def check_multiple_of_tp(ctx: LintContext) -> Iterator[Diagnostic]:
    """An EP group is `ep_size` consecutive ranks and must be made of whole TP groups, so that
    every rank of a TP group sees the same experts. `ep_size: 1` (no EP) is always fine."""
    yield from _problems(ctx, EP_NOT_MULTIPLE_OF_TP)


@rule(
    EP_NOT_DIVIDING_WORLD, "ep-size-not-dividing-world", "`ep_size` does not divide `tp_size * dp_size`",
    bad=_TOP + "parallel: {tp_size: 2, ep_size: 4, dp_size: 3}\nexperts: {ep_implementation: all_to_all}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 2, ep_size: 4, dp_size: 4}\nexperts: {ep_implementation: all_to_all}\n" + _EP,
)
def check_divides_world(ctx: LintContext) -> Iterator[Diagnostic]:
    """The world (`tp_size * dp_size` ranks) is cut into EP groups of `ep_size` ranks; a remainder
    would leave ranks without an EP group."""
    yield from _problems(ctx, EP_NOT_DIVIDING_WORLD)


@rule(
    SIZE_BEYOND_CLUSTERS, "size-beyond-any-cluster", "A parallel size is larger than any cluster",
    bad=_TOP + "parallel: {tp_size: 8, ep_size: 8, dp_size: 100000000000}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 8, ep_size: 8, dp_size: 16}\n" + _EP,
)
def check_world_size(ctx: LintContext) -> Iterator[Diagnostic]:
    """`tp_size`, `ep_size`, `dp_size` and the world `tp_size * dp_size` are at most 2**20 (1,048,576)
    ranks, an order of magnitude above the largest clusters: a larger value is a typo. The other size
    rules skip such a plan, so their hints are always computed over a bounded range."""
    yield from _problems(ctx, SIZE_BEYOND_CLUSTERS)


register(Rule(
    WORLD_MISMATCH, "world-size-mismatch", "the launched world does not have `tp_size * dp_size` ranks",
    "`planc.apply` compares the plan's world (`tp_size * dp_size`) with `torch.distributed`'s world size "
    "before anything else: with the wrong number of processes every other check is moot, so this problem "
    "is reported alone, once, with the ranks it happened on. The hint lists sizes that fit the launched "
    "world and pass every other check of the plan against the model.",
    family="sizes",
))

__all__ = ["MAX_WORLD_SIZE"]
