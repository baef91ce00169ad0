"""The `planc lint`, `planc rules` and `planc schema` commands through the real CLI, in fresh processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.checkout_env import checkout_env

from .helpers import GOOD, REPO, planc

BAD = GOOD.replace("ep_size: 2}", "ep_size: 2, ep_szie: 2}").replace("o_proj: rowwise", "o_proj: rowwize")
WARN = GOOD.replace("ep_size: 2", "ep_size: 1")


@pytest.fixture
def plans(tmp_path):
    (tmp_path / "good.yaml").write_text(GOOD)
    (tmp_path / "bad.yaml").write_text(BAD)
    (tmp_path / "warn.yaml").write_text(WARN)
    return tmp_path


def test_default_path_is_plans_and_shipped_plans_pass():
    r = planc("lint")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no problems" in r.stdout and r.stderr == ""


def test_errors_exit_1_with_file_line_col(plans):
    r = planc("lint", str(plans / "bad.yaml"), str(plans / "good.yaml"))
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    bad = re.escape(str(plans / "bad.yaml"))
    assert re.fullmatch(rf"{bad}:3:36: PLC101 error: unknown key `ep_szie` in `parallel`", lines[0]), lines[0]
    assert lines[1].strip().startswith("hint: did you mean `ep_size`?")
    assert re.fullmatch(rf"{bad}:6:36: PLC310 error: unknown style `rowwize` in tp_plan", lines[2]), lines[2]
    assert lines[3] == "    hint: did you mean `rowwise`?"
    assert lines[-1] == "2 error(s), 0 warning(s) in 2 files"
    assert "Traceback" not in r.stderr


def test_warnings_pass_unless_strict(plans):
    assert planc("lint", str(plans / "warn.yaml")).returncode == 0
    r = planc("lint", "--strict", str(plans / "warn.yaml"))
    assert r.returncode == 1 and "PLC405 error" in r.stdout


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: str(p / "missing.yaml"), 2),
        (lambda p: (p / "latin1.yaml").write_bytes(b"name: caf\xe9\n") and str(p / "latin1.yaml"), 2),
        (lambda p: (p / "big.yaml").write_bytes(b"#" * (1 << 21)) and str(p / "big.yaml"), 2),
        (lambda p: (p / "empty").mkdir() or str(p / "empty"), 1),
        (lambda p: (p / "t.yaml").write_text("a:\n\tb: 1\n") and str(p / "t.yaml"), 1),
    ],
    ids=["missing", "not-utf8", "too-large", "empty-dir", "tabs"],
)
def test_exit_codes_for_bad_input(tmp_path, make, expected):
    r = planc("lint", make(tmp_path))
    assert r.returncode == expected, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and re.search(r":\d+:\d+: PLC\d{3} error: ", r.stdout)


def test_empty_directory_is_a_diagnostic(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    r = planc("lint", str(tmp_path))
    assert r.returncode == 1 and "PLC010" in r.stdout


def test_usage_error_exits_2():
    assert planc("lint", "--format", "xml").returncode == 2
    assert planc("lint", "--no-such-flag").returncode == 2


def test_json_format(plans):
    r = planc("lint", "--format", "json", str(plans))
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["files"] == 3 and doc["errors"] == 2 and doc["warnings"] == 1
    d = doc["diagnostics"][0]
    assert set(d) - {"fix"} == {"path", "line", "col", "end_line", "end_col", "code", "severity", "message", "hint"}
    assert all(x["fix"] for x in doc["diagnostics"] if "fix" in x)  # a fix, when given, is text to write
    assert {x["code"] for x in doc["diagnostics"]} == {"PLC101", "PLC310", "PLC405"}


def _lint_stdin(text: str, *args: str, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "planc", "lint", *args], input=text, cwd=cwd, env=checkout_env(),
                          capture_output=True, text=True, timeout=60)


def test_stdin_filename_lints_the_buffer_not_the_file(tmp_path):
    """An editor's unsaved buffer: the text on stdin is linted under PATH, whatever PATH holds on disk."""
    (tmp_path / "base.yaml").write_text(GOOD)
    on_disk = tmp_path / "child.yaml"
    on_disk.write_text(GOOD)  # clean on disk; the buffer is not
    r = _lint_stdin("extends: base.yaml\nparallel: {ep_size: 3}\n", "--stdin-filename", str(on_disk))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{on_disk}:2:" in r.stdout and "PLC500" in r.stdout  # `extends` resolved next to PATH
    assert _lint_stdin(GOOD, "-").returncode == 0
    bad = _lint_stdin("a: [\n", "-")
    assert bad.returncode == 1 and bad.stdout.startswith("<stdin>:2:1: PLC001")
    assert _lint_stdin(GOOD, "--stdin-filename", "x.yaml", "plans/").returncode == 2


def test_github_format(plans):
    r = planc("lint", "--format", "github", str(plans))
    lines = r.stdout.splitlines()
    assert len(lines) == 3
    for line in lines:
        assert re.fullmatch(r"::(error|warning) file=[^,]+,line=\d+,col=\d+,title=PLC\d{3}::.+%0Ahint: .+", line), line
    assert any(line.startswith("::warning ") for line in lines)


def test_rules_lists_every_code_and_explains_one():
    from planc.lint.registry import all_rules

    r = planc("rules")
    assert r.returncode == 0
    for rule in all_rules():
        assert rule.code in r.stdout and rule.name in r.stdout
    r = planc("rules", "PLC402")
    assert r.returncode == 0 and "shared-batch-needs-ep-equal-tp" in r.stdout and "Fails:" in r.stdout
    assert planc("rules", "missing-ep-dispatch").returncode == 0
    r = planc("rules", "PLC4O2")
    assert r.returncode == 2 and "did you mean PLC402" in r.stderr


def test_schema_command_matches_checked_in_file():
    r = planc("schema")
    assert r.returncode == 0
    checked_in = (REPO / "schemas" / "plan.schema.json").read_text()
    assert r.stdout == checked_in, "schemas/plan.schema.json is stale: run `planc schema -o schemas/plan.schema.json`"
