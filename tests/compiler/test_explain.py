"""`planc explain` on the full-size default configs with the shipped plans, and its failure modes."""

from __future__ import annotations

import json
import os

import pytest

from planc.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = {
    "mixtral.yaml": 32,
    "qwen3_moe.yaml": 24,
    "gpt_oss.yaml": 36,
    "deepseek_v3.yaml": 58,
    "deepseek_v4_allreduce.yaml": 43,
    "deepseek_v4_megamoe.yaml": 43,
}


def plan(name):
    return os.path.join(ROOT, "plans", name)


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "plans"))))
def test_shipped_plan_has_full_coverage_on_the_full_size_model(name, capsys):
    """Every shipped plan (docs/compile.md says so); the experts counts of the families checked by number."""
    assert main(["explain", plan(name), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["full_coverage"] is True
    assert data["experts_covered"] == len(data["experts"]) == SHIPPED.get(name, len(data["experts"])) > 0
    assert all(c["modules"] + c["parameters"] > 0 for c in data["coverage"])
    assert data["bytes_per_rank"] < data["bytes_total"]
    strategy = data["experts"][0]["strategy"]
    assert strategy["reason"]
    if name == "deepseek_v4_megamoe.yaml":
        assert strategy["strategy"] == "MegaMoeEP"


def test_text_output_groups_by_rule(capsys):
    assert main(["explain", plan("mixtral.yaml")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.*.self_attn.{q,k,v}_proj" in out and "96 modules" in out
    assert "strategy AutoEP:" in out and "coverage: full" in out
    assert "per rank:" in out and "replicated" in out


def test_set_overrides_the_config(capsys):
    assert main(["explain", plan("mixtral.yaml"), "--set", "num_hidden_layers=2", "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["experts"]) == 2


def test_config_json(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 3, "architectures": ["MixtralForCausalLM"]}))
    assert main(["explain", plan("mixtral.yaml"), "--config", str(cfg), "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["experts"]) == 3


def test_plan_that_does_not_resolve_exits_1_with_the_problems(tmp_path, capsys):
    text = open(plan("mixtral.yaml")).read().replace("model.layers.*.self_attn.o_proj", "model.layers.*.self_attn.out_proj")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["explain", str(bad), "--set", "num_hidden_layers=2"]) == 1
    err = capsys.readouterr().err
    assert "PLC601" in err and f"{bad}:" in err and "model.layers.*.self_attn.o_proj" in err


def test_bad_set_is_a_usage_error(capsys):
    assert main(["explain", plan("mixtral.yaml"), "--set", "num_hidden_layers"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_several_plans_as_pre_commit_passes_them(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(plan("mixtral.yaml")).read().replace("lm_head", "lm_heed"))
    assert main(["explain", plan("mixtral.yaml"), str(bad), "--set", "num_hidden_layers=2"]) == 1
    captured = capsys.readouterr()
    assert "coverage: full" in captured.out and "lm_heed" in captured.err and "`lm_head`" in captured.err


def test_explain_shows_the_training_mode(tmp_path, capsys):
    with open(plan("mixtral.yaml"), encoding="utf-8") as f:
        text = f.read()
    assert "training:" not in text
    assert main(["explain", plan("mixtral.yaml"), "--set", "num_hidden_layers=1"]) == 0
    assert "training: data_parallel=replicate over dp_size=" in capsys.readouterr().out
    p = tmp_path / "train.yaml"
    p.write_text(text + "training:\n  data_parallel: fsdp\n  mixed_precision: {param_dtype: bfloat16}\n")
    assert main(["explain", str(p), "--set", "num_hidden_layers=1", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["data_parallel"] == "fsdp"
    assert data["training"] == {
        "data_parallel": "fsdp", "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
    }
    assert main(["explain", str(p), "--set", "num_hidden_layers=1"]) == 0
    assert "mixed_precision param_dtype=bfloat16 reduce_dtype=float32" in capsys.readouterr().out


def test_train_counts_no_gradients_for_inference_only_experts(capsys):
    """Mega MoE experts cannot train: `--train` holds their parameters without gradients or AdamW state."""
    assert main(["explain", plan("deepseek_v4_megamoe.yaml"), "--train", "--format", "json"]) == 0
    train = json.loads(capsys.readouterr().out)["train"]
    frozen = train["inference_only_parameters_per_rank"]
    assert 0 < frozen < train["parameters_per_rank"]
    indexers = train["indexer_parameters_per_rank"]  # its CSA layers' indexers return token indices: no gradient
    assert train["gradients_per_rank"] == train["parameters_per_rank"] - frozen - indexers
    assert train["optimizer_per_rank"] == 2 * train["gradients_per_rank"] + 4 * train["tensors"]
    assert main(["explain", plan("deepseek_v4_megamoe.yaml"), "--train"]) == 0
    assert "experts of an inference-only EP strategy (Mega MoE): held, without gradients" in capsys.readouterr().out


def test_train_bytes_keep_the_fp32_routers_of_a_bf16_model(capsys):
    """transformers (5.24 on) keeps DeepSeek-V3's router in fp32 inside a bf16 model: explain counts it so; with
    5.23, which builds it bf16, no parameter is fp32."""
    from tests.fp32_routers import routers_kept_fp32

    assert main(["explain", plan("deepseek_v3.yaml"), "--dtype", "bfloat16", "--train", "--format", "json"]) == 0
    by_dtype = json.loads(capsys.readouterr().out)["train"]["parameters_by_dtype"]
    if not routers_kept_fp32("deepseek_v3"):
        assert set(by_dtype) == {"bfloat16"}, by_dtype
        return
    # 58 MoE layers' routers (256 x 7168) in fp32, replicated over TP
    assert by_dtype["float32"] >= 58 * 256 * 7168 * 4 and by_dtype["bfloat16"] > 100 * by_dtype["float32"]
