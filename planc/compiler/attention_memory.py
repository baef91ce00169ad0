"""What an attention kernel holds of the S x S scores, beyond the layer's shapes: eager's score dtypes, which differ
by family, and sdpa's math path, which torch takes on a CPU when the query and value head widths differ (MLA).

Eager attention is each family's own `eager_attention_forward` in transformers 5.25: gpt-oss keeps its scores, the
sink column and the softmax in the model dtype, OpenAI's privacy filter runs the softmax in fp32
(`softmax(..., dtype=float32)`), Flint upcasts q and k before QK^T and stays in fp32 to the softmax. How many
[B, heads, S, S(+1)] tensors are alive at once, and in which dtype, is the family's row
(`planc.compiler.family_memory`: `eager_scores`, `eager_softmax_fp32`, `eager_qk_fp32`).

sdpa on a CPU runs its fused flash kernel only when q, k and v have one head width; otherwise (MLA: q/k
`qk_nope + qk_rope`, v `v_head_dim`) torch falls back to `_scaled_dot_product_attention_math`, which upcasts a bf16
q, k and v to fp32, scales q, and holds the fp32 `q @ k^T` and its sum with the mask at once (softmax follows when
the product is freed). On CUDA the memory-efficient kernel takes different value widths: no scores there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from planc.compiler.family_memory import FamilyMemory

if TYPE_CHECKING:
    from planc.compiler.peak_memory import LayerShape

FP32 = 4


def eager_prefill(elements: int, a: int, fam: FamilyMemory) -> int:
    """Bytes of the score tensors eager attention holds at once at its peak in a prefill, `elements` each: the
    family's count in the model dtype (`a` bytes) and in fp32."""
    in_model, in_fp32 = fam.eager_scores
    return elements * (in_model * a + in_fp32 * FP32)


def eager_kept_fp32(elements: int, tokens: int, s: LayerShape, fam: FamilyMemory) -> int:
    """What eager keeps for backward beyond its model-dtype probabilities: the fp32 softmax output (a softmax in fp32,
    cast back for the output matmul) and the fp32 q and repeated k of an fp32 QK^T."""
    n = elements * FP32 if fam.eager_softmax_fp32 else 0
    if fam.eager_qk_fp32:
        n += tokens * FP32 * (s.q + s.heads * s.head_dim)
    return n


def runs_sdpa_math(s: LayerShape, device_type: str) -> bool:
    """sdpa falls back to its math path: on a CPU, with a value head width other than the query's (MLA)."""
    if device_type != "cpu" or s.attn_impl != "sdpa" or s.attention == "linear" or not s.heads or not s.kv_heads:
        return False
    return s.q // s.heads != s.v // s.kv_heads


def with_sdpa_math(shapes: list[LayerShape], device_type: str) -> list[LayerShape]:
    """The layers with `sdpa_math` set where torch takes sdpa's math path on `device_type`."""
    return [replace(s, sdpa_math=True) if runs_sdpa_math(s, device_type) else s for s in shapes]


def sdpa_math_prefill(s: LayerShape, batch: int, seq: int) -> int:
    """sdpa's math path at its peak in a prefill, beside its fp32 q, scaled q, k and v: two fp32 [B, heads, S, S]
    (q @ k^T and its sum with the mask, then the sum and its softmax), or at the output's product the softmax, its
    cast to the model dtype (the weights the kernel returns, cast first), the fp32 value made contiguous for the
    batched matmul and the fp32 output: the larger below S = 4 x v_head_dim."""
    tokens = batch * seq
    scores = batch * s.heads * seq * seq
    at_output = (FP32 + 2) * scores + 2 * tokens * FP32 * s.v
    return max(2 * FP32 * scores, at_output) + tokens * FP32 * (2 * s.q + s.k + s.v)


def sdpa_math_kept(s: LayerShape, batch: int, seq: int) -> int:
    """What sdpa's math path keeps for backward: the fp32 softmax output [B, heads, S, S] and the fp32 scaled q, k
    and v its matmuls read (the model-dtype q, k and v it upcast are freed: the casts and the scaling by a number save
    nothing)."""
    return FP32 * batch * s.heads * seq * seq + batch * seq * FP32 * (s.q + s.k + s.v)


def mla_math_kept(s: LayerShape, a: int) -> int:
    """Bytes per token an MLA layer keeps around sdpa's math path beyond `sdpa_math_kept`: the kernel's output and
    the output projection's input, or the output gate's product (dots.llm3's `attn_output * gate.sigmoid()` keeps
    the contiguous output, the projection the product): two [tokens, heads x v_head_dim] in the model dtype. The
    query and key it builds (`cat`, `new_empty` + copies) and kv_b's output are freed once upcast: rotary's products
    with the cos/sin tables keep the tables, not the query."""
    return 2 * a * s.v


def sdpa_repeated_kv(s: LayerShape, batch: int, seq: int, a: int) -> int:
    """K and V repeated to every query head for sdpa: transformers' `sdpa_attention_forward` lets sdpa group the
    heads itself only without a mask (`use_gqa_in_sdpa`), and a sliding layer the sequence reaches gets one
    (`create_sliding_window_causal_mask` returns None only below the window): two [B, heads, S, head_dim] in the model
    dtype, which a prefill holds through the kernel and training keeps for its backward. 0 where sdpa sees no mask,
    on its math path (counted there) and without grouped heads."""
    if (s.attn_impl != "sdpa" or s.sdpa_math or s.attention != "gqa" or s.kv_heads >= s.heads
            or s.cache_kind != "sliding window" or s.window is None or seq < s.window):
        return 0
    return 2 * batch * seq * s.heads * s.head_dim * a


def mla_math_held(s: LayerShape, a: int) -> int:
    """Bytes per token an MLA layer's forward holds around sdpa's math path in a prefill (`sdpa_math_prefill` beside
    them), all in the model dtype: q_b's output (the split's views keep it), the query (`cat`) and its roped part, the
    key (`new_empty` + copies) and kv_b's output (k_nope and the value): q twice, k twice (its roped part and
    k_nope's together one k) and v once."""
    return a * (2 * s.q + 2 * s.k + s.v)


def mla_efficient_kept(s: LayerShape, a: int) -> int:
    """Bytes per token an MLA layer keeps for backward around sdpa's memory-efficient kernel (CUDA): the query and the
    key it builds (`cat`, `new_empty` + copies), kv_b's output (the value is a view of it; counted as k + v wide, its
    k_nope and value halves bound above), the kernel's output and the output projection's input (or the output gate's
    product: either way two [tokens, heads x v_head_dim]), and the fp32 log-sum-exp."""
    return a * (s.q + 2 * s.k + 3 * s.v) + FP32 * s.heads


__all__ = ["eager_kept_fp32", "eager_prefill", "mla_efficient_kept", "mla_math_held", "mla_math_kept",
           "runs_sdpa_math", "sdpa_math_kept", "sdpa_math_prefill", "sdpa_repeated_kv", "with_sdpa_math"]
