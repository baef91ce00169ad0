"""The `planc-lint` hook of .pre-commit-hooks.yaml, run by the real pre-commit client.

Two ways: as a `repo: local` hook built from the published definition (same id, files regex and entry,
with `planc` replaced by this interpreter's `-m planc`; no network), and through `pre-commit try-repo`,
which builds the hook's own environment from a git copy of this repository as users get it (pip
installs pydantic and pyyaml from the package registry).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.checkout_env import checkout_env

from .helpers import GOOD, REPO

PRE_COMMIT = shutil.which("pre-commit") or os.path.join(os.path.dirname(sys.executable), "pre-commit")
pytestmark = pytest.mark.skipif(
    not os.path.exists(PRE_COMMIT) or shutil.which("git") is None, reason="needs git and pre-commit"
)


def hook(hook_id: str) -> dict:
    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    return next(h for h in hooks if h["id"] == hook_id)


def local_language() -> str:
    from pre_commit import all_languages

    return "unsupported" if "unsupported" in all_languages.languages else "system"


def test_manifest_is_valid_for_pre_commit():
    r = subprocess.run([PRE_COMMIT, "validate-manifest", str(REPO / ".pre-commit-hooks.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hooks_file_shape():
    lint, explain = hook("planc-lint"), hook("planc-explain")
    assert lint["entry"] == "planc lint" and lint["language"] == "python"
    assert explain["entry"] == "planc explain" and explain["language"] == "python"
    assert explain["files"] == r"^plans/.*\.ya?ml$"


def run(cmd, cwd, **kw):
    e = checkout_env()
    e.update(PRE_COMMIT_HOME=str(cwd.parent / "pre-commit-home"), GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
             GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=240, **kw)


def test_planc_lint_hook_passes_good_and_fails_bad(tmp_path):
    repo = tmp_path / "repo"
    (repo / "plans").mkdir(parents=True)
    h = hook("planc-lint")
    entry = h["entry"].replace("planc", f"{sys.executable} -m planc", 1)
    config = {"repos": [{"repo": "local", "hooks": [
        {"id": h["id"], "name": h["name"], "entry": entry, "language": local_language(), "files": h["files"]}
    ]}]}
    (repo / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config))
    (repo / "plans" / "good.yaml").write_text(GOOD)
    (repo / "notes.yaml").write_text("not: [a plan\n")  # outside plans/: the hook must not see it
    assert run(["git", "init", "-q"], repo).returncode == 0
    assert run(["git", "add", "-A"], repo).returncode == 0

    ok = run([PRE_COMMIT, "run", "--all-files"], repo)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "planc lint" in ok.stdout and "Passed" in ok.stdout

    (repo / "plans" / "bad.yaml").write_text(GOOD.replace("rowwise", "rowwize"))
    run(["git", "add", "-A"], repo)
    bad = run([PRE_COMMIT, "run", "--all-files"], repo)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "Failed" in bad.stdout
    assert "plans/bad.yaml:6:36: PLC310 error: unknown style `rowwize`" in bad.stdout
    assert "good.yaml" not in bad.stdout.replace("in 2 files", "")


def test_published_hook_installs_and_runs_via_try_repo(tmp_path):
    """The hook as users get it: pre-commit builds planc's own environment from this repository.

    `pre-commit try-repo` clones a git repository and pip-installs it (pydantic and pyyaml come from the
    package registry), so this covers `language: python`, the console script and `.pre-commit-hooks.yaml`
    end to end. The repository is a committed copy of this checkout's package files.
    """
    src = tmp_path / "planc-src"
    src.mkdir()
    for name in ("planc", "pyproject.toml", "README.md", ".pre-commit-hooks.yaml"):
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "planc"]):
        assert run(cmd, src).returncode == 0

    user = tmp_path / "user"
    (user / "plans").mkdir(parents=True)
    (user / "plans" / "good.yaml").write_text(GOOD)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"]):
        assert run(cmd, user).returncode == 0
    ok = run([PRE_COMMIT, "try-repo", str(src), "planc-lint", "--all-files"], user)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "Passed" in ok.stdout

    (user / "plans" / "bad.yaml").write_text(GOOD.replace("rowwise", "rowwize"))
    run(["git", "add", "-A"], user)
    bad = run([PRE_COMMIT, "try-repo", str(src), "planc-lint", "--all-files"], user)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "plans/bad.yaml:6:36: PLC310 error: unknown style `rowwize`" in bad.stdout
