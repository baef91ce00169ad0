"""Compile rules: what `planc.compile` refuses (or warns about) once a plan meets a real module tree.

These rules have no lint check: the compiler emits them (`planc.compiler`), because they need the
model. They live in the one registry so `planc rules PLC601` and docs/lint.md know them, and each
carries a failing and a passing plan that `tests/compiler/test_rule_examples.py` compiles against the
tiny random model of the plan's `model.type` (with `config` overrides where the rule needs them).
Codes are stable: retired ones (planc.lint.registry.RETIRED: the plans that reached them now go through
lint first) are never given again, and `planc rules CODE` says what replaced them.
"""

from __future__ import annotations

from typing import Any, Optional

from planc.lint.diagnostic import WARNING
from planc.lint.registry import Rule, register

UNMATCHED_RULE = "PLC601"
EXPERTS_UNCOVERED = "PLC602"
CONFLICTING_RULES = "PLC603"
STYLE_NOT_INSTALLABLE = "PLC605"
EXPERTS_NOT_DIVISIBLE = "PLC606"
MODEL_TYPE_MISMATCH = "PLC607"
MEGAMOE_NO_GATE = "PLC608"
MEGAMOE_TOP_K = "PLC609"
MEGAMOE_EP_SIZE = "PLC610"
MEGAMOE_SIZES = "PLC611"
MEGAMOE_NOT_FP4 = "PLC612"
WRONG_TARGET = "PLC613"
EXPERTS_PARTIAL = "PLC615"
UNEVEN_SHARD = "PLC616"
HEAD_SPLIT = "PLC617"
MEGAMOE_ACTIVATION = "PLC621"
MEGAMOE_KERNEL_BLOCKS = "PLC622"
BARE_PARAM_UNWRAPPED = "PLC623"
EXPERTS_IMPL_FIXED = "PLC624"
BLOCK_GRID = "PLC625"
LAYOUT_SHARDED_INTO_REPLICATED = "PLC630"
LAYOUT_ROWWISE_WITHOUT_SHARDED = "PLC631"
LAYOUT_OUTPUT_LEFT_SHARDED = "PLC632"
LAYOUT_NORM_OVER_SHARDED = "PLC633"
LAYOUT_PRODUCERS_DISAGREE = "PLC634"
LAYOUT_MODULE_PARAM_CONFLICT = "PLC635"
DEVICE_MEMORY = "PLC660"
REPLICATED_DENSE = "PLC651"
TABLE_INACTIVE = "PLC652"
MEGAMOE_ALIGNMENT = "PLC653"

_TOP = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2, ep_size: 2}\n"
_ATTN = (
    "  model.embed_tokens: embedding_rowwise\n"
    "  model.layers.*.self_attn.{q,k,v}_proj: colwise\n"
    "  model.layers.*.self_attn.o_proj: rowwise\n"
)
_HEAD = "  lm_head: colwise_gather_output\n"
_EP = (
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
)
_GOOD = _TOP + "tp_plan:\n" + _ATTN + _HEAD + _EP
_MOE_TP = (
    "  model.layers.*.mlp.experts.gate_up_proj: packed_colwise\n"
    "  model.layers.*.mlp.experts.down_proj: rowwise\n"
    "  model.layers.*.mlp.experts: moe_tp_experts\n"
)
_V4 = "version: 1\nmodel: {type: deepseek_v4}\nparallel: {tp_size: 2, ep_size: 2}\n"
_V4_EP = _EP + "experts:\n  implementation: deepgemm_megamoe\n  megamoe: {backend: reference, quantize: fp4}\n"


def _compile_rule(
    code: str,
    name: str,
    title: str,
    doc: str,
    bad: str,
    good: str,
    *,
    family: str = "compile",
    severity: str = "error",
    config: Optional[dict[str, Any]] = None,
) -> None:
    register(Rule(code, name, title, doc, None, severity, family, True, bad, good, config=config))


_compile_rule(
    UNMATCHED_RULE, "rule-matches-nothing", "a rule, or one `{a,b}` alternative of it, matches nothing in the model",
    "transformers only warns, after the weights are loaded, about a rule that matches nothing; the layers it "
    "meant stay replicated. planc refuses it and suggests the closest real paths (a missing `model.` prefix "
    "first).",
    _TOP + "tp_plan:\n" + _ATTN + _HEAD + "  model.layers.*.mlp.gate_proj: colwise\n" + _EP, _GOOD,
)
_compile_rule(
    EXPERTS_UNCOVERED, "experts-without-rule", "an experts module has no EP or TP rule while a size is > 1",
    "Experts with no rule are replicated: every rank holds every expert, usually most of the model. Shard "
    "them by expert (`grouped_gemm` + `ep_dispatch_experts` in ep_plan) or by feature (`moe_tp_experts` in "
    "tp_plan with `packed_colwise`/`rowwise` on their parameters).",
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n" + _ATTN + _HEAD,
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n" + _ATTN + _HEAD + _MOE_TP,
)
_compile_rule(
    CONFLICTING_RULES, "two-styles-on-one-target", "two rules give one target different styles, or a rule names a tied parameter",
    "A parameter takes one style. Two rules that both match it (in one table or across tables) would shard it "
    "twice; a rule on one of two tied names would shard a tensor the other name reads whole.",
    _TOP + "tp_plan:\n" + _ATTN + "  model.layers.1.self_attn.q_proj: rowwise\n" + _HEAD + _EP, _GOOD,
)
_compile_rule(
    STYLE_NOT_INSTALLABLE, "style-not-installed", "a style planc's runtime does not install",
    "transformers knows more styles than planc installs (`planc.spec.styles`, rows with `runtime`). planc "
    "refuses such a rule instead of silently skipping it; `replicate` keeps the module whole.",
    _TOP + "tp_plan:\n" + _ATTN + _HEAD + "  model.norm: sequence_parallel\n" + _EP, _GOOD,
)
_compile_rule(
    EXPERTS_NOT_DIVISIBLE, "experts-not-divisible", "the expert count is not a multiple of `ep_size`",
    "Each EP rank holds `num_experts / ep_size` experts. The hint lists sizes from the joint solver "
    "(`planc.spec.sizes.solve_sizes`) under which the plan compiles against this model.",
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1, ep_size: 3, dp_size: 3}\n" + _EP,
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1, ep_size: 2, dp_size: 2}\n" + _EP,
)
_compile_rule(
    MODEL_TYPE_MISMATCH, "model-type-mismatch", "`model.type` differs from the model's `config.model_type`",
    "A plan's paths and sizes are written for one family; compiling it against another is almost always the "
    "wrong file.",
    _GOOD.replace("type: mixtral", "type: qwen3_moe"), _GOOD,
)
_compile_rule(
    MEGAMOE_NO_GATE, "megamoe-needs-gated-experts", "Mega MoE on experts with no gate, or with transposed weights",
    "The Mega MoE kernel computes SwiGLU over [gate | up] rows of gate_up_proj [E, 2I, H]; gpt_oss stores its "
    "experts transposed, so it runs `implementation: grouped_mm`.",
    "version: 1\nmodel: {type: gpt_oss}\nparallel: {tp_size: 2, ep_size: 2}\n"
    + _EP.replace("{gate_up_proj,down_proj}", "{gate_up_proj,down_proj,gate_up_proj_bias,down_proj_bias}")
    + "experts:\n  implementation: deepgemm_megamoe\n  megamoe: {backend: reference, quantize: fp4}\n",
    _V4 + _V4_EP,
)
_compile_rule(
    MEGAMOE_TOP_K, "megamoe-top-k", "Mega MoE with top-k above 32",
    "The kernel routes each token to at most 32 experts.",
    _V4 + _V4_EP, _V4 + _V4_EP.replace("deepgemm_megamoe", "grouped_mm").replace(
        "  megamoe: {backend: reference, quantize: fp4}\n", ""),
    config={"num_experts_per_tok": 33, "n_routed_experts": 64},
)
_compile_rule(
    MEGAMOE_EP_SIZE, "megamoe-ep-size", "Mega MoE with `ep_size` above 72",
    "Mega MoE reaches its peers over one NVLink domain (at most 72 GPUs).",
    _V4.replace("tp_size: 2, ep_size: 2", "tp_size: 80, ep_size: 80") + _V4_EP,
    _V4.replace("tp_size: 2, ep_size: 2", "tp_size: 40, ep_size: 40") + _V4_EP,
    config={"n_routed_experts": 80},
)
_compile_rule(
    MEGAMOE_SIZES, "megamoe-deep-gemm-sizes", "`backend: deep_gemm` with hidden or intermediate sizes not multiples of 128",
    "The deep_gemm kernel's host checks need both sizes divisible by 128; the PyTorch reference backend runs "
    "any size.",
    _V4 + _V4_EP.replace("backend: reference", "backend: deep_gemm"), _V4 + _V4_EP,
)
_compile_rule(
    MEGAMOE_NOT_FP4, "megamoe-needs-fp4", "Mega MoE experts that are not FP4 while `megamoe.quantize` is none",
    "Mega MoE runs FP8 x FP4 experts: load an FP4 checkpoint, or write `megamoe: {quantize: fp4}` to quantize "
    "bf16 experts when the plan is applied.",
    _V4 + _V4_EP.replace("quantize: fp4", "quantize: none"), _V4 + _V4_EP,
)
_compile_rule(
    WRONG_TARGET, "style-on-wrong-target", "a style on the wrong kind of target",
    "`grouped_gemm` shards the expert dimension of an experts parameter (or of a per-expert tensor of a module "
    "inside the experts, such as a per-expert norm); `ep_dispatch_experts` and `moe_tp_experts` hook an experts "
    "module's forward. On anything else they cannot run.",
    _GOOD.replace("model.layers.*.mlp.experts: ep_dispatch_experts", "model.layers.*.mlp.gate: ep_dispatch_experts"),
    _GOOD,
)
_compile_rule(
    EXPERTS_PARTIAL, "experts-partly-sharded", "an experts parameter left whole under EP, or sharded without its module rule",
    "Under EP every experts tensor must be sharded by expert (`grouped_gemm`): a whole tensor would be indexed "
    "with local expert ids. That includes a per-expert tensor of a module inside the experts (leading dim = the "
    "experts count: ergo's `experts.post_expert_norm.weight`). Under `moe_tp_experts`, gate_up/down must be "
    "feature-sharded.",
    _GOOD.replace("{gate_up_proj,down_proj}", "gate_up_proj"), _GOOD,
)
_compile_rule(
    UNEVEN_SHARD, "uneven-shard", "a TP style that splits a dimension unevenly",
    "DTensor would give ranks slices of different sizes, which the forwards do not expect. The hint names "
    "sizes that divide every split dimension.",
    _GOOD.replace("tp_size: 2, ep_size: 2", "tp_size: 3, ep_size: 3").replace(_EP, "ep_plan:\n" + _MOE_TP.replace(
        "  model.layers.*.mlp.experts: moe_tp_experts\n", "").replace("packed_colwise", "grouped_gemm").replace(
        "rowwise", "grouped_gemm") + "  model.layers.*.mlp.experts: ep_dispatch_experts\n"),
    _GOOD,
)
_compile_rule(
    HEAD_SPLIT, "head-split", "a colwise q/k/v or rowwise o_proj that gives a rank a fraction of a head",
    "Attention computes whole heads; a rank with part of a head computes garbage without an error.",
    _GOOD.replace("tp_size: 2, ep_size: 2", "tp_size: 8, ep_size: 8"), _GOOD,
)
_compile_rule(
    MEGAMOE_ACTIVATION, "megamoe-activation", "Mega MoE on a model whose activation is not the kernel's SiLU SwiGLU",
    "Every Mega MoE backend computes SiLU SwiGLU (clamped by `swiglu_limit`) and nothing else. A config with "
    "another `hidden_act`, or with `swiglu_alpha`, `mlp_gate_softcap`/`mlp_up_softcap` (`gate_softcap`/"
    "`up_softcap`) set, would get a different function without an error; such models run "
    "`implementation: grouped_mm`.",
    _V4 + _V4_EP, _V4 + _V4_EP.replace("deepgemm_megamoe", "grouped_mm").replace(
        "  megamoe: {backend: reference, quantize: fp4}\n", ""),
    config={"hidden_act": "gelu"},
)
_compile_rule(
    MEGAMOE_KERNEL_BLOCKS, "megamoe-kernel-blocks",
    "`backend: deep_gemm` with sizes that pass the kernel's host checks but not its block alignment",
    "Sizes that are multiples of 128 pass deep_gemm's host checks, but the kernel also needs hidden / 128 "
    "even and, at decode-sized batches (BLOCK_K 256), intermediate % 256 == 0. `backend: triton` (FP4 kept "
    "packed) or `backend: reference` run any size; with `backend: auto` the same sizes give warning PLC653.",
    _V4 + _V4_EP.replace("backend: reference", "backend: deep_gemm"), _V4 + _V4_EP,
    config={"hidden_size": 384, "moe_intermediate_size": 128},
)
_GRANITE_SWA = (
    "version: 1\nmodel: {type: granitemoe_swa}\nparallel: {tp_size: 2}\ntp_plan:\n"
    "  model.layers.*.self_attn.{q,k,v}_proj: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n"
    "  model.layers.*.self_attn.sinks: colwise\n"
    "  model.layers.*.block_sparse_moe.experts.gate_up_proj: packed_colwise\n"
    "  model.layers.*.block_sparse_moe.experts.down_proj: rowwise\n"
    "  model.layers.*.block_sparse_moe.experts: moe_tp_experts\n"
)
_compile_rule(
    BARE_PARAM_UNWRAPPED, "sharded-parameter-of-unwrapped-module",
    "a TP style shards a bare parameter of a module whose forward planc does not wrap",
    "A TP style on a parameter makes it a DTensor slice; only the forwards planc wraps (styles with "
    "`local_forward` in `planc.spec.styles`) compute on local shards. Any other forward (attention `sinks`, "
    "a shared experts `[n, I, H]` tensor) would mix the DTensor with plain tensors at the first call. Write "
    "`local_params` on the module when its children already reduce the output (per-head parameters sharded "
    "with their heads), `all_reduce` when its output is a partial sum, or delete the rule.",
    _GRANITE_SWA, _GRANITE_SWA + "  model.layers.*.self_attn: local_params\n",
)
_compile_rule(
    EXPERTS_IMPL_FIXED, "experts-implementation-fixed",
    "an experts kernel other than `eager` for a model class that cannot switch its experts implementation",
    "Some model classes run only their own experts forward (transformers' "
    "`_can_set_experts_implementation()` is false: llama4; longcat_flash before transformers 5.25): `grouped_mm` "
    "or Mega MoE cannot be installed on them. `implementation: eager` keeps the model's forward, which the EP "
    "strategies and TP styles wrap.",
    "version: 1\nmodel: {type: llama4_text}\nparallel: {tp_size: 1}\nexperts: {implementation: grouped_mm}\n",
    "version: 1\nmodel: {type: llama4_text}\nparallel: {tp_size: 1}\nexperts: {implementation: eager}\n",
)
_compile_rule(
    LAYOUT_SHARDED_INTO_REPLICATED, "sharded-output-consumed-whole",
    "a sharded output consumed by a module that expects a whole input",
    "A `colwise` module leaves each rank a slice of its output features. Only a `rowwise` consumer takes that "
    "slice; any other module (o_proj with no rule, the residual stream, a router) would compute on a slice as "
    "if it were the whole tensor, or fail with mismatched shapes. Which module feeds which is read from "
    "transformers' `base_model_tp_plan` and from the shared names (q/k/v_proj -> o_proj, gate/up_proj -> "
    "down_proj); the message says which.",
    _TOP + "tp_plan:\n  model.layers.*.self_attn.{q,k,v}_proj: colwise\n" + _EP, _GOOD, family="layout",
)
_compile_rule(
    LAYOUT_ROWWISE_WITHOUT_SHARDED, "rowwise-without-sharded-input", "a `rowwise` whose producers leave their outputs whole",
    "`rowwise` expects its input already split over the last dim (after a `colwise`). With whole inputs, write "
    "`rowwise_split_input`, which slices the input itself, or make the producers colwise.",
    _TOP + "tp_plan:\n  model.layers.*.self_attn.o_proj: rowwise\n" + _EP, _GOOD, family="layout",
)
_compile_rule(
    LAYOUT_OUTPUT_LEFT_SHARDED, "lm-head-left-sharded", "an lm_head whose output is left sharded",
    "With `lm_head: colwise` each rank gets 1/tp of the logits: `generate` picks different tokens on each "
    "rank and a loss with labels fails. `colwise_gather_output` gathers them.",
    _TOP + "tp_plan:\n" + _ATTN + "  lm_head: colwise\n" + _EP, _GOOD, family="layout",
)
_compile_rule(
    LAYOUT_NORM_OVER_SHARDED, "norm-over-sharded-dim", "a norm over a dimension the plan shards",
    "A norm over the whole projected width (OLMoE's q_norm/k_norm, MLA's q_a_layernorm) would normalize each "
    "rank's slice as if it were the whole. Gather first (`colwise_gather_output` + `rowwise_split_input`, "
    "transformers' own OLMoE plan) or leave the projection whole. Per-head norms (Qwen3) are fine.",
    "version: 1\nmodel: {type: deepseek_v3}\nparallel: {tp_size: 2, ep_size: 2}\ntp_plan:\n"
    "  model.layers.*.self_attn.q_a_proj: colwise\n" + _EP,
    "version: 1\nmodel: {type: deepseek_v3}\nparallel: {tp_size: 2, ep_size: 2}\ntp_plan:\n"
    "  model.layers.*.mlp.shared_experts.{gate,up}_proj: colwise\n  model.layers.*.mlp.shared_experts.down_proj: rowwise\n"
    "  model.layers.*.mlp.{gate,up}_proj: colwise\n  model.layers.*.mlp.down_proj: rowwise\n" + _EP,
    family="layout",
)
_compile_rule(
    LAYOUT_PRODUCERS_DISAGREE, "producers-disagree", "modules that feed one consumer leave different layouts",
    "o_proj combines q, k and v (down_proj combines gate and up): either all of them are colwise, with a "
    "rowwise consumer, or none is. The producers of a chain transformers declares include those with a "
    "style planc does not install (`unit_colwise`), whose layouts the style table still gives.",
    _TOP + "tp_plan:\n  model.layers.*.self_attn.q_proj: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n" + _EP,
    _GOOD, family="layout",
)
_compile_rule(
    LAYOUT_MODULE_PARAM_CONFLICT, "module-rule-contradicts-parameter-rule",
    "a module rule and a rule on one of its parameters split it differently",
    "A module style also shards its own parameters; a parameter rule that splits one of them another way hands "
    "the module's forward a weight of the wrong shape (`mat1 and mat2 shapes cannot be multiplied`).",
    _TOP + "tp_plan:\n" + _ATTN + _HEAD + "  lm_head.weight: rowwise\n" + _EP, _GOOD, family="layout",
)
_compile_rule(
    REPLICATED_DENSE, "dense-left-replicated", "dense weights that no rule shards (per generic path, with bytes per rank)",
    "Often intended for norms, routers and small layers; a large replicated group is memory every rank pays.",
    _GOOD, "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1}\n", severity=WARNING,
)
_compile_rule(
    TABLE_INACTIVE, "table-not-applied", "a rule table whose size is 1: checked against the model, not applied",
    "transformers keeps a plan only when its size is > 1; planc still matches the rules so the plan stays "
    "correct when the size is raised.",
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1, ep_size: 1}\n" + _EP,
    "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 1, ep_size: 2, dp_size: 2}\n" + _EP, severity=WARNING,
)
_compile_rule(
    MEGAMOE_ALIGNMENT, "megamoe-alignment", "Mega MoE sizes the kernel's block alignment may not fit",
    "`backend: auto` falls back to the reference below 128-multiples; sizes that pass the host checks but not "
    "the block alignment (hidden % 256, % 512 above 4096; intermediate % 256) are worth verifying on the GPU.",
    _V4 + _V4_EP.replace("backend: reference", "backend: auto"), _V4 + _V4_EP, severity=WARNING,
)
register(Rule(
    BLOCK_GRID, "shard-off-fp8-block-grid", "a TP shard of an FP8 block-scaled weight that is not whole scale blocks",
    "An FP8 checkpoint in the DeepSeek-V3 format (`quantization_config: {quant_method: fp8, weight_block_size: "
    "[128, 128]}`) stores each weight with a `weight_scale_inv` of one factor per 128 x 128 block. Loaded with "
    "FP8 kept (`planc.load` on an FP8-capable GPU, or `dequantize=False`), a scale is sharded with its weight on "
    "the same dim (a colwise shard of rows [r0, r1) holds scale rows [r0/128, r1/128)), so every rank's rows or "
    "columns must be whole blocks: at tp 2 a 384-row weight (192 rows each, 1.5 blocks) is refused. The hint "
    "names sizes that split on the grid; `replicate` the weight, or load with `dequantize=True`, which reads "
    "each rank's scale blocks and dequantizes exactly off the grid too. A block scale with no rule of its own "
    "takes its weight's style. It needs the quantized model `planc.load` builds from an FP8 checkpoint, so it "
    "has no plan-only example: `planc explain PLAN --checkpoint DIR` on such a checkpoint runs it.",
    family="compile",
))
register(Rule(
    DEVICE_MEMORY, "shard-exceeds-device-memory", "a rank's parameters, or its workload's peak, exceed the device memory",
    "A device memory budget comes from `planc explain --device-memory` (a card such as `H100`, or a size: `80GiB` "
    "binary, `80GB` decimal) or from `planc.load`, which reads its device's. Two checks use it. (1) The parameters "
    "each rank holds once loaded (its TP/EP shard: the sharded part plus the replicated part; under "
    "`data_parallel: fsdp` this is the loading moment, before FSDP shards them over dp) must fit; the hint names "
    "the ranks, or the FP8 weights, that would fit. (2) `planc explain` only, with a workload (`--train` or "
    "`--serve` with `--batch`/`--seq`): the workload's peak per rank (parameters, gradients and AdamW state "
    "when training, the activations kept for backward or the KV cache, the largest transient) plus the reserve "
    "outside PyTorch's allocator (`--reserve`, 2 GiB by default) must fit; the hint names the largest "
    "micro-batch (or, with `--seq auto`, sequence) that fits, else what the plan and flags do not already use "
    "(more ranks, fsdp, activation checkpointing, a shorter sequence, FP8 weights when serving). It needs a "
    "model and a budget, so its examples are commands, not plans: `planc explain plans/deepseek_v3.yaml "
    "--device-memory H200` fails (158.11 GiB per rank at tp_size 8), `--device-memory 200GiB` passes; "
    "`planc explain plans/mixtral.yaml --train --batch 1 --seq 4096 --device-memory H100` prices the peak "
    "(docs/memory.md).",
    family="compile",
))
