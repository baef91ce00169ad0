"""`planc init --from-transformers`: per family, the output lints clean and compiles on the full-size model."""

from __future__ import annotations

import pytest

import planc
from planc.cli import main
from planc.lint.runner import lint_text
from planc.models.build import build_meta_model
from planc.spec.source import parse_yaml

FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v4"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_init_plan_lints_clean_and_compiles(model_type, tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["init", "--from-transformers", model_type, "-o", str(out)]) == 0
    text = out.read_text()
    assert [d.format() for d in lint_text(text) if d.severity == "error"] == []
    compiled = planc.compile(build_meta_model(model_type), str(out))
    assert compiled.full_coverage and compiled.experts_covered == len(compiled.experts) > 0
    data = parse_yaml(text).data
    # class-correct prefix: every base-model rule starts with `model.`; lm_head comes from the model class
    assert all(k.startswith("model.") for k in data["ep_plan"])
    assert data["tp_plan"]["lm_head"] == "colwise_gather_output"
    assert data["ep_plan"]["model.layers.*.mlp.experts"] == "ep_dispatch_experts"


def test_init_drops_what_transformers_drops_and_says_so(capsys):
    assert main(["init", "--from-transformers", "qwen3_moe"]) == 0
    text = capsys.readouterr().out
    data = parse_yaml(text).data
    # transformers' TP rules on the experts lose to its EP rules; the dense-MLP rules match nothing here
    assert "model.layers.*.mlp.experts" not in data["tp_plan"]
    assert "model.layers.*.mlp.gate_proj" not in data["tp_plan"]
    assert "#   tp_plan `model.layers.*.mlp.gate_proj: colwise`: PLC601: matches nothing" in text
    # 4 KV heads: the largest size that compiles is 4
    assert data["parallel"] == {"tp_size": 4, "ep_size": 4}


def test_unknown_model_type_is_a_usage_error(capsys):
    assert main(["init", "--from-transformers", "no_such_model"]) == 2
    assert "no_such_model" in capsys.readouterr().err


def test_experts_on_their_own_forward_get_an_ep_plan():
    """Every family whose model class cannot switch its experts implementation (the compiler's check, PLC624:
    llama4_text; also longcat_flash and step3p5 before transformers 5.25): init writes `eager`, says why, and
    still writes expert parallelism (the model's own forward runs under it); the plan compiles."""
    import torch
    import yaml

    from planc.models.synthesis import init_plan
    from planc.compiler.walk import can_switch_experts
    from planc.models.families import moe_families
    from planc.models.build import tiny_config

    fixed = [f for f in moe_families() if can_switch_experts(f.model_class(None)) is False]
    assert fixed, "no MoE family of this transformers runs only its own experts forward"
    for fam in fixed:
        config = tiny_config(fam)
        text = init_plan(fam.model_type, config.to_dict(), sizes=(2,))
        plan = yaml.safe_load(text)
        assert plan["experts"]["implementation"] == "eager", fam.text_type
        assert "cannot switch its experts kernel (its own forward runs)" in text
        assert plan["parallel"] == {"tp_size": 2, "ep_size": 2}, fam.text_type
        assert "ep_dispatch_experts" in plan["ep_plan"].values(), fam.text_type
        with torch.device("meta"):
            meta = fam.model_class(config)._from_config(config, dtype=torch.float32)
        planc.compile(meta, text)


def test_parameter_free_experts_get_no_ep_rule_and_are_not_counted():
    """longcat_flash's router also picks parameter-free "zero" experts (identities): init writes expert
    parallelism with no rule for them, and the compiler counts the experts with weights. Before transformers 5.25
    they were an `identity_expert` child of the experts and `gate_up_proj` had rows for them too (which install
    drops); since 5.25 the MoE block adds them outside the experts."""
    import torch
    import yaml

    from planc.models.synthesis import init_plan
    from planc.models.families import family
    from planc.models.build import tiny_config

    fam = family("longcat_flash")
    config = tiny_config(fam)
    text = init_plan(fam.model_type, config.to_dict(), sizes=(2,))
    plan = yaml.safe_load(text)
    assert config.zero_expert_num > 0
    assert plan["parallel"] == {"tp_size": 2, "ep_size": 2}
    assert plan["ep_plan"] == {
        "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
        "model.layers.*.mlp.experts": "ep_dispatch_experts",
    }
    with torch.device("meta"):
        meta = fam.model_class(config)._from_config(config, dtype=torch.float32)
    compiled = planc.compile(meta, text)
    assert {(e.num_experts, e.num_local_experts) for e in compiled.experts} == {(config.n_routed_experts, 4)}
    # bytes per rank count only the rows install keeps: the experts with weights, split over ep
    gate_up = meta.model.layers[0].mlp.experts.gate_up_proj
    assert gate_up.shape[0] >= config.n_routed_experts
    (cov,) = [c for c in compiled.coverage if c.rule.pattern.endswith("experts.gate_up_proj")]
    assert cov.bytes_per_rank * 2 == cov.bytes_total * config.n_routed_experts // gate_up.shape[0]


def test_a_rule_that_suits_one_class_of_blocks_is_kept_for_their_layers():
    """glm5_next: `layers.*.self_attn.o_proj: rowwise` suits the MLA layers and breaks the linear-attention ones
    (PLC631); init keeps it for the MLA layers (so their q_b_proj/kv_b_proj stay colwise) and says so."""
    import torch
    import yaml

    from planc.models.synthesis import init_plan
    from planc.models.families import family
    from planc.models.build import tiny_config

    fam = family("glm5_next_text")
    config = tiny_config(fam)
    with torch.device("meta"):
        meta = fam.model_class(config)._from_config(config, dtype=torch.float32)
    mla = [n.split(".")[3] for n, m in meta.named_modules()
           if n.endswith("self_attn") and type(m).__name__ == "Glm5NextTextAttention"]
    text = init_plan(fam.model_type, config.to_dict(), sizes=(2,))
    tp = yaml.safe_load(text)["tp_plan"]
    layers = mla[0] if len(mla) == 1 else "{" + ",".join(mla) + "}"
    assert tp[f"model.language_model.layers.{layers}.self_attn.o_proj"] == "rowwise"
    assert tp["model.language_model.layers.*.self_attn.q_b_proj"] == "colwise"
    assert "model.language_model.layers.*.self_attn.o_proj" not in tp
    assert "PLC631" in text and "(the layers it suits)" in text
    planc.compile(meta, text)


def test_init_adds_the_gradient_reduction_per_head_norms_need():
    """qwen3_vl_moe: transformers' text plan splits the heads but leaves the per-head q_norm/k_norm without a rule,
    so each rank's norm gradient would be partial (PLC636); init adds the all-reducing rule and says why."""
    import yaml

    from planc.models.synthesis import init_plan

    text = init_plan("qwen3_vl_moe", {}, {"text_config.num_hidden_layers": 2, "vision_config.depth": 1}, sizes=(2,))
    tp = yaml.safe_load(text)["tp_plan"]
    for norm in ("q_norm", "k_norm"):
        assert tp[f"model.language_model.layers.*.self_attn.{norm}"] == "replicated_with_grad_allreduce"
        assert f"self_attn.{norm}: replicated_with_grad_allreduce`: added (PLC636)" in text
    assert tp["model.language_model.layers.*.self_attn.q_proj"] == "colwise"  # the heads stay split


def test_init_keeps_sinks_whole_when_the_heads_stay_whole():
    """mimo_v2_flash at tp 8: its 4 kv heads do not divide, so init drops the q/k/v rules; the per-head sinks must
    go with them (PLC637), else each rank would meet 64 heads with 8 sinks."""
    import yaml

    from planc.models.synthesis import init_plan

    text = init_plan("mimo_v2_flash", None, {"num_hidden_layers": 2, "n_routed_experts": 8}, sizes=(8,))
    tp = yaml.safe_load(text)["tp_plan"]
    assert "model.layers.*.self_attn.q_proj" not in tp and "model.layers.*.self_attn.sinks" not in tp
    assert "`model.layers.*.self_attn.sinks: colwise`: PLC637" in text


# (family, the config's expert-count field, the experts' TP rules init writes without EP)
_TP_EXPERTS = [
    ("flex_olmo", "num_experts", {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}),
    ("aria_text", "moe_num_experts", {"gate_up_proj": "packed_rowwise", "down_proj": "colwise"}),  # [E, H, 2I]
    ("nemotron_h", "n_routed_experts", {"up_proj": "colwise", "down_proj": "rowwise"}),  # no gate
]


@pytest.mark.parametrize("name,count,want", _TP_EXPERTS, ids=[t[0] for t in _TP_EXPERTS])
def test_experts_no_size_divides_are_tensor_parallel(name, count, want):
    """3 experts split over no size: init writes the experts tensor-parallel. transformers declared those TP rules
    up to 5.24; from 5.25 (`moe_tp_experts` deprecated) it declares only EP rules, and init derives the TP ones
    from the experts' layout and says so. Either way the rules are the same."""
    import torch
    import yaml

    from planc.models.synthesis import init_plan
    from planc.models.families import family
    from planc.models.build import tiny_config

    fam = family(name)
    config = tiny_config(fam, **{count: 3})
    text = init_plan(fam.model_type, config.to_dict(), sizes=(2,))
    plan = yaml.safe_load(text)
    assert plan["parallel"] == {"tp_size": 2} and "PLC606 3 experts cannot be split evenly over ep_size=2" in text
    experts = next(k for k, v in plan["tp_plan"].items() if v == "moe_tp_experts")
    assert {k[len(experts) + 1:]: v for k, v in plan["tp_plan"].items() if k.startswith(experts + ".")} == want
    declared = any(v == "moe_tp_experts" for v in (fam.config_class().base_model_tp_plan or {}).values())
    assert ("# tp_plan: the experts' rules derived from their EP rules and layout" in text) == (not declared)
    with torch.device("meta"):
        meta = fam.model_class(config)._from_config(config, dtype=torch.float32)
    compiled = planc.compile(meta, text)
    assert {e.mode for e in compiled.experts} == {"tp"}


def test_experts_tp_styles_cannot_shard_get_no_tp_rules():
    """gpt_oss's experts have biases (every rank would add the down bias once) and interleaved gate|up: no TP
    rules, so 3 experts cannot be planned at tp_size 2, and init says why for each layout it tried."""
    from planc.models.synthesis import init_plan
    from planc.models.families import family
    from planc.models.build import tiny_config

    fam = family("gpt_oss")
    with pytest.raises(ValueError) as e:
        init_plan(fam.model_type, tiny_config(fam, num_local_experts=3).to_dict(), sizes=(2,))
    assert "PLC606 3 experts cannot be split evenly over ep_size=2" in str(e.value)
    assert "PLC602 experts module GptOssExperts has no EP or TP rule" in str(e.value)
