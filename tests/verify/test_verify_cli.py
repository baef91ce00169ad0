"""`planc verify` on bad input: one clear message, exit 2, no traceback, no rank started; and the report's shape.

None of these spawn a rank: every refusal happens in the parent before the world starts (seconds each).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import planc
from planc.verification import VerifyReport
from planc.verification.report import Divergence, RuleRef, StageResult
from planc.verification.shrink import shrunk_count, size_overrides
from planc.verification.tolerance import tolerance
from tests.checkout_env import checkout_env

ROOT = Path(__file__).resolve().parents[2]
PLANS = Path(__file__).parent / "plans"
MIXTRAL = str(ROOT / "plans" / "mixtral.yaml")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planc", "verify", *args], capture_output=True, text=True,
                          env=checkout_env(), cwd=ROOT, timeout=600)


def _refused(report: VerifyReport, *words: str) -> None:
    assert report.error is not None and report.exit_code == 2 and not report.ok
    assert "Traceback" not in report.error
    for w in words:
        assert w in report.error, report.error


def test_plan_that_does_not_compile_gives_its_diagnostics(tmp_path):
    plan = tmp_path / "bad.yaml"
    plan.write_text(Path(MIXTRAL).read_text().replace("model.layers.*.self_attn.o_proj: rowwise",
                                                      "model.layers.*.self_attn.o_prj: rowwise"))
    report = planc.verify(plan=str(plan))
    _refused(report, "does not resolve", "o_prj", f"{plan}:")


def test_plan_that_does_not_load(tmp_path):
    plan = tmp_path / "bad.yaml"
    plan.write_text("version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 3, ep_size: 2}\n")
    _refused(planc.verify(plan=str(plan)), "does not load")


@pytest.mark.parametrize("target, words", [
    ("tests.verify.seeded_models", "write pkg.module:function"),
    ("tests.verify.no_such_module:build", "cannot import `tests.verify.no_such_module`"),
    ("tests.verify.seeded_models:no_such_fn", "has no attribute `no_such_fn`"),
    ("tests.verify.seeded_models:not_a_module", "returned a dict, not a torch.nn.Module"),
    ("tests.verify.seeded_models:raises", "raised RuntimeError: the checkpoint bucket is not reachable"),
])
def test_bad_build_target(target, words):
    _refused(planc.verify(target, str(PLANS / "mixtral_attention_tp.yaml")), words)


def test_nested_callable_refused():
    def build():
        return None

    _refused(planc.verify(build, str(PLANS / "mixtral_attention_tp.yaml")), "module-level function")


def test_unbuildable_model_names_its_source(tmp_path):
    _refused(planc.verify(plan=MIXTRAL, model_type="mixtrall"), "--model-type mixtrall", "mixtral")
    _refused(planc.verify(plan=MIXTRAL, model=str(tmp_path)), f"--model {tmp_path}", "config.json")
    (tmp_path / "config.json").write_text("{not json")
    _refused(planc.verify(plan=MIXTRAL, model=str(tmp_path)), "cannot read its config")


def test_world_too_large_for_the_host():
    _refused(planc.verify(plan=MIXTRAL, parallel={"tp_size": 8, "ep_size": 8, "dp_size": 16}), "128 ranks",
             "at most 64")


def test_sizes_that_do_not_divide_at_the_real_widths_give_the_compile_diagnostics(tmp_path):
    # 6 KV heads over tp 4: the real model does not compile, and the shrink keeps that (4 does not divide 2 KV heads)
    plan = tmp_path / "p.yaml"
    plan.write_text(Path(MIXTRAL).read_text().replace("tp_size: 8", "tp_size: 4").replace("ep_size: 8", "ep_size: 4"))
    report = planc.verify(plan=str(plan), overrides={"num_key_value_heads": 6, "num_attention_heads": 24})
    _refused(report, "does not resolve", "PLC617", f"{plan}:17:3")
    assert "num_key_value_heads 6->2" in " ".join(report.shrink)


def test_unfaithful_shrink_is_refused():
    # a shrink that gave 8 KV heads over tp 8 only 4 would drop the k/v rules the real model keeps
    from planc.errors import VerifyError
    from planc.lint.plan_loader import load_plan
    from planc.models.build import build_meta_model
    from planc.verification.shrink import check_faithful

    real = build_meta_model("mixtral", {"num_hidden_layers": 1})
    unfaithful = build_meta_model("mixtral", {"num_hidden_layers": 1, "num_key_value_heads": 4})
    with pytest.raises(VerifyError, match="no faithful shrink|would change how the plan shards"):
        check_faithful(real, unfaithful, load_plan(MIXTRAL))
    check_faithful(real, build_meta_model("mixtral", {"num_hidden_layers": 1, "hidden_size": 512}), load_plan(MIXTRAL))


def test_cli_exit_2_without_traceback(tmp_path):
    r = _cli(str(PLANS / "mixtral_attention_tp.yaml"), "--build", "tests.verify.seeded_models:not_a_module")
    assert r.returncode == 2, r.stderr
    assert "returned a dict" in r.stderr and "Traceback" not in r.stderr + r.stdout
    r = _cli(str(PLANS / "mixtral_attention_tp.yaml"), "--build", "x:y", "--format", "json")
    assert r.returncode == 2
    data = json.loads(r.stdout)
    assert data["exit_code"] == 2 and "cannot import" in data["error"] and data["ok"] is False


def test_shrink_keeps_divisibility():
    assert shrunk_count(4, 8, 8) == 8  # 8 KV heads over 8 ranks: one each, still
    assert shrunk_count(32, 1407, 8, align=4) == 36  # 1407 % 8 != 0: still does not divide; rows of 16 bytes
    assert shrunk_count(32, 1407, 8) == 33
    assert shrunk_count(4, 1, 8) == 1  # never above the real count
    out = size_overrides({"num_attention_heads": 4, "num_key_value_heads": 4, "num_local_experts": 8},
                         {"num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8}, 8, 8)
    assert out == {"num_attention_heads": 8, "num_key_value_heads": 8}


def test_tolerances_are_derived_from_the_dtype():
    assert tolerance("logits", "float32").rel == 2 ** 10 * 2 ** -23
    assert tolerance("grads", "bfloat16").rel == 8 * 2 ** -7
    assert "eps(bfloat16)" in tolerance("loss", "bfloat16").rule


def test_report_json_and_text_carry_every_field():
    rule = RuleRef("tp_plan", "model.layers.*.mlp.gate_up_proj", "colwise", "p.yaml:12:3")
    report = VerifyReport("p.yaml", 2, {"tp_size": 2, "ep_size": 2, "dp_size": 1}, "float32", "m",
                          stages=[StageResult("logits", 0.5, 0.2, 1e-4, "1024 x eps(float32)", False)],
                          first_divergence=Divergence("logits", "forward", "model.layers.0.mlp", 0.2, None, (rule,)))
    data = json.loads(report.render_json())
    assert data["ok"] is False and data["exit_code"] == 1
    assert data["stages"][0] | {"verdict": "MISMATCH"} == data["stages"][0]
    assert data["first_divergence"]["module"] == "model.layers.0.mlp"
    assert data["first_divergence"]["where"] == "p.yaml:12:3" and data["first_divergence"]["style"] == "colwise"
    text = report.render_text()
    assert "MISMATCH" in text and "p.yaml:12:3" in text and "model.layers.0.mlp" in text
