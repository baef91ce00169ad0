"""Size rules: an EP group size that does not fit the TP groups and the world."""

from __future__ import annotations

from planc.lint.registry import rule

EP_NOT_MULTIPLE_OF_TP = "PLC500"
EP_NOT_DIVIDING_WORLD = "PLC501"
SIZE_BEYOND_CLUSTERS = "PLC502"

# 2**20 ranks: an order of magnitude above the largest training clusters. A larger size is a typo
# (or an attack on the hint arithmetic), and the other size rules skip it.
MAX_WORLD_SIZE = 1 << 20

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
    if _too_large(p):
        return
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
    if _too_large(p):
        return
    if p.ep_size > 1 and world % p.ep_size:
        divisors = [p.tp_size * k for k in _divisors(p.dp_size) if p.tp_size * k > 1]
        yield ctx.diag(
            EP_NOT_DIVIDING_WORLD,
            f"ep_size {p.ep_size} does not divide the world size tp_size*dp_size = {world}",
            f"use an ep_size among {divisors[:6]}, or change dp_size" if divisors else "set `ep_size: 1`",
            ("parallel", "ep_size"), at_value=True,
        )


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt(n)) steps (n <= MAX_WORLD_SIZE here)."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def _too_large(p) -> bool:
    return max(p.tp_size, p.ep_size, p.dp_size, p.world_size) > MAX_WORLD_SIZE


@rule(
    SIZE_BEYOND_CLUSTERS, "size-beyond-any-cluster", "A parallel size is larger than any cluster",
    bad=_TOP + "parallel: {tp_size: 8, ep_size: 8, dp_size: 100000000000}\n" + _EP,
    good=_TOP + "parallel: {tp_size: 8, ep_size: 8, dp_size: 16}\n" + _EP,
)
def check_world_size(ctx):
    """`tp_size`, `ep_size`, `dp_size` and the world `tp_size * dp_size` are at most 2**20 (1,048,576)
    ranks, an order of magnitude above the largest clusters: a larger value is a typo. The other size
    rules skip such a plan, so their hints are always computed over a bounded range."""
    p = ctx.plan.parallel
    if not _too_large(p):
        return
    key = max(("tp_size", "ep_size", "dp_size"), key=lambda k: getattr(p, k))
    yield ctx.diag(
        SIZE_BEYOND_CLUSTERS,
        f"parallel sizes ask for {p.world_size:,} ranks (tp_size {p.tp_size} * dp_size {p.dp_size}, ep_size "
        f"{p.ep_size}); planc accepts at most {MAX_WORLD_SIZE:,}",
        f"check `{key}`: a real job has at most a few thousand ranks",
        ("parallel", key), at_value=True,
    )
