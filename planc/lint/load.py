"""load_plan(): any plan source -> a linted, validated LoadedPlan, or PlanError with lint's diagnostics.

It sits above lint (spec -> lint -> load): the spec layer parses and merges, lint checks, and this
is the one entry the compiler, the runtime and the CLI load plans through.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Union

from planc.errors import PlanError
from planc.lint import runner
from planc.spec.load import LoadedPlan
from planc.spec.model import Plan

PlanSource = Union[str, "os.PathLike[str]", Mapping[str, Any], Plan, LoadedPlan]


def load_plan(source: PlanSource) -> LoadedPlan:
    """Load a plan from a path, a YAML string, a mapping, a Plan or a LoadedPlan; raises PlanError when invalid.

    Every source except a LoadedPlan (returned as is) goes through the linter, a `Plan` built in code
    too: a plan that `planc lint` rejects does not load, and the PlanError carries the same
    diagnostics, so the compiler never repeats a lint check. Warnings are kept on `LoadedPlan.diagnostics`.
    """
    if isinstance(source, LoadedPlan):
        return source
    if isinstance(source, Plan):
        result = runner.check_data(source.model_dump(exclude_none=True))
    elif isinstance(source, Mapping):
        result = runner.check_data(dict(source))
    elif isinstance(source, os.PathLike) or (
        isinstance(source, str) and "\n" not in source and source.strip().endswith((".yaml", ".yml"))
    ):
        result = runner.check_file(os.fspath(source))
    elif isinstance(source, str):
        result = runner.check_text(source)
    else:
        raise TypeError(
            f"load_plan() takes a path, YAML text, a mapping, a Plan or a LoadedPlan, not {type(source).__name__}"
        )
    errors = [d for d in result.diagnostics if d.severity == "error"]
    if errors or result.loaded is None:
        raise PlanError(errors or result.diagnostics)
    result.loaded.diagnostics = list(result.diagnostics)
    return result.loaded
