"""The plans and the JSON Schema planc ships as package data: `planc/plans/*.yaml`, `planc/schemas/plan.schema.json`.

They live inside the package so that a wheel carries them (`planc demo`, `planc lint` and the docs' examples work
from a non-editable install); in a checkout, `planc/plans` and `planc/schemas` link to the repository's `plans/`
and `schemas/`, the one copy. The shipped plans keep `$schema=../schemas/plan.schema.json`: true in both places.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

PACKAGE_DIR = Path(__file__).resolve().parents[1]
PLANS_DIR = PACKAGE_DIR / "plans"
SCHEMA_PATH = PACKAGE_DIR / "schemas" / "plan.schema.json"
# `planc:mixtral` names the shipped plan mixtral.yaml wherever a plan path is taken (`extends:`, the commands,
# planc.load_plan / compile / apply / load), so a script or a plan reaches it from any directory.
SHIPPED_PREFIX = "planc:"


def shipped_plans() -> list[Path]:
    """The shipped plan files, sorted by name (empty when the package was installed without its data)."""
    return sorted(PLANS_DIR.glob("*.yaml")) if PLANS_DIR.is_dir() else []


def shipped_plan(name: str) -> Path:
    """The shipped plan `name` (`mixtral` or `mixtral.yaml`)."""
    return PLANS_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")


def shipped_reference(text: str) -> Optional[Path]:
    """The shipped plan a `planc:NAME` reference names; None when `text` is no such reference or NAME is not
    shipped (the caller reports it, listing the shipped names)."""
    if not text.startswith(SHIPPED_PREFIX):
        return None
    name = text[len(SHIPPED_PREFIX):]
    return next((p for p in shipped_plans() if p.stem == name), None)


def shipped_names() -> list[str]:
    return [p.stem for p in shipped_plans()]


__all__ = ["PACKAGE_DIR", "PLANS_DIR", "SCHEMA_PATH", "SHIPPED_PREFIX", "shipped_names", "shipped_plan",
           "shipped_plans", "shipped_reference"]
