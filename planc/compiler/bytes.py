"""Byte accounting: what each rank holds under the plan, per rule and in total, and what stays replicated.

A parameter's bytes per rank follow its style's row in `planc.spec.styles` (the same placement the
runtime shards by): split over the TP or EP group when the style splits a dim of its shape, whole
otherwise. Tied tensors count once.
"""

from __future__ import annotations

from collections import OrderedDict

from planc.compiler.compiled import Assignment, CompileWarning, ReplicatedGroup, RuleCoverage
from planc.compiler.context import REPLICATED_DENSE, TABLE_INACTIVE, PlanRule, key_where
from planc.compiler.render import human_bytes
from planc.spec.styles import STYLE


def account(c, final: dict[str, PlanRule]):
    walk, tp, ep = c.walk, c.tp, c.ep
    seen: set[int] = set()
    total = sharded = replicated = 0
    per_rule_bytes: dict[int, list[int]] = {}
    groups: "OrderedDict[str, list]" = OrderedDict()
    for p in walk.params.values():
        if p.tensor_id in seen:
            continue
        seen.add(p.tensor_id)
        total += p.nbytes
        r = final.get(p.fqn)
        div = 1
        if r is not None:
            spec = STYLE.get(r.style)
            if spec is not None and spec.placement(len(p.shape)) is not None:
                div = ep if spec.mesh == "ep" else tp
        per_rank = -(-p.nbytes // div)
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


def coverage(c, assignments: list[Assignment], per_rule_bytes) -> list[RuleCoverage]:
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


def table_warnings(c, replicated_groups) -> None:
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
