"""The Mega MoE kernel stages of `planc verify`: the Triton backend against the reference backend at a plan's per-rank
shapes, on the same FP4 weights and tokens.

Off a GPU the kernels run under Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1), at tiny shapes
here; the `gpu` tests run `planc verify plans/deepseek_v4_megamoe.yaml` at the real DeepSeek-V4 shapes. A seeded bug,
a Triton weight layout whose scale bytes for one expert are one binade off, is caught with that expert named.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV4Config

import planc
from planc.kernels.megamoe.triton import layout, target
from planc.lint.plan_loader import load_plan, with_values
from planc.verification.kernels import kernel_device, run_kernel_stages, token_batches
from planc.verification.report import SkippedStage, StageResult, VerifyReport

PLAN = str(Path(__file__).resolve().parents[2] / "plans" / "deepseek_v4_megamoe.yaml")
CORRUPTED_EXPERT = 1  # local index on every rank: global id 1 on rank 0

interpreted = pytest.mark.skipif(not target.interpreting(), reason="CPU tensors need Triton's interpreter")


@pytest.fixture
def corrupt_one_expert(monkeypatch):
    """A layout bug in the Triton backend: the scale bytes of one expert come out one binade high (its weights
    doubled) in both GEMMs; every other expert's bytes are right."""
    shuffle = layout.shuffle_fp4

    def wrong(packed, scales):
        words, sbytes = shuffle(packed, scales)
        sbytes = sbytes.clone()
        sbytes[CORRUPTED_EXPERT] += 1
        return words, sbytes

    monkeypatch.setattr(layout, "shuffle_fp4", wrong)


def _tiny_plan():
    """The Mega MoE plan at 2 ranks with a prefill of 8 tokens per rank, and a DeepSeek-V4 config whose experts the
    Triton layout tiles (hidden and intermediate % 64)."""
    loaded = load_plan(PLAN, parallel={"tp_size": 2, "ep_size": 2})
    loaded = with_values(loaded, ("experts", "megamoe"), {"max_tokens_per_rank": 8}, "a test's prefill")
    return loaded, DeepseekV4Config(hidden_size=128, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                                    num_hidden_layers=1, vocab_size=128)


def test_batches_and_where_the_stages_run():
    assert token_batches(None) == (1, 24, 4096)
    assert token_batches(type("S", (), {"max_tokens_per_rank": 8})()) == (1, 8)
    assert token_batches(type("S", (), {"max_tokens_per_rank": 2000})()) == (1, 24, 2000)
    assert kernel_device(False) == (None, "not asked for (--no-kernels)")
    if not torch.cuda.is_available():
        device, why = kernel_device(None)
        assert device is None and ("no CUDA GPU" in why or "interpreter" in why)


def test_a_stage_not_run_is_reported_not_failed():
    ran = StageResult("logits", 0.0, 0.0, 1e-4, "rule", True)
    report = VerifyReport("p.yaml", 2, {"tp_size": 2}, "float32", "m", stages=[ran],
                          skipped=[SkippedStage("kernels", "no CUDA GPU here")])
    assert report.ok and report.exit_code == 0
    assert "kernels" in report.render_text() and "not run: no CUDA GPU here" in report.render_text()
    assert report.to_json()["skipped"] == [{"name": "kernels", "reason": "no CUDA GPU here"}]


def test_a_kernel_mismatch_says_the_sharding_held():
    ran = StageResult("logits", 0.0, 0.0, 1e-4, "rule", True)
    kernel = StageResult("kernels[24]", 0.1, 0.5, 1e-4, "kernels: calc_diff", False, measure="calc_diff")
    report = VerifyReport("p.yaml", 2, {"tp_size": 2}, "float32", "m", stages=[ran, kernel])
    assert report.exit_code == 1
    assert "the Triton Mega MoE kernels do not compute what the reference backend computes" in report.render_text()


@interpreted
def test_triton_equals_the_reference_at_the_plans_per_rank_shapes():
    loaded, config = _tiny_plan()
    out = run_kernel_stages(loaded, config, torch.device("cpu"), layers=1)
    assert [s.name for s in out.stages] == ["kernels[1]", "kernels[8]"]
    assert all(s.ok and s.measure == "calc_diff" and s.tolerance == 1e-4 for s in out.stages), out.stages
    assert out.divergence is None and not out.skipped
    assert "4 experts per rank (of 8, ep_size 2), hidden 128, intermediate 64, top-2" in out.notes[0]
    fewest = [int(re.search(r"(\d+)-\d+ slots on the rank's experts", s.detail).group(1)) for s in out.stages]
    assert all(n > 0 for n in fewest), fewest  # the experts computed something: not zeros against zeros


@interpreted
def test_a_layout_bug_in_one_expert_is_caught_and_named(corrupt_one_expert):
    loaded, config = _tiny_plan()
    out = run_kernel_stages(loaded, config, torch.device("cpu"), layers=1)
    assert not out.stages[-1].ok and out.stages[-1].max_rel_error > 100 * out.stages[-1].tolerance
    d = out.divergence
    assert d is not None and d.module == "model.layers.0.mlp.experts" and d.direction == "kernel"
    assert d.expert == CORRUPTED_EXPERT and d.tokens in (1, 8), d
    assert f"worst expert {CORRUPTED_EXPERT}" in d.describe()


@pytest.mark.distributed
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_megamoe_plan_verifies_its_triton_kernels_at_real_shapes():
    """`planc verify plans/deepseek_v4_megamoe.yaml` on a GPU: the CPU ranks' serving stages, then every Mega MoE
    layer's rank share at DeepSeek-V4's real widths, Triton against the reference backend."""
    report = planc.verify(plan=PLAN)
    assert report.ok, report.render_text()
    names = [s.name for s in report.stages]
    assert names == ["logits", "generate", "kernels[1]", "kernels[24]", "kernels[4096]"], names
    assert not report.skipped
    note = next(n for n in report.notes if n.startswith("kernel stages on"))
    assert "43 Mega MoE layers" in note and "32 experts per rank (of 256, ep_size 8), hidden 4096, intermediate 2048" \
        in note, note
    print(report.render_text())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_layout_bug_in_one_expert_is_caught_at_real_shapes(corrupt_one_expert):
    out = run_kernel_stages(load_plan(PLAN), DeepseekV4Config(), torch.device("cuda"), layers=1)
    assert not out.stages[-1].ok, out.stages
    d = out.divergence
    assert d is not None and d.module == "model.layers.0.mlp.experts" and d.expert == CORRUPTED_EXPERT, d
    print(d.describe())
