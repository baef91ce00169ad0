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
    # q_norm/k_norm per head in a model-dtype RMSNorm (`weight * x.float()...to(dtype)`): training keeps each one's fp32
    # upcast and its cast back, as a full-width norm does (the q/k projections' outputs are not kept: the upcast's
    # backward needs none)
    per_head_qk_norm_kept: bool = False
    # q_norm/k_norm multiply their weight into the fp32 normalized states, `(weight * x).to(dtype)` (OLMo 2's norm):
    # training keeps those fp32 states in place of the cast back
    qk_norm_weight_fp32: bool = False
    # the residual stream is fp32 between layers (Zaya's `residual_in_fp32`), and each of a layer's two residual
    # scalings keeps `residual + bias` (fp32) and `hidden + bias` (model dtype) for its products with the scales
    residual_fp32: bool = False
    # keys, values and both residual branches (the attention's and the MLP's output) pass a causal short convolution
    # in fp32 (Inkling's `InklingShortConvolution`: `x.float()`, the conv, `+ x`, cast back): a prefill holds three fp32
    # [tokens, hidden] at a branch's conv; training keeps each conv's fp32 input
    residual_short_conv: bool = False
    # q_norm/k_norm per head compute in fp32 to the scale (`_norm(x.float()) * weight.float()`, Gemma's RMSNorm): two
    # fp32 copies of q at once in a prefill
    qk_norm_fp32: bool = False
    # rotary in complex fp32 (`view_as_complex(x.float())`): fp32 copies of q and k
    complex_rope_fp32: bool = False
    # what a `linear_attention` layer runs without its kernels: `chunk` (Qwen3-Next's gated delta rule, transformers'
    # `torch_chunk_gated_delta_rule`), `chunk_per_key` (Kimi Delta Attention's `torch_chunk_kda`: the decay is per key
    # channel, so its chunk matrices are [chunks, 64, 64, key_dim] fp32), `mamba` (Mamba's selective scan, the slow
    # path: [tokens, d_inner, d_state] fp32 discretized A, B and B*u), `mamba2` (Mamba2's chunked scan,
    # transformers' `mamba2_chunk_scan`: planc.compiler.ssm_memory), `short_conv` (LFM2's gated short convolution:
    # peak_memory.short_conv_layer)
    linear_scan: str = "chunk"
    # the family's own names for layer types the peak model prices as one of its kinds (`layer_types` entries:
    # name -> full_attention | sliding_attention | chunked_attention | linear_attention)
    layer_types: tuple[tuple[str, str], ...] = ()
    # each decoder layer is one mixer its layer type names, after one norm (Nemotron-H's blocks: `linear_attention`,
    # `full_attention`, `moe`, `mlp`), not an attention and an MLP
    mixer_blocks: bool = False
    # a per-head relative-position bias materialised densely (Inkling's `InklingRelativeLogits`): [B, heads, S,
    # extent] logits, gathered to [B, heads, S, S] and masked, all three in the model dtype, in every attention layer
    relative_position_bias: bool = False
    # eager attention's [B, heads, S, S(+1)] score tensors alive at once at its peak in a prefill, (in the model
    # dtype, in fp32), read off the family's `eager_attention_forward` (planc.compiler.attention_memory): gpt-oss's
    # scores + mask, the sink joined and the max subtracted, softmax, all in the model dtype: three
    eager_scores: tuple[int, int] = (3, 0)
    # eager's softmax runs in fp32 and is cast back (`softmax(..., dtype=float32).to(dtype)`): training keeps its
    # fp32 output beside the cast probabilities the output matmul reads
    eager_softmax_fp32: bool = False
    # eager subtracts the row max in every layer, with or without a sink column (MiMo-V2-Flash's
    # `eager_attention_forward`): backward keeps the max's int64 indices and no fp32 softmax
    eager_max_subtracted: bool = False
    # eager upcasts q and k for QK^T (`matmul(query.float(), key.float())`): training keeps fp32 q and repeated k
    eager_qk_fp32: bool = False
    # SwiGLU evaluated in fp32 (`act_fn(gate.float()) * up.float()`) in the experts' `_apply_gate` and the dense MLP
    swiglu_fp32: bool = False
    # two more RMSNorms over the hidden in each layer (after the attention and after the MLP: Gemma's sandwich)
    sandwich_norms: bool = False
    # the norm's weight multiplies the fp32 normalized states, `(weight * x).to(dtype)`: the fp32 states are kept
    norm_weight_fp32: bool = False
    # the indexed layers' rotary is computed from `inputs_embeds.float()` (dots.llm3): the indexer's rotated queries
    # and their concatenation are fp32 (planc.compiler.indexer_memory)
    indexer_rope_fp32: bool = False
    # an RMSNorm over every routed row's expert output, computed in fp32 (Ergo's `ErgoExpertNorm`, Muse Spark's
    # `post_expert_norm`): three fp32 [slots, width] at once (the fp32 rows, scaled or normalized, and their
    # product), beside the gathered input rows and the down output in the model dtype
    expert_output_norm_fp32: bool = False
    # the embedding output and the residual stream are fp32 (Ergo's fp32 `embed_tokens`, its residual gates mixing
    # the fp32 residual with the branch in fp32): the embedding output, the layer's input and its residual, which a
    # prefill holds through a layer, are fp32
    fp32_stream: bool = False
    # the attention's inputs are a block attention residual's fp32 outputs (Inkling 2's `BlockAttentionResidual`: an
    # eager attention of learned queries over the fp32 stacked block states): this many fp32 [tokens, hidden] and
    # their normed model-dtype copies alive through the attention (Inkling 2's full layers: 3, its sliding ones 1).
    # The layer binds the fp32 mixes until it returns, so they live through its MLP too, beside its fp32 residual and
    # the MLP's own fp32 mix; the model keeps the stacked block states ([tokens, blocks, hidden], one block every
    # `n_layers_per_attn_res_block` layers) through the forward
    block_residual_inputs: int = 0
    # the experts' (and shared experts', dense MLPs') gate is GPT-OSS's clamped SwiGLU: `gate.clamp(max=limit)`,
    # `up.clamp(-limit, limit)`, `gate * sigmoid(gate * alpha)`, `(up + 1) * glu`: training keeps seven [rows, width]
    clamped_swiglu: bool = False
    # the fp32 [rows, moe_intermediate] tensors the experts' `_apply_gate` holds at once in a prefill, beside the
    # gathered rows and the gate/up output in the model dtype (Inkling 2's softcapped SwiGLU: `gate.float()`,
    # `up.float()`, and three of `softcap(gate)`, `sigmoid(gate)`, their product, `softcap(up)`, the product: five)
    expert_gate_fp32: int = 0
    # a soft-capped head (`final_logit_softcapping`) computes in fp32 (`tanh(logits.float() / cap) * cap`, Gemma); off:
    # in the model dtype (`tanh(logits / cap) * cap`), so training keeps tanh's output in the model dtype
    logit_softcap_fp32: bool = True
    unpriced: tuple[str, ...] = ()
    measured: bool = True  # in the grid of docs/memory.md (its prefills and a training step)


INKLING2 = FamilyMemory(
    routing_weights_fp32=True, router_input_fp32=True, relative_position_bias=True, eager_scores=(2, 2),
    eager_softmax_fp32=True, block_residual_inputs=3, expert_gate_fp32=5,
    # `hybrid` layers are full attention, `hybrid_sliding` sliding attention (Inkling2TextModel picks their masks and
    # relative distances by `attention_type`): eager builds a mask for each kind
    layer_types=(("hybrid", "full_attention"), ("hybrid_sliding", "sliding_attention")),
)

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
    # DeepSeek-V3's router (fp32 input and weights); Kimi Delta Attention's per-key decay (`torch_chunk_kda`, its
    # forward and backward: planc.compiler.peak_memory's `linear_saved` and `_linear_backward`); MLA full attention
    "kimi_linear": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, linear_scan="chunk_per_key"),
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
    # HY-V4 (and its VL model's text decoder) route as DeepSeek-V3 does: an fp32 router input, the weights kept fp32;
    # their hyper-connection streams wrap the common layer (planc.compiler.hyper_connection_memory, read from HY-V4)
    # Their eager attention joins an fp32 sink column to the scores (`sinks` is created fp32), so the max-subtracted
    # scores and the softmax are fp32, kept beside the probabilities cast back for the output matmul
    "hy_v4": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, eager_softmax_fp32=True),
    "hy_v4_vl": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, eager_softmax_fp32=True),
    "hy_v4_vl_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, eager_softmax_fp32=True),
    # the families whose default configs cannot be built (their points take a checkpoint's values,
    # bench/memory_grid_families.py's CONFIG): an fp32 router input and fp32 weights (DeepSeek-OCR 2's DeepSeek-V3
    # router, dots.llm1, Hunyuan-A13B whose gate weight is fp32, Muse Spark)
    "deepseek_ocr2": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "deepseek_ocr2_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "dots1": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "hunyuan_v1_moe": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # routers in the model dtype throughout (Cohere 2 MoE, Qwen3-Omni's thinker, Qwen4-Exp); LFM2-MoE's has no row:
    # its short-convolution layers are not priced, and its prefill point measured 0.3% above the prediction
    "cohere2_moe": FamilyMemory(),
    "qwen3_omni_moe_thinker": FamilyMemory(),
    "qwen3_omni_moe_text": FamilyMemory(),
    # Qwen4-Exp's gated-residual hyper-connections are planc.compiler.hyper_connection_memory's (read from its config)
    "qwen4_exp_text": FamilyMemory(),
    # F.linear(x.float(), w.float()); softmax (Mistral Large 4, LongCat-Flash: `.to(router_logits.dtype)`, fp32) or
    # softmax(dtype=float32) (Unlimited-OCR), the gathered weights kept fp32. Mistral Large 4 soft-caps its logits in
    # the model dtype (`tanh(logits / cap) * cap` on lm_head's output, modeling_mistral_large4.py); LongCat-Flash's
    # layers are two attention sublayers and two dense MLPs beside the MoE (peak_memory's `sublayers`)
    "mistral_large4": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, logit_softcap_fp32=False),
    "mistral_large4_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, logit_softcap_fp32=False),
    "longcat_flash": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "unlimited_ocr": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "unlimited_ocr_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # F.linear(x.type(float32), w.type(float32)) (off CUDA or with grad; torch.mm(out_dtype=float32) otherwise), the
    # gathered logits' sigmoid kept fp32; four norms a layer (post_self_attn and post_mlp besides the input and
    # post-attention norms); q_norm/k_norm per head over 48 heads of 128, wider than the 2560 hidden (modeling_kolibri1.py,
    # modeling_kolibri1_1.py: the training points' missing activations, a MemTracker trace at 1 x 512)
    "kolibri1": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, sandwich_norms=True,
                             per_head_qk_norm_kept=True),
    "kolibri1_1": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, sandwich_norms=True,
                               per_head_qk_norm_kept=True),
    # modeling_inkling.py: F.linear(x.float(), w.float()), logsigmoid weights cast back `.to(hidden_states.dtype)`; a
    # dense relative-position bias in every attention layer (sdpa drops it, but it is built). Its `hybrid` layers are
    # full attention and `hybrid_sliding` sliding attention (the text model picks their masks so; transformers' cache
    # keeps their keys and values as those kinds', beside four [B, channels, 4] fp32 conv states, under 1 MiB a
    # layer), with fp32 short convolutions on keys, values and both residual branches (`residual_short_conv`)
    "inkling_text": FamilyMemory(router_input_fp32=True, relative_position_bias=True, residual_short_conv=True,
                                 layer_types=(("hybrid", "full_attention"), ("hybrid_sliding", "sliding_attention"))),
    # the router Linear in the model dtype, `.to(float32)`, sigmoid: fp32 weights, no fp32 input copy; AfMoE's layer
    # normalizes before and after both attention and MLP, each norm `(weight * x_fp32).to(dtype)`
    "afmoe": FamilyMemory(routing_weights_fp32=True, sandwich_norms=True, norm_weight_fp32=True),
    # the router Linear in the model dtype, `.to(float32)`, sigmoid: fp32 weights, no fp32 input copy. Its norms are
    # Gemma's, `(x_fp32 * (1 + weight.float())).type_as(x)`, the layer's and q_norm/k_norm per head alike; its experts'
    # and shared experts' `_apply_gate` is GPT-OSS's clamped SwiGLU (modeling_minimax_m3_vl.py)
    "minimax_m3_vl_text": FamilyMemory(routing_weights_fp32=True, norm_weight_fp32=True, qk_norm_fp32=True,
                                       clamped_swiglu=True),
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
    # FlexOlmo's norms are OLMo 2's, `(weight * x_fp32).to(dtype)`: its q/k norms keep fp32 states; its layer norms
    # come after the attention and the MLP (their outputs feed the residual sum, not kept), as many bytes as a
    # pre-norm's upcast, cast and output (modeling_flex_olmo.py; a MemTracker trace at 1 x 512)
    "flex_olmo": FamilyMemory(full_width_qk_norm=True, qk_norm_weight_fp32=True),
    # --- attention, embeddings, routers (the families grid's fp32 routers, eager attention with sinks, per-layer
    # embeddings), each read from its transformers 5.25 modeling file
    # modeling_ernie4_5_moe.py: `F.linear(hidden.float(), weight.float())` and softmax in fp32 (the weight is kept
    # fp32: `_keep_in_fp32_modules_strict`), the top-k weights cast back to the hidden dtype; rotary in fp32 on q and
    # k (`q.float() * cos + rotate_half(q).float() * sin`), cast back
    "ernie4_5_moe": FamilyMemory(router_input_fp32=True, complex_rope_fp32=True),
    # modeling_ernie4_5_vl_moe.py: ERNIE 4.5's router and rotary; text tokens run only the text experts
    "ernie4_5_vl_moe": FamilyMemory(router_input_fp32=True, complex_rope_fp32=True),
    "ernie4_5_vl_moe_text": FamilyMemory(router_input_fp32=True, complex_rope_fp32=True),
    # Param2MoE is GLM-4.5's model (auto maps it to Glm4MoeForCausalLM): its fp32 router and weights
    "param2moe": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # modeling_gemma4.py (the text decoder; the grid's config is dense, `enable_moe_block` off): sdpa, sliding and
    # full layers, the full layers at their own head width (`per_layer_config`, read from the attention module);
    # q_norm/k_norm/v_norm per head in fp32 to the scale; per-layer embeddings [tokens, layers x 256] (small beside
    # the hidden stream); its router (an MoE config) softmax in fp32, the top-k weights kept fp32 and scaled
    "gemma4_text": FamilyMemory(routing_weights_fp32=True, qk_norm_fp32=True),
    "gemma4": FamilyMemory(routing_weights_fp32=True, qk_norm_fp32=True),
    # modeling_dots3_note.py (the text decoder): MLA at 128 heads with DeepSeek Sparse Attention's indexer
    # (`indexed_attention` layers: fp32 indexer scores and key cache, planc.compiler.attention_memory) and sliding
    # MLA layers; on a CPU sdpa runs its math path (q/k 192 wide, v 128): fp32 scores. DeepSeek-V3's router:
    # `F.linear(hidden.float(), weight.float())`, sigmoid, the top-k weights gathered from the fp32 scores. The
    # indexed layers' rotary runs on `inputs_embeds.float()` (`Dots3NoteTextModel.forward`): fp32 indexer queries
    "dots3_note_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, indexer_rope_fp32=True),
    # modeling_flint.py: eager only (sdpa cannot add its sinks); `matmul(query.float(), key.float())`, the mask added,
    # the sink joined and the softmax, all fp32: three fp32 scores at once; `.to(value dtype)` after. Its router:
    # `F.linear(hidden.float(), weight.float())`, sigmoid, top-k weights kept fp32
    "flint": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, eager_scores=(0, 3),
                          eager_softmax_fp32=True, eager_qk_fp32=True),
    # modeling_openai_privacy_filter.py: eager only; scores + mask and the max subtracted in the model dtype, the
    # softmax in fp32 (`dtype=torch.float32`: an fp32 copy and its output), two of each at once. Its router:
    # `F.linear(hidden.float(), weight.float(), bias.float())`, softmax over the top-k in fp32, weights kept fp32
    "openai_privacy_filter": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, eager_scores=(2, 2),
                                          eager_softmax_fp32=True),
    # linear attention, SSM and hybrid layers of the families sweep (read from each family's modeling file, 5.25)
    # DeepSeek-V3's router (F.linear(x.float(), w.float()), sigmoid, weights kept fp32); its `linear_attention`
    # layers run Kimi Delta Attention (`chunk_kimi_delta_attention`, per-key decay: `torch_chunk_kda`'s rule)
    "bailing_hybrid": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, linear_scan="chunk_per_key"),
    # the same router and Kimi Delta Attention; hyper-connection streams (hc_mult, planc.compiler.deepseek_v4_memory)
    "glm5_next": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, linear_scan="chunk_per_key"),
    "glm5_next_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, linear_scan="chunk_per_key"),
    # Mamba2 mixers on transformers' reference chunked scan (no mamba_ssm kernels: planc.compiler.ssm_memory);
    # GraniteMoeHybridTopKRouter: softmax over the top-k logits in their dtype (the model dtype)
    "granitemoehybrid": FamilyMemory(linear_scan="mamba2"),
    # NemotronHTopkRouter: F.linear(x.float(), w.float()), sigmoid, weights kept fp32; each block one mixer
    "nemotron_h": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, linear_scan="mamba2",
                               mixer_blocks=True),
    # LaraMiniTopKRouter: F.linear(x.float(), w.float()), softmax, top-k weights cast back to the model dtype;
    # Qwen3-Next's gated delta rule in its `linear_attention` layers, sliding and full attention layers
    "lara_mini": FamilyMemory(router_input_fp32=True),
    # ZayaRouter: an MLP router, softmax in the model dtype; ZayaResidualScaling keeps the residual in fp32; its
    # `hybrid` layers are GQA attention whose q/k pass a causal conv (CCA, `ZayaCCAProjection`): a full-attention
    # KV cache plus a conv state and the last token's delayed value, `hybrid_sliding` the same over a window
    "zaya": FamilyMemory(layer_types=(("hybrid", "full_attention"), ("hybrid_sliding", "sliding_attention")),
                         residual_fp32=True),
    # --- families with their own MoE and mixer layers (the families grid's Ergo, LFM2-MoE, Muse Spark), each read from its
    # transformers 5.25 modeling file
    # modeling_ergo.py: ErgoLinearWithFP32Output runs `F.linear(hidden.float(), weight.float())` off CUDA or with grad,
    # sigmoid, the top-k weights `.to(dtype).float()`; `ErgoExpertNorm` normalizes each routed row in fp32 and
    # multiplies it by its expert's gathered fp32 weight; `embed_tokens` and the residual gates are kept in fp32
    # (`_keep_in_fp32_modules_strict`), so the residual stream is fp32; q_norm/k_norm per head and rotary in fp32;
    # four norms per layer (input, post-attention, pre- and post-feedforward), each `F.rms_norm(x.float(), w.float())`
    "ergo": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, expert_output_norm_fp32=True,
                         fp32_stream=True, qk_norm_fp32=True, complex_rope_fp32=True, sandwich_norms=True,
                         norm_weight_fp32=True),
    # modeling_lfm2_moe.py: the router Linear in the model dtype, sigmoid, the gathered weights `.type_as(logits)`;
    # its `conv` layers are gated short convolutions (`Lfm2MoeShortConv`, peak_memory.short_conv_layer)
    "lfm2_moe": FamilyMemory(layer_types=(("conv", "linear_attention"),), linear_scan="short_conv"),
    # modeling_muse_spark.py: `F.linear(hidden.type(float32), weight.type(float32))`, sigmoid, the top-k weights kept
    # fp32; the experts run at `moe_hidden_size` behind `pre_expert_proj`, each routed row's output normalized in fp32
    # (`MuseSparkTextInputScaledRMSNorm`: the scaled fp32 rows, their fp32 copy, its square); the per-head qk_norm in
    # fp32; four norms per layer, `(x_fp32 * (1 + weight)).type_as(x)`
    "muse_spark": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, expert_output_norm_fp32=True,
                               qk_norm_fp32=True, sandwich_norms=True, norm_weight_fp32=True),
    "muse_spark_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, expert_output_norm_fp32=True,
                                    qk_norm_fp32=True, sandwich_norms=True, norm_weight_fp32=True),
    # --- families new to the grid (GLM-4.5V, MiMo-V2-Flash, Step 3.5), each read from its transformers 5.25 modeling
    # file; the grid's points of GLM-4.5V and Step 3.5 were measured after these rows were written (held out)
    # modeling_glm4v_moe.py: GLM-4.5's router (`F.linear(hidden.type(float32), weight.type(float32))`, sigmoid, the
    # gathered weights kept fp32, the gate weight kept fp32) and attention (partial rotary, cos/sin in the model dtype)
    "glm4v_moe": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    "glm4v_moe_text": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True),
    # modeling_mimo_v2_flash.py: DeepSeek-V3's router (fp32 input, sigmoid, fp32 weights); eager only (sdpa has no
    # sinks). Its `eager_attention_forward` rebinds one name at each step (scores x scale, + mask, the sink column
    # joined in sliding layers, the max subtracted, softmax in the model dtype): two [B, h, S, S(+1)] at once
    "mimo_v2_flash": FamilyMemory(routing_weights_fp32=True, router_input_fp32=True, eager_scores=(2, 0),
                                  eager_max_subtracted=True),
    # modeling_step3p7.py (`step3p5`, the text decoder of Step 3.7): the router Linear in the model dtype,
    # `sigmoid(logits.float())`, the gathered weights kept fp32; q_norm/k_norm per head `_norm(x.float()) *
    # (1 + weight.float())` (two fp32 copies of q at once); every RMSNorm keeps its fp32 normalized states
    "step3p5": FamilyMemory(routing_weights_fp32=True, qk_norm_fp32=True, norm_weight_fp32=True),
    "step3p7": FamilyMemory(routing_weights_fp32=True, qk_norm_fp32=True, norm_weight_fp32=True),
    # modeling_inkling2.py and modeling_inkling2_loop.py (the text decoders): the router on `hidden.float()` with an
    # fp32 weight, sigmoid, the gathered weights fp32 into an fp32 expert accumulation; eager only, over a dense
    # relative-position bias and a per-token sink: scores x scale, + bias, + mask rebind one name (two in the model
    # dtype at once), the sink column joined and `.float()`, the softmax in fp32, then `[..., :-1].to(dtype)`: two
    # [B, h, S, S(+1)] in the model dtype and two in fp32 at its peak; its full layers' query, key and value inputs
    # are three fp32 block-residual mixes (on every layer here: the safe side), kept through the MLP beside the fp32
    # residual and the MLP's fp32 mix; the experts' softcapped SwiGLU in fp32 (`expert_gate_fp32`). Its fp32 short
    # convolutions (on keys and values inside the projections, on both residual branches after them) hold three fp32
    # [tokens, width] at once, under the experts' all-slots buffers at every grid shape; its experts' own fp32
    # accumulation runs only with `experts.implementation: eager` (planc init's plans run grouped_mm, whose slots'
    # buffers bound it). The loop model's looped layers are flagged by planc.compiler.peak_memory's
    # unpriced_features when the model reaches them
    "inkling2": INKLING2,
    "inkling2_text": INKLING2,
    "inkling2_loop": INKLING2,
    "inkling2_loop_text": INKLING2,
}

UNMEASURED = FamilyMemory(
    routing_weights_fp32=True, router_input_fp32=True, measured=False,
    eager_scores=(0, 3), eager_softmax_fp32=True, eager_qk_fp32=True,  # the most a family's eager holds: all fp32
    unpriced=("this family's own allocations were not measured (priced on the safe side: fp32 routing weights "
              "and an fp32 router input)",),
)


def family_memory(model_type: str | None) -> FamilyMemory:
    """The row of `model_type`, or the safe-side default of a family the grid has not measured."""
    return FAMILIES.get(model_type or "", UNMEASURED)


__all__ = ["FAMILIES", "FamilyMemory", "family_memory"]
