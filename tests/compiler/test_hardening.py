"""The CLI never loses a file, and refuses clearly (exit 2, one line) what it cannot write."""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys

import pytest

from planc.cli import main

from tests.checkout_env import checkout_env

from ..lint.helpers import REPO

OLD_PLAN = (
    "# keep this comment\r\n"
    "version: 1\r\n"
    "model: {type: deepseek_v4}   # family\r\n"
    "parallel: {tp_size: 8, ep_size: 8}\r\n"
    "experts:\r\n"
    "  implementation: deepgemm_megamoe\r\n"
    "ep_plan:\r\n"
    "  model.layers.*.mlp.gate: megamoe_router\r\n"
    "  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm   # by expert\r\n"
    "  model.layers.*.mlp.experts: megamoe_experts\r\n"
)
BOM = b"\xef\xbb\xbf"


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


# ---- 4. migrate --write is atomic and keeps every untouched byte ---------------------------------------


def test_migrate_write_under_a_file_size_limit_leaves_the_plan_intact(tmp_path):
    plan = tmp_path / "old.yaml"
    plan.write_bytes(OLD_PLAN.encode())
    r = subprocess.run(
        [sys.executable, "-m", "planc", "migrate", str(plan), "--write"], cwd=REPO, env=checkout_env(),
        capture_output=True, text=True, timeout=120, preexec_fn=_limit_file_size,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "left as it was" in r.stderr and len(r.stderr.splitlines()) == 1
    assert plan.read_bytes() == OLD_PLAN.encode()
    assert os.listdir(tmp_path) == ["old.yaml"]  # no temporary file left behind


def test_migrate_write_keeps_bom_mode_and_untouched_bytes(tmp_path, capsys):
    plan = tmp_path / "old.yaml"
    plan.write_bytes(BOM + OLD_PLAN.encode())
    plan.chmod(0o640)
    assert main(["migrate", str(plan), "--write"]) == 0, capsys.readouterr().err
    out = plan.read_bytes()
    assert out.startswith(BOM) and stat.S_IMODE(plan.stat().st_mode) == 0o640
    kept = [ln for ln in OLD_PLAN.encode().splitlines(keepends=True) if b"megamoe_" not in ln]
    lines = out[len(BOM):].splitlines(keepends=True)
    assert all(ln in lines for ln in kept), out
    assert b"  model.layers.*.mlp.experts: ep_dispatch_experts\r\n" in lines


def test_migrate_write_through_a_symlink_replaces_the_target(tmp_path, capsys):
    real = tmp_path / "real.yaml"
    real.write_bytes(OLD_PLAN.encode())
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    assert main(["migrate", str(link), "--write"]) == 0, capsys.readouterr().err
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert b"ep_dispatch_experts" in real.read_bytes()


def test_migrate_write_refuses_a_read_only_file_and_directory(tmp_path, capsys):
    plan = tmp_path / "old.yaml"
    plan.write_bytes(OLD_PLAN.encode())
    plan.chmod(0o444)
    assert main(["migrate", str(plan), "--write"]) == 2
    assert "read-only" in capsys.readouterr().err and plan.read_bytes() == OLD_PLAN.encode()
    plan.chmod(0o644)
    tmp_path.chmod(0o555)
    try:
        assert main(["migrate", str(plan), "--write"]) == 2
        err = capsys.readouterr().err
        assert "directory" in err and "read-only" in err and plan.read_bytes() == OLD_PLAN.encode()
    finally:
        tmp_path.chmod(0o755)


# ---- 5. init -o never overwrites silently, and bad paths are one line ------------------------------------


def test_init_refuses_to_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    out.write_text("# mine\n")
    assert main(["init", "--from-transformers", "mixtral", "-o", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err and out.read_text() == "# mine\n"
    assert main(["init", "--from-transformers", "mixtral", "-o", str(out), "--force"]) == 0
    assert "type: mixtral" in out.read_text()


@pytest.mark.parametrize("where", ["missing-dir", "a-directory"])
def test_init_output_into_a_missing_directory_or_onto_a_directory(tmp_path, capsys, where):
    target = tmp_path / "nope" / "plan.yaml" if where == "missing-dir" else tmp_path
    assert main(["init", "--from-transformers", "mixtral", "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("does not exist" in err or "is a directory" in err), err


# ---- 8, 10, 12. building a model: one line naming the model type, never transformers' traceback ---------


def test_explain_bad_set_value_is_a_usage_error(capsys):
    assert main(["explain", str(REPO / "plans" / "mixtral.yaml"), "--set", "num_hidden_layers=abc"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`mixtral` config" in err and "num_hidden_layers" in err, err


def test_explain_set_values_are_read_as_yaml_1_2(capsys):
    assert main(["explain", str(REPO / "plans" / "mixtral.yaml"), "--set", "num_hidden_layers=010"]) == 2
    assert "YAML 1.1" in capsys.readouterr().err


def test_a_family_transformers_cannot_build_is_one_line(tmp_path):
    # `planc init --from-transformers dbrx` now stops earlier (transformers declares no EP plan for dbrx);
    # building the model is reached through explain, which shares the one model-building path with init and demo.
    plan = tmp_path / "dbrx.yaml"
    plan.write_text("version: 1\nmodel: {type: dbrx}\nparallel: {tp_size: 2}\ntp_plan:\n  lm_head: colwise_gather_output\n")
    r = subprocess.run([sys.executable, "-m", "planc", "explain", str(plan)], cwd=REPO, env=checkout_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") <= 1 and "Traceback" not in r.stderr, r.stderr
    assert "`dbrx`" in r.stderr and "DbrxForCausalLM" in r.stderr and "rope_theta" in r.stderr
    r = subprocess.run([sys.executable, "-m", "planc", "init", "--from-transformers", "dbrx"], cwd=REPO, env=checkout_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr and "`dbrx`" in r.stderr, r.stderr


def test_unknown_model_type_suggests_the_closest_few(tmp_path, capsys):
    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nmodel: {type: mixtrl}\nparallel: {tp_size: 2}\n")
    assert main(["explain", str(plan)]) == 2
    err = capsys.readouterr().err
    assert len(err) < 300 and "did you mean `mixtral`" in err, err
    assert main(["init", "--from-transformers", "qwen3moe"]) == 2
    err = capsys.readouterr().err
    assert len(err) < 300 and "`qwen3_moe`" in err, err


# ---- 13. compile() with a path without suffix, a directory, or no model ----------------------------------


def test_compile_names_the_missing_suffix_the_directory_and_a_missing_model():
    import planc
    from planc.errors import PlanError
    from planc.models.build import build_meta_model

    model = build_meta_model("mixtral")
    with pytest.raises(PlanError, match=r"PLC002.*no such plan file or directory: `.*plans/mixtral`") as e:
        planc.compile(model, str(REPO / "plans" / "mixtral"))
    assert "did you mean" in str(e.value) and "mixtral.yaml" in str(e.value)
    with pytest.raises(PlanError, match="is a directory; a plan is one YAML file"):
        planc.compile(model, str(REPO / "plans"))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module .* got NoneType"):
        planc.compile(None, str(REPO / "plans" / "mixtral.yaml"))


# ---- 15. exit codes and CLI conventions ------------------------------------------------------------------


def test_explain_on_a_missing_file_exits_2_like_lint(tmp_path, capsys):
    assert main(["explain", str(tmp_path / "missing.yaml")]) == 2
    assert "PLC002" in capsys.readouterr().err


# ---- 16. the README's migrate example runs as written: tests/test_docs.py ---------------------------------


# ---- 17. running a plan at other sizes -------------------------------------------------------------------


def test_load_plan_at_other_sizes_is_checked_like_the_plan():
    import planc
    from planc.errors import PlanError

    path = str(REPO / "plans" / "mixtral.yaml")
    assert planc.load_plan(path).plan.parallel.tp_size == 8
    loaded = planc.load_plan(path, parallel={"tp_size": 2, "ep_size": 2})
    assert (loaded.plan.parallel.tp_size, loaded.plan.parallel.ep_size, loaded.plan.parallel.dp_size) == (2, 2, 1)
    assert loaded.position(("tp_plan",)).line > 1  # positions of the plan's own keys are kept
    with pytest.raises(PlanError, match=r"PLC500 .*\(with parallel sizes tp_size=2, ep_size=3\)"):
        planc.load_plan(path, parallel={"tp_size": 2, "ep_size": 3})
    with pytest.raises(TypeError, match="tp_size, ep_size, dp_size"):
        planc.load_plan(path, parallel={"tp": 2})
