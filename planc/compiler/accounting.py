"""Byte accounting: what each rank holds under the plan, per rule and in total, and what stays replicated.

A parameter's bytes per rank follow its style's row in `planc.spec.styles` (the same placement the
runtime shards by): split over the TP or EP group when the style splits a dim of its shape, whole
otherwise. Tied tensors count once.
"""

from __future__ import annotations

from typing import Any, Optional

from collections import OrderedDict

from planc.compiler.compiled import Assignment, CompileWarning, ReplicatedGroup, RuleCoverage
from planc.compiler.walk import ModelWalk, ParamInfo
from planc.compiler.context import PlanRule, key_where, Resolution
from planc.compiler.units import human_bytes
from planc.spec.styles import STYLE
from planc.compiler import rule_examples as ex
from planc.lint.diagnostic import WARNING
from planc.lint.registry import compile_rule


REPLICATED_DENSE = compile_rule(
    "PLC651", "dense-left-replicated", "dense weights that no rule shards (per generic path, with bytes per rank)",
    "Often intended for norms, routers and small layers; a large replicated group is memory every rank pays.",
    ex.GOOD, "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1}\n", severity=WARNING,
)
TABLE_INACTIVE = compile_rule(
    "PLC652", "table-not-applied", "a rule table whose size is 1: checked against the model, not applied",
    "transformers keeps a plan only when its size is > 1; planc still matches the rules so the plan stays "
    "correct when the size is raised.",
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1, ep_size: 1}\n" + ex.EP,
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1, ep_size: 2, dp_size: 2}\n" + ex.EP, severity=WARNING,
)


def shard_divisor(style: Optional[str], shape: tuple[int, ...], tp: int, ep: int) -> int:
    """Over how many ranks a parameter of `shape` under `style` is split (1: every rank holds it whole).

    From the style's row in `planc.spec.styles`; the accounting below and the memory budget both use it.
    """
    spec = STYLE.get(style) if style is not None else None
    if spec is None or spec.placement(len(shape)) is None:
        return 1
    return ep if spec.mesh == "ep" else tp


def _held_rows_bytes(p: ParamInfo, rule: Optional[PlanRule], walk: ModelWalk) -> int:
    """A parameter's bytes before the split. An expert-sharded tensor allocated with more leading rows than the
    module has experts with weights (longcat_flash's gate_up_proj also counts its parameter-free "zero" experts)
    keeps only those experts' rows at install (`planc.runtime.ep.base.shard_expert_tensor`); the rest is never held."""
    spec = STYLE.get(rule.style) if rule is not None else None
    experts = walk.modules[p.owner].experts
    fewer = experts is not None and p.shape and 0 < experts.num_experts < p.shape[0]
    if spec is not None and spec.mesh == "ep" and experts is not None and fewer:
        return p.nbytes * experts.num_experts // p.shape[0]
    return p.nbytes


def account(
    c: Resolution, final: dict[str, PlanRule]
) -> tuple[int, int, int, dict[int, list[int]], tuple[ReplicatedGroup, ...]]:
    walk, tp, ep = c.walk, c.tp, c.ep
    seen: set[int] = set()
    total = sharded = replicated = 0
    per_rule_bytes: dict[int, list[int]] = {}
    c.by_dtype = {}  # bytes per rank by dtype: the memory budget (planc.compiler.memory)
    groups: OrderedDict[str, list[Any]] = OrderedDict()
    for p in walk.params.values():
        if p.tensor_id in seen:
            continue
        seen.add(p.tensor_id)
        total += p.nbytes
        r = final.get(p.fqn)
        div = shard_divisor(r.style if r is not None else None, p.shape, tp, ep)
        per_rank = -(-_held_rows_bytes(p, r, walk) // div)
        c.by_dtype[p.dtype] = c.by_dtype.get(p.dtype, 0) + per_rank
        if div > 1:
            sharded += per_rank
        else:
            replicated += per_rank
            owner = walk.modules[p.owner]
            if owner.experts is None:
                g = groups.setdefault(owner.generic or "<root>", [set(), 0, 0])
                g[0].add(p.owner)
                g[1] += 1
                g[2] += per_rank
        if r is not None:
            b = per_rule_bytes.setdefault(r.index, [0, 0])
            b[0] += p.nbytes
            b[1] += per_rank
    replicated_groups = tuple(
        ReplicatedGroup(path, len(mods), n, nbytes)
        for path, (mods, n, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][2])
    )
    return total, sharded, replicated, per_rule_bytes, replicated_groups


def coverage(c: Resolution, assignments: list[Assignment], per_rule_bytes: dict[int, list[int]]) -> list[RuleCoverage]:
    counts: dict[int, list[int]] = {r.index: [0, 0] for r in c.rules}
    examples: dict[int, str] = {}
    by_source = {id(r.source): r for r in c.rules}
    for a in assignments:
        r = by_source[id(a.rule)]
        counts[r.index][0 if a.target == "module" else 1] += 1
        examples.setdefault(r.index, a.fqn)
    out = []
    for r in c.rules:
        active = c.active[r.kind]
        if active:
            mods, params = counts[r.index]
            total, per_rank = per_rule_bytes.get(r.index, (0, 0))
        else:  # inactive table: report what it matched, it installs nothing
            mods = sum(1 for f in r.targets if f in c.walk.modules)
            params = len(r.targets) - mods
            total = per_rank = sum(c.walk.params[f].nbytes for f in r.targets if f in c.walk.params)
        example = examples.get(r.index) or (min(r.targets, key=len) if r.targets else None)
        out.append(RuleCoverage(r.source, mods, params, total, per_rank, active, example))
    return out


def table_warnings(c: Resolution, replicated_groups: tuple[ReplicatedGroup, ...]) -> None:
    for kind, table in (("tp", "tp_plan"), ("ep", "ep_plan")):
        if not c.active[kind] and getattr(c.plan, table):
            c.warnings.append(
                CompileWarning(
                    TABLE_INACTIVE,
                    f"{table} is not applied: {kind}_size is 1 (its rules were checked against the model)",
                    f"set `parallel.{kind}_size` > 1 to apply it, or delete the table",
                    key_where(c.loaded, (table,)),
                )
            )
    if not (c.active["tp"] or c.active["ep"]):
        return
    for g in replicated_groups:
        c.warnings.append(
            CompileWarning(
                REPLICATED_DENSE,
                f"{g.path}: {g.parameters} parameter(s) in {g.modules} module(s) stay replicated, "
                f"{human_bytes(g.bytes_per_rank, digits=1)} per rank",
                "often intended for norms, routers and small layers; add a tp_plan rule to shard large ones",
                g.path,
            )
        )
