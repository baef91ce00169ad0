"""Plan fragments the compile rules' examples share (`compile_rule(..., bad, good)` beside each check).

Each example is a whole plan, compiled in tests/compiler/test_rule_examples.py against the tiny random
model of its `model.type`; most are the passing plan `GOOD` (mixtral, tp 2, ep 2) with one line changed.
"""

# mixtral at tp 2, ep 2: the header, then its attention, lm_head and EP experts rules.
TOP = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2, ep_size: 2}\n"
ATTN = (
    "  model.embed_tokens: embedding_rowwise\n"
    "  model.layers.*.self_attn.{q,k,v}_proj: colwise\n"
    "  model.layers.*.self_attn.o_proj: rowwise\n"
)
HEAD = "  lm_head: colwise_gather_output\n"
EP = (
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
)
GOOD = TOP + "tp_plan:\n" + ATTN + HEAD + EP
# mixtral experts split by feature (tp_plan), and deepseek_v4 with Mega MoE experts.
MOE_TP = (
    "  model.layers.*.mlp.experts.gate_up_proj: packed_colwise\n"
    "  model.layers.*.mlp.experts.down_proj: rowwise\n"
    "  model.layers.*.mlp.experts: moe_tp_experts\n"
)
V4 = "version: 1\nmodel: {type: deepseek_v4}\nparallel: {tp_size: 2, ep_size: 2}\n"
V4_EP = EP + "experts:\n  implementation: deepgemm_megamoe\n  megamoe: {backend: reference, quantize: fp4}\n"

