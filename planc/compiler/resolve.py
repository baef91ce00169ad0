"""compile_plan(): resolve a plan against a model's real module tree, or refuse with every reason at once.

transformers applies a plan as it finds it: a rule that matches nothing is a warning after the weights
are loaded, experts without a rule are silently replicated, a module rule before its parameters'
rules computes wrong results. Here each of those is found before a parameter is touched, against
the concrete module paths, and reported together in one CompileError whose problems name the module,
the plan line and what to write instead. Reads the model by duck typing (see `walk.py`); no torch.
"""

from __future__ import annotations

import difflib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from planc.compiler.compiled import (
    Assignment,
    CompiledPlan,
    CompileProblem,
    CompileWarning,
    ExpertsAssignment,
    ReplicatedGroup,
    RuleCoverage,
    SourceRule,
)
from planc.compiler.ep import EPResolutionError, EPStrategy, resolve_ep
from planc.compiler.render import human_bytes
from planc.compiler.walk import ModelWalk, generic_path, walk_model
from planc.errors import CompileError
from planc.spec.patterns import Pattern, PatternError
from planc.spec.styles import ALL_STYLES, EP_STYLES, REMOVED_STYLES, RUNTIME_STYLES, TP_STYLES

# Problem codes (documented in docs/compile.md).
UNMATCHED_RULE = "PLC601"
EXPERTS_UNCOVERED = "PLC602"
CONFLICTING_RULES = "PLC603"
TP_ON_EP_EXPERTS = "PLC604"
STYLE_NOT_INSTALLABLE = "PLC605"
EXPERTS_NOT_DIVISIBLE = "PLC606"
MODEL_TYPE_MISMATCH = "PLC607"
MEGAMOE_NO_GATE = "PLC608"
MEGAMOE_TOP_K = "PLC609"
MEGAMOE_EP_SIZE = "PLC610"
MEGAMOE_SIZES = "PLC611"
MEGAMOE_NOT_FP4 = "PLC612"
WRONG_TARGET = "PLC613"
EP_RESOLUTION = "PLC614"
EXPERTS_PARTIAL = "PLC615"
UNEVEN_SHARD = "PLC616"
HEAD_SPLIT = "PLC617"
WRONG_TABLE = "PLC618"
BAD_PATTERN = "PLC619"
BAD_SIZES = "PLC620"
MEGAMOE_ACTIVATION = "PLC621"
MEGAMOE_KERNEL_BLOCKS = "PLC622"
# Warning codes.
REPLICATED_DENSE = "PLC651"
TABLE_INACTIVE = "PLC652"
MEGAMOE_ALIGNMENT = "PLC653"

# Module styles that hook an experts module; their parameters need rules of their own.
EXPERTS_MODULE_STYLES = {"ep_dispatch_experts": "ep", "moe_tp_experts": "tp"}
PARAMETER_ONLY_STYLES = frozenset({"grouped_gemm"})
# TP styles that slice a parameter over the TP group: style -> (dim for ndim >= 2, dim for a bias, packed halves)
TP_SHARDING = {
    "colwise": (-2, 0, False),
    "colwise_gather_output": (-2, 0, False),
    "rowwise": (-1, None, False),
    "rowwise_split_input": (-1, None, False),
    "packed_colwise": (-2, 0, True),
    "packed_rowwise": (-1, None, True),
    "embedding_rowwise": (0, 0, False),
    "embedding_colwise": (1, 0, False),
}
EP_TABLE_STYLES = frozenset(EP_STYLES) | {"replicate"}


def _shard_dim(style: str, shape: tuple) -> Optional[int]:
    """The dim `style` splits over the TP group for a parameter of `shape`; None when it stays whole."""
    if style not in TP_SHARDING:
        return None
    dim2, dim1, _ = TP_SHARDING[style]
    return dim2 if len(shape) >= 2 else dim1


MEGAMOE_MAX_TOP_K = 32
MEGAMOE_MAX_RANKS = 72
# The real kernel's block alignment beyond its host checks (% 128): H/128 must be even, and at decode-sized
# batches (about <= 8.5 tokens per expert) its heuristics take BLOCK_K = 256 over the intermediate size.
MEGAMOE_KERNEL_BLOCK = 256
# Config fields of gated activations other than the kernel's SiLU SwiGLU (the clamp is `swiglu_limit`).
MEGAMOE_OTHER_ACTIVATION_FIELDS = ("swiglu_alpha", "mlp_gate_softcap", "mlp_up_softcap", "gate_softcap", "up_softcap")
ATTENTION_PROJ = {"q_proj": "out", "k_proj": "out", "v_proj": "out", "o_proj": "in"}


@dataclass
class _Rule:
    index: int
    table: str  # "tp_plan" | "ep_plan"
    pattern_text: str
    style: str
    source: SourceRule
    pattern: Optional[Pattern] = None
    targets: set = field(default_factory=set)
    per_alternative: list = field(default_factory=list)  # hit count per alternative

    @property
    def kind(self) -> str:
        return "tp" if self.table == "tp_plan" else "ep"


class _Problems:
    """Collects problems, folding the same problem on many layers into one line with a count."""

    def __init__(self) -> None:
        self._groups: "OrderedDict[tuple, list]" = OrderedDict()

    def add(self, code: str, message: str, where: str, hint: str, fqn: Optional[str] = None) -> None:
        key = (code, message, where, hint, generic_path(fqn) if fqn else None)
        self._groups.setdefault(key, []).append(fqn)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def build(self) -> list[CompileProblem]:
        out = []
        for (code, message, where, hint, generic), fqns in self._groups.items():
            concrete = list(dict.fromkeys(f for f in fqns if f))
            if not concrete:
                module = None
            elif len(concrete) == 1:
                module = concrete[0]
            else:
                module = f"{generic} ({len(concrete)} targets, e.g. {concrete[0]})"
            out.append(CompileProblem(code, message, module, where, hint))
        return out


def _load(plan):
    from planc.spec.load import LoadedPlan, load_plan

    return plan if isinstance(plan, LoadedPlan) else load_plan(plan)


def _where(loaded, keypath: tuple) -> str:
    pos = loaded.position(keypath)
    return str(pos) if pos is not None else ".".join(str(k) for k in keypath)


def _source_rule(loaded, table: str, pattern: str, style: str) -> SourceRule:
    pos = loaded.key_positions.get((table, pattern)) if loaded.key_positions else None
    if pos is None:
        return SourceRule(table, pattern, style)
    return SourceRule(table, pattern, style, pos.path or "<string>", pos.line, pos.col)


class _Resolver:
    def __init__(self, loaded, walk: ModelWalk):
        self.loaded = loaded
        self.plan = loaded.plan
        self.walk = walk
        self.parallel = self.plan.parallel
        self.tp, self.ep = self.parallel.tp_size, self.parallel.ep_size
        self.active = {"tp": self.tp > 1, "ep": self.ep > 1}
        self.megamoe = self.plan.experts.implementation == "deepgemm_megamoe"
        self.problems = _Problems()
        self.warnings: list[CompileWarning] = []
        self.rules: list[_Rule] = []

    # ---- plan-level checks -------------------------------------------------------------------

    def check_model_type(self) -> None:
        want, have = self.plan.model.type, self.walk.model_type
        if have is not None and want != have:
            self.problems.add(
                MODEL_TYPE_MISMATCH,
                f"the plan is written for `model.type: {want}`, but this model's config.model_type is `{have}` "
                f"({self.walk.model_class})",
                _where(self.loaded, ("model", "type")),
                f"write `model: {{type: {have}}}` if the rules fit this model, or compile the plan against a "
                f"`{want}` model",
            )

    def check_sizes(self) -> None:
        """The lint size rules, repeated here: a mapping or Plan object reaches compile without lint."""
        p = self.parallel
        if p.ep_size > 1 and (p.ep_size % p.tp_size or p.world_size % p.ep_size):
            self.problems.add(
                BAD_SIZES,
                f"ep_size {p.ep_size} must be a multiple of tp_size {p.tp_size} and divide the world "
                f"(tp_size * dp_size = {p.world_size}): an EP group is made of whole TP groups",
                _where(self.loaded, ("parallel", "ep_size")),
                f"use `ep_size: {p.tp_size}`, or a multiple of it that divides {p.world_size}, or `ep_size: 1`",
            )

    def collect_rules(self) -> None:
        for table in ("tp_plan", "ep_plan"):
            for pattern_text, style in getattr(self.plan, table).items():
                rule = _Rule(
                    len(self.rules), table, pattern_text, style, _source_rule(self.loaded, table, pattern_text, style)
                )
                self.rules.append(rule)
                where = rule.source.where
                try:
                    rule.pattern = Pattern(pattern_text)
                except PatternError as e:
                    self.problems.add(BAD_PATTERN, f"{table} pattern `{pattern_text}`: {e.problem}", where, e.hint)
                self.check_style(rule)

    def check_style(self, rule: _Rule) -> None:
        style, where, table = rule.style, rule.source.where, rule.table
        if style in REMOVED_STYLES:
            self.problems.add(
                STYLE_NOT_INSTALLABLE,
                f"style `{style}` was removed from transformers (>= 5.23) and planc does not install it",
                where,
                f"{REMOVED_STYLES[style]}; `planc migrate` rewrites it",
            )
            return
        if style not in ALL_STYLES:
            guess = difflib.get_close_matches(style, sorted(ALL_STYLES), n=1, cutoff=0.6)
            self.problems.add(
                STYLE_NOT_INSTALLABLE,
                f"unknown style `{style}`",
                where,
                f"did you mean `{guess[0]}`?" if guess else f"use one of: {', '.join(sorted(RUNTIME_STYLES))}",
            )
            return
        if table == "tp_plan" and style in EP_STYLES:
            self.problems.add(
                WRONG_TABLE,
                f"`{style}` is an expert-parallel style, but this rule is in tp_plan",
                where,
                f"move `{rule.pattern_text}: {style}` to ep_plan",
            )
        elif table == "ep_plan" and style not in EP_TABLE_STYLES:
            hint = (
                f"move `{rule.pattern_text}: {style}` to tp_plan (with packed_colwise/rowwise on its parameters), or "
                "shard the experts by expert: `grouped_gemm` on their parameters and `ep_dispatch_experts` on the module"
                if style == "moe_tp_experts"
                else f"move `{rule.pattern_text}: {style}` to tp_plan; ep_plan takes {', '.join(sorted(EP_TABLE_STYLES))}"
            )
            self.problems.add(WRONG_TABLE, f"`{style}` is a tensor-parallel style, but this rule is in ep_plan", where, hint)
        if style not in RUNTIME_STYLES:
            self.problems.add(
                STYLE_NOT_INSTALLABLE,
                f"planc's runtime does not install style `{style}` ({TP_STYLES.get(style, '')}); transformers would, "
                "planc refuses instead of skipping it",
                where,
                f"use one of the installable styles ({', '.join(sorted(RUNTIME_STYLES))}), or `replicate` to keep "
                "the module whole on every rank",
            )

    # ---- matching ------------------------------------------------------------------------------

    def match_rules(self) -> None:
        generics = [(g.split("."), fqns) for g, fqns in self.walk.by_generic.items()]
        for rule in self.rules:
            if rule.pattern is None:
                continue
            for alt in rule.pattern.alternatives:
                hits = 0
                for gsegs, fqns in generics:
                    matched = _match_generic(alt, gsegs, fqns)
                    hits += len(matched)
                    rule.targets.update(matched)
                rule.per_alternative.append(hits)
            self.check_matched(rule)

    def check_matched(self, rule: _Rule) -> None:
        alts = rule.pattern.alternatives
        missing = [".".join(a) for a, n in zip(alts, rule.per_alternative) if n == 0]
        if not missing:
            return
        for text in missing:
            suggestions = self.suggest(text)
            what = f"rule `{rule.pattern_text}`" if len(alts) == 1 else f"alternative `{text}` of rule `{rule.pattern_text}`"
            hint = (
                "closest paths in this model: " + ", ".join(f"`{s}`" for s in suggestions)
                if suggestions
                else "run `planc explain` on the plan to list the module paths of this model"
            )
            self.problems.add(
                UNMATCHED_RULE,
                f"{rule.table} {what} matches no module or parameter of {self.walk.model_class}",
                rule.source.where,
                hint,
            )

    def suggest(self, text: str) -> list[str]:
        candidates = list(self.walk.by_generic)
        # The commonest mistake: the base-model prefix is missing (transformers' config plans have none).
        out = [c for c in candidates if c.endswith("." + text)]
        for c in difflib.get_close_matches(text, candidates, n=3, cutoff=0.5):
            if c not in out:
                out.append(c)
        return out[:3]

    # ---- per-table target maps ------------------------------------------------------------------

    def table_maps(self) -> dict[str, dict[str, _Rule]]:
        maps: dict[str, dict[str, _Rule]] = {"tp": {}, "ep": {}}
        for rule in self.rules:
            if rule.style not in ALL_STYLES:
                continue
            table = maps[rule.kind]
            for fqn in rule.targets:
                prev = table.get(fqn)
                if prev is None:
                    table[fqn] = rule
                elif prev.style != rule.style:
                    self.problems.add(
                        CONFLICTING_RULES,
                        f"{rule.table} rules `{prev.pattern_text}` ({prev.style}, {prev.source.where}) and "
                        f"`{rule.pattern_text}` ({rule.style}) give the same target two different styles",
                        rule.source.where,
                        "keep one rule per target: narrow one pattern, or delete one of the two rules",
                        fqn,
                    )
            self.check_targets(rule)
        return maps

    def check_targets(self, rule: _Rule) -> None:
        walk, style = self.walk, rule.style
        for fqn in rule.targets:
            if fqn in walk.params:
                owner = walk.modules[walk.params[fqn].owner]
                if style in EXPERTS_MODULE_STYLES:
                    self.problems.add(
                        WRONG_TARGET,
                        f"`{style}` hooks an experts module's forward, but `{rule.pattern_text}` matches a parameter",
                        rule.source.where,
                        f"write `{style}` on the experts module (`{generic_path(owner.fqn)}`)",
                        fqn,
                    )
                elif style in PARAMETER_ONLY_STYLES and owner.experts is None:
                    self.problems.add(
                        WRONG_TARGET,
                        f"`{style}` shards the expert dimension, but `{generic_path(fqn)}` belongs to {owner.class_name}, "
                        "which is not an experts module",
                        rule.source.where,
                        "use `grouped_gemm` only on the parameters of experts modules (gate_up_proj, down_proj, ...); "
                        "dense layers take TP styles in tp_plan",
                        fqn,
                    )
            else:
                module = walk.modules[fqn]
                if style in PARAMETER_ONLY_STYLES:
                    names = ", ".join(p.rsplit(".", 1)[-1] for p in module.params) or "none"
                    self.problems.add(
                        WRONG_TARGET,
                        f"`{style}` is a parameter style, but `{rule.pattern_text}` matches the module {generic_path(fqn)} "
                        f"({module.class_name})",
                        rule.source.where,
                        f"write one rule per parameter (`{rule.pattern_text}.{{...}}`; its parameters: {names}) and "
                        "`ep_dispatch_experts` on the module",
                        fqn,
                    )
                elif style in EXPERTS_MODULE_STYLES and module.experts is None:
                    self.problems.add(
                        WRONG_TARGET,
                        f"`{style}` needs an experts module (forward(hidden_states, top_k_index, top_k_weights) with "
                        f"gate_up_proj/down_proj), but {generic_path(fqn)} is a {module.class_name}",
                        rule.source.where,
                        "point the rule at the `experts` child of the MoE block, e.g. `model.layers.*.mlp.experts`",
                        fqn,
                    )

    # ---- expansion -------------------------------------------------------------------------------

    def find_ep_experts(self, maps) -> set[str]:
        """The experts modules that ep_plan shards by expert (none while ep_size is 1)."""
        if not self.active["ep"]:
            return set()
        modules = self.walk.modules
        return {
            fqn for fqn, r in maps["ep"].items()
            if r.style == "ep_dispatch_experts" and fqn in modules and modules[fqn].experts is not None
        }

    def expand(self, maps, ep_experts: set[str]) -> tuple[list[Assignment], dict[str, _Rule]]:
        """Concrete assignments in module order, each module's parameters before the module."""
        walk, active = self.walk, self.active
        tp_map = maps["tp"] if active["tp"] else {}
        ep_map = maps["ep"] if active["ep"] else {}
        out: list[Assignment] = []
        final: dict[str, _Rule] = {}

        def style_in(table_map, fqn, owner):
            r = table_map.get(fqn)
            if r is not None:
                return r, False
            r = table_map.get(owner) if owner is not None else None
            if r is not None and r.style not in EXPERTS_MODULE_STYLES and r.style not in PARAMETER_ONLY_STYLES:
                return r, True
            return None, False

        owner_of: dict[str, Optional[str]] = {}  # module -> the EP experts module it is (in), parents first
        for mname, minfo in walk.modules.items():
            experts_owner = mname if mname in ep_experts else owner_of.get(mname.rpartition(".")[0])
            owner_of[mname] = experts_owner
            targets = [(p, "parameter", mname) for p in minfo.params] + ([(mname, "module", None)] if mname else [])
            for fqn, target, owner in targets:
                tr, t_inh = style_in(tp_map, fqn, owner)
                er, e_inh = style_in(ep_map, fqn, owner)
                if tr is not None and experts_owner is not None and not t_inh:
                    self.problems.add(
                        TP_ON_EP_EXPERTS,
                        f"tp_plan rule `{tr.pattern_text}` ({tr.style}) targets experts that ep_plan shards by expert "
                        f"(ep_size={self.ep}); transformers silently drops such TP rules, planc refuses",
                        tr.source.where,
                        f"delete `{tr.pattern_text}` from tp_plan (with EP the experts are never tensor-sharded), "
                        "or set `ep_size: 1` to keep them tensor-parallel",
                        fqn,
                    )
                    tr = None
                rule, inherited = (er, e_inh) if er is not None else (tr, t_inh)
                if er is not None and tr is not None and er.style != tr.style:
                    self.problems.add(
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

    # ---- checks on the expanded assignments ----------------------------------------------------

    def check_tied(self, final: dict[str, _Rule]) -> None:
        by_tensor: dict[int, list[str]] = {}
        for p in self.walk.params.values():
            by_tensor.setdefault(p.tensor_id, []).append(p.fqn)
        for fqns in by_tensor.values():
            if len(fqns) < 2:
                continue
            # Any rule on a tied name treats the names separately: a name without a rule would read the
            # shard as the whole tensor, and two rules would shard the one tensor twice.
            ruled = [f for f in fqns if f in final]
            if not ruled:
                continue
            listing = ", ".join(f"{f} ({final[f].style if f in final else 'no rule'})" for f in fqns)
            self.problems.add(
                CONFLICTING_RULES,
                f"tied parameters share one tensor but the plan treats them separately: {listing}",
                final[ruled[-1]].source.where,
                "a tied tensor stays whole: delete "
                + " and ".join(dict.fromkeys(f"`{final[f].pattern_text}`" for f in ruled))
                + ", or untie the weights (`tie_word_embeddings: false` in the config)",
                ruled[-1],
            )

    def check_shards(self, assignments: list[Assignment], final: dict[str, _Rule]) -> None:
        walk, tp = self.walk, self.tp
        if tp <= 1:
            return
        head_dim = _head_dim(walk.config)
        for a in assignments:
            if a.target != "parameter" or a.style not in TP_SHARDING:
                continue
            p = walk.params[a.fqn]
            dim = _shard_dim(a.style, p.shape)
            if dim is None or not p.shape:
                continue
            packed = TP_SHARDING[a.style][2]
            size = p.shape[dim]
            parts = tp * (2 if packed else 1)
            where = final[a.fqn].source.where
            if size % parts:
                self.problems.add(
                    UNEVEN_SHARD,
                    f"`{a.style}` splits dim {dim} of {generic_path(p.fqn)} (size {size}) into {parts} "
                    f"{'halves x ranks' if packed else 'ranks'}, which does not divide evenly",
                    where,
                    f"pick a tp_size that divides {size // (2 if packed else 1)}, or write `replicate` for this target",
                    a.fqn,
                )
                continue
            side = ATTENTION_PROJ.get(p.owner.rsplit(".", 1)[-1])
            splits_heads = (side == "out" and dim in (-2, 0)) or (side == "in" and dim == -1)
            local = size // tp
            if head_dim and splits_heads and local % head_dim:
                self.problems.add(
                    HEAD_SPLIT,
                    f"`{a.style}` gives each of the {tp} ranks {local} features of {generic_path(p.fqn)}, which is not a "
                    f"whole number of heads (head_dim {head_dim}): attention would split a head across ranks",
                    where,
                    f"use a tp_size that divides the head count ({size // head_dim} heads here), or "
                    "`replicate` attention",
                    a.fqn,
                )

    def resolve_strategy(self, ep_experts: set[str]) -> Optional[EPStrategy]:
        # Mega MoE experts always run behind MegaMoeEP (it hands the kernel its process group), even at ep_size 1.
        if not ep_experts and not self.megamoe:
            return None
        try:
            return resolve_ep(self.plan.experts, self.parallel)
        except EPResolutionError as e:
            self.problems.add(EP_RESOLUTION, str(e), _where(self.loaded, tuple(e.field.split("."))), e.hint)
            return None

    def experts_assignments(self, final: dict[str, _Rule], strategy) -> list[ExpertsAssignment]:
        walk, out = self.walk, []
        sharding = self.active["tp"] or self.active["ep"]
        for m in walk.experts:
            info = m.experts
            rule = final.get(m.fqn)
            mode = EXPERTS_MODULE_STYLES.get(rule.style) if rule is not None else None
            if mode is None and sharding:
                table = "ep_plan" if self.active["ep"] else "tp_plan"
                self.problems.add(
                    EXPERTS_UNCOVERED,
                    f"experts module {m.class_name} has no EP or TP rule: with tp_size={self.tp}, ep_size={self.ep} "
                    f"every rank would hold all {info.num_experts} experts "
                    f"({human_bytes(sum(walk.params[p].nbytes for p in m.params), digits=1)} per layer)",
                    _where(self.loaded, (table,)),
                    "shard them by expert: ep_plan `<path>.experts.{gate_up_proj,down_proj}: grouped_gemm` and "
                    "`<path>.experts: ep_dispatch_experts` (or moe_tp_experts in tp_plan)",
                    m.fqn,
                )
            self.check_experts_params(m, mode, final)
            if mode == "ep" and info.num_experts % self.ep:
                self.problems.add(
                    EXPERTS_NOT_DIVISIBLE,
                    f"{info.num_experts} experts cannot be split evenly over ep_size={self.ep} ranks",
                    _where(self.loaded, ("parallel", "ep_size")),
                    "pick an ep_size that divides " + str(info.num_experts)
                    + f" ({', '.join(str(d) for d in _divisors(info.num_experts) if d > 1)})",
                    m.fqn,
                )
            if self.megamoe:
                self.check_megamoe(m)
            out.append(
                ExpertsAssignment(
                    fqn=m.fqn,
                    strategy=strategy if mode == "ep" or self.megamoe else None,
                    num_experts=info.num_experts,
                    num_local_experts=info.num_experts // self.ep if mode == "ep" else info.num_experts,
                    top_k=info.top_k,
                    hidden_size=info.hidden_size,
                    intermediate_size=info.intermediate_size,
                    has_gate=info.has_gate,
                    is_fp4=info.is_fp4,
                    mode=mode,
                    is_transposed=info.is_transposed,
                )
            )
        return out

    def check_experts_params(self, m, mode, final: dict[str, _Rule]) -> None:
        for pfqn in m.params:
            r = final.get(pfqn)
            name = pfqn.rsplit(".", 1)[-1]
            if mode == "ep" and (r is None or r.style != "grouped_gemm"):
                self.problems.add(
                    EXPERTS_PARTIAL,
                    f"{name} of expert-parallel experts is not sharded by expert"
                    + (f" (it has `{r.style}`)" if r else "")
                    + ": every rank would index a full tensor with its local expert ids",
                    final[m.fqn].source.where,
                    f"add `{generic_path(m.fqn)}.{name}: grouped_gemm` to ep_plan",
                    pfqn,
                )
            elif mode == "tp" and name in ("gate_up_proj", "up_proj", "down_proj") and (
                r is None or r.style not in TP_SHARDING
            ):
                want = "rowwise" if name == "down_proj" else ("packed_colwise" if name == "gate_up_proj" else "colwise")
                self.problems.add(
                    EXPERTS_PARTIAL,
                    f"{name} of tensor-parallel experts (moe_tp_experts) is not sharded: the all-reduced output "
                    "would count every expert tp_size times",
                    final[m.fqn].source.where,
                    f"add `{generic_path(m.fqn)}.{name}: {want}` to tp_plan",
                    pfqn,
                )
            elif mode != "ep" and r is not None and r.style == "grouped_gemm" and self.active["ep"]:
                self.problems.add(
                    EXPERTS_PARTIAL,
                    f"{name} is sharded by expert (grouped_gemm) but its experts module has no "
                    "`ep_dispatch_experts`: the forward would run local experts with global ids",
                    r.source.where,
                    f"add `{generic_path(m.fqn)}: ep_dispatch_experts` to ep_plan",
                    pfqn,
                )

    def check_megamoe(self, m) -> None:
        info, settings = m.experts, self.plan.experts.megamoe
        impl_where = _where(self.loaded, ("experts", "implementation"))
        if not info.has_gate or info.is_transposed:
            why = "have no gate (up_proj only)" if not info.has_gate else "store their weights transposed ([E, H, 2I])"
            self.problems.add(
                MEGAMOE_NO_GATE,
                f"Mega MoE computes SwiGLU over [gate | up] rows of gate_up_proj [E, 2I, H]; these experts "
                f"({m.class_name}) {why}",
                impl_where,
                "use `implementation: grouped_mm` for this model; deepgemm_megamoe needs gated, untransposed experts",
                m.fqn,
            )
        if info.top_k is not None and info.top_k > MEGAMOE_MAX_TOP_K:
            self.problems.add(
                MEGAMOE_TOP_K,
                f"Mega MoE supports top-k <= {MEGAMOE_MAX_TOP_K}, this model routes each token to {info.top_k} experts",
                impl_where,
                "use `implementation: grouped_mm` for this model",
                m.fqn,
            )
        if self.ep > MEGAMOE_MAX_RANKS:
            self.problems.add(
                MEGAMOE_EP_SIZE,
                f"Mega MoE reaches peers over one NVLink domain of at most {MEGAMOE_MAX_RANKS} ranks, "
                f"ep_size is {self.ep}",
                _where(self.loaded, ("parallel", "ep_size")),
                f"set ep_size <= {MEGAMOE_MAX_RANKS}",
            )
        self.check_megamoe_activation(m, impl_where)
        backend = settings.backend if settings else "auto"
        h, i = info.hidden_size, info.intermediate_size
        backend_where = _where(self.loaded, ("experts", "megamoe", "backend"))
        if h is not None and i is not None and backend in ("deep_gemm", "auto"):
            bad = [f"{n} {v}" for n, v in (("hidden", h), ("intermediate", i)) if v % 128]
            blocks = [f"{n} {v}" for n, v in (("hidden", h), ("intermediate", i)) if v % MEGAMOE_KERNEL_BLOCK]
            if bad and backend == "deep_gemm":
                self.problems.add(
                    MEGAMOE_SIZES,
                    f"the deep_gemm Mega MoE kernel needs hidden and intermediate sizes divisible by 128, "
                    f"got {', '.join(bad)}",
                    backend_where,
                    "write `megamoe: {backend: triton}` (FP4 kept packed) or `{backend: reference}` (PyTorch), "
                    "or use `implementation: grouped_mm`",
                    m.fqn,
                )
            elif blocks and backend == "deep_gemm":
                self.problems.add(
                    MEGAMOE_KERNEL_BLOCKS,
                    f"the deep_gemm Mega MoE kernel passes its host checks (% 128) but not its block alignment: "
                    f"hidden / 128 must be even and, at decode-sized batches (BLOCK_K {MEGAMOE_KERNEL_BLOCK}), "
                    f"intermediate % {MEGAMOE_KERNEL_BLOCK} == 0; got {', '.join(blocks)}",
                    backend_where,
                    "write `megamoe: {backend: triton}` (FP4 kept packed) or `{backend: reference}`",
                    m.fqn,
                )
            elif blocks:
                self.warnings.append(
                    CompileWarning(
                        MEGAMOE_ALIGNMENT,
                        f"{generic_path(m.fqn)}: hidden {h} / intermediate {i} are not multiples of "
                        f"{MEGAMOE_KERNEL_BLOCK}, which the deep_gemm kernel needs: backend `auto` runs the Triton "
                        "backend (or the reference) even on SM100",
                        "write `megamoe: {backend: triton}` to say so",
                        backend_where,
                    )
                )
        quantize = settings.quantize if settings else "none"
        if not info.is_fp4 and quantize == "none":
            self.problems.add(
                MEGAMOE_NOT_FP4,
                f"Mega MoE runs FP8 x FP4 experts, but gate_up_proj of these experts is "
                f"{self.walk.params[m.params[0]].dtype}, not FP4 (int8-packed), and megamoe.quantize is none",
                _where(self.loaded, ("experts", "megamoe")),
                "write `megamoe: {quantize: fp4}` to quantize the experts when the plan is applied, or load an "
                "FP4 checkpoint",
                m.fqn,
            )

    def check_megamoe_activation(self, m, where) -> None:
        """Every Mega MoE backend computes the kernel's SiLU SwiGLU (with the `swiglu_limit` clamp) and nothing else."""
        config = self.walk.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None)
        reasons = []
        if act is not None and str(act).lower() not in ("silu", "swish"):
            reasons.append(f"hidden_act is {act!r}")
        for name in MEGAMOE_OTHER_ACTIVATION_FIELDS:
            if getattr(text, name, None) is not None:
                reasons.append(f"{name} is {getattr(text, name)!r}")
        if reasons:
            self.problems.add(
                MEGAMOE_ACTIVATION,
                f"Mega MoE computes SiLU SwiGLU (clamped by swiglu_limit) and nothing else, but this model's config "
                f"sets {', '.join(reasons)}: the experts would compute a different function",
                where,
                "use `implementation: grouped_mm` for this model",
                m.fqn,
            )

    # ---- bytes and warnings -------------------------------------------------------------------

    def account(self, final: dict[str, _Rule]):
        walk, tp, ep = self.walk, self.tp, self.ep
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
                if r.style == "grouped_gemm":
                    div = ep
                elif _shard_dim(r.style, p.shape) is not None:
                    div = tp
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

    def coverage(self, assignments: list[Assignment], per_rule_bytes) -> list[RuleCoverage]:
        counts: dict[int, list[int]] = {r.index: [0, 0] for r in self.rules}
        examples: dict[int, str] = {}
        by_source = {id(r.source): r for r in self.rules}
        for a in assignments:
            r = by_source[id(a.rule)]
            counts[r.index][0 if a.target == "module" else 1] += 1
            examples.setdefault(r.index, a.fqn)
        out = []
        for r in self.rules:
            active = self.active[r.kind]
            if active:
                mods, params = counts[r.index]
                total, per_rank = per_rule_bytes.get(r.index, (0, 0))
            else:  # inactive table: report what it matched, it installs nothing
                mods = sum(1 for f in r.targets if f in self.walk.modules)
                params = len(r.targets) - mods
                total = per_rank = sum(self.walk.params[f].nbytes for f in r.targets if f in self.walk.params)
            example = examples.get(r.index) or (min(r.targets, key=len) if r.targets else None)
            out.append(RuleCoverage(r.source, mods, params, total, per_rank, active, example))
        return out

    def table_warnings(self, replicated_groups) -> None:
        for kind, table in (("tp", "tp_plan"), ("ep", "ep_plan")):
            if not self.active[kind] and getattr(self.plan, table):
                self.warnings.append(
                    CompileWarning(
                        TABLE_INACTIVE,
                        f"{table} is not applied: {kind}_size is 1 (its rules were checked against the model)",
                        f"set `parallel.{kind}_size` > 1 to apply it, or delete the table",
                        _where(self.loaded, (table,)),
                    )
                )
        if not (self.active["tp"] or self.active["ep"]):
            return
        for g in replicated_groups:
            self.warnings.append(
                CompileWarning(
                    REPLICATED_DENSE,
                    f"{g.path}: {g.parameters} parameter(s) in {g.modules} module(s) stay replicated, "
                    f"{human_bytes(g.bytes_per_rank, digits=1)} per rank",
                    "often intended for norms, routers and small layers; add a tp_plan rule to shard large ones",
                    g.path,
                )
            )

    # ---- driver --------------------------------------------------------------------------------

    def run(self) -> CompiledPlan:
        self.check_model_type()
        self.check_sizes()
        self.collect_rules()
        self.match_rules()
        maps = self.table_maps()
        ep_experts = self.find_ep_experts(maps)
        assignments, final = self.expand(maps, ep_experts)
        self.check_tied(final)
        self.check_shards(assignments, final)
        strategy = self.resolve_strategy(ep_experts)
        experts = self.experts_assignments(final, strategy)
        total, sharded, replicated, per_rule_bytes, replicated_groups = self.account(final)
        if self.problems:
            raise CompileError(self.problems.build())
        self.table_warnings(replicated_groups)
        return CompiledPlan(
            model_type=self.walk.model_type or self.plan.model.type,
            model_class=self.walk.model_class,
            parallel=self.parallel,
            experts_settings=self.plan.experts,
            assignments=tuple(assignments),
            experts=tuple(experts),
            coverage=tuple(self.coverage(assignments, per_rule_bytes)),
            bytes_sharded_per_rank=sharded,
            bytes_replicated_per_rank=replicated,
            warnings=tuple(self.warnings),
            plan_name=self.plan.name,
            plan_path=self.loaded.path,
            bytes_total=total,
            replicated=replicated_groups,
        )


def _match_alt(alt: tuple, segs: list) -> bool:
    return len(alt) == len(segs) and all(a == "*" or a == s for a, s in zip(alt, segs))


def _match_generic(alt: tuple, gsegs: list, fqns: list) -> list:
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


def _head_dim(config) -> Optional[int]:
    hd = getattr(config, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 128) + 1) if n % d == 0]


def compile_plan(plan, model) -> CompiledPlan:
    """Resolve `plan` (path, YAML text, mapping, Plan or LoadedPlan) against `model`; never changes the model.

    Raises CompileError listing every problem found (each with module path, plan position and hint).
    """
    loaded = _load(plan)
    return _Resolver(loaded, walk_model(model)).run()
