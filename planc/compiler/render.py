"""Human and machine views of a CompiledPlan (what `planc explain` prints).

Grouped by rule, because the rule is what a person edits: for each pattern, what it matched, its
style, and what it costs per rank; then the experts and their EP strategy with the reason it was
chosen; then what stays replicated and the per-rank total.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planc.compiler.units import human_bytes
from planc.compiler.walk import generic_path

if TYPE_CHECKING:  # annotations only: compiled.py imports this module for CompiledPlan.__str__
    from planc.compiler.compiled import CompiledPlan, ExpertsAssignment


def _group_experts(compiled: CompiledPlan) -> list[tuple[str, int, ExpertsAssignment]]:
    """Experts modules folded by (generic path, strategy, sizes): one line per kind, not per layer."""
    groups: dict[tuple[object, ...], tuple[int, ExpertsAssignment]] = {}
    for e in compiled.experts:
        key = (generic_path(e.fqn), e.mode, e.strategy, e.num_experts, e.num_local_experts)
        n, first = groups.get(key, (0, e))
        groups[key] = (n + 1, first)
    return [(str(k[0]), n, e) for k, (n, e) in groups.items()]


def training_text(compiled: CompiledPlan) -> str:
    """The training mode in one line: data_parallel, over how many replicas, and the mixed precision."""
    t = compiled.training
    text = f"data_parallel={compiled.data_parallel} over dp_size={compiled.parallel.dp_size}"
    if t is None:
        text += " (no `training:` section: the default)"
    elif t.mixed_precision is not None:
        mp = t.mixed_precision
        text += f", mixed_precision param_dtype={mp.param_dtype} reduce_dtype={mp.reduce_dtype}"
    return text


def render_text(compiled: CompiledPlan) -> str:
    p = compiled.parallel
    lines = []
    title = compiled.plan_name or compiled.plan_path or "plan"
    lines.append(f"{title}: {compiled.model_class} ({compiled.model_type})")
    lines.append(
        f"  parallel: tp_size={p.tp_size} ep_size={p.ep_size} dp_size={p.dp_size} (world {p.world_size})"
        f"   fingerprint {compiled.fingerprint}"
    )
    s = compiled.experts_settings
    lines.append(f"  experts: implementation={s.implementation} ep_implementation={s.ep_implementation}")
    lines.append(f"  training: {training_text(compiled)}")
    sizes, names = compiled.mesh_dims
    lines.append(f"  mesh: {' x '.join(f'{n}={k}' for n, k in zip(names, sizes))}")
    lines.append("")
    lines.append("rules:")
    width = max((len(c.rule.pattern) for c in compiled.coverage), default=10)
    for c in compiled.coverage:
        status = "" if c.active else "   (not applied: size 1)"
        lines.append(
            f"  {c.rule.table:<7} {c.rule.pattern:<{width}}  {c.rule.style:<22} "
            f"{c.modules:>4} modules {c.parameters:>4} params   "
            f"{human_bytes(c.bytes_total):>11} -> {human_bytes(c.bytes_per_rank):>11}/rank{status}"
        )
        if c.rule.line:
            lines.append(f"  {'':<7} at {c.rule.where}" + (f", e.g. {c.example}" if c.example else ""))
    lines.append("")
    lines.append(f"experts: {compiled.experts_covered}/{len(compiled.experts)} modules sharded")
    for path, n, e in _group_experts(compiled):
        if e.mode == "ep":
            how = f"expert-parallel, {e.num_local_experts}/{e.num_experts} experts per rank"
        elif e.mode == "tp":
            how = f"tensor-parallel (moe_tp_experts), {e.num_experts} experts sliced over {p.tp_size} ranks"
        else:
            how = f"replicated, {e.num_experts} experts"
        lines.append(f"  {path} x{n}: {how}")
        if e.strategy is not None and e.mode == "ep" and e.dispatch == "dense":
            lines.append("    strategy: experts that take every token pre-scaled (no routed pairs): each rank runs its "
                         "experts on their rows of the shared batch, outputs gathered; ep_implementation does not apply")
        elif e.strategy is not None:
            lines.append(f"    strategy {e.strategy.describe()}")
    lines.append("")
    if compiled.replicated:
        lines.append("replicated (no rule shards them):")
        for g in compiled.replicated:
            lines.append(
                f"  {g.path:<{width + 8}} {g.modules:>4} modules {g.parameters:>4} params "
                f"{human_bytes(g.bytes_per_rank):>11}/rank"
            )
        lines.append("")
    lines.append(
        f"per rank: {human_bytes(compiled.bytes_sharded_per_rank)} sharded + "
        f"{human_bytes(compiled.bytes_replicated_per_rank)} replicated = {human_bytes(compiled.bytes_per_rank)} "
        f"(model {human_bytes(compiled.bytes_total)})"
    )
    covered = "full" if compiled.full_coverage else "INCOMPLETE"
    experts = (
        f"{compiled.experts_covered}/{len(compiled.experts)} experts modules sharded"
        if compiled.experts
        else "no experts module found (planc finds experts by transformers' experts contract; see docs/compile.md)"
    )
    lines.append(
        f"coverage: {covered}: {sum(1 for c in compiled.coverage if c.modules + c.parameters)}/"
        f"{len(compiled.coverage)} rules matched, {experts}"
    )
    other = [w for w in compiled.warnings if w.code != "PLC651"]  # PLC651: the replicated section above
    if other:
        lines.append("")
        lines.append("warnings:")
        lines.extend(f"  {w}" for w in other)
    return "\n".join(lines)


def json_data(compiled: CompiledPlan) -> dict[str, Any]:
    """The canonical form plus the explain-only numbers (coverage, replicated groups, warnings), for `--format json`."""
    data = compiled.to_json()
    data["fingerprint"] = compiled.fingerprint
    data["plan_name"] = compiled.plan_name
    data["plan_path"] = compiled.plan_path
    data["coverage"] = [
        {
            "table": c.rule.table,
            "pattern": c.rule.pattern,
            "style": c.rule.style,
            "where": c.rule.where,
            "active": c.active,
            "modules": c.modules,
            "parameters": c.parameters,
            "bytes_total": c.bytes_total,
            "bytes_per_rank": c.bytes_per_rank,
        }
        for c in compiled.coverage
    ]
    data["replicated"] = [
        {"path": g.path, "modules": g.modules, "parameters": g.parameters, "bytes_per_rank": g.bytes_per_rank}
        for g in compiled.replicated
    ]
    data["bytes_per_rank"] = compiled.bytes_per_rank
    data["bytes_total"] = compiled.bytes_total
    data["full_coverage"] = compiled.full_coverage
    data["experts_covered"] = compiled.experts_covered
    data["data_parallel"] = compiled.data_parallel
    data["warnings"] = [{"code": w.code, "message": w.message, "hint": w.hint, "where": w.where} for w in compiled.warnings]
    return data
