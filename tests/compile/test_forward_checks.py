"""Compiler checks added for every family (issue 13), on real transformers models on the meta device."""

from __future__ import annotations

import pytest

from planc.compiler.resolve import compile_plan
from planc.errors import CompileError
from planc.runtime.models import build_meta_model


def _codes(plan, model):
    with pytest.raises(CompileError) as info:
        compile_plan(model, plan)
    return info.value.problems


def _attention(prefix="model.layers.*.self_attn"):
    return {f"{prefix}.{p}": s for p, s in
            (("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"), ("o_proj", "rowwise"))}


def test_sharded_sinks_without_a_wrapped_attention_forward_is_refused():
    model = build_meta_model("granitemoe_swa", {"num_hidden_layers": 2})
    plan = {"version": 1, "model": {"type": "granitemoe_swa"}, "parallel": {"tp_size": 2},
            "tp_plan": {**_attention(), "model.layers.*.self_attn.sinks": "colwise",
                        "model.layers.*.block_sparse_moe.experts.gate_up_proj": "packed_colwise",
                        "model.layers.*.block_sparse_moe.experts.down_proj": "rowwise",
                        "model.layers.*.block_sparse_moe.experts": "moe_tp_experts"}}
    (p,) = _codes(plan, model)
    assert p.code == "PLC623" and "model.layers.*.self_attn" in p.message
    assert "`model.layers.*.self_attn: local_params`" in p.hint and p.where == "tp_plan['model.layers.*.self_attn.sinks']"
    plan["tp_plan"]["model.layers.*.self_attn"] = "local_params"
    compiled = compile_plan(model, plan)
    assert ("model.layers.0.self_attn", "local_params") in {(a.fqn, a.style) for a in compiled.assignments}


def test_experts_kernel_the_class_cannot_switch_is_refused():
    model = build_meta_model("longcat_flash", {"num_layers": 1})
    plan = {"version": 1, "model": {"type": "longcat_flash"}, "parallel": {"tp_size": 1},
            "experts": {"implementation": "grouped_mm"}}
    (p,) = _codes(plan, model)
    assert p.code == "PLC624" and "LongcatFlashForCausalLM" in p.message and "implementation: eager" in p.hint
    plan["experts"]["implementation"] = "eager"
    compile_plan(model, plan)


def test_head_check_uses_v_head_dim_for_v_and_o_proj():
    # MiMo-V2-Flash: head_dim 192 for q/k, v_head_dim 128 for v/o; 4 ranks hold whole heads of both
    model = build_meta_model("mimo_v2_flash", {"num_hidden_layers": 2})
    plan = {"version": 1, "model": {"type": "mimo_v2_flash"}, "parallel": {"tp_size": 4},
            "tp_plan": {**_attention(), "model.layers.*.self_attn.sinks": "colwise",
                        "model.layers.*.self_attn": "local_params",
                        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                        "model.layers.*.mlp.experts.down_proj": "rowwise",
                        "model.layers.*.mlp.experts": "moe_tp_experts",
                        "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                        "model.layers.*.mlp.down_proj": "rowwise"}}
    compiled = compile_plan(model, plan)
    assert compiled.parallel.tp_size == 4


def test_per_layer_config_does_not_crash_the_head_check():
    model = build_meta_model("gemma4_text", {"num_hidden_layers": 2})
    plan = {"version": 1, "model": {"type": "gemma4_text"}, "parallel": {"tp_size": 2},
            "tp_plan": {**_attention(), "model.layers.*.experts.gate_up_proj": "packed_colwise",
                        "model.layers.*.experts.down_proj": "rowwise", "model.layers.*.experts": "moe_tp_experts",
                        "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                        "model.layers.*.mlp.down_proj": "rowwise"}}
    try:
        compile_plan(model, plan)
    except CompileError as e:  # a real problem is fine; the per-layer attribute error is not
        assert all(p.code.startswith("PLC") for p in e.problems)


def test_llama4_experts_take_ep_dispatch_only_over_one_batch():
    """Llama 4's experts take every token pre-scaled: expert-parallel over an EP group that holds one batch
    (ep_size == tp_size, planc.runtime.ep.dense), refused (PLC613) when the EP group spans data-parallel replicas."""
    model = build_meta_model("llama4_text", {"num_hidden_layers": 2})
    plan = {"version": 1, "model": {"type": "llama4_text"}, "parallel": {"tp_size": 2, "ep_size": 2},
            "experts": {"implementation": "eager"},
            "ep_plan": {"model.layers.*.feed_forward.experts.gate_up_proj": "grouped_gemm",
                        "model.layers.*.feed_forward.experts.down_proj": "grouped_gemm",
                        "model.layers.*.feed_forward.experts": "ep_dispatch_experts"}}
    compiled = compile_plan(model, plan)  # compiles: every experts module expert-parallel
    assert compiled.experts_covered == len(compiled.experts) > 0
    plan["parallel"] = {"tp_size": 1, "ep_size": 2, "dp_size": 2}
    problems = _codes(plan, model)
    assert any(p.code == "PLC613" and "pre-scaled" in p.message and "ep_size == tp_size" in p.message
               and "packed_rowwise" in p.hint for p in problems), problems