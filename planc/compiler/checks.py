"""Model-aware checks: what the expanded plan does to this model that cannot run or loses work.

Each check reads the `Resolver` and reports through `c.problems` with the module path, the plan
position and what to write instead.
"""

from __future__ import annotations

from typing import Optional

from planc.compiler.compiled import Assignment, CompileWarning, ExpertsAssignment
from planc.compiler.context import *  # noqa: F403 - the problem codes
from planc.compiler.context import PlanRule, key_where
from planc.spec.ep import EPStrategy, resolve_ep
from planc.spec.megamoe import MEGAMOE_KERNEL_BLOCK
from planc.compiler.render import human_bytes
from planc.compiler.walk import generic_path
from planc.spec.sizes import check_sizes as _check_sizes
from planc.spec.styles import ALL_STYLES, EXPERTS_MODULE_STYLES, PARAMETER_STYLES, RUNTIME_STYLES, STYLE

MEGAMOE_MAX_TOP_K = 32
MEGAMOE_MAX_RANKS = 72
# Config fields of gated activations other than the kernel's SiLU SwiGLU (the clamp is `swiglu_limit`).
MEGAMOE_OTHER_ACTIVATION_FIELDS = ("swiglu_alpha", "mlp_gate_softcap", "mlp_up_softcap", "gate_softcap", "up_softcap")
ATTENTION_PROJ = {"q_proj": "out", "k_proj": "out", "v_proj": "out", "o_proj": "in"}



def check_model_type(c) -> None:
    want, have = c.plan.model.type, c.walk.model_type
    if have is not None and want != have:
        c.problems.add(
            MODEL_TYPE_MISMATCH,
            f"the plan is written for `model.type: {want}`, but this model's config.model_type is `{have}` "
            f"({c.walk.model_class})",
            key_where(c.loaded, ("model", "type")),
            f"write `model: {{type: {have}}}` if the rules fit this model, or compile the plan against a "
            f"`{want}` model",
        )


def check_sizes(c) -> None:
    """`planc.spec.sizes.check_sizes`, the function lint and the runtime call. Plans reach the compiler
    linted, so this only fires for a `LoadedPlan` built in code; the codes are lint's (PLC500-502)."""
    p = c.parallel
    for problem in _check_sizes(p.tp_size, p.ep_size, p.dp_size):
        c.problems.add(problem.code, problem.message, key_where(c.loaded, problem.key), problem.hint)


def check_style(c, rule: PlanRule) -> None:
    """A style lint accepts (current, in the right table) that planc's runtime does not install."""
    style = rule.style
    if style not in RUNTIME_STYLES:
        c.problems.add(
            STYLE_NOT_INSTALLABLE,
            f"planc's runtime does not install style `{style}` ({ALL_STYLES.get(style, 'unknown')}); transformers "
            "would, planc refuses instead of skipping it",
            rule.source.where,
            f"use one of the installable styles ({', '.join(sorted(RUNTIME_STYLES))}), or `replicate` to keep "
            "the module whole on every rank",
        )


def check_targets(c, rule: PlanRule) -> None:
    walk, style = c.walk, rule.style
    for fqn in rule.targets:
        if fqn in walk.params:
            owner = walk.modules[walk.params[fqn].owner]
            if style in EXPERTS_MODULE_STYLES:
                c.problems.add(
                    WRONG_TARGET,
                    f"`{style}` hooks an experts module's forward, but `{rule.pattern_text}` matches a parameter",
                    rule.source.where,
                    f"write `{style}` on the experts module (`{generic_path(owner.fqn)}`)",
                    fqn,
                )
            elif style in PARAMETER_STYLES and owner.experts is None and nested_expert_owner(walk, fqn) is None:
                c.problems.add(
                    WRONG_TARGET,
                    f"`{style}` shards the expert dimension, but `{generic_path(fqn)}` belongs to {owner.class_name}, "
                    "which is not an experts module",
                    rule.source.where,
                    "use `grouped_gemm` only on the parameters of experts modules (gate_up_proj, down_proj, ...) and "
                    "on per-expert tensors of modules inside them (leading dim = the experts count); dense layers "
                    "take TP styles in tp_plan",
                    fqn,
                )
        else:
            module = walk.modules[fqn]
            if style in PARAMETER_STYLES:
                names = ", ".join(p.rsplit(".", 1)[-1] for p in module.params) or "none"
                c.problems.add(
                    WRONG_TARGET,
                    f"`{style}` is a parameter style, but `{rule.pattern_text}` matches the module {generic_path(fqn)} "
                    f"({module.class_name})",
                    rule.source.where,
                    f"write one rule per parameter (`{rule.pattern_text}.{{...}}`; its parameters: {names}) and "
                    "`ep_dispatch_experts` on the module",
                    fqn,
                )
            elif style in EXPERTS_MODULE_STYLES and module.experts is None:
                c.problems.add(
                    WRONG_TARGET,
                    f"`{style}` needs an experts module (forward(hidden_states, top_k_index, top_k_weights) with "
                    f"gate_up_proj/down_proj), but {generic_path(fqn)} is a {module.class_name}",
                    rule.source.where,
                    "point the rule at the `experts` child of the MoE block, e.g. `model.layers.*.mlp.experts`",
                    fqn,
                )


def check_tied(c, final: dict[str, PlanRule]) -> None:
    by_tensor: dict[int, list[str]] = {}
    for p in c.walk.params.values():
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
        c.problems.add(
            CONFLICTING_RULES,
            f"tied parameters share one tensor but the plan treats them separately: {listing}",
            final[ruled[-1]].source.where,
            "a tied tensor stays whole: delete "
            + " and ".join(dict.fromkeys(f"`{final[f].pattern_text}`" for f in ruled))
            + ", or untie the weights (`tie_word_embeddings: false` in the config)",
            ruled[-1],
        )


def check_shards(c, assignments: list[Assignment], final: dict[str, PlanRule]) -> None:
    walk, tp = c.walk, c.tp
    if tp <= 1:
        return
    config_head_dim = _head_dim(walk.config)
    for a in assignments:
        spec = STYLE.get(a.style)
        if a.target != "parameter" or spec is None or spec.mesh != "tp":
            continue
        if block_scale_weight(walk, a.fqn) is not None:
            continue  # a block scale follows its weight: the weight's split is checked here, the grid by PLC625
        p = walk.params[a.fqn]
        dim = spec.placement(len(p.shape))
        if dim is None or not p.shape:
            continue
        packed = spec.packed
        size = p.shape[dim]
        parts = tp * (2 if packed else 1)
        where = final[a.fqn].source.where
        if size % parts:
            c.problems.add(
                UNEVEN_SHARD,
                f"`{a.style}` splits dim {dim} of {generic_path(p.fqn)} (size {size}) into {parts} "
                f"{'halves x ranks' if packed else 'ranks'}, which does not divide evenly",
                where,
                c.sizes_hint(f"pick a tp_size that divides {size // (2 if packed else 1)}, or write `replicate` "
                             "for this target"),
                a.fqn,
            )
            continue
        proj = p.owner.rsplit(".", 1)[-1]
        side = ATTENTION_PROJ.get(proj)
        splits_heads = (side == "out" and dim in (-2, 0)) or (side == "in" and dim == -1)
        local = size // tp
        head_dim = _proj_head_dim(walk, p.owner, proj, config_head_dim)
        if head_dim and splits_heads and local % head_dim:
            c.problems.add(
                HEAD_SPLIT,
                f"`{a.style}` gives each of the {tp} ranks {local} features of {generic_path(p.fqn)}, which is not a "
                f"whole number of heads (head_dim {head_dim}): attention would split a head across ranks",
                where,
                c.sizes_hint(f"use a tp_size that divides the head count ({size // head_dim} heads here), or "
                             "`replicate` attention"),
                a.fqn,
            )


BLOCK_SCALE_SUFFIX = "_scale_inv"


def block_scale_weight(walk, fqn: str) -> Optional[str]:
    """The weight a block-scale parameter belongs to (`q_proj.weight_scale_inv` -> `q_proj.weight`), else None."""
    if not fqn.endswith(BLOCK_SCALE_SUFFIX):
        return None
    weight = fqn[: -len(BLOCK_SCALE_SUFFIX)]
    return weight if weight in walk.params else None


def _block_size(config) -> Optional[tuple[int, int]]:
    q = getattr(config, "quantization_config", None)
    block = q.get("weight_block_size") if isinstance(q, dict) else getattr(q, "weight_block_size", None)
    if isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return int(block[0]), int(block[1])
    return None


def check_block_grid(c, assignments: list[Assignment], final: dict[str, PlanRule]) -> None:
    """PLC625: a block-scaled (FP8) weight whose TP shards do not start and end on its scale blocks.

    A weight `W` with a companion `W_scale_inv` holds one scale per `weight_block_size` block (128 x 128 in
    DeepSeek-V3). The scale is sharded with the weight on the same dim, so each rank's rows (or columns) of the
    weight must be whole blocks: a colwise shard of rows [r0, r1) uses scale rows [r0/128, r1/128).
    """
    walk, tp = c.walk, c.tp
    block = _block_size(walk.config)
    if tp <= 1 or block is None:
        return
    for a in assignments:
        spec = STYLE.get(a.style)
        if a.target != "parameter" or spec is None or spec.mesh != "tp" or a.fqn + BLOCK_SCALE_SUFFIX not in walk.params:
            continue
        p = walk.params[a.fqn]
        ndim = len(p.shape)
        dim = spec.placement(ndim) if ndim >= 2 else None
        if dim is None:
            continue
        axis = dim % ndim - (ndim - 2)  # 0: rows (output features), 1: columns (input features)
        if axis not in (0, 1):
            continue
        parts = tp * (2 if spec.packed else 1)
        size = p.shape[dim]
        if size % parts:
            continue  # PLC616 already says the split is uneven
        local, b = size // parts, block[axis]
        if local % b == 0:
            continue
        what = "rows (output features)" if axis == 0 else "columns (input features)"
        fits = [n for n in range(2, 65) if size % (n * (2 if spec.packed else 1) * b) == 0]
        c.problems.add(
            BLOCK_GRID,
            f"`{a.style}` gives each of the {tp} ranks {local} {what} of the FP8 block-scaled {generic_path(p.fqn)} "
            f"(size {size}{', each half' if spec.packed else ''}), which is not a whole number of its "
            f"{block[0]}x{block[1]} scale blocks: each rank's `{p.name}{BLOCK_SCALE_SUFFIX}` blocks would not line up with "
            "its weight shard",
            final[a.fqn].source.where,
            c.sizes_hint(
                f"use a tp_size that splits {size} on the {b} grid ({', '.join(map(str, fits[:4]))})" if fits
                else f"no tp_size splits {size} on the {b} grid"
            )
            + "; or write `replicate` for this target, or load with `planc.load(..., dequantize=True)` (the "
            "weights are dequantized as each rank reads them, which works off the grid)",
            a.fqn,
        )


def resolve_strategy(c, ep_experts: set[str]) -> Optional[EPStrategy]:
    # Mega MoE experts always run behind MegaMoeEP (it hands the kernel its process group), even at ep_size 1.
    if not ep_experts and not c.megamoe:
        return None
    return resolve_ep(c.plan.experts, c.parallel)  # lint (PLC400-402) has refused the plans it raises for


def experts_assignments(c, final: dict[str, PlanRule], strategy) -> list[ExpertsAssignment]:
    walk, out = c.walk, []
    sharding = c.active["tp"] or c.active["ep"]
    for m in walk.experts:
        info = m.experts
        rule = final.get(m.fqn)
        mode = EXPERTS_MODULE_STYLES.get(rule.style) if rule is not None else None
        if mode is None and sharding:
            table = "ep_plan" if c.active["ep"] else "tp_plan"
            c.problems.add(
                EXPERTS_UNCOVERED,
                f"experts module {m.class_name} has no EP or TP rule: with tp_size={c.tp}, ep_size={c.ep} "
                f"every rank would hold all {info.num_experts} experts "
                f"({human_bytes(sum(walk.params[p].nbytes for p in m.params), digits=1)} per layer)",
                key_where(c.loaded, (table,)),
                "shard them by expert: ep_plan `<path>.experts.{gate_up_proj,down_proj}: grouped_gemm` and "
                "`<path>.experts: ep_dispatch_experts` (or moe_tp_experts in tp_plan)",
                m.fqn,
            )
        check_experts_params(c, m, mode, final)
        if mode == "ep" and info.num_experts % c.ep:
            c.problems.add(
                EXPERTS_NOT_DIVISIBLE,
                f"{info.num_experts} experts cannot be split evenly over ep_size={c.ep} ranks",
                key_where(c.loaded, ("parallel", "ep_size")),
                c.sizes_hint(f"no sizes on {c.parallel.world_size} ranks split {info.num_experts} experts evenly "
                             "and pass the other checks: launch another number of ranks, or shard the experts with "
                             "`moe_tp_experts` in tp_plan and `ep_size: 1`"),
                m.fqn,
            )
        if c.megamoe:
            check_megamoe(c, m)
        out.append(
            ExpertsAssignment(
                fqn=m.fqn,
                strategy=strategy if mode == "ep" or c.megamoe else None,
                num_experts=info.num_experts,
                num_local_experts=info.num_experts // c.ep if mode == "ep" else info.num_experts,
                top_k=info.top_k,
                hidden_size=info.hidden_size,
                intermediate_size=info.intermediate_size,
                has_gate=info.has_gate,
                is_fp4=info.is_fp4,
                mode=mode,
                is_transposed=info.is_transposed,
                dispatch=info.dispatch,
            )
        )
    return out


def nested_expert_owner(walk, fqn: str):
    """The experts module (ModuleInfo) that parameter `fqn` is a per-expert tensor of, from a module inside it
    (ergo's `experts.post_expert_norm.weight` [E, H]: the experts' forward indexes it with the expert ids it runs):
    the nearest experts ancestor of its owner when the tensor's leading dim is that module's experts count; None
    for a parameter of an experts module itself, or of any other module."""
    p = walk.params.get(fqn)
    if p is None or not p.shape:
        return None
    owner = p.owner
    while owner:
        owner = owner.rpartition(".")[0]
        m = walk.modules.get(owner)
        if m is not None and m.experts is not None:
            return m if p.shape[0] == m.experts.num_experts else None
    return None


def nested_expert_params(walk, m) -> list[str]:
    """The per-expert tensors of modules inside experts module `m` (see `nested_expert_owner`)."""
    prefix = m.fqn + "."
    return [f for f, p in walk.params.items()
            if p.owner.startswith(prefix) and getattr(nested_expert_owner(walk, f), "fqn", None) == m.fqn]


def check_experts_params(c, m, mode, final: dict[str, PlanRule]) -> None:
    nested = nested_expert_params(c.walk, m)
    for pfqn in [*m.params, *nested]:
        r = final.get(pfqn)
        name = pfqn[len(m.fqn) + 1:]
        if pfqn in nested:
            what = (f"{name}, a per-expert tensor (leading dim {m.experts.num_experts}, the experts count) inside "
                    "expert-parallel experts,")
        else:
            what = f"{name} of expert-parallel experts"
        if mode == "ep" and (r is None or r.style != "grouped_gemm"):
            c.problems.add(
                EXPERTS_PARTIAL,
                f"{what} is not sharded by expert"
                + (f" (it has `{r.style}`)" if r else "")
                + ": every rank would index a full tensor with its local expert ids",
                final[m.fqn].source.where,
                f"add `{generic_path(m.fqn)}.{name}: grouped_gemm` to ep_plan",
                pfqn,
            )
        elif mode == "tp" and name in ("gate_up_proj", "up_proj", "down_proj") and (
            r is None or not _splits_over_tp(r.style)
        ):
            want = "rowwise" if name == "down_proj" else ("packed_colwise" if name == "gate_up_proj" else "colwise")
            c.problems.add(
                EXPERTS_PARTIAL,
                f"{name} of tensor-parallel experts (moe_tp_experts) is not sharded: the all-reduced output "
                "would count every expert tp_size times",
                final[m.fqn].source.where,
                f"add `{generic_path(m.fqn)}.{name}: {want}` to tp_plan",
                pfqn,
            )
        elif mode != "ep" and r is not None and r.style == "grouped_gemm" and c.active["ep"]:
            c.problems.add(
                EXPERTS_PARTIAL,
                f"{name} is sharded by expert (grouped_gemm) but its experts module has no "
                "`ep_dispatch_experts`: the forward would run local experts with global ids",
                r.source.where,
                f"add `{generic_path(m.fqn)}: ep_dispatch_experts` to ep_plan",
                pfqn,
            )


def check_megamoe(c, m) -> None:
    info, settings = m.experts, c.plan.experts.megamoe
    impl_where = key_where(c.loaded, ("experts", "implementation"))
    if not info.has_gate or info.is_transposed:
        why = "have no gate (up_proj only)" if not info.has_gate else "store their weights transposed ([E, H, 2I])"
        c.problems.add(
            MEGAMOE_NO_GATE,
            f"Mega MoE computes SwiGLU over [gate | up] rows of gate_up_proj [E, 2I, H]; these experts "
            f"({m.class_name}) {why}",
            impl_where,
            "use `implementation: grouped_mm` for this model; deepgemm_megamoe needs gated, untransposed experts",
            m.fqn,
        )
    if info.top_k is not None and info.top_k > MEGAMOE_MAX_TOP_K:
        c.problems.add(
            MEGAMOE_TOP_K,
            f"Mega MoE supports top-k <= {MEGAMOE_MAX_TOP_K}, this model routes each token to {info.top_k} experts",
            impl_where,
            "use `implementation: grouped_mm` for this model",
            m.fqn,
        )
    if c.ep > MEGAMOE_MAX_RANKS:
        c.problems.add(
            MEGAMOE_EP_SIZE,
            f"Mega MoE reaches peers over one NVLink domain of at most {MEGAMOE_MAX_RANKS} ranks, "
            f"ep_size is {c.ep}",
            key_where(c.loaded, ("parallel", "ep_size")),
            f"set ep_size <= {MEGAMOE_MAX_RANKS}",
        )
    check_megamoe_activation(c, m, impl_where)
    backend = settings.backend if settings else "auto"
    h, i = info.hidden_size, info.intermediate_size
    backend_where = key_where(c.loaded, ("experts", "megamoe", "backend"))
    if h is not None and i is not None and backend in ("deep_gemm", "auto"):
        bad = [f"{n} {v}" for n, v in (("hidden", h), ("intermediate", i)) if v % 128]
        blocks = [f"{n} {v}" for n, v in (("hidden", h), ("intermediate", i)) if v % MEGAMOE_KERNEL_BLOCK]
        if bad and backend == "deep_gemm":
            c.problems.add(
                MEGAMOE_SIZES,
                f"the deep_gemm Mega MoE kernel needs hidden and intermediate sizes divisible by 128, "
                f"got {', '.join(bad)}",
                backend_where,
                "write `megamoe: {backend: triton}` (FP4 kept packed) or `{backend: reference}` (PyTorch), "
                "or use `implementation: grouped_mm`",
                m.fqn,
            )
        elif blocks and backend == "deep_gemm":
            c.problems.add(
                MEGAMOE_KERNEL_BLOCKS,
                f"the deep_gemm Mega MoE kernel passes its host checks (% 128) but not its block alignment: "
                f"hidden / 128 must be even and, at decode-sized batches (BLOCK_K {MEGAMOE_KERNEL_BLOCK}), "
                f"intermediate % {MEGAMOE_KERNEL_BLOCK} == 0; got {', '.join(blocks)}",
                backend_where,
                "write `megamoe: {backend: triton}` (FP4 kept packed) or `{backend: reference}`",
                m.fqn,
            )
        elif blocks:
            c.warnings.append(
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
        c.problems.add(
            MEGAMOE_NOT_FP4,
            f"Mega MoE runs FP8 x FP4 experts, but gate_up_proj of these experts is "
            f"{c.walk.params[m.params[0]].dtype}, not FP4 (int8-packed), and megamoe.quantize is none",
            key_where(c.loaded, ("experts", "megamoe")),
            "write `megamoe: {quantize: fp4}` to quantize the experts when the plan is applied, or load an "
            "FP4 checkpoint",
            m.fqn,
        )


def check_megamoe_activation(c, m, where) -> None:
    """Every Mega MoE backend computes the kernel's SiLU SwiGLU (with the `swiglu_limit` clamp) and nothing else."""
    config = c.walk.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None)
    reasons = []
    if act is not None and str(act).lower() not in ("silu", "swish"):
        reasons.append(f"hidden_act is {act!r}")
    for name in MEGAMOE_OTHER_ACTIVATION_FIELDS:
        if getattr(text, name, None) is not None:
            reasons.append(f"{name} is {getattr(text, name)!r}")
    if reasons:
        c.problems.add(
            MEGAMOE_ACTIVATION,
            f"Mega MoE computes SiLU SwiGLU (clamped by swiglu_limit) and nothing else, but this model's config "
            f"sets {', '.join(reasons)}: the experts would compute a different function",
            where,
            "use `implementation: grouped_mm` for this model",
            m.fqn,
        )
def _proj_head_dim(walk, owner: str, proj: str, config_head_dim: Optional[int]) -> Optional[int]:
    """The head width a q/k/v/o projection's features come in: v_proj/o_proj use v_head_dim where the
    attention has one (dots3_note, mimo_v2_flash); the attention module's own attributes win over the
    config (per-layer configs such as gemma4's have no global head_dim)."""
    parent = walk.modules.get(owner.rpartition(".")[0])
    hd, vd = (parent.head_dims if parent is not None and parent.head_dims else (None, None))
    if proj in ("v_proj", "o_proj"):
        cfg_v = _config_attr(walk.config, "v_head_dim")
        for v in (vd, cfg_v if isinstance(cfg_v, int) and not isinstance(cfg_v, bool) and cfg_v > 0 else None):
            if v:
                return v
    return hd or config_head_dim


def _config_attr(config, name: str):
    """getattr that tolerates per-layer configs, which raise for a global attribute (gemma4)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - such configs raise their own error type
        return None


def _head_dim(config) -> Optional[int]:
    hd = _config_attr(config, "head_dim")
    if isinstance(hd, int) and hd > 0:
        return hd
    hidden, heads = _config_attr(config, "hidden_size"), _config_attr(config, "num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def _splits_over_tp(style: str) -> bool:
    spec = STYLE.get(style)
    return spec is not None and spec.mesh == "tp" and spec.shards


# ---- forwards that must take the sharded parameters (issue 13) ----------------------------------------
#
# A TP style on a parameter makes it a DTensor slice. Only the forwards planc wraps (styles with
# `local_forward` in the styles table) compute on local shards; any other forward would mix the DTensor
# with plain tensors at the first call. A model class that cannot switch its experts kernel
# (transformers' `_can_set_experts_implementation()`) runs only its own forward, and experts that take
# every token pre-scaled (`forward(hidden_states)`, Llama 4) have no routed ids to dispatch.


def check_bare_parameters(c, assignments, final) -> None:
    """PLC623: a sharded parameter whose module's forward planc does not wrap."""
    if not c.active["tp"]:
        return
    walk = c.walk
    module_style = {a.fqn: a.style for a in assignments if a.target == "module"}
    for a in assignments:
        spec = STYLE.get(a.style)
        if a.target != "parameter" or spec is None or spec.mesh != "tp" or not spec.shards:
            continue
        owner = walk.params[a.fqn].owner
        owner_spec = STYLE.get(module_style.get(owner, ""))
        if owner_spec is not None and owner_spec.local_forward:
            continue
        info = walk.modules[owner]
        gowner = generic_path(owner)
        rule = final[a.fqn]
        c.problems.add(
            BARE_PARAM_UNWRAPPED,
            f"`{a.style}` makes {generic_path(a.fqn)} a sharded DTensor, but its module {gowner} ({info.class_name}) "
            "gets no style whose forward runs on local shards: its own forward would mix the DTensor with plain "
            "tensors at the first call",
            rule.source.where,
            f"add `{gowner}: local_params` to tp_plan when its children already reduce the output (per-head "
            f"parameters such as attention sinks, sharded with their heads), or `{gowner}: all_reduce` when the "
            f"module's output is a partial sum; or delete `{rule.pattern_text}` to keep the parameter whole",
            a.fqn,
        )


def check_experts_implementation(c, where_impl: str) -> None:
    """PLC624: an experts kernel the model class cannot switch to."""
    walk, impl = c.walk, c.plan.experts.implementation
    if walk.can_switch_experts is not False or impl in ("eager", "deepgemm_megamoe") or not walk.experts:
        return
    c.problems.add(
        EXPERTS_IMPL_FIXED,
        f"{walk.model_class} cannot switch its experts implementation (transformers: "
        f"`{walk.model_class} does not support setting experts implementation`), so `{impl}` cannot be installed",
        where_impl,
        "write `experts: {implementation: eager}`: the model's own experts forward runs, and the EP strategies "
        "and TP styles wrap it",
    )


def check_dense_experts(c, final) -> None:
    """PLC613: ep_dispatch_experts on experts that take every token pre-scaled (Llama 4) when the EP group does not
    hold one batch. Such experts have no routed (token, expert) pairs to dispatch: each rank runs its own experts
    on every token of the batch its EP group shares and the outputs are gathered, so ep_size must equal tp_size."""
    for m in c.walk.experts:
        rule = final.get(m.fqn)
        if m.experts.dispatch != "dense" or rule is None or rule.style != "ep_dispatch_experts" or c.ep == c.tp:
            continue
        c.problems.add(
            WRONG_TARGET,
            f"{generic_path(m.fqn)} ({m.class_name}) runs forward(hidden_states) on every token pre-scaled by its "
            f"router score; with no routed pairs to dispatch, expert parallelism runs each rank's experts on the "
            f"batch its EP group shares, which needs ep_size == tp_size (got ep_size {c.ep}, tp_size {c.tp})",
            rule.source.where,
            f"set `ep_size: {c.tp}`, or shard these experts tensor-parallel in tp_plan: "
            f"`{generic_path(m.fqn)}.gate_up_proj: packed_rowwise`, `{generic_path(m.fqn)}.down_proj: colwise`, "
            f"`{generic_path(m.fqn)}: moe_tp_experts`, with `ep_size: 1`",
            m.fqn,
        )