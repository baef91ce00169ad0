"""What a family's transformers code allocates beyond the common decoder layer: the facts the peak model prices.

`planc.compiler.peak_memory` prices a decoder layer from its shapes (attention heads, MLP widths, experts). Some
families allocate more than those shapes say, in code the shapes cannot show: a router that computes in fp32 and
keeps fp32 routing weights, an MoE block that repeats the hidden states over every expert, a q/k norm over the whole
projected width. Each row here is read from that family's modeling file in transformers 5.25 (the installed
version the grid in docs/memory.md measures); `unpriced` lists what the family allocates that planc does not
price yet, so that `planc explain` says so next to its verdict instead of printing a number it cannot back.

A family without a row was not measured: it is priced on the safe side (fp32 routing weights and router input,
the larger of the two) and its verdict carries a note.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyMemory:
    """One family's allocations the layer shapes do not show."""

    # the top-k routing weights stay fp32 into the experts' output stage (`proj_out * weights` and its scatter
    # back are fp32 [slots, hidden]): a router whose softmax/sigmoid runs in fp32 with no cast back
    routing_weights_fp32: bool = False
    # the router runs `F.linear(hidden.float(), weight.float())`: training keeps an fp32 [tokens, hidden] copy
    router_input_fp32: bool = False
    # q_norm/k_norm normalise the whole projected q/k width (not per head): an fp32 copy of q and k in forward
    full_width_qk_norm: bool = False
    # rotary in complex fp32 (`view_as_complex(x.float())`): fp32 copies of q and k
    complex_rope_fp32: bool = False
    # what a `linear_attention` layer runs without its kernels: `chunk` (Qwen3-Next's gated delta rule, transformers'
    # `torch_chunk_gated_delta_rule`), `chunk_per_key` (Kimi Delta Attention's `torch_chunk_kda`: the decay is per key
    # channel, so its chunk matrices are [chunks, 64, 64, key_dim] fp32), `mamba` (Mamba's selective scan, the slow
    # path: [tokens, d_inner, d_state] fp32 discretized A, B and B*u)
    linear_scan: str = "chunk"
    # a per-head relative-position bias materialised densely (Inkling's `InklingRelativeLogits`): [B, heads, S,
    # extent] logits, gathered to [B, heads, S, S] and masked, all three in the model dtype, in every attention layer
    relative_position_bias: bool = False
    # SwiGLU evaluated in fp32 (`act_fn(gate.float()) * up.float()`) in the experts' `_apply_gate` and the dense MLP
    swiglu_fp32: bool = False
    # two more RMSNorms over the hidden in each layer (after the attention and after the MLP: Gemma's sandwich)
    sandwich_norms: bool = False
    # the norm's weight multiplies the fp32 normalized states, `(weight * x).to(dtype)`: the fp32 states are kept
    norm_weight_fp32: bool = False
    unpriced: tuple[str, ...] = ()
    measured: bool = True  # in the grid of docs/memory.md


FAMILIES: dict[str, FamilyMemory] = {
    # softmax(router_logits.float()), top-k weights kept fp32
    "mixtral": FamilyMemory(routing_weights_fp32=True),
    # softmax then `.to(router_logits.dtype)`
    "qwen3_moe": FamilyMemory(),
    "qwen3_vl_moe": FamilyMemory(),
    "qwen3_vl_moe_text": FamilyMemory(),
    "qwen3_next": FamilyMemory(),
    # DeepSeek's router: F.linear(x.float(), w.float()), sigmoid/softmax in fp32, weights kept fp32
    "deepseek_v2": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, complex_rope_fp32=True),
    "deepseek_v3": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "glm4_moe": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # sigmoid(router_logits.float()), weights kept fp32; q_norm/k_norm over all heads' width
    "minimax_m2": FamilyMemory(routing_weights_fp32=True, full_width_qk_norm=True),
    # softmax over the top-k in the logits' dtype; eager attention with sinks (priced from the attention layer)
    "gpt_oss": FamilyMemory(),
    # sigmoid(...).to(dtype); complex fp32 rotary (its dense expert dispatch is the compiled plan's: `dispatch`)
    "llama4_text": FamilyMemory(complex_rope_fp32=True),
    "llama4": FamilyMemory(complex_rope_fp32=True),
    # the families section of the grid (bench/memory_grid_families.py): planc init's plans, no shipped plan
    # softmax(dtype=float) then `.to(router_logits.dtype)`; q_norm/k_norm over the whole projected width
    "olmoe": FamilyMemory(full_width_qk_norm=True),
    # softmax(dtype=float) then `.to(router_logits.dtype)`; a sigmoid-gated shared expert
    "qwen2_moe": FamilyMemory(),
    # DeepSeek-V3's router (fp32 input and weights); Kimi Delta Attention's per-key decay; MLA full attention
    "kimi_linear": FamilyMemory(
        routing_weights_fp32=True, router_input_fp32=True, linear_scan="chunk_per_key",
        unpriced=("Kimi Delta Attention's backward (training keeps twice the chunk rule's forward work, as Qwen3-Next's "
                  "gated delta rule does; the grid measured 12% less at 1 x 256)",),
    ),
    # softmax(dtype=float), top-k weights cast back; Mamba layers on the slow path (no mamba_ssm kernels)
    "jamba": FamilyMemory(linear_scan="mamba"),
    # Qwen3-Next's layers (gated delta rule, gated attention), softmax then `.to(router_logits.dtype)`
    "qwen3_5_moe_text": FamilyMemory(),
    # sparsemixer's softmax in the logits' dtype
    "phimoe": FamilyMemory(),
    # MLA; softmax in the logits' dtype (DeepSeek-V3's group-limited top-k without its fp32 router)
    "mistral4": FamilyMemory(),
    # MLA; GLM-4.5's router: F.linear(x.float(), w.float()), sigmoid, weights kept fp32
    "glm4_moe_lite": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # softmax(router_logits.float()), weights kept fp32; its lightning attention layers (`linear_attention`) are
    # priced as the gated delta rule's: both grid points hold (docs/memory.md)
    "minimax": FamilyMemory(routing_weights_fp32=True),
    # F.linear(flat, weight) in the model dtype, weights gathered from the scores in it; its layer (hyper-connection
    # streams, fp32-weighted norms, compressors) is planc.compiler.deepseek_v4_memory's
    "deepseek_v4": FamilyMemory(),
    # The families sweep's routers and attentions (bench/memory_grid_families.py), each read from its modeling file in
    # transformers 5.25 (modeling_<family>.py; sarvam_mla builds DeepSeek-V3's model, sarvam_moe GLM-4.5's)
    # DeepSeek-V3's router: F.linear(x.type(float32), w.type(float32)), sigmoid, the gathered weights kept fp32
    "axk1": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "axk2": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # ...and Beam evaluates SwiGLU in fp32 in its experts (`_apply_gate`) and dense MLP
    "beam": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, swiglu_fp32=True),
    "deepseek_v32": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "exaone_moe": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "glm_moe_dsa": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "minicpm5_moe": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "sarvam_mla": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "sarvam_moe": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "solar_open": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # F.linear(x.float(), w.float()), sigmoid, weights kept fp32 (its fp32 combine of routed and shared output is
    # one [tokens, hidden] pair after the experts' output stage)
    "hy_v3": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # F.linear(x.float(), w.float()); softmax (Mistral Large 4, LongCat-Flash: `.to(router_logits.dtype)`, fp32) or
    # softmax(dtype=float32) (Unlimited-OCR), the gathered weights kept fp32
    "mistral_large4": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "mistral_large4_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "longcat_flash": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "unlimited_ocr": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "unlimited_ocr_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # F.linear(x.type(float32), w.type(float32)) (off CUDA or with grad; torch.mm(out_dtype=float32) otherwise), the
    # gathered logits' sigmoid kept fp32
    "kolibri1": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "kolibri1_1": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # F.linear(x.float(), w.float()), logsigmoid weights cast back `.to(hidden_states.dtype)`; a dense relative-position
    # bias in every attention layer (sdpa drops it, but it is built); its `hybrid`/`hybrid_sliding` layers (short
    # convolutions on keys, values and both residual branches, in fp32) are flagged as layer types planc does not know
    "inkling_text": FamilyMemory(router_input_fp32=True, relative_position_bias=True),
    # the router Linear in the model dtype, `.to(float32)`, sigmoid: fp32 weights, no fp32 input copy; AfMoE's layer
    # normalizes before and after both attention and MLP, each norm `(weight * x_fp32).to(dtype)`
    "afmoe": FamilyMemory(routing_weights_fp32=True, sandwich_norms=True, norm_weight_fp32=True),
    # the router Linear in the model dtype, `.to(float32)`, sigmoid: fp32 weights, no fp32 input copy
    "minimax_m3_vl_text": FamilyMemory(routing_weights_fp32=True),
    # softmax over the top-k logits in the model dtype
    "aria_text": FamilyMemory(),
    # F.linear(...).float(), softmax over the top-k, `.type_as(hidden_states)`
    "granitemoe": FamilyMemory(),
    "granitemoeshared": FamilyMemory(),
    "granitemoe_swa": FamilyMemory(),
    # softmax(dtype=float) then `.to(router_logits.dtype)` (Mellum, FlexOlmo); sigmoid of `.float()` logits cast
    # `.to(hidden_states.dtype)` (Laguna); q/k norms per head (Mellum, Laguna), over the whole width (FlexOlmo)
    "mellum": FamilyMemory(),
    "laguna": FamilyMemory(),
    "flex_olmo": FamilyMemory(full_width_qk_norm=True),
}

UNMEASURED = FamilyMemory(
    routing_weights_fp32=True, router_input_fp32=True, measured=False,
    unpriced=("this family's own allocations were not measured (priced on the safe side: fp32 routing weights "
              "and an fp32 router input)",),
)


def family_memory(model_type: str | None) -> FamilyMemory:
    """The row of `model_type`, or the safe-side default of a family the grid has not measured."""
    return FAMILIES.get(model_type or "", UNMEASURED)


__all__ = ["FAMILIES", "FamilyMemory", "family_memory"]
