"""What a new user meets in the first hour, each message naming its fix: `--set` keys the config does not have,
`planc init` on a type whose default config transformers cannot build, a mistyped or missing plan path, a
mis-indented rule, a hub id passed to planc.load, the removed styles of an old plan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


from planc.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_explain_set_refuses_a_key_the_config_does_not_have(capsys):
    assert main(["explain", str(REPO / "plans" / "mixtral.yaml"), "--set", "num_layers=4"]) == 2
    err = capsys.readouterr().err
    assert "MixtralConfig has no key `num_layers`" in err and "did you mean `num_hidden_layers`" in err, err
    # a sub-config key, misspelt
    assert main(["explain", str(REPO / "plans" / "qwen3_vl_moe.yaml"), "--set", "text_config.num_hiden_layers=2"]) == 2
    assert "did you mean `text_config.num_hidden_layers`" in capsys.readouterr().err


def test_set_takes_a_key_the_model_code_reads_though_the_config_class_lacks_it():
    """GLM-4.5V's text config class declares no `head_dim`, but its attention reads `getattr(config, "head_dim", ...)`
    and the released config.json sets 128: the override changes the model, so it is taken; a misspelt one is not."""
    import pytest

    from planc.errors import ModelBuildError
    from planc.models.build import check_override_keys, overridden_config

    check_override_keys("glm4v_moe", {"text_config.head_dim": 128})
    assert overridden_config("glm4v_moe", {"text_config.head_dim": 128}).text_config.head_dim == 128
    with pytest.raises(ModelBuildError, match="has no key `head_dimm`"):
        check_override_keys("glm4v_moe", {"text_config.head_dimm": 128})


def test_init_names_the_values_a_default_config_leaves_unset(capsys):
    assert main(["init", "--from-transformers", "hunyuan_v1_moe"]) == 2
    err = capsys.readouterr().err
    assert "--config path/to/config.json" in err and "leaves `head_dim` unset" in err, err
    assert "planc init --from-transformers hunyuan_v1_moe --set head_dim=..." in err
    assert main(["init", "--from-transformers", "qwen3_moe", "--set", "num_expert=8"]) == 2
    assert "Qwen3MoeConfig has no key `num_expert`; did you mean `num_experts`" in capsys.readouterr().err.replace(
        ", so it would change nothing", "")


def test_a_mis_indented_rule_is_named_with_the_indentation_to_write(tmp_path, capsys):
    head = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n  model.layers.*.self_attn.q_proj: colwise\n"
    cases = {
        "dedented": head + " model.layers.*.self_attn.o_proj: rowwise\n",        # 1 space among 2s
        "deeper": head + "    model.layers.*.self_attn.o_proj: rowwise\n",      # 4 under a rule, not a table
    }
    for name, text in cases.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        assert main(["lint", str(tmp_path / f"{name}.yaml")]) == 1
        out = capsys.readouterr().out
        assert f"{name}.yaml:6:1: PLC001" in out and "indent line 6 by 2 spaces, like line 5 (a rule of `tp_plan:`)" in out, out
    # flush left under an empty `tp_plan:`: valid YAML, read as a top-level key
    (tmp_path / "flush.yaml").write_text("version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n"
                                         "model.layers.*.self_attn.q_proj: colwise\n")
    assert main(["lint", str(tmp_path / "flush.yaml")]) == 1
    out = capsys.readouterr().out
    assert "this is a rule: indent it two spaces under `tp_plan:` (line 4)" in out, out
    assert "`tp_plan:` has no rules under it" in out


def test_a_missing_plan_file_gets_the_same_did_you_mean_in_lint_and_explain(tmp_path, capsys):
    (tmp_path / "mixtral_tp2.yaml").write_text((REPO / "plans" / "mixtral.yaml").read_text())
    typo = str(tmp_path / "mixtrl_tp2.yaml")
    assert main(["lint", typo]) == 2
    lint_out = capsys.readouterr().out
    assert main(["explain", typo]) == 2
    explain_err = capsys.readouterr().err
    want = f"hint: did you mean `{tmp_path / 'mixtral_tp2.yaml'}`?"
    assert want in lint_out and want in explain_err, (lint_out, explain_err)
    # a shipped plan's name where there is none: the shipped file is named
    assert main(["lint", str(tmp_path / "plans" / "qwen3_moe.yaml")]) == 2
    assert "planc ships a plan of that name: `" in capsys.readouterr().out


def test_a_hub_id_is_told_to_download_first(capsys):
    assert main(["explain", str(REPO / "plans" / "mixtral.yaml"), "--checkpoint", "mistralai/Mixtral-8x7B-v0.1"]) == 2
    err = capsys.readouterr().err
    assert "looks like a Hugging Face hub id" in err and "hf download mistralai/Mixtral-8x7B-v0.1" in err, err


def test_an_old_plan_gets_plc320_pointing_at_migrate_and_no_cascade(tmp_path, capsys):
    (tmp_path / "old.yaml").write_text(
        "version: 1\nmodel: {type: deepseek_v4}\nparallel: {tp_size: 8, ep_size: 8}\n"
        "experts: {implementation: deepgemm_megamoe}\nep_plan:\n"
        "  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
        "  model.layers.*.mlp.experts: megamoe_experts\n")
    assert main(["lint", str(tmp_path / "old.yaml")]) == 1
    out = capsys.readouterr().out
    assert "PLC320" in out and "PLC404" not in out and f"planc migrate {tmp_path / 'old.yaml'} --write" in out, out


def test_load_without_torchrun_names_what_is_missing():
    """The process group is started from torchrun's environment (tests/test_docs.py runs that under torchrun);
    without it the error names the variables. In a fresh interpreter: a test worker may already hold a group."""
    script = (
        "import planc\n"
        "from planc.errors import ApplyError\n"
        "try:\n"
        f"    planc.load('ckpt', {str(REPO / 'plans' / 'mixtral.yaml')!r})\n"
        "except ApplyError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["RANK"] = "0"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set (found RANK)" in out.stdout, out.stdout + out.stderr
