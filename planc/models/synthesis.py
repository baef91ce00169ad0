"""Plan synthesis: a starting plan from what transformers declares for a model type (`planc init`).

transformers keeps its plans on the config class (`base_model_tp_plan`, `base_model_ep_plan`, keys
relative to the base model) and on the model class (`_tp_plan`, e.g. `lm_head`). This writes them as a
planc plan for the model users load (`planc.models.families`): the `*ForCausalLM`, or the multimodal
model whose language model the config describes, with the base model's real path as prefix
(`model.`, `model.language_model.`). It does what transformers does implicitly (the vocab-parallel
embedding added to every TP plan, TP rules on experts that EP shards dropped) and then resolves the
plan against the model built from the config, on the meta device. Where the config declares only EP
rules on an experts module (transformers deprecated `moe_tp_experts` in 5.25 and dropped it from its
configs' TP plans; planc's runtime still installs it), the TP rules used without EP are derived from the
experts' layout.

It always writes the closest plan that compiles: every rule it had to drop or change is a comment
with the reason and the compiler's code, and the header says which sizes it chose and why. Sizes
tried: 8, 4, 2 with expert parallelism (ep_size = tp_size), then the same without (experts
tensor-parallel, for expert counts no size divides); the first that compiles without dropping a
rule wins, else the one that drops the fewest.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Optional

from planc.errors import one_line

SIZES = (8, 4, 2)
_MAX_REPAIRS = 12
_WHERE_RULE = re.compile(r"^(tp_plan|ep_plan)\[(.+)\]$")


@dataclass
class _Draft:
    tp: dict
    ep: dict
    notes: list = field(default_factory=list)  # (table, pattern, style, code, reason)

    def drop(self, table: str, pattern: str, code: str, reason: str) -> None:
        rules = self.tp if table == "tp_plan" else self.ep
        style = rules.pop(pattern)
        self.notes.append((table, pattern, style, code, reason))


def _transformers_rules(fam, model):
    """tp rules, ep rules and the base-model prefix(es) exactly as transformers declares them for `model`:
    each base model applies its own config's plans under its own path, so the family's rules are written
    under every base model that carries its config, and so are those of any other MoE tower of the model
    (a vision encoder with experts next to the language model)."""
    from planc.models.families import base_model_paths, declares_experts_plan

    config_cls = fam.config_class()
    classes = [config_cls]
    for _, module in model.named_modules():
        cls = type(getattr(module, "config", None))
        if cls not in classes and declares_experts_plan(cls):
            classes.append(cls)
    tp: dict[str, str] = {}
    ep: dict[str, str] = {}
    all_prefixes: list[str] = []
    for cls in classes:
        prefixes = base_model_paths(model, cls)
        if not prefixes and cls is config_cls:
            raise ValueError(
                f"no module of {type(model).__name__} carries a {config_cls.__name__}; planc cannot place "
                "transformers' plans in this model"
            )
        tp_base = dict(getattr(cls, "base_model_tp_plan", None) or {})
        ep_base = dict(getattr(cls, "base_model_ep_plan", None) or {}) or _ep_from_tp(tp_base)
        for prefix in prefixes:
            if tp_base:
                tp[f"{prefix}.embed_tokens"] = "embedding_rowwise"  # transformers adds it to every TP plan
            tp.update({f"{prefix}.{k}": v for k, v in tp_base.items()})
            ep.update({f"{prefix}.{k}": v for k, v in ep_base.items()})
        all_prefixes += prefixes
    tp.update(dict(getattr(type(model), "_tp_plan", None) or {}))
    return tp, ep, "`, `".join(all_prefixes)


def _ep_from_tp(tp_base: dict) -> dict:
    """An EP plan for a config that declares only TP rules on its experts (Llama 4: "no base_model_ep_plan, the
    experts take every token pre-scaled"): the same experts tensors sharded by expert, the module dispatched.
    planc runs such experts expert-parallel (planc.runtime.ep.dense); the compiler refuses what cannot run."""
    from planc.spec.styles import STYLE

    ep: dict[str, str] = {}
    modules = [k for k, v in tp_base.items() if v == "moe_tp_experts"]
    for module in modules:
        for key, style in tp_base.items():
            spec = STYLE.get(style)
            # a style that shards no tensor (longcat_flash's `identity_expert: moe_identity_expert`) has no EP
            # counterpart: under EP the experts' own forward runs that child on the tokens it gets
            if key.startswith(module + ".") and (spec is None or spec.shards):
                ep[key] = "grouped_gemm"
        ep[module] = "ep_dispatch_experts"
    return ep


# The TP style of each experts tensor, untransposed ([E, out, in]) and transposed ([E, in, out]): the
# intermediate dim is sharded, the fused gate|up halves each (planc.runtime.tp_styles).
_EXPERTS_TP = {"gate_up_proj": ("packed_colwise", "packed_rowwise"), "up_proj": ("colwise", "rowwise"),
               "down_proj": ("rowwise", "colwise")}


def _tp_from_ep(draft: _Draft, walk, model) -> dict:
    """TP rules for the experts modules that the EP rules dispatch and no TP rule names (from transformers 5.25,
    every config but Llama 4's): each tensor sharded on the intermediate dim as its layout requires, the module
    `moe_tp_experts`. Experts with any other tensor (biases: every rank would add a down bias once; a norm inside
    the experts) or with gate and up interleaved get none: they are planned expert-parallel only."""
    from planc.spec.patterns import Pattern

    out: dict[str, str] = {}
    for pattern, style in draft.ep.items():
        if style != "ep_dispatch_experts" or any(_under(k, [pattern]) for k in draft.tp):
            continue
        pat = Pattern(pattern)
        infos = [m for m in walk.modules.values() if m.experts is not None and pat.matches(m.generic)]
        derived = {_experts_tp_rules(model.get_submodule(m.fqn), m.experts.is_transposed) for m in infos}
        rules = derived.pop() if len(derived) == 1 else None
        if rules is not None:
            out.update({f"{pattern}.{name}" if name else pattern: s for name, s in rules})
    return out


def _experts_tp_rules(module, transposed: bool) -> Optional[tuple]:
    """((tensor, style), ..., ("", "moe_tp_experts")) for one experts module, or None when planc's TP styles
    cannot shard it."""
    params = dict(module.named_parameters())
    if getattr(module, "is_concatenated", True) is False or not set(params) <= set(_EXPERTS_TP) \
            or not all(p.is_floating_point() for p in params.values()):
        return None
    return tuple((name, _EXPERTS_TP[name][transposed]) for name in params) + (("", "moe_tp_experts"),)


def _under(pattern: str, keys) -> bool:
    return any(pattern == k or pattern.startswith(k + ".") for k in keys)


def _prefilter(draft: _Draft, walk, model_type: str) -> None:
    """What transformers' own resolution would drop or planc cannot install, before any compile."""
    from planc.spec.patterns import Pattern
    from planc.spec.styles import RUNTIME_STYLES

    generic = list(walk.by_generic)
    for table in ("tp_plan", "ep_plan"):
        rules = draft.tp if table == "tp_plan" else draft.ep
        for pattern, style in list(rules.items()):
            if not any(Pattern(pattern).matches(g) for g in generic):
                draft.drop(table, pattern, "PLC601", f"matches nothing in this {model_type} config")
            elif style not in RUNTIME_STYLES:
                draft.drop(table, pattern, "PLC605", f"planc's runtime does not install `{style}`")
    _drop_tied(draft, walk)


def _drop_tied(draft: _Draft, walk) -> None:
    """Rules on tied parameters (`lm_head` tied to `embed_tokens`): a tied tensor stays whole."""
    from planc.spec.patterns import Pattern

    by_tensor: dict[int, list[str]] = {}
    for p in walk.params.values():
        by_tensor.setdefault(p.tensor_id, []).append(p.fqn)
    tied = [f for fqns in by_tensor.values() if len(fqns) > 1 for f in fqns]
    if not tied:
        return
    for pattern in list(draft.tp):
        pat = Pattern(pattern)
        hits = [f for f in tied if pat.matches(f) or pat.matches(f.rpartition(".")[0])]
        if hits:
            draft.drop(
                "tp_plan", pattern, "PLC603",
                f"{hits[0]} is tied to another parameter (tie_word_embeddings); a tied tensor stays whole",
            )


def _rule_of(where: str) -> Optional[tuple[str, str]]:
    m = _WHERE_RULE.match(where)
    if not m:
        return None
    try:
        return m.group(1), ast.literal_eval(m.group(2))
    except (ValueError, SyntaxError):
        return None


def _plan_data(model_type: str, size: int, ep_on: bool, draft: _Draft, impl: str) -> dict:
    data = {
        "version": 1,
        "model": {"type": model_type},
        "parallel": {"tp_size": size, "ep_size": size if ep_on else 1},
        "experts": {"implementation": impl, "ep_implementation": "auto"},
        "tp_plan": dict(draft.tp),
        "ep_plan": dict(draft.ep) if ep_on else {},
    }
    return data


def _attempt(model_type, model, size: int, ep_on: bool, base: _Draft, impl: str, tp_experts: dict):
    """Compile at these sizes, dropping each rule a problem points at, until it compiles or cannot be repaired.
    `tp_experts`: the experts' TP rules derived from the EP rules (`_tp_from_ep`), used without EP.

    Returns (draft, compiled or None, the unrepairable problems).
    """
    from planc.compiler.layout import narrowed_pattern
    from planc.compiler.resolve import compile_plan
    from planc.errors import CompileError, PlanError
    from planc.lint.plan_loader import load_plan
    from planc.spec.model import Plan

    draft = _Draft(dict(base.tp), dict(base.ep), list(base.notes))
    if not ep_on:
        # Without EP, transformers' TP rules on the experts (moe_tp_experts) are the experts' rules, else
        # the ones derived from the experts' layout.
        for pattern in list(draft.ep):
            draft.notes.append(("ep_plan", pattern, draft.ep[pattern], "", "expert parallelism is off at these sizes"))
        draft.ep = {}
        draft.tp.update(tp_experts)
    elif not any(s == "ep_dispatch_experts" for s in draft.ep.values()):
        return draft, None, ["no ep_plan rule shards experts (PLC404)"]
    else:
        from planc.spec.styles import TP_STYLES

        # transformers' EP plan is the whole plan used with EP: its TP styles (the dense MLP's colwise/rowwise)
        # belong in a planc plan's tp_plan
        for pattern, style in list(draft.ep.items()):
            if style in TP_STYLES and draft.tp.get(pattern, style) == style:
                how = "already in tp_plan" if pattern in draft.tp else "moved to tp_plan"
                draft.tp[pattern] = draft.ep.pop(pattern)
                draft.notes.append(("ep_plan", pattern, style, "", f"a tensor-parallel style: {how}"))
        ep_experts = [k for k, s in draft.ep.items() if s == "ep_dispatch_experts"]
        for pattern in [k for k in draft.tp if _under(k, ep_experts)]:
            draft.drop("tp_plan", pattern, "PLC406", "the experts are expert-parallel (ep_plan); EP wins")
    for _ in range(_MAX_REPAIRS):
        data = _plan_data(model_type, size, ep_on, draft, impl)
        try:
            loaded = load_plan(Plan.model_validate(data))
            return draft, compile_plan(model, loaded), []
        except PlanError as e:
            return draft, None, [str(e).splitlines()[0]]
        except CompileError as e:
            if _add_reducing_rules(draft, e.problems):
                continue
            fixable = []
            for p in e.problems:
                rule = _rule_of(p.where)
                if rule is not None and rule[1] in (draft.tp if rule[0] == "tp_plan" else draft.ep):
                    fixable.append((rule, p))
            if not fixable:
                return draft, None, [f"{p.code} {one_line(p.message)}" for p in e.problems]
            for (table, pattern), p in fixable:
                rules = draft.tp if table == "tp_plan" else draft.ep
                new = narrowed_pattern(p.hint)
                if pattern in rules and new and new not in rules:
                    # a rule right for blocks of one class and wrong for another under the same path (glm5_next's
                    # MLA and linear attention): kept for the layers the compiler names, in its place
                    style = rules[pattern]
                    items = [(new if k == pattern else k, v) for k, v in rules.items()]
                    rules.clear()
                    rules.update(items)
                    draft.notes.append((table, pattern, style, p.code,
                                        f"{one_line(p.message)}; kept as `{new}` (the layers it suits)"))
                elif pattern in rules:
                    draft.drop(table, pattern, p.code, one_line(p.message))
    return draft, None, ["too many problems to repair"]


def _add_reducing_rules(draft: _Draft, problems) -> bool:
    """The rules PLC636 asks for (a per-head norm or MLA's rope key whose gradient each rank holds in part): added,
    with a note, in place of the rule they replace. Whether any was added."""
    from planc.compiler.layout import LAYOUT_PARTIAL_GRADIENT, added_rule

    added = False
    for p in problems:
        rule = added_rule(p.hint) if p.code == LAYOUT_PARTIAL_GRADIENT else None
        if rule is None or draft.tp.get(rule[0]) == rule[1]:
            continue
        pattern, style = rule
        replaced = _rule_of(p.where)
        if replaced is not None and replaced[0] == "tp_plan" and f"in place of `{replaced[1]}:" in p.hint:
            draft.drop("tp_plan", replaced[1], p.code, "its gradient would be partial on each rank; replaced below")
        draft.tp[pattern] = style
        draft.notes.append(("tp_plan", pattern, style, "",
                            f"added ({p.code}): each rank's heads give only part of its gradient, so it is all-reduced"))
        added = True
    return added


def _experts_implementation(model) -> str:
    """`grouped_mm` where the model can switch its experts kernel, else its own forward (`eager`): the
    compiler's check (PLC624)."""
    from planc.compiler.walk import can_switch_experts

    return "eager" if can_switch_experts(type(model)) is False else "grouped_mm"


def init_plan(model_type: str, config: Optional[dict] = None, overrides: Optional[dict] = None,
              sizes: tuple = SIZES) -> str:
    """The plan text for `model_type`; ValueError/KeyError with one line for what cannot be planned."""
    import transformers

    from planc.compiler.walk import walk_model
    from planc.models.families import family
    from planc.models.build import build_meta_model

    try:
        fam = family(model_type)
    except KeyError:
        from planc.models.build import config_class

        config_class(model_type)  # a type transformers does not know: ModelBuildError naming the closest ones
        raise ValueError(
            f"transformers {transformers.__version__} declares no expert-parallel plan for `{model_type}` "
            "(no base_model_ep_plan, no experts in base_model_tp_plan); `planc init` starts from those plans"
        ) from None
    top_type = fam.model_type
    model = build_meta_model(top_type, {**(config or {}), **(overrides or {})})
    tp, ep, prefix = _transformers_rules(fam, model)
    walk = walk_model(model)
    base = _Draft(tp, ep)
    _prefilter(base, walk, top_type)
    tp_experts = _tp_from_ep(base, walk, model)
    impl = _experts_implementation(model)
    tried = []
    best = None
    for ep_on in (True, False):
        for size in sizes:
            draft, compiled, blockers = _attempt(top_type, model, size, ep_on, base, impl, tp_experts)
            dropped = sum(1 for n in draft.notes[len(base.notes):] if n[3] not in ("", "PLC406"))
            label = f"tp_size {size}" + (f", ep_size {size}" if ep_on else ", ep_size 1")
            if compiled is None:
                tried.append(f"{label}: {blockers[0] if blockers else 'does not compile'}")
                continue
            score = (dropped, 0 if ep_on else 1, -size)
            if best is None or score < best[0]:
                best = (score, size, ep_on, draft, label)
            if dropped == 0:
                break
            tried.append(f"{label}: compiles only without {dropped} rule(s)")
        if best is not None and best[0][0] == 0:
            break
    if best is None:
        raise ValueError(
            f"no plan for `{top_type}` compiles at tp_size {', '.join(map(str, sizes))}, with or without expert parallelism: "
            + "; ".join(tried)
        )
    _, size, ep_on, draft, label = best
    tried = [t for t in tried if not t.startswith(label + ":")]  # the chosen sizes are not "not chosen"
    why = f"{label}: the largest size that compiles" + (
        "" if best[0][0] == 0 else f" with the fewest rules dropped ({best[0][0]})"
    )
    derived = {} if ep_on else {k: v for k, v in tp_experts.items() if draft.tp.get(k) == v}
    return _render(fam, type(model).__name__, prefix, transformers.__version__, size, ep_on, draft, impl, why, tried,
                   derived)


def _render(fam, model_cls, prefix, version, size, ep_on, draft: _Draft, impl, why, tried, derived) -> str:
    lines = [
        f"# Starting plan for {fam.model_type}, written by `planc init --from-transformers {fam.model_type}`",
        f"# from transformers {version}: {fam.config_class().__name__}.base_model_tp_plan / base_model_ep_plan",
        f"# (prefixed `{prefix}.` for {model_cls}) and {model_cls}._tp_plan. Edit sizes and rules, then run",
        "# `planc lint` and `planc explain` on it.",
        f"# Sizes: {why}.",
    ]
    lines.extend(f"#   not chosen: {t}" for t in tried)
    if ep_on and not getattr(fam.config_class(), "base_model_ep_plan", None):
        lines.append(f"# ep_plan: derived from the TP rules on the experts ({fam.config_class().__name__} declares no "
                     "base_model_ep_plan)")
    if derived:
        lines.append(f"# tp_plan: the experts' rules derived from their EP rules and layout "
                     f"({fam.config_class().__name__} declares no TP rules on its experts)")
    if impl != "grouped_mm":
        lines.append(f"# experts.implementation: {impl}: {model_cls} cannot switch its experts kernel (its own forward runs)")
    if draft.notes:
        lines.append("# Rules dropped, added or changed (table, rule, code: reason):")
        for table, pattern, style, code, reason in draft.notes:
            lines.append(f"#   {table} `{pattern}: {style}`: {code + ': ' if code else ''}{reason}")
    lines += [
        "version: 1",
        f"name: {fam.model_type.replace('_', '-')}-tp{size}" + (f"-ep{size}" if ep_on else ""),
        "model:",
        f"  type: {fam.model_type}",
        "parallel:",
        f"  tp_size: {size}",
    ]
    if ep_on:
        lines += [f"  ep_size: {size}"]
    lines += ["experts:", f"  implementation: {impl}", "  ep_implementation: auto"]
    for table, rules in (("tp_plan", draft.tp), ("ep_plan", draft.ep if ep_on else {})):
        if rules:
            lines.append(f"{table}:")
            lines.extend(f"  {k}: {v}" for k, v in rules.items())
    return "\n".join(lines) + "\n"
