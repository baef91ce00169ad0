"""The pre-commit hooks, run by the real pre-commit client.

Three ways: docs/lint.md's `.pre-commit-config.yaml` as written (`repo: local` hooks running the `planc`
installed in the environment, found on PATH); a `repo: local` hook built from the published definition
(same id, files regex and entry, with `planc` replaced by this interpreter's `-m planc`; no network); and
the published hooks pinned by a release tag of a local clone, for which pre-commit builds the hook's own
environment as users get it (pip installs pydantic and pyyaml from the package registry).
"""

from __future__ import annotations

import os
import re
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
    assert lint["entry"] == "planc lint --quiet" and lint["language"] == "python"
    assert explain["entry"] == "planc explain --quiet" and explain["language"] == "python"
    assert explain["files"] == r"^plans/.*\.ya?ml$"


def run(cmd, cwd, **kw):
    # the docs' recipe runs the `planc` on PATH: this interpreter's console script, importing this checkout
    e = checkout_env(PATH=os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", ""))))
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


def test_published_hook_pinned_by_a_release_tag_of_a_clone(tmp_path):
    """The hook as users get it, pinned by a tag: pre-commit clones the repository at `rev` and pip-installs it
    (pydantic and pyyaml come from the package registry), so this covers `language: python`, the console script
    and `.pre-commit-hooks.yaml` end to end. The repository is a committed, tagged copy of this checkout's
    package files, the tag named as docs/lint.md names release tags (`v` + the version)."""
    from planc.version import __version__

    src = tmp_path / "planc-src"
    src.mkdir()
    for name in ("planc", "pyproject.toml", "README.md", ".pre-commit-hooks.yaml"):
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    tag = f"v{__version__}"
    assert f"`{tag}`" in (REPO / "docs" / "lint.md").read_text()
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "planc"], ["git", "tag", tag]):
        assert run(cmd, src).returncode == 0

    user = tmp_path / "user"
    (user / "plans").mkdir(parents=True)
    (user / "plans" / "good.yaml").write_text(GOOD)
    config = {"repos": [{"repo": str(src), "rev": tag, "hooks": [{"id": "planc-lint"}]}]}
    (user / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"]):
        assert run(cmd, user).returncode == 0
    ok = run([PRE_COMMIT, "run", "--all-files"], user)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "Passed" in ok.stdout

    (user / "plans" / "bad.yaml").write_text(GOOD.replace("rowwise", "rowwize"))
    run(["git", "add", "-A"], user)
    bad = run([PRE_COMMIT, "run", "--all-files"], user)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "plans/bad.yaml:6:36: PLC310 error: unknown style `rowwize`" in bad.stdout


def docs_recipe() -> str:
    """The `.pre-commit-config.yaml` block of docs/lint.md's pre-commit section, verbatim."""
    section = (REPO / "docs" / "lint.md").read_text().split("## pre-commit\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    return block


def test_the_docs_recipe_runs_as_written_and_prints_only_failing_plans(tmp_path):
    recipe = docs_recipe()
    assert "<" not in recipe and "repo: local" in recipe
    repo = tmp_path / "repo"
    (repo / "plans").mkdir(parents=True)
    (repo / ".pre-commit-config.yaml").write_text(recipe)
    (repo / "plans" / "good.yaml").write_text(GOOD)
    # a plan that lints clean but does not resolve against its model (an attention path mixtral lacks)
    (repo / "plans" / "broken.yaml").write_text(GOOD.replace("self_attn.o_proj", "self_attn.out_proj"))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"]):
        assert run(cmd, repo).returncode == 0
    bad = run([PRE_COMMIT, "run", "--all-files"], repo)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "deprecated" not in (bad.stdout + bad.stderr).lower(), bad.stdout + bad.stderr
    lint_part, explain_part = bad.stdout.split("planc explain", 1)
    assert "Passed" in lint_part and "Failed" in explain_part, bad.stdout
    assert "plans/broken.yaml" in explain_part and "PLC601" in explain_part, bad.stdout
    assert "good.yaml" not in explain_part and "rules:" not in explain_part, bad.stdout  # no table of a passing plan
