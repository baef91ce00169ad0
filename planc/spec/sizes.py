"""The parallel sizes: one pure check and one solver, called by lint, the compiler and the runtime.

`check_sizes` is the only place that knows which (tp_size, ep_size, dp_size[, world]) fit together.
`solve_sizes` is the only place size hints come from: it searches (tp, ep, dp) jointly for a world
size, under the expert count and every dimension tensor parallelism splits (heads, features), so a
hint never suggests a size that another check then rejects. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

EP_NOT_MULTIPLE_OF_TP = "PLC500"
EP_NOT_DIVIDING_WORLD = "PLC501"
SIZE_BEYOND_CLUSTERS = "PLC502"
WORLD_MISMATCH = "PLC503"

# 2**20 ranks: an order of magnitude above the largest training clusters. A larger size is a typo
# (or an attack on the hint arithmetic), and the other size checks skip it.
MAX_WORLD_SIZE = 1 << 20


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt(n)) steps."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


@dataclass(frozen=True)
class Sizes:
    tp: int
    ep: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def yaml(self) -> str:
        """As the plan writes it."""
        return f"`parallel: {{tp_size: {self.tp}, ep_size: {self.ep}, dp_size: {self.dp}}}`"


@dataclass(frozen=True)
class SizeProblem:
    """A sizes problem: its code, the plan key it is about (`parallel.ep_size`), what and what instead."""

    code: str
    key: tuple[str, ...]
    message: str
    hint: str


def solve_sizes(
    world: int,
    *,
    num_experts: Optional[int] = None,
    tp_divides: Iterable[int] = (),
    need_ep: bool = False,
    prefer: Optional[Sizes] = None,
    accept: Optional[Callable[[Sizes], bool]] = None,
    limit: int = 3,
) -> list[Sizes]:
    """(tp, ep, dp) with tp * dp == `world` that pass every size check, best first.

    `num_experts`: ep must divide it. `tp_divides`: sizes TP splits (head counts, feature dims); tp must
    divide each. `need_ep`: only ep > 1 (the plan shards experts by expert). `prefer`: the sizes the plan
    asked for; candidates closest to it come first (same tp, then the largest ep). `accept`: a final
    check of a candidate (the compiler passes "this plan compiles under these sizes").
    """
    tp_divides = [d for d in tp_divides if d]
    out: list[Sizes] = []
    if world < 1 or world > MAX_WORLD_SIZE:
        return out
    for tp in divisors(world):
        if any(d % tp for d in tp_divides):
            continue
        eps = [1] + [tp * k for k in divisors(world // tp) if tp * k > 1]  # whole TP groups dividing the world
        for ep in eps:
            if ep > 1 and num_experts is not None and num_experts % ep:
                continue
            if need_ep and ep == 1 and world > 1:
                continue
            out.append(Sizes(tp, ep, world // tp))
    if prefer is not None:
        out.sort(key=lambda s: (s.tp != prefer.tp, s.ep != prefer.ep, -s.ep, -s.tp))
    else:
        out.sort(key=lambda s: (-s.ep, -s.tp))
    if accept is not None:
        picked: list[Sizes] = []
        for s in out:
            if len(picked) >= limit:
                break
            if accept(s):
                picked.append(s)
        return picked
    return out[:limit]


def sizes_hint(found: list[Sizes], world: int, fallback: str) -> str:
    """A hint naming the solver's answers, or `fallback` when no sizes fit `world` ranks."""
    if not found:
        return fallback
    return f"on {world} ranks, write " + " or ".join(s.yaml() for s in found)


def check_sizes(tp: int, ep: int, dp: int, world: Optional[int] = None) -> list[SizeProblem]:
    """Every sizes problem of (tp_size, ep_size, dp_size), and against `world` ranks when given.

    A world that does not match is reported alone: the other checks are about the plan's own world.
    """
    plan_world = tp * dp
    if max(tp, ep, dp, plan_world) > MAX_WORLD_SIZE:
        key = max(("tp_size", "ep_size", "dp_size"), key=lambda k: {"tp_size": tp, "ep_size": ep, "dp_size": dp}[k])
        return [SizeProblem(
            SIZE_BEYOND_CLUSTERS, ("parallel", key),
            f"parallel sizes ask for {plan_world:,} ranks (tp_size {tp} * dp_size {dp}, ep_size {ep}); planc "
            f"accepts at most {MAX_WORLD_SIZE:,}",
            f"check `{key}`: a real job has at most a few thousand ranks",
        )]
    if world is not None and world != plan_world:
        found = solve_sizes(world, prefer=Sizes(tp, ep, world // tp if world % tp == 0 else 1))
        return [SizeProblem(
            WORLD_MISMATCH, ("parallel",),
            f"the plan needs tp_size * dp_size = {tp} * {dp} = {plan_world} processes, but the world has {world}",
            f"launch {plan_world} processes (torchrun --nproc-per-node {plan_world}), or "
            + sizes_hint(found, world, "change `parallel` to match the world"),
        )]
    out = []
    if ep > 1 and (ep % tp or plan_world % ep):
        # the EP sizes that fit this tp_size and this world, from the one solver
        eps = sorted(s.ep for s in solve_sizes(plan_world, prefer=Sizes(tp, ep, dp), need_ep=True, limit=1 << 20)
                     if s.tp == tp)[:6]
        fits = f"use an ep_size among {eps}, " if eps else ""
        if ep % tp:
            out.append(SizeProblem(
                EP_NOT_MULTIPLE_OF_TP, ("parallel", "ep_size"),
                f"ep_size {ep} is not a multiple of tp_size {tp}: an EP group is made of whole TP groups",
                f"{fits}or `ep_size: 1`" if eps else "set `ep_size: 1`",
            ))
        if plan_world % ep:
            out.append(SizeProblem(
                EP_NOT_DIVIDING_WORLD, ("parallel", "ep_size"),
                f"ep_size {ep} does not divide the world size tp_size*dp_size = {plan_world}",
                f"{fits}or change dp_size" if eps else "set `ep_size: 1`",
            ))
    return out


def mesh_dims(tp: int, ep: int, dp: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(sizes, names) of the one root DeviceMesh the runtime builds for valid sizes (planc.runtime.mesh).

    With ep > 1 the dp dim is split in two so that the EP group (ep consecutive ranks: `dp_in_ep` x `tp`)
    and the ranks holding the same experts (`dp_mod_ep`, world / ep of them) are both views of the root.
    """
    if ep > 1:
        return (tp * dp // ep, ep // tp, tp), ("dp_mod_ep", "dp_in_ep", "tp")
    return (dp, tp), ("dp", "tp")
