"""The seeded-bug corpus: plans that compile and install on custom models yet compute something else.

Each wrong plan must be caught (`ok` False) with the right first module named and the plan rule behind it; the same
model under a right plan must be certified (no false alarm). Models come from `--build` functions
(tests/verify/seeded_models.py); plans from tests/verify/plans. 2 gloo ranks each (tp_size 2, ep_size 2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import planc

PLANS = Path(__file__).parent / "plans"
MODELS = "tests.verify.seeded_models"

# (build function, wrong plan, right plan, stage caught in, first module (suffix), parameter suffix, rule pattern)
CASES = {
    "fused_projection_colwise": ("fused_mlp_model", "qwen3_fused_mlp_colwise.yaml", "qwen3_fused_mlp_packed_colwise.yaml",
                                 "logits", "model.layers.0.mlp", None, "model.layers.0.mlp.gate_up_proj"),
    "norm_over_sharded_dim": ("norm_q_model", "mixtral_attention_tp.yaml", "mixtral_attention_replicated.yaml",
                              "logits", "model.layers.0.self_attn", None, "model.layers.*.self_attn.{q,k,v}_proj"),
    "replicated_param_partial_grad": ("gain_q_model", "mixtral_attention_tp.yaml", "mixtral_gain_reduced.yaml",
                                      "grads", "self_attn.q_scale", "self_attn.q_scale.weight",
                                      "model.layers.*.self_attn.{q,k,v}_proj"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_plan_caught_at_its_first_module(case):
    build, wrong, _, stage, module, parameter, pattern = CASES[case]
    report = planc.verify(f"{MODELS}:{build}", str(PLANS / wrong))
    assert report.error is None, report.error
    assert not report.ok and report.exit_code == 1, report.render_text()
    d = report.first_divergence
    assert d is not None, report.render_text()
    assert d.stage == stage and d.module.endswith(module), d.describe()
    if parameter is None:
        assert d.parameter is None and d.direction == "forward"
    else:
        assert d.parameter.endswith(parameter) and d.direction == "backward"
    assert d.rule is not None and d.rule.pattern == pattern, d.describe()
    assert d.where.startswith(str(PLANS / wrong)) and d.where.count(":") == 2  # file:line:col of that rule
    assert report.stage(stage).max_rel_error > 10 * report.stage(stage).tolerance


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_right_plan_certified(case):
    build, _, right, *_ = CASES[case]
    report = planc.verify(f"{MODELS}:{build}", str(PLANS / right))
    assert report.ok and report.exit_code == 0, report.render_text()
    assert report.first_divergence is None
    assert [s.name for s in report.stages] == ["logits", "generate", "loss", "grads", "step"]
