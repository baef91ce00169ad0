"""Checks of how TP splits each tensor: evenly, in whole attention heads, on the FP8 scale-block grid."""

from __future__ import annotations

from typing import Any, Optional

from planc.compiler.compiled import Assignment
from planc.compiler.context import PlanRule, Resolution
from planc.compiler.walk import ModelWalk, config_attr, generic_path
from planc.spec.styles import STYLE
from planc.compiler import rule_examples as ex
from planc.lint.registry import compile_rule


UNEVEN_SHARD = compile_rule(
    "PLC616", "uneven-shard", "a TP style that splits a dimension unevenly",
    "DTensor would give ranks slices of different sizes, which the forwards do not expect. The hint names "
    "sizes that divide every split dimension.",
    ex.GOOD.replace("tp_size: 2, ep_size: 2", "tp_size: 3, ep_size: 3").replace(ex.EP, "ep_plan:\n" + ex.MOE_TP.replace(
        "  model.layers.*.mlp.experts: moe_tp_experts\n", "").replace("packed_colwise", "grouped_gemm").replace(
        "rowwise", "grouped_gemm") + "  model.layers.*.mlp.experts: ep_dispatch_experts\n"),
    ex.GOOD,
)
HEAD_SPLIT = compile_rule(
    "PLC617", "head-split", "a colwise q/k/v or rowwise o_proj that gives a rank a fraction of a head",
    "Attention computes whole heads; a rank with part of a head computes garbage without an error.",
    ex.GOOD.replace("tp_size: 2, ep_size: 2", "tp_size: 8, ep_size: 8"), ex.GOOD,
)
BLOCK_GRID = compile_rule(
    "PLC625", "shard-off-fp8-block-grid", "a TP shard of an FP8 block-scaled weight that is not whole scale blocks",
    "An FP8 checkpoint in the DeepSeek-V3 format (`quantization_config: {quant_method: fp8, weight_block_size: "
    "[128, 128]}`) stores each weight with a `weight_scale_inv` of one factor per 128 x 128 block. Loaded with "
    "FP8 kept (`planc.load` on an FP8-capable GPU, or `dequantize=False`), a scale is sharded with its weight on "
    "the same dim (a colwise shard of rows [r0, r1) holds scale rows [r0/128, r1/128)), so every rank's rows or "
    "columns must be whole blocks: at tp 2 a 384-row weight (192 rows each, 1.5 blocks) is refused. The hint "
    "names sizes that split on the grid; `replicate` the weight, or load with `dequantize=True`, which reads "
    "each rank's scale blocks and dequantizes exactly off the grid too. A block scale with no rule of its own "
    "takes its weight's style. It needs the quantized model `planc.load` builds from an FP8 checkpoint, so it "
    "has no plan-only example: `planc explain PLAN --checkpoint DIR` on such a checkpoint runs it.",
)


ATTENTION_PROJ = {"q_proj": "out", "k_proj": "out", "v_proj": "out", "o_proj": "in"}


def check_shards(c: Resolution, assignments: list[Assignment], final: dict[str, PlanRule]) -> None:
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


def block_scale_weight(walk: ModelWalk, fqn: str) -> Optional[str]:
    """The weight a block-scale parameter belongs to (`q_proj.weight_scale_inv` -> `q_proj.weight`), else None."""
    if not fqn.endswith(BLOCK_SCALE_SUFFIX):
        return None
    weight = fqn[: -len(BLOCK_SCALE_SUFFIX)]
    return weight if weight in walk.params else None


def _block_size(config: Any) -> Optional[tuple[int, int]]:
    q = getattr(config, "quantization_config", None)
    block = q.get("weight_block_size") if isinstance(q, dict) else getattr(q, "weight_block_size", None)
    if isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        return int(block[0]), int(block[1])
    return None


def check_block_grid(c: Resolution, assignments: list[Assignment], final: dict[str, PlanRule]) -> None:
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


def _proj_head_dim(walk: ModelWalk, owner: str, proj: str, config_head_dim: Optional[int]) -> Optional[int]:
    """The head width a q/k/v/o projection's features come in: v_proj/o_proj use v_head_dim where the
    attention has one (dots3_note, mimo_v2_flash); the attention module's own attributes win over the
    config (per-layer configs such as gemma4's have no global head_dim)."""
    parent = walk.modules.get(owner.rpartition(".")[0])
    hd, vd = (parent.head_dims if parent is not None and parent.head_dims else (None, None))
    if proj in ("v_proj", "o_proj"):
        cfg_v = config_attr(walk.config, "v_head_dim")
        for v in (vd, cfg_v if isinstance(cfg_v, int) and not isinstance(cfg_v, bool) and cfg_v > 0 else None):
            if v:
                return v
    return hd or config_head_dim


def _head_dim(config: Any) -> Optional[int]:
    hd = config_attr(config, "head_dim")
    if isinstance(hd, int) and hd > 0:
        return hd
    hidden, heads = config_attr(config, "hidden_size"), config_attr(config, "num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None
