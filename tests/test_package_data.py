"""A non-editable install works: the wheel carries the shipped plans and the schema, and the commands find them there.

The wheel is built here (no isolation: setuptools from this environment, about 2 s) and unpacked, so the package
runs from a directory with no checkout beside it, as from site-packages. No torch: only the torch-free commands
run from it here; .ci/run installs the same wheel in a fresh venv and runs lint, demo, init and explain from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build_wheel(out: Path) -> Path:
    """Build from a copy (links kept, as git checks them out), so setuptools' build/ and egg-info stay in tmp."""
    src = out.parent / "src"
    for name in ("planc", "plans", "schemas"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out.mkdir()
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300,
                          cwd=out, env={**os.environ, "PIP_NO_INDEX": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("planc-*.whl")
    return wheel


def test_the_wheel_ships_the_plans_and_schema_and_the_commands_use_them(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    plans = sorted(p.name for p in (ROOT / "plans").glob("*.yaml"))
    assert plans and {f"planc/plans/{p}" for p in plans} <= names, sorted(names)
    assert "planc/schemas/plan.schema.json" in names
    site, work = tmp_path / "site", tmp_path / "work"
    zipfile.ZipFile(wheel).extractall(site)
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def planc(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "planc", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=120)

    # `planc lint` with no path and no plans/ here: the shipped plans, from the unpacked package
    done = planc("lint")
    assert done.returncode == 0 and f"{len(plans)} files checked: no problems" in done.stdout, done
    where = subprocess.run([sys.executable, "-c", "import planc.commands.demo as d, planc.spec.shipped as s; "
                            "print(d.DEFAULT_PLAN.is_file(), d.DEFAULT_PLAN, s.SCHEMA_PATH.is_file())"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.split() == ["True", str(site / "planc" / "plans" / "mixtral.yaml"), "True"], where
    # the README's path, typed where there is no checkout: the message names the shipped plan
    done = planc("lint", "plans/mixtral.yaml")
    assert done.returncode == 2 and str(site / "planc" / "plans" / "mixtral.yaml") in done.stdout, done
