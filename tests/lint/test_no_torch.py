"""The lint path (CLI included) imports neither torch nor transformers: pre-commit stays fast."""

from __future__ import annotations

import subprocess
import sys

from .helpers import REPO, env

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
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0 []", r.stdout
