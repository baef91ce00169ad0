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
WORLD_MISMATCH = "PLC502"


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
    key: tuple
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
    out = []
    for tp in range(1, world + 1):
        if world % tp or any(d % tp for d in tp_divides):
            continue
        eps = [1] + [ep for ep in range(tp, world + 1, tp) if ep > 1 and world % ep == 0]
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
        picked = []
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
    if world is not None and world != plan_world:
        found = solve_sizes(world, prefer=Sizes(tp, ep, world // tp if world % tp == 0 else 1))
        return [SizeProblem(
            WORLD_MISMATCH, ("parallel",),
            f"the plan needs tp_size * dp_size = {tp} * {dp} = {plan_world} processes, but the world has {world}",
            f"launch {plan_world} processes (torchrun --nproc-per-node {plan_world}), or "
            + sizes_hint(found, world, "change `parallel` to match the world"),
        )]
    out = []
    if ep > 1 and ep % tp:
        found = solve_sizes(plan_world, prefer=Sizes(tp, ep, dp), need_ep=True)
        out.append(SizeProblem(
            EP_NOT_MULTIPLE_OF_TP, ("parallel", "ep_size"),
            f"ep_size {ep} is not a multiple of tp_size {tp}: an EP group is made of whole TP groups",
            sizes_hint(found, plan_world, "set `ep_size: 1`"),
        ))
    if ep > 1 and plan_world % ep:
        found = solve_sizes(plan_world, prefer=Sizes(tp, ep, dp), need_ep=True)
        out.append(SizeProblem(
            EP_NOT_DIVIDING_WORLD, ("parallel", "ep_size"),
            f"ep_size {ep} does not divide the world size tp_size*dp_size = {plan_world}: the world is cut into "
            "EP groups of ep_size consecutive ranks",
            sizes_hint(found, plan_world, "set `ep_size: 1`"),
        ))
    return out
