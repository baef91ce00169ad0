"""Compiler checks that every family needs, on real transformers models on the meta device."""

from __future__ import annotations

import pytest

import planc
from planc.errors import CompileError
from planc.models.build import build_meta_model


def _codes(plan, model):
    with pytest.raises(CompileError) as info:
        planc.compile(model, plan)
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
    compiled = planc.compile(model, plan)
    assert ("model.layers.0.self_attn", "local_params") in {(a.fqn, a.style) for a in compiled.assignments}


def test_experts_kernel_the_class_cannot_switch_is_refused():
    """Every MoE family whose model class cannot switch its experts implementation, found by the compiler's own
    check (llama4_text; also longcat_flash and step3p5 before transformers 5.25, which wrapped their experts)."""
    import torch

    from planc.compiler.walk import can_switch_experts
    from planc.models.families import moe_families
    from planc.models.build import tiny_config

    fixed = [f for f in moe_families() if can_switch_experts(f.model_class(None)) is False]
    assert fixed, "no MoE family of this transformers runs only its own experts forward: PLC624 has no example"
    for fam in fixed:
        config = tiny_config(fam)
        with torch.device("meta"):
            model = fam.model_class(config)._from_config(config, dtype=torch.float32)
        plan = {"version": 1, "model": {"type": fam.model_type}, "parallel": {"tp_size": 1},
                "experts": {"implementation": "grouped_mm"}}
        (p,) = _codes(plan, model)
        assert p.code == "PLC624" and type(model).__name__ in p.message and "implementation: eager" in p.hint
        plan["experts"]["implementation"] = "eager"
        planc.compile(model, plan)


def test_head_check_uses_v_head_dim_for_v_and_o_proj():
    # MiMo-V2-Flash: head_dim 192 for q/k, v_head_dim 128 for v/o (4 KV heads: v_proj 512 features)
    model = build_meta_model("mimo_v2_flash", {"num_hidden_layers": 2})
    plan = {"version": 1, "model": {"type": "mimo_v2_flash"}, "parallel": {"tp_size": 4},
            "tp_plan": {**_attention(), "model.layers.*.self_attn.sinks": "colwise",
                        "model.layers.*.self_attn": "local_params",
                        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                        "model.layers.*.mlp.experts.down_proj": "rowwise",
                        "model.layers.*.mlp.experts": "moe_tp_experts",
                        "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                        "model.layers.*.mlp.down_proj": "rowwise"}}
    # 4 ranks: 128 features of v_proj each, one whole v head (a check reading head_dim 192 would refuse them)
    v_proj = next(c for c in planc.compile(model, plan).coverage if c.rule.pattern.endswith("v_proj"))
    assert v_proj.bytes_per_rank * 4 == v_proj.bytes_total > 0
    # 8 ranks split the 4 KV heads: k_proj is measured in 192-wide heads, v_proj in 128-wide ones
    plan["parallel"]["tp_size"] = 8
    split = {p.message.split(" features of ")[1].split(".weight")[0]: p.message for p in _codes(plan, model)
             if p.code == "PLC617"}
    assert "96 features" in split["model.layers.*.self_attn.k_proj"] and "(head_dim 192)" in split[
        "model.layers.*.self_attn.k_proj"]
    assert "64 features" in split["model.layers.*.self_attn.v_proj"] and "(head_dim 128)" in split[
        "model.layers.*.self_attn.v_proj"]


def test_per_layer_config_gives_the_head_check_each_layers_head_dim():
    # Gemma 4: a per-layer config with no global head_dim (sliding layers 256 wide, full-attention layers 512)
    model = build_meta_model("gemma4_text", {"num_hidden_layers": 2})
    plan = {"version": 1, "model": {"type": "gemma4_text"}, "parallel": {"tp_size": 4},
            "tp_plan": {**_attention(), "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                        "model.layers.*.mlp.down_proj": "rowwise",
                        # per-head q/k norms under split heads: their gradients are all-reduced (PLC636)
                        "model.layers.*.self_attn.{q,k}_norm": "replicated_with_grad_allreduce"}}
    compiled = planc.compile(model, plan)  # 4 KV heads of each width: one whole head per rank
    assert compiled.bytes_per_rank < compiled.bytes_total
    plan["parallel"]["tp_size"] = 8
    widths = {(p.message.split(" features of ")[0].rsplit(" ", 1)[1], p.message.rsplit("head_dim ", 1)[1].split(")")[0])
              for p in _codes(plan, model) if p.code == "PLC617" and "v_proj" in p.message}
    assert widths == {("128", "256"), ("256", "512")}  # each layer's v_proj in its own head width


def test_llama4_experts_take_ep_dispatch_only_over_one_batch():
    """Llama 4's experts take every token pre-scaled: expert-parallel over an EP group that holds one batch
    (ep_size == tp_size, planc.runtime.ep.dense), refused (PLC613) when the EP group spans data-parallel replicas."""
    model = build_meta_model("llama4_text", {"num_hidden_layers": 2})
    plan = {"version": 1, "model": {"type": "llama4_text"}, "parallel": {"tp_size": 2, "ep_size": 2},
            "experts": {"implementation": "eager"},
            "ep_plan": {"model.layers.*.feed_forward.experts.gate_up_proj": "grouped_gemm",
                        "model.layers.*.feed_forward.experts.down_proj": "grouped_gemm",
                        "model.layers.*.feed_forward.experts": "ep_dispatch_experts"}}
    compiled = planc.compile(model, plan)  # compiles: every experts module expert-parallel
    assert compiled.experts_covered == len(compiled.experts) > 0
    plan["parallel"] = {"tp_size": 1, "ep_size": 2, "dp_size": 2}
    problems = _codes(plan, model)
    assert any(p.code == "PLC613" and "pre-scaled" in p.message and "ep_size == tp_size" in p.message
               and "packed_rowwise" in p.hint for p in problems), problems


def _needs(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers has no {model_type} before 5.25")


def test_per_expert_tensor_inside_experts_is_sharded_by_expert_with_them():
    """ergo's experts hold a per-expert norm (`post_expert_norm.weight` [E, H]) that their forward indexes with the
    expert ids it runs: under EP it takes `grouped_gemm` like the experts' own tensors, and leaving it whole is
    refused (PLC615); `grouped_gemm` on a tensor outside any experts module stays PLC613."""
    _needs("ergo")
    model = build_meta_model("ergo", {"num_hidden_layers": 2, "num_experts": 8})
    experts = "model.layers.*.mlp.experts"
    ep_plan = {f"{experts}.up_proj": "grouped_gemm", f"{experts}.down_proj": "grouped_gemm",
               experts: "ep_dispatch_experts"}
    plan = {"version": 1, "model": {"type": "ergo"}, "parallel": {"tp_size": 2, "ep_size": 2}, "ep_plan": ep_plan}
    problems = _codes(plan, model)
    assert {p.code for p in problems} == {"PLC615"}
    assert all("post_expert_norm.weight" in p.message and "local expert ids" in p.message for p in problems)
    assert problems[0].hint == f"add `{experts}.post_expert_norm.weight: grouped_gemm` to ep_plan"
    ep_plan[f"{experts}.post_expert_norm.weight"] = "grouped_gemm"
    compiled = planc.compile(model, plan)
    norm = [a for a in compiled.assignments if a.fqn.endswith("mlp.experts.post_expert_norm.weight")]
    assert norm and {a.style for a in norm} == {"grouped_gemm"}
    plan["ep_plan"] = {**ep_plan, "model.layers.*.input_layernorm.weight": "grouped_gemm"}
    assert {p.code for p in _codes(plan, model)} == {"PLC613"}


def test_projections_transformers_chains_with_a_style_planc_lacks_must_agree():
    """minicpm5_moe's plan shards q_gate_proj `colwise` and k/v_proj `unit_colwise` (a transformers 5.25 style planc
    does not install), all feeding o_proj: keeping q sharded with k/v whole is refused (PLC634), not compiled."""
    _needs("minicpm5_moe")
    model = build_meta_model("minicpm5_moe", {"num_hidden_layers": 2})
    attn = "model.layers.*.self_attn"
    plan = {"version": 1, "model": {"type": "minicpm5_moe"}, "parallel": {"tp_size": 2},
            "tp_plan": {f"{attn}.q_gate_proj": "colwise", f"{attn}.o_proj": "rowwise"}}
    plan["tp_plan"].update({"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                            "model.layers.*.mlp.experts.down_proj": "rowwise",
                            "model.layers.*.mlp.experts": "moe_tp_experts"})
    problems = _codes(plan, model)
    assert {p.code for p in problems} == {"PLC634"}
    assert "k_proj, v_proj" in problems[0].message and "MiniCPM5MoeConfig.base_model_tp_plan" in problems[0].message
    assert problems[0].where == f"tp_plan['{attn}.q_gate_proj']"
    plan["tp_plan"].update({f"{attn}.k_proj": "colwise", f"{attn}.v_proj": "colwise"})
    planc.compile(model, plan)
