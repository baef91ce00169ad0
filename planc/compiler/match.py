"""Matching: plan rules -> concrete module and parameter paths, in module order, params before modules.

Patterns are matched against the model's generic paths (`model.layers.*.mlp`) and only then expanded
to concrete ones, so a rule is tried against a few dozen paths, not thousands. A parameter without a
rule of its own inherits its module's TP style, as in transformers.
"""

from __future__ import annotations

from typing import Literal, Optional

import difflib

from planc.compiler.checks import shards, targets
from planc.compiler.checks.targets import CONFLICTING_RULES
from planc.compiler.compiled import Assignment
from planc.compiler.context import PlanRule, source_rule, Resolution
from planc.spec.patterns import Pattern
from planc.spec.styles import ALL_STYLES, EXPERTS_MODULE_STYLES, PARAMETER_STYLES, dispatches_experts
from planc.compiler import rule_examples as ex
from planc.lint.registry import compile_rule


UNMATCHED_RULE = compile_rule(
    "PLC601", "rule-matches-nothing", "a rule, or one `{a,b}` alternative of it, matches nothing in the model",
    "transformers only warns, after the weights are loaded, about a rule that matches nothing; the layers it "
    "meant stay replicated. planc refuses it and suggests the closest real paths (a missing `model.` prefix "
    "first).",
    ex.TOP + "tp_plan:\n" + ex.ATTN + ex.HEAD + "  model.layers.*.mlp.gate_proj: colwise\n" + ex.EP, ex.GOOD,
)


def collect_rules(c: Resolution) -> None:
    for table in ("tp_plan", "ep_plan"):
        for pattern_text, style in getattr(c.plan, table).items():
            rule = PlanRule(
                len(c.rules), table, pattern_text, style, source_rule(c.loaded, table, pattern_text, style)
            )
            c.rules.append(rule)
            rule.pattern = Pattern(pattern_text)  # lint (PLC300) has refused invalid patterns
            targets.check_style(c, rule)


def match_rules(c: Resolution) -> None:
    generics = [(g.split("."), fqns) for g, fqns in c.walk.by_generic.items()]
    for rule in c.rules:
        if rule.pattern is None:
            continue
        for alt in rule.pattern.alternatives:
            hits = 0
            for gsegs, fqns in generics:
                matched = _match_generic(alt, gsegs, fqns)
                hits += len(matched)
                rule.targets.update(matched)
            rule.per_alternative.append(hits)
        check_matched(c, rule)


def check_matched(c: Resolution, rule: PlanRule) -> None:
    assert rule.pattern is not None  # parsed by collect_rules
    alts = rule.pattern.alternatives
    missing = [".".join(a) for a, n in zip(alts, rule.per_alternative) if n == 0]
    if not missing:
        return
    for text in missing:
        suggestions = suggest(c, text)
        what = f"rule `{rule.pattern_text}`" if len(alts) == 1 else f"alternative `{text}` of rule `{rule.pattern_text}`"
        hint = (
            "closest paths in this model: " + ", ".join(f"`{s}`" for s in suggestions)
            if suggestions
            else "run `planc explain` on the plan to list the module paths of this model"
        )
        c.problems.add(
            UNMATCHED_RULE,
            f"{rule.table} {what} matches no module or parameter of {c.walk.model_class}",
            rule.source.where,
            hint,
        )


def suggest(c: Resolution, text: str) -> list[str]:
    candidates = list(c.walk.by_generic)
    # The commonest mistake: the base-model prefix is missing (transformers' config plans have none).
    out = [cand for cand in candidates if cand.endswith("." + text)]
    for cand in difflib.get_close_matches(text, candidates, n=3, cutoff=0.5):
        if cand not in out:
            out.append(cand)
    return out[:3]


# "tp" / "ep" -> target fqn -> the rule that gives it its style
TableMaps = dict[str, dict[str, PlanRule]]


def table_maps(c: Resolution) -> TableMaps:
    maps: dict[str, dict[str, PlanRule]] = {"tp": {}, "ep": {}}
    for rule in c.rules:
        if rule.style not in ALL_STYLES:
            continue
        table = maps[rule.kind]
        for fqn in rule.targets:
            prev = table.get(fqn)
            if prev is None:
                table[fqn] = rule
            elif prev.style != rule.style:
                c.problems.add(
                    CONFLICTING_RULES,
                    f"{rule.table} rules `{prev.pattern_text}` ({prev.style}, {prev.source.where}) and "
                    f"`{rule.pattern_text}` ({rule.style}) give the same target two different styles",
                    rule.source.where,
                    "keep one rule per target: narrow one pattern, or delete one of the two rules",
                    fqn,
                )
        targets.check_targets(c, rule)
    return maps


def find_ep_experts(c: Resolution, maps: TableMaps) -> set[str]:
    """The experts modules that ep_plan shards by expert (none while ep_size is 1)."""
    if not c.active["ep"]:
        return set()
    modules = c.walk.modules
    return {
        fqn for fqn, r in maps["ep"].items()
        if dispatches_experts(r.style) and fqn in modules and modules[fqn].experts is not None
    }


def expand(c: Resolution, maps: TableMaps, ep_experts: set[str]) -> tuple[list[Assignment], dict[str, PlanRule]]:
    """Concrete assignments in module order, each module's parameters before the module."""
    walk, active = c.walk, c.active
    tp_map = maps["tp"] if active["tp"] else {}
    ep_map = maps["ep"] if active["ep"] else {}
    out: list[Assignment] = []
    final: dict[str, PlanRule] = {}

    def style_in(table_map: dict[str, PlanRule], fqn: str, owner: Optional[str]) -> tuple[Optional[PlanRule], bool]:
        r = table_map.get(fqn)
        if r is not None:
            return r, False
        weight = shards.block_scale_weight(walk, fqn)
        r = table_map.get(weight) if weight is not None else None
        if r is not None:  # a block scale (`weight_scale_inv`) is sharded with its weight, like it
            return r, True
        r = table_map.get(owner) if owner is not None else None
        if r is not None and r.style not in EXPERTS_MODULE_STYLES and r.style not in PARAMETER_STYLES:
            return r, True
        return None, False

    for mname, minfo in walk.modules.items():
        targets: list[tuple[str, Literal["parameter", "module"], Optional[str]]] = [
            (p, "parameter", mname) for p in minfo.params
        ] + ([(mname, "module", None)] if mname else [])
        for fqn, target, owner in targets:
            tr, t_inh = style_in(tp_map, fqn, owner)
            er, e_inh = style_in(ep_map, fqn, owner)
            rule, inherited = (er, e_inh) if er is not None else (tr, t_inh)
            if er is not None and tr is not None and er.style != tr.style:
                c.problems.add(
                    CONFLICTING_RULES,
                    f"tp_plan rule `{tr.pattern_text}` ({tr.style}, {tr.source.where}) and ep_plan rule "
                    f"`{er.pattern_text}` ({er.style}) give the same target two different styles",
                    er.source.where,
                    "keep one rule per target: delete one of the two rules",
                    fqn,
                )
            if rule is None:
                continue
            final[fqn] = rule
            out.append(Assignment(fqn, target, rule.style, rule.source, inherited))
    return out, final


def _match_alt(alt: tuple[str, ...], segs: list[str]) -> bool:
    return len(alt) == len(segs) and all(a == "*" or a == s for a, s in zip(alt, segs))


def _match_generic(alt: tuple[str, ...], gsegs: list[str], fqns: list[str]) -> list[str]:
    """The concrete `fqns` of generic path `gsegs` that alternative `alt` matches.

    All of them, unless `alt` names a layer index (`model.layers.7.mlp`) where the generic path has `*`:
    then each concrete path is checked.
    """
    if len(gsegs) != len(alt):
        return []
    concrete_index = False
    for a, g in zip(alt, gsegs):
        if a == "*" or a == g:
            continue
        if g == "*" and a.isdigit():
            concrete_index = True
            continue
        return []
    return [f for f in fqns if _match_alt(alt, f.split("."))] if concrete_index else fqns
