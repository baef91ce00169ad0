"""What a DeepSeek-V4 decoder layer keeps for backward, read from transformers' `modeling_deepseek_v4` (5.25).

A V4 layer shares little with the decoder layer `planc.compiler.peak_memory` prices from its shapes:

- hyper-connections: the residual is `hc_mult` streams `[tokens, N, hidden]` in the model dtype; each of the two
  mixers of a layer (`attn_hc`, `ffn_hc`) and the final `hc_head` flattens the streams to fp32 and normalises them
  (`input_norm`), keeping both fp32 copies for the mixing linear and the streams for the collapse, and the
  Sinkhorn projection keeps every iteration's `[N, N]` matrix and its column or row sums;
- the block norms keep fp32 weights, so they keep the fp32 upcast and the normalised fp32 (not the model-dtype
  cast back the common RMSNorm keeps);
- attention runs over every head on every rank unless the plan shards it: the unweighted `q_b_norm` over the whole
  `[tokens, heads * head_dim]` q keeps its fp32 upcast and its input, eager attention keeps q after rotary, the
  probabilities over the sliding keys, the compressed entries and the sink, and the max's indices; one shared K=V
  head is broadcast (a view, no copy); the grouped output projection keeps its `[tokens, heads * head_dim]` input;
- compressors: the heavily compressed layer's (HCA) keeps its fp32 gate and softmax over `head_dim`; a compressed
  sparse layer (CSA) keeps two series of them and its Lightning indexer's, the indexer's fp32 queries and two fp32
  `[tokens, index heads, S / rate]` score tensors (priced from the code: the grid's two layers are HCA);
- the clamped SwiGLU of routed and shared experts keeps the clamped gate and up besides the activation.

Each term is checked against the tensors autograd saves on rank 0 of the grid's DeepSeek-V4 points
(docs/memory.md). Pure arithmetic, no torch.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

FP32 = 4
HCA, CSA = "heavily_compressed_attention", "compressed_sparse_attention"


class HyperConnectionLayer(NamedTuple):
    """The config facts a DeepSeek-V4 layer's memory depends on beyond its attention and MLP widths."""

    streams: int  # hc_mult
    sinkhorn_iters: int
    q_lora: int
    o_width: int  # o_groups * o_lora_rank: the grouped output projection's width
    index_heads: int
    index_dim: int


def hyper_connections(config: Mapping[str, Any]) -> Optional[HyperConnectionLayer]:
    """The V4 facts of `config`, None for a model without hyper-connections."""
    streams = int(config.get("hc_mult") or 1)
    if streams <= 1:
        return None
    return HyperConnectionLayer(
        streams=streams, sinkhorn_iters=int(config.get("hc_sinkhorn_iters") or 1),
        q_lora=int(config.get("q_lora_rank") or 0),
        o_width=int(config.get("o_groups") or 1) * int(config.get("o_lora_rank") or 0),
        index_heads=int(config.get("index_n_heads") or 0), index_dim=int(config.get("index_head_dim") or 0),
    )


def mixer_saved(hc: HyperConnectionLayer, hidden: int, a: int) -> int:
    """Bytes per token one hyper-connection mixer keeps: the streams, their fp32 flattening and its norm, and the
    Sinkhorn iterations' [N, N] matrices and sums (2 * iters divisions)."""
    n = hc.streams
    return n * hidden * (a + 2 * FP32) + 2 * hc.sinkhorn_iters * (n * n + n) * FP32


def _fp32_norm(width: int) -> int:
    """An RMSNorm with fp32 weights: the fp32 upcast and the normalised fp32 are kept."""
    return 2 * FP32 * width


def layer_saved(hc: HyperConnectionLayer, *, layer_type: str, compress_rate: int, hidden: int, a: int, tokens: int,
                seq: int, heads: int, head_dim: int, rows: int, moe_intermediate: int, shared: int,
                experts: int) -> int:
    """Bytes one V4 decoder layer keeps for backward at `tokens` tokens (`rows` (token, expert) rows its experts
    run on this rank)."""
    t, q = tokens, heads * head_dim
    n = 2 * mixer_saved(hc, hidden, a)  # attn_hc and ffn_hc
    n += 2 * _fp32_norm(hidden)  # input_layernorm, post_attention_layernorm
    n += 2 * a * hidden  # the attention's and the MLP's outputs, kept by the streams' expansion
    # attention: q_a_proj's input, q_a_norm, q_b_proj's input, q_b_norm (fp32 upcast, its input, the rsqrt per
    # head), q after rotary, the probabilities (keys, compressed entries, sink), the max's indices, the grouped
    # output projection's input and o_b_proj's, the shared K=V head and its norm
    c = seq // compress_rate if compress_rate else 0  # compressed entries appended to the keys
    n += a * hidden + _fp32_norm(hc.q_lora) + a * hc.q_lora
    n += q * (FP32 + a) + heads * (FP32 + a) + a * q
    n += heads * (seq + c + 1) * a + 8 * heads
    n += a * q + a * hc.o_width
    n += _fp32_norm(head_dim) + a * head_dim
    if layer_type == HCA:  # gate + position bias (fp32), its softmax cast back, the kv
        n += head_dim * (FP32 + 2 * a)
    elif layer_type == CSA:  # two series at head_dim and the indexer's two at index_dim, its queries, its scores
        n += 2 * head_dim * (2 * FP32 + 2 * a) + 2 * hc.index_dim * (2 * FP32 + 2 * a)
        n += hc.index_heads * hc.index_dim * (FP32 + a) + 2 * FP32 * hc.index_heads * c + FP32 * hc.index_heads
    # MLP: the router's input and scores; the routed rows, gate/up output, the clamped gate and up, the
    # activation and its product, the down output before weighting; the shared experts the same per token
    n += a * hidden + FP32 * experts
    n *= t
    n += rows * a * (2 * hidden + 6 * moe_intermediate) + rows * (8 + a)
    n += t * 6 * a * shared
    return n


def head_saved(hc: HyperConnectionLayer, hidden: int, a: int, tokens: int) -> int:
    """The final collapse (`hc_head`: the streams and their fp32 flattening and norm), the fp32-weighted final norm
    and lm_head's input."""
    n = hc.streams * hidden * (a + 2 * FP32)
    return tokens * (n + _fp32_norm(hidden) + a * hidden)


__all__ = ["CSA", "HCA", "HyperConnectionLayer", "head_saved", "hyper_connections", "layer_saved", "mixer_saved"]
