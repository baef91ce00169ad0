"""An editable install is not shadowed by a clone checked out as a folder named `planc`.

The check installs this checkout for real (`pip install -e`, no dependencies, into a temporary prefix),
puts a `planc` symlink to the checkout in an empty directory, and imports planc from there with only
that install on the path: exactly what a script next to the clone does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

from .helpers import REPO

# `pip install -e` writes planc.egg-info into the checkout: one worker for every test that installs it
pytestmark = pytest.mark.xdist_group("installs_the_checkout")


def test_editable_install_wins_over_a_clone_folder_named_planc(tmp_path):
    prefix = tmp_path / "prefix"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--ignore-installed", "--prefix", str(prefix),
         "-e", str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    site = sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})
    parent = tmp_path / "parent"
    parent.mkdir()
    os.symlink(REPO, parent / "planc", target_is_directory=True)  # the clone, as a folder named planc
    code = f"import site; site.addsitedir({site!r}); import planc; print(planc.__file__, planc.apply.__name__)"
    done = subprocess.run([sys.executable, "-S", "-E", "-c", code], cwd=parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(REPO / "planc" / "__init__.py"), "apply"], done.stdout
