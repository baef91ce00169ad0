"""The layout pass: follow the activation layout through each block and refuse chains that cannot compute.

Every TP module style declares the layout it takes and gives (`planc.spec.styles`: colwise takes a
replicated input and leaves its output sharded, rowwise takes a sharded input and all-reduces). A
module without a TP style computes on whole tensors: it takes and gives replicated activations. So
a plan computes only when every sharded output is consumed by a module that takes a sharded input,
and every sharded input comes from a sharded output:

    embed_tokens ─R─▶ q/k/v_proj ─S─▶ attention ─S─▶ o_proj ─R─▶ residual ─R─▶ gate/up_proj ─S─▶ down_proj ─R─▶ ... ─▶ lm_head ─R─▶ logits

Which module feeds which inside a block is not in the module tree. It is read, per container module,
from what transformers declares for the model (the config class's `base_model_tp_plan` pairs each
colwise producer with the rowwise consumer of the same container), and from the names every family
shares (q/k/v_proj -> o_proj, gate/up_proj -> down_proj); each diagnostic says which one it assumed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from planc.compiler.context import PlanRule, Resolution
from planc.compiler.compiled import Assignment
from planc.compiler.walk import ModelWalk, config_attr, generic_path
from planc.spec.styles import REPLICATED, SHARDED, STYLE, STYLES, Style
from planc.compiler import rule_examples as ex
from planc.lint.registry import compile_rule

# Producer leaf names -> the consumer that takes their (sharded) outputs, in the same container module.

LAYOUT_SHARDED_INTO_REPLICATED = compile_rule(
    "PLC630", "sharded-output-consumed-whole",
    "a sharded output consumed by a module that expects a whole input",
    "A `colwise` module leaves each rank a slice of its output features. Only a `rowwise` consumer takes that "
    "slice; any other module (o_proj with no rule, the residual stream, a router) would compute on a slice as "
    "if it were the whole tensor, or fail with mismatched shapes. Which module feeds which is read from "
    "transformers' `base_model_tp_plan` and from the shared names (q/k/v_proj -> o_proj, gate/up_proj -> "
    "down_proj); the message says which.",
    ex.TOP + "tp_plan:\n  model.layers.*.self_attn.{q,k,v}_proj: colwise\n" + ex.EP, ex.GOOD, family="layout",
)
LAYOUT_ROWWISE_WITHOUT_SHARDED = compile_rule(
    "PLC631", "rowwise-without-sharded-input", "a `rowwise` whose producers leave their outputs whole",
    "`rowwise` expects its input already split over the last dim (after a `colwise`). With whole inputs, write "
    "`rowwise_split_input`, which slices the input itself, or make the producers colwise.",
    ex.TOP + "tp_plan:\n  model.layers.*.self_attn.o_proj: rowwise\n" + ex.EP, ex.GOOD, family="layout",
)
LAYOUT_OUTPUT_LEFT_SHARDED = compile_rule(
    "PLC632", "lm-head-left-sharded", "an lm_head whose output is left sharded",
    "With `lm_head: colwise` each rank gets 1/tp of the logits: `generate` picks different tokens on each "
    "rank and a loss with labels fails. `colwise_gather_output` gathers them.",
    ex.TOP + "tp_plan:\n" + ex.ATTN + "  lm_head: colwise\n" + ex.EP, ex.GOOD, family="layout",
)
LAYOUT_NORM_OVER_SHARDED = compile_rule(
    "PLC633", "norm-over-sharded-dim", "a norm over a dimension the plan shards",
    "A norm over the whole projected width (OLMoE's q_norm/k_norm, MLA's q_a_layernorm) would normalize each "
    "rank's slice as if it were the whole. Gather first (`colwise_gather_output` + `rowwise_split_input`, "
    "transformers' own OLMoE plan) or leave the projection whole. Per-head norms (Qwen3) are fine.",
    "version: 1\nmodel: {type: deepseek_v3}\nparallel: {tp_size: 2, ep_size: 2}\ntp_plan:\n"
    "  model.layers.*.self_attn.q_a_proj: colwise\n" + ex.EP,
    "version: 1\nmodel: {type: deepseek_v3}\nparallel: {tp_size: 2, ep_size: 2}\ntp_plan:\n"
    "  model.layers.*.mlp.shared_experts.{gate,up}_proj: colwise\n  model.layers.*.mlp.shared_experts.down_proj: rowwise\n"
    "  model.layers.*.mlp.{gate,up}_proj: colwise\n  model.layers.*.mlp.down_proj: rowwise\n" + ex.EP,
    family="layout",
)
LAYOUT_PRODUCERS_DISAGREE = compile_rule(
    "PLC634", "producers-disagree", "modules that feed one consumer leave different layouts",
    "o_proj combines q, k and v (down_proj combines gate and up): either all of them are colwise, with a "
    "rowwise consumer, or none is. The producers of a chain transformers declares include those with a "
    "style planc does not install (`unit_colwise`), whose layouts the style table still gives.",
    ex.TOP + "tp_plan:\n  model.layers.*.self_attn.q_proj: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n" + ex.EP,
    ex.GOOD, family="layout",
)
LAYOUT_MODULE_PARAM_CONFLICT = compile_rule(
    "PLC635", "module-rule-contradicts-parameter-rule",
    "a module rule and a rule on one of its parameters split it differently",
    "A module style also shards its own parameters; a parameter rule that splits one of them another way hands "
    "the module's forward a weight of the wrong shape (`mat1 and mat2 shapes cannot be multiplied`).",
    ex.TOP + "tp_plan:\n" + ex.ATTN + ex.HEAD + "  lm_head.weight: rowwise\n" + ex.EP, ex.GOOD, family="layout",
)


LAYOUT_PARTIAL_GRADIENT = compile_rule(
    "PLC636", "whole-parameter-partial-gradient",
    "a parameter kept whole on every rank that only each rank's heads use, its gradient not all-reduced",
    "Once a `colwise` rule splits the heads, a parameter every rank keeps whole but uses only on its own heads "
    "gets a partial gradient on each rank: a per-head norm's weight (Qwen3's q_norm/k_norm) sums over the "
    "heads, MLA's shared rope key (the last slice of kv_a_proj_with_mqa's output) feeds every head. Each rank "
    "would step with a different, partial gradient while the forward and the loss stay right. "
    "`replicated_with_grad_allreduce` all-reduces the norm's gradient, `mla_kv_a_proj` the rope slice's; "
    "serving is unchanged (the all-reduce runs in backward only).",
    "version: 1\nmodel: {type: deepseek_v3}\nparallel: {tp_size: 2, ep_size: 2}\ntp_plan:\n"
    "  model.layers.*.self_attn.{q_b_proj,kv_b_proj}: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n" + ex.EP,
    "version: 1\nmodel: {type: deepseek_v3}\nparallel: {tp_size: 2, ep_size: 2}\ntp_plan:\n"
    "  model.layers.*.self_attn.{q_b_proj,kv_b_proj}: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n"
    "  model.layers.*.self_attn.kv_a_proj_with_mqa: mla_kv_a_proj\n" + ex.EP,
    family="layout",
)

_SINKS_WHOLE_HEADS = (
    "version: 1\nmodel: {type: granitemoe_swa}\nparallel: {tp_size: 2}\ntp_plan:\n"
    "  model.layers.*.self_attn.o_proj: rowwise_split_input\n"
    "  model.layers.*.self_attn.sinks: colwise\n  model.layers.*.self_attn: local_params\n"
    "  model.layers.*.block_sparse_moe.experts.gate_up_proj: packed_colwise\n"
    "  model.layers.*.block_sparse_moe.experts.down_proj: rowwise\n"
    "  model.layers.*.block_sparse_moe.experts: moe_tp_experts\n"
)
LAYOUT_PER_HEAD_SPLIT_HEADS_WHOLE = compile_rule(
    "PLC637", "per-head-parameter-split-heads-whole",
    "a per-head parameter split over the TP ranks while its module's heads stay whole",
    "`local_params` runs a module (an attention) on the local shards of its own per-head parameters (attention "
    "sinks), which holds only when a `colwise` rule on its projections splits the heads the same way. With the "
    "heads whole on every rank, each rank would meet all the heads with 1/tp of the sinks (a shape error at the "
    "first call, or a silent broadcast). Split the heads (`colwise` q/k/v, `rowwise` o_proj) where their counts "
    "divide by tp_size, or keep the per-head parameter whole.",
    _SINKS_WHOLE_HEADS,
    "version: 1\nmodel: {type: granitemoe_swa}\nparallel: {tp_size: 2}\ntp_plan:\n"
    "  model.layers.*.block_sparse_moe.experts.gate_up_proj: packed_colwise\n"
    "  model.layers.*.block_sparse_moe.experts.down_proj: rowwise\n"
    "  model.layers.*.block_sparse_moe.experts: moe_tp_experts\n",
    family="layout",
)

NAMED_CHAINS: tuple[tuple[frozenset[str], str], ...] = (
    (frozenset({"q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj"}), "o_proj"),
    (frozenset({"gate_proj", "up_proj"}), "down_proj"),
    (frozenset({"gate_up_proj"}), "down_proj"),
    (frozenset({"w1", "w3"}), "w2"),
)
# A projection whose output a norm of the same container normalizes before the next projection (MLA).
NORMED_OUTPUTS = {"q_a_proj": "q_a_layernorm", "kv_a_proj_with_mqa": "kv_a_layernorm"}
MODEL_OUTPUTS = ("lm_head", "embed_out")


@dataclass(frozen=True)
class Chain:
    """In `container` (a generic path), the outputs of `producers` feed `consumer`; `source` says who says so."""

    container: str
    producers: frozenset[str]
    consumer: str
    source: str


# module fqn -> the tp_plan rule that gives it a module style
ModuleRules = dict[str, PlanRule]


def _style(rule: Optional[PlanRule]) -> Optional[Style]:
    return STYLE.get(rule.style) if rule is not None else None


def _takes(spec: Optional[Style]) -> str:
    return spec.input if spec is not None and spec.input else REPLICATED


def _gives(spec: Optional[Style]) -> str:
    return spec.output if spec is not None and spec.output else REPLICATED


def _described(spec: Optional[Style]) -> str:
    return f"`{spec.name}`" if spec is not None else "no TP rule"


def declared_chains(walk: ModelWalk) -> list[Chain]:
    """The producer -> consumer pairs transformers declares for this model (`base_model_tp_plan`)."""
    plans = []
    for config in _configs(walk.config):  # a multimodal model: its language model's config declares the plan
        plan = getattr(type(config), "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
        if isinstance(plan, dict) and plan:
            plans.append((f"transformers' {type(config).__name__}.base_model_tp_plan", plan))
    out: list[Chain] = []
    for name, plan in plans:
        out += [c for c in _declared_chains(walk, name, plan) if all(o.container != c.container for o in out)]
    return out


def _configs(config: Any, depth: int = 0) -> list[Any]:
    """`config` and every sub-config under it (text_config, vision_config, thinker_config.text_config...)."""
    if config is None or depth > 3:
        return []
    out = [config]
    for attr in getattr(type(config), "sub_configs", None) or {}:
        out += _configs(getattr(config, attr, None), depth + 1)
    return out


def _declared_chains(walk: ModelWalk, name: str, plan: dict[str, str]) -> list[Chain]:
    by_container: dict[str, tuple[set[str], set[str]]] = {}
    for key, style_name in plan.items():
        spec = STYLE.get(style_name)
        if spec is None or spec.target != "module" or not isinstance(key, str):
            continue
        for g in walk.by_generic:
            if g == key or g.endswith("." + key):
                container, _, leaf = g.rpartition(".")
                if g not in walk.modules and not any(f in walk.modules for f in walk.by_generic[g]):
                    continue  # a parameter (experts' gate_up_proj): not a module boundary
                prods, cons = by_container.setdefault(container, (set(), set()))
                if spec.output == SHARDED:
                    prods.add(leaf)
                elif spec.input == SHARDED:
                    cons.add(leaf)
    out = []
    for container, (prods, cons) in by_container.items():
        if prods and len(cons) == 1:
            out.append(Chain(container, frozenset(prods), next(iter(cons)), name))
    return out


class _Blocks:
    """The model's containers and their children by leaf name, with the chains that hold in each."""

    def __init__(self, walk: ModelWalk) -> None:
        self.children: dict[str, dict[str, str]] = {}
        for fqn in walk.modules:
            if fqn:
                parent, _, leaf = fqn.rpartition(".")
                self.children.setdefault(parent, {})[leaf] = fqn
        self.declared = {c.container: c for c in declared_chains(walk)}

    def chains(self, container: str) -> list[Chain]:
        kids = self.children.get(container, {})
        generic = generic_path(container)
        out = []
        declared = self.declared.get(generic)
        # a declared chain holds in the containers that have its consumer and a producer: a generic path can hold
        # blocks of different classes (glm5_next: linear attention in some layers, MLA in others, both `self_attn`)
        if declared is not None and declared.consumer in kids and declared.producers & set(kids):
            out.append(declared)
        for producers, consumer in NAMED_CHAINS:
            present = producers & set(kids)
            if present and consumer in kids and not any(c.consumer == consumer for c in out):
                out.append(Chain(generic, frozenset(present), consumer,
                                 f"the module names ({', '.join(sorted(present))} feed {consumer})"))
        return out


def check_layouts(c: Resolution, assignments: list[Assignment], final: dict[str, PlanRule]) -> None:
    """Refuse every module style whose neighbours cannot take or give the layout it needs."""
    if not c.active["tp"]:
        return
    walk = c.walk
    module_rule = {a.fqn: final[a.fqn] for a in assignments if a.target == "module" and a.table == "tp"}
    _check_module_vs_parameters(c, assignments, final, module_rule)
    _check_split_per_head_parameters(c, assignments, final, module_rule)
    blocks = _Blocks(walk)
    explained: set[str] = set()  # modules already reported as part of a chain
    for container in blocks.children:
        for chain in blocks.chains(container):
            explained |= _check_chain(c, blocks, container, chain, module_rule)
    for fqn, rule in module_rule.items():
        spec = _style(rule)
        if spec is None or fqn in explained:
            continue
        parent, _, leaf = fqn.rpartition(".")
        if spec.output == SHARDED and _consumes_shards_inside(_style(module_rule.get(parent))):
            continue  # a per-head gate inside a `local_params` attention: its forward takes the local heads
        if spec.output == SHARDED:
            if leaf in MODEL_OUTPUTS:
                c.problems.add(
                    LAYOUT_OUTPUT_LEFT_SHARDED,
                    f"`{spec.name}` leaves the output of {leaf} sharded: each rank would get 1/{c.tp} of the logits "
                    "(generate picks different tokens on each rank, a loss with labels fails)",
                    rule.source.where,
                    f"write `{rule.pattern_text}: colwise_gather_output` (the logits are gathered on every rank)",
                    fqn,
                )
                continue
            normed = NORMED_OUTPUTS.get(leaf)
            if normed and normed in blocks.children.get(parent, {}):
                c.problems.add(
                    LAYOUT_NORM_OVER_SHARDED,
                    f"`{spec.name}` shards the output of {leaf}, which {normed} then normalizes over its whole "
                    f"width: each rank would normalize over 1/{c.tp} of the features (data flow assumed from the "
                    f"module names: {leaf} feeds {normed})",
                    rule.source.where,
                    f"write `replicate` for `{rule.pattern_text}` (as transformers' plans leave it), or "
                    "`colwise_gather_output`",
                    fqn,
                )
                continue
            c.problems.add(
                LAYOUT_SHARDED_INTO_REPLICATED,
                f"`{spec.name}` leaves the output of {leaf} sharded, but no module after it takes a sharded "
                f"input (no rowwise consumer is known for {leaf} in {generic_path(parent) or 'the model'}): the "
                "next module would compute on 1/" + f"{c.tp} of the features",
                rule.source.where,
                f"write `{rule.pattern_text}: colwise_gather_output`, or `replicate`",
                fqn,
            )
        elif spec.input == SHARDED:
            c.problems.add(
                LAYOUT_ROWWISE_WITHOUT_SHARDED,
                f"`{spec.name}` expects the input of {leaf} sharded over the last dim, but no module before it "
                f"leaves a sharded output (no colwise producer is known for {leaf} in "
                f"{generic_path(parent) or 'the model'})",
                rule.source.where,
                f"write `{rule.pattern_text}: rowwise_split_input` (it slices the replicated input itself)",
                fqn,
            )


def _consumes_shards_inside(spec: Optional[Style]) -> bool:
    """A container style (`local_params`) whose forward runs on local shards and whose children do the
    communication: a sharded child output consumed inside its forward is this rank's heads, as intended."""
    return spec is not None and spec.local_forward and not spec.shards and spec.output is None


def _check_chain(c: Resolution, blocks: _Blocks, container: str, chain: Chain, module_rule: ModuleRules) -> set[str]:
    """Check one producer -> consumer chain in one container; returns the fqns it accounted for."""
    kids = blocks.children[container]
    consumer_fqn = kids[chain.consumer]
    consumer_rule = module_rule.get(consumer_fqn)
    consumer = _style(consumer_rule)
    producers = {leaf: fqn for leaf, fqn in kids.items() if leaf in chain.producers}  # in module order
    gives = {leaf: _gives(_style(module_rule.get(f))) for leaf, f in producers.items()}
    sharded = [leaf for leaf, g in gives.items() if g == SHARDED]
    assumed = f"data flow assumed from {chain.source}"
    names = "/".join(producers)
    if not sharded and _takes(consumer) == REPLICATED:
        return set()  # nothing sharded crosses this chain; the consumer's own output is checked on its own
    explained = set(producers.values()) | {consumer_fqn}
    if sharded and len(sharded) != len(producers):
        first = producers[sharded[0]]
        whole = [leaf for leaf in producers if leaf not in sharded]
        c.problems.add(
            LAYOUT_PRODUCERS_DISAGREE,
            f"{', '.join(sharded)} leave their outputs sharded but {', '.join(whole)} give whole ones; {chain.consumer} "
            f"combines all of them, so their layouts must agree ({assumed})",
            module_rule[first].source.where,
            f"give {names} one style: all `colwise` (with `{chain.consumer}: rowwise`), or none",
            first,
        )
        return explained
    if sharded and _takes(consumer) != SHARDED:
        first = producers[sharded[0]]
        c.problems.add(
            LAYOUT_SHARDED_INTO_REPLICATED,
            f"{names} leave their outputs sharded, but {chain.consumer} ({_described(consumer)}) expects a whole "
            f"input: the first forward fails with mismatched shapes ({assumed})",
            (consumer_rule or module_rule[first]).source.where,
            f"add `{generic_path(consumer_fqn)}: rowwise` to tp_plan",
            consumer_fqn,
        )
    elif not sharded and _takes(consumer) == SHARDED:
        assert consumer_rule is not None  # a style that takes a sharded input has a rule
        where, narrow = _mixed_blocks(c, container, consumer_rule.pattern_text)
        c.problems.add(
            LAYOUT_ROWWISE_WITHOUT_SHARDED,
            f"{_described(consumer)} on {chain.consumer}{where} expects its input sharded, but {names} leave their outputs "
            f"whole (no colwise rule): the first forward fails with mismatched shapes ({assumed})",
            consumer_rule.source.where,
            f"add `{generic_path(container)}.{{{','.join(producers)}}}: colwise` to tp_plan, or write "
            f"`{consumer_rule.pattern_text}: rowwise_split_input`{narrow}",
            consumer_fqn,
        )
    elif sharded:
        _check_norms(c, blocks, container, producers, module_rule, assumed)
        _check_partial_gradients(c, blocks, container, producers, sharded[0], module_rule, assumed)
    if _gives(consumer) == SHARDED:
        assert consumer_rule is not None  # a style that gives a sharded output has a rule
        c.problems.add(
            LAYOUT_SHARDED_INTO_REPLICATED,
            f"{_described(consumer)} leaves the output of {chain.consumer} sharded, but it goes back to the residual "
            f"stream, which every module of the next block reads whole ({assumed})",
            consumer_rule.source.where,
            f"write `{consumer_rule.pattern_text}: rowwise`",
            consumer_fqn,
        )
    return explained


_NARROW = "; or keep the rule for the other blocks only: `{}`"
_NARROWED = re.compile(re.escape(_NARROW.split("`")[0]) + r"`([^`]+)`")


def narrowed_pattern(hint: str) -> Optional[str]:
    """The pattern a layout hint suggests in place of a rule that suits only some of the blocks it matches (what
    `_mixed_blocks` writes), or None; `planc init` takes it to keep such a rule for the layers it suits."""
    m = _NARROWED.search(hint or "")
    return m.group(1) if m else None


def _mixed_blocks(c: Resolution, container: str, pattern: str) -> tuple[str, str]:
    """(" (in Cls, ...)", "; or ...narrowed pattern") when the generic path of `container` holds blocks of more
    than one class (glm5_next's `layers.*.self_attn`: linear attention in some layers, MLA in others): one rule on
    all of them is right for one class only, and the hint names the layers of the others."""
    walk = c.walk
    generic = generic_path(container)
    cls = walk.modules[container].class_name
    others: dict[str, list[Optional[str]]] = {}
    for fqn in walk.by_generic.get(generic, ()):
        info = walk.modules.get(fqn)
        if info is not None and info.class_name != cls:
            index = next((seg for seg in fqn.split(".") if seg.isdigit()), None)
            others.setdefault(info.class_name, []).append(index)
    if not others:
        return "", ""
    where = (f" (in the {cls} blocks of {generic}; its other layers are "
             f"{', '.join(sorted(others))}, which this rule may suit)")
    indices = sorted({i for ids in others.values() for i in ids if i is not None}, key=int)
    narrow = ""
    if indices and "*" in pattern:
        layers = indices[0] if len(indices) == 1 else "{" + ",".join(indices) + "}"
        narrow = _NARROW.format(pattern.replace("*", layers, 1))
    return where, narrow


def _check_norms(
    c: Resolution, blocks: _Blocks, container: str, producers: dict[str, str], module_rule: ModuleRules, assumed: str
) -> None:
    """A norm in the container whose weight spans a producer's whole (now sharded) output would normalize
    each rank's slice as if it were the whole (OLMoE's q_norm over all heads; Qwen3's per-head q_norm is fine)."""
    walk = c.walk
    widths = {}
    for leaf, fqn in producers.items():
        w = walk.params.get(f"{fqn}.weight")
        if w is not None and len(w.shape) == 2:
            widths[leaf] = w.shape[0]
    for leaf, fqn in blocks.children[container].items():
        if "norm" not in leaf.lower():
            continue
        w = walk.params.get(f"{fqn}.weight")
        if w is None or len(w.shape) != 1:
            continue
        over = [p for p, width in widths.items() if width == w.shape[0] and width % c.tp == 0]
        head_dim = config_attr(walk.config, "head_dim")
        if over and w.shape[0] != head_dim:
            c.problems.add(
                LAYOUT_NORM_OVER_SHARDED,
                f"{leaf} normalizes over all {w.shape[0]} features of {over[0]}'s output, which the plan shards "
                f"over {c.tp} ranks: each rank would normalize its slice as if it were the whole ({assumed})",
                module_rule[producers[over[0]]].source.where,
                f"gather before the norm: `{generic_path(container)}.{{{','.join(producers)}}}: colwise_gather_output` "
                "and `o_proj: rowwise_split_input` (transformers' own plan for such models), or replicate attention",
                fqn,
            )


# A module that stays whole in a container whose heads are split, whose gradient each rank holds only in part, and
# the grad-reducing kind of style it needs (`Style.grad_allreduce`): MLA's kv_a_proj_with_mqa, whose rope slice every
# head reads; per-head norms are found by their width (`_check_partial_gradients`).
SHARED_BY_HEADS = {"kv_a_proj_with_mqa": "mla_rope"}
_ADD_RULE = "add `{}: {}` to tp_plan"
_ADDED_RULE = re.compile(r"add `([^`:]+): ([a-z_]+)` to tp_plan")


def added_rule(hint: str) -> Optional[tuple[str, str]]:
    """The (pattern, style) a PLC636 hint asks to add, or None; `planc init` adds it to the plan it writes."""
    m = _ADDED_RULE.search(hint or "")
    return (m.group(1), m.group(2)) if m else None


def _check_partial_gradients(
    c: Resolution, blocks: _Blocks, container: str, producers: dict[str, str], first: str, module_rule: ModuleRules,
    assumed: str,
) -> None:
    """Modules of a container whose heads the plan splits that keep their parameters whole, although each rank
    uses them on its own heads only (a per-head norm, MLA's shared rope key): without a style that all-reduces
    their gradients, each rank's gradient is partial (the forward is right, training is not)."""
    walk = c.walk
    weights = [w.shape for f in producers.values() if (w := walk.params.get(f"{f}.weight")) is not None and len(w.shape) == 2]
    for leaf, fqn in blocks.children[container].items():
        need = SHARED_BY_HEADS.get(leaf)
        if need is None and "norm" in leaf.lower():
            w = walk.params.get(f"{fqn}.weight")
            # per head: its width divides every projection's output (heads x head_dim) and is less than each (a
            # norm over all of q's or k's heads, OLMoE's, is as wide as one of them: PLC633's); a norm as wide as a
            # projection's input normalizes that whole input before it (MLA's q_a_layernorm): not per head
            n = w.shape[0] if w is not None and len(w.shape) == 1 else None
            if n and weights and all(i != n for _, i in weights) and all(o > n and o % n == 0 for o, _ in weights):
                need = "all"
        if need is None:
            continue
        rule = module_rule.get(fqn)
        spec = _style(rule)
        if spec is not None and (spec.grad_allreduce == need or spec.shards):
            continue  # reduced, or sharded (then the layout checks above speak for it)
        style = next(s.name for s in STYLES if s.grad_allreduce == need)  # planc's own row for it
        what = ("its weight is applied to every head" if need == "all"
                else "the rope key in the last slice of its output is read by every head")
        c.problems.add(
            LAYOUT_PARTIAL_GRADIENT,
            f"{leaf} stays whole on every rank ({_described(spec)}) and {what}, but the plan splits the heads over "
            f"{c.tp} ranks: each rank's backward gives only its own heads' part of {leaf}'s gradient, so the ranks "
            f"would step with different, partial gradients while the loss looks right ({assumed})",
            (rule or module_rule[producers[first]]).source.where,
            _ADD_RULE.format(generic_path(fqn), style) + " (it all-reduces the gradient in backward; serving is "
            "unchanged)" + (f", in place of `{rule.pattern_text}: {spec.name}`" if rule is not None and spec else ""),
            fqn,
        )


def _check_split_per_head_parameters(
    c: Resolution, assignments: list[Assignment], final: dict[str, PlanRule], module_rule: ModuleRules
) -> None:
    """A bare parameter split under a `local_params` module none of whose children splits its output: the
    per-head parameter is split while the heads it goes with stay whole on every rank."""
    walk = c.walk
    for a in assignments:
        spec = STYLE.get(a.style)
        if a.target != "parameter" or spec is None or spec.mesh != "tp" or not spec.shards:
            continue
        owner = walk.params[a.fqn].owner
        mspec = _style(module_rule.get(owner))
        if mspec is None or not mspec.local_forward or mspec.shards or mspec.experts_mode:
            continue
        inside = [_style(r) for f, r in module_rule.items() if f.startswith(owner + ".")]
        if any(s is not None and s.output == SHARDED for s in inside):
            continue
        rule = final[a.fqn]
        c.problems.add(
            LAYOUT_PER_HEAD_SPLIT_HEADS_WHOLE,
            f"`{a.style}` splits {a.fqn.rsplit('.', 1)[-1]} of {generic_path(owner)} over {c.tp} ranks, but no rule "
            f"splits that module's heads (none of its projections is `colwise`): each rank would meet every head "
            f"with 1/{c.tp} of {a.fqn.rsplit('.', 1)[-1]}",
            rule.source.where,
            f"delete `{rule.pattern_text}` (and `{generic_path(owner)}: local_params`) to keep it whole, or split the "
            f"heads with `colwise` on the projections of {generic_path(owner)} and `rowwise` on its output "
            "projection where the head counts divide by tp_size",
            a.fqn,
        )


def _check_module_vs_parameters(
    c: Resolution, assignments: list[Assignment], final: dict[str, PlanRule], module_rule: ModuleRules
) -> None:
    """A parameter rule that splits its tensor differently from its module's style: the module's forward
    would compute on a tensor laid out the way it does not expect."""
    walk = c.walk
    for a in assignments:
        if a.target != "parameter" or a.inherited:
            continue
        owner = walk.params[a.fqn].owner
        mrule = module_rule.get(owner)
        mspec = _style(mrule)
        pspec = STYLE.get(a.style)
        if mrule is None or mspec is None or pspec is None or mspec.experts_mode or (mspec.local_forward and not mspec.shards):
            continue  # experts styles and local_params/all_reduce leave each parameter to its own rule
        ndim = len(walk.params[a.fqn].shape)
        if (mspec.placement(ndim), mspec.packed, mspec.mesh) == (pspec.placement(ndim), pspec.packed, pspec.mesh):
            continue
        prule = final[a.fqn]
        c.problems.add(
            LAYOUT_MODULE_PARAM_CONFLICT,
            f"module rule `{mrule.pattern_text}: {mspec.name}` ({mrule.source.where}) and parameter rule "
            f"`{prule.pattern_text}: {pspec.name}` split {a.fqn.rsplit('.', 1)[-1]} differently "
            f"(dim {mspec.placement(ndim)} vs {pspec.placement(ndim)}): the module's forward would get a weight "
            "of the wrong shape",
            prule.source.where,
            f"delete `{prule.pattern_text}` (the module rule `{mspec.name}` already shards its parameters), or "
            "make the two rules name the same style",
            a.fqn,
        )
