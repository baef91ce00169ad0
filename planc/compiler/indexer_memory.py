"""DeepSeek Sparse Attention's token indexer (`indexed_attention` layers): what transformers' eager indexer allocates.

DeepSeek-V3.2, GLM-5 (glm_moe_dsa), A.X K2, HY-V4 and Mistral Large 4 pick, per query, the keys their attention reads
with a Lightning indexer (`*Indexer.forward` in their modeling files, transformers 5.25), which runs under
`torch.no_grad()` on every layer whose `indexer_types` entry is not `shared` (a shared layer reuses the previous
layer's picks):

- `torch.matmul(q.float(), k.float())` (`* softmax_scale`) and `F.relu`: two fp32 `[B, S, index_heads, T]` score
  tensors live at once, beside the fp32 copy of the queries `[B, S, index_heads, index_head_dim]`; the head-weighted
  sum, its mask and the top-k are `[B, S, T]`, a head's worth;
- the eager and sdpa paths turn the picks into a boolean `[B, 1, S, T]` mask (`scatter` of the picks, then `&` with
  the causal mask): the attention keeps the combined one for backward;
- the cache keeps the indexer's keys, `[B, T, index_head_dim]` in the model dtype, beside the attention's own.

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


def prefill_bytes(batch: int, seq: int, heads: int, dim: int) -> int:
    """The indexer's peak in a prefill of `seq` tokens: the fp32 queries, two fp32 score tensors, and the [B, S, T]
    boolean masks the picks become."""
    if not heads:
        return 0
    tokens = batch * seq
    return tokens * heads * dim * FP32 + 2 * tokens * heads * seq * FP32 + 2 * tokens * seq


def cache_bytes_per_token(dim: int, itemsize: int) -> int:
    """The indexer keys the cache keeps per token (`cache.update_indexer`)."""
    return dim * itemsize


def saved_mask_bytes(batch: int, seq: int, heads: int) -> int:
    """What training keeps of an indexed layer's picks: the attention's boolean [B, 1, S, T] mask (the indexer itself
    runs without grad)."""
    return batch * seq * seq if heads else 0


__all__ = ["INDEXED", "cache_bytes_per_token", "indexer_shape", "prefill_bytes", "saved_mask_bytes"]
