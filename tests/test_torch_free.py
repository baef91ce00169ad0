"""A torch-free install (`pip install planc`: pydantic and pyyaml only) as a newcomer has it: the torch-free
commands run, and each command that needs an extra says which one to install, with no traceback.

The venv is real (python -m venv, the two dependencies from the package index, this checkout installed
without dependencies), built once for the module.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.checkout_env import REPO

# `pip install -e` writes planc.egg-info into the checkout: one worker for every test that installs it
pytestmark = pytest.mark.xdist_group("installs_the_checkout")


@pytest.fixture(scope="session")
def torch_free_planc(tmp_path_factory) -> str:
    venv = tmp_path_factory.mktemp("torch_free") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    for args in (["pydantic>=2", "pyyaml>=6"], ["--no-deps", "-e", str(REPO)]):
        r = subprocess.run(pip + args, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
    return str(venv / "bin" / "planc")


def _run(planc: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([planc, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_torch_free_install_lints_and_names_the_extra_each_command_needs(torch_free_planc):
    r = _run(torch_free_planc, "lint", "plans/")
    assert r.returncode == 0 and "no problems" in r.stdout, r.stdout + r.stderr
    for args in (("rules", "colwise"), ("rules", "PLC660"), ("explain", "--help")):
        r = _run(torch_free_planc, *args)
        assert r.returncode == 0 and r.stdout and not r.stderr, (args, r.stdout, r.stderr)
    needs = {
        ("explain", "plans/deepseek_v4_megamoe.yaml"): "runtime",
        ("init", "--from-transformers", "mixtral"): "runtime",
        ("demo",): "runtime",
        ("lsp",): "lsp",
    }
    for args, extra in needs.items():
        r = _run(torch_free_planc, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert f"planc {args[0]}: needs the `{extra}` extra" in r.stderr, r.stderr
        assert f"hint: pip install 'planc[{extra}]'" in r.stderr, r.stderr
        # nothing else: no traceback, no follow-up hint about the model or the config
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 2, r.stderr


def test_install_md_transcript_is_what_a_torch_free_install_prints(torch_free_planc):
    """docs/install.md's console block, run on the torch-free install from a clone: the command, exit 2, and
    the lines it shows (tests/test_docs.py leaves this block to this test)."""
    from tests.doc_blocks import all_blocks

    (block,) = [b for b in all_blocks() if b.page.name == "install.md" and b.language == "console"]
    command, *shown = block.text.splitlines()
    args = command.removeprefix("$ planc ").split(" #")[0].split()
    r = _run(torch_free_planc, *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert [" ".join(ln.split()) for ln in r.stderr.splitlines()] == [" ".join(ln.split()) for ln in shown], r.stderr
