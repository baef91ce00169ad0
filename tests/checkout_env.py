"""The environment of a child process (a CLI run, torchrun, a measured rank) that imports this checkout.

The checkout comes first on PYTHONPATH, so the child imports this planc and `tests`; whatever PYTHONPATH the caller
had stays behind it (on the device, the carried wheels' site directory lives there).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def checkout_env(**overrides: str) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH, then `overrides`."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **overrides}
