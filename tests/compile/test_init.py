"""`planc init --from-transformers`: per family, the output lints clean and compiles on the full-size model."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.compiler.resolve import compile_plan
from planc.lint.runner import lint_text
from planc.runtime.models import build_meta_model
from planc.spec.source import parse_yaml

FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v4"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_init_plan_lints_clean_and_compiles(model_type, tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["init", "--from-transformers", model_type, "-o", str(out)]) == 0
    text = out.read_text()
    assert [d.format() for d in lint_text(text) if d.severity == "error"] == []
    compiled = compile_plan(build_meta_model(model_type), str(out))
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
    """longcat_flash cannot switch its experts implementation and has parameter-free "zero" experts: init still
    writes expert parallelism (its own forward runs under it), without a grouped_gemm rule on the identity child,
    and the compiler counts the experts with weights (gate_up_proj is allocated for the zero experts too)."""
    import torch
    import yaml

    from planc.commands.init import init_plan
    from planc.runtime.families import family
    from planc.runtime.models import tiny_config

    fam = family("longcat_flash")
    config = tiny_config(fam)
    text = init_plan(fam.model_type, config.to_dict(), sizes=(2,))
    plan = yaml.safe_load(text)
    assert plan["parallel"] == {"tp_size": 2, "ep_size": 2}
    assert plan["experts"]["implementation"] == "eager"
    assert plan["ep_plan"] == {
        "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
        "model.layers.*.mlp.experts": "ep_dispatch_experts",
    }
    with torch.device("meta"):
        meta = fam.model_class(config)._from_config(config, dtype=torch.float32)
    compiled = compile_plan(meta, text)
    assert {(e.num_experts, e.num_local_experts) for e in compiled.experts} == {(config.n_routed_experts, 4)}
    # bytes per rank count only the rows install keeps: the experts with weights, split over ep
    gate_up = meta.model.layers[0].mlp.experts.gate_up_proj
    assert gate_up.shape[0] > config.n_routed_experts  # allocated for the zero experts too
    (cov,) = [c for c in compiled.coverage if c.rule.pattern.endswith("experts.gate_up_proj")]
    assert cov.bytes_per_rank * 2 == cov.bytes_total * config.n_routed_experts // gate_up.shape[0]


def test_a_rule_that_suits_one_class_of_blocks_is_kept_for_their_layers():
    """glm5_next: `layers.*.self_attn.o_proj: rowwise` suits the MLA layers and breaks the linear-attention ones
    (PLC631); init keeps it for the MLA layers (so their q_b_proj/kv_b_proj stay colwise) and says so."""
    import torch
    import yaml

    from planc.commands.init import init_plan
    from planc.runtime.families import family
    from planc.runtime.models import tiny_config

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
    compile_plan(meta, text)
