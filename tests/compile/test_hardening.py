"""Issue 12: the CLI never loses a file, and refuses clearly (exit 2, one line) what it cannot write."""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys

import pytest

from planc.cli import main

from ..lint.helpers import REPO, env

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
        [sys.executable, "-m", "planc", "migrate", str(plan), "--write"], cwd=REPO, env=env(),
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
