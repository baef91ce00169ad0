"""The lint path (CLI included) imports neither torch nor transformers: pre-commit stays fast."""

from __future__ import annotations

import subprocess
import sys

from tests.checkout_env import checkout_env

from .helpers import REPO

SCRIPT = """
import io, sys, contextlib
from planc.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(["lint", "plans/"])
    main(["rules", "PLC402"])
    main(["schema"])
import planc
planc.load_plan("plans/mixtral.yaml")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "numpy"))
print(rc, heavy)
"""


def test_lint_imports_no_torch():
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=checkout_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0 []", r.stdout


LSP_SCRIPT = """
import sys
import planc.commands.lsp
from planc.lint.lsp import build_server, code_actions, lint_buffer, to_lsp
build_server()
text = open("plans/mixtral.yaml").read().replace("experts: ep_dispatch_experts", "experts: megamoe_experts")
diags, doc = lint_buffer(text, "plans/mixtral.yaml")
found = to_lsp(diags, text, "plans/mixtral.yaml", doc)
actions = code_actions(text, "plans/mixtral.yaml", "file:///x.yaml", found)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "numpy"))
print(len(found) > 0, len(actions), heavy)
"""


def test_lsp_imports_no_torch():
    """`planc lsp` lints on every keystroke: the server, its diagnostics and its quick fixes stay torch-free."""
    import pytest

    pytest.importorskip("pygls", reason="planc lsp needs pygls (the planc[lsp] extra)")
    r = subprocess.run([sys.executable, "-c", LSP_SCRIPT], cwd=REPO, env=checkout_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True 1 []", r.stdout
