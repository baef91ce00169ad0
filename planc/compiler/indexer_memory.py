"""DeepSeek Sparse Attention's token indexer (`indexed_attention` layers): what transformers' eager indexer allocates.

DeepSeek-V3.2, GLM-5 (glm_moe_dsa), A.X K2, HY-V4, dots.llm3 and Mistral Large 4 pick, per query, the keys their
attention reads with a Lightning indexer (`*Indexer.forward` in their modeling files, transformers 5.25), which runs
under `torch.no_grad()` on every layer whose `indexer_types` entry is not `shared` (a shared layer reuses the previous
layer's picks). Its peak is one of two moments:

- the score product, `torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))`: the fp32 copy of the
  queries `[B, S, index_heads, index_head_dim]`, the fp32 keys `[B, index_head_dim, T]` and the fp32 scores
  `[B, S, index_heads, T]`. The keys' batch dimensions `[B, 1]` broadcast against the queries' `[B, S]`: torch's
  matmul expands them and reshapes to `[B * S, index_head_dim, T]` for its bmm, a view at batch 1 (a stride-0 batch)
  but a copy of the keys for every query at batch > 1: `B * S * index_head_dim * T` fp32 more, `index_head_dim /
  index_heads` times the scores (8x for A.X K2's 16 heads of 128), which is why a batch of two sequences needs more
  than one sequence of the same tokens;
- `* softmax_scale` and `F.relu`: two fp32 score tensors (the queries' fp32 copy and the broadcast keys are freed).

Both beside the queries as the indexer built them, live until it returns: the projection (kept by the view the rope
split leaves), its rotated part and their concatenation. dots.llm3 computes its indexed layers' rotary from
`inputs_embeds.float()`: the rotated part and the concatenation are fp32 there, and `q.float()` copies nothing
(planc.compiler.family_memory's `indexer_rope_fp32`). The head-weighted sum, its mask and the top-k that follow are
`[B, S, T]`, a head's worth, after the scores' peak. Measured on each family's indexer at 1 x 256, 2 x 128 and
4 x 64 (tests/memory/test_indexer_memory.py).

The eager and sdpa paths turn the picks into a boolean `[B, 1, S, T]` mask (`scatter` of the picks, then `&` with
the causal mask), which the attention keeps for backward; the cache keeps the indexer's keys, `[B, T,
index_head_dim]` in the model dtype, beside the attention's own.

The indexer's projections stay whole under the plans `planc init` writes (no TP rule names them), so every rank
scores with all `index_n_heads`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

INDEXED = "indexed_attention"
FP32 = 4


def indexer_shape(config: Mapping[str, Any], layer_type: str, index: int) -> tuple[int, int]:
    """(index heads, index head dim) of layer `index`'s own indexer; (0, 0) where the layer has none (not an indexed
    layer, or one that reuses the previous layer's picks)."""
    if layer_type != INDEXED:
        return 0, 0
    kinds: Optional[list[str]] = config.get("indexer_types")
    if kinds and index < len(kinds) and kinds[index] == "shared":
        return 0, 0
    return int(config.get("index_n_heads") or 0), int(config.get("index_head_dim") or 0)


def indexer_rope(config: Mapping[str, Any]) -> int:
    """The width of the indexer's queries that rotary turns (`qk_rope_head_dim`, the split every indexer makes)."""
    return int(config.get("qk_rope_head_dim") or 0)


def prefill_bytes(batch: int, seq: int, heads: int, dim: int, itemsize: int, rope: int = 0,
                  rope_fp32: bool = False) -> int:
    """The indexer's peak in a prefill of `seq` tokens a sequence (module docstring): its queries, and the larger of
    the score product (fp32 queries and keys, the keys broadcast to every query at batch > 1, the scores) and the
    scaled and rectified scores (two)."""
    if not heads:
        return 0
    tokens = batch * seq
    scores = tokens * heads * seq * FP32
    rotated = FP32 if rope_fp32 else itemsize  # the rotated part and the concatenation, in the cos/sin dtype
    queries = tokens * heads * (dim * itemsize + (rope + dim) * rotated)
    upcast = 0 if rope_fp32 else tokens * heads * dim * FP32  # `q.float()` of fp32 queries is the same tensor
    keys = batch * dim * seq * FP32
    broadcast = tokens * dim * seq * FP32 if batch > 1 else 0
    return queries + max(upcast + keys + broadcast + scores, 2 * scores)


def cache_bytes_per_token(dim: int, itemsize: int) -> int:
    """The indexer keys the cache keeps per token (`cache.update_indexer`)."""
    return dim * itemsize


def attention_mask_bytes(batch: int, seq: int, itemsize: int, impl: str, sdpa_math: bool) -> int:
    """The masks an indexed layer's attention holds beyond the causal one (the picks of this layer's indexer or of the
    layer it shares them with): the picks' boolean [B, 1, S, T] (`scatter`) and its combination with the causal mask
    (`&` under sdpa; eager's `masked_fill` of its additive mask, in the model dtype), and where sdpa runs its math
    path, the additive mask it converts the boolean one to, in the query's dtype (`where` before the math path's
    upcast)."""
    combined = 1 if impl == "sdpa" else itemsize
    return batch * seq * seq * (1 + combined + (itemsize if sdpa_math else 0))


def causal_mask_bytes(batch: int, seq: int) -> int:
    """sdpa's boolean causal mask [B, 1, S, T], which a model with indexed layers builds for its indexer
    (`create_causal_mask(..., allow_is_causal_skip=False)`: the indexer reads it) and holds through the forward."""
    return batch * seq * seq


def saved_mask_bytes(batch: int, seq: int, heads: int) -> int:
    """What training keeps of an indexed layer's picks: the attention's boolean [B, 1, S, T] mask (the indexer itself
    runs without grad)."""
    return batch * seq * seq if heads else 0


__all__ = ["INDEXED", "attention_mask_bytes", "cache_bytes_per_token", "causal_mask_bytes", "indexer_rope", "indexer_shape", "prefill_bytes", "saved_mask_bytes"]
