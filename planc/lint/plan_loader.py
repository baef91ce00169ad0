"""load_plan(): any plan source -> a linted, validated LoadedPlan, or PlanError with lint's diagnostics.

It sits above lint (spec -> lint -> load): the spec layer parses and merges, lint checks, and this
is the one entry the compiler, the runtime and the CLI load plans through.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Union

from planc.errors import PlanError
from planc.lint import runner
from planc.lint.context import LintContext
from planc.lint.diagnostic import ERROR, Diagnostic
from planc.spec.loaded_plan import LoadedPlan
from planc.spec.model import Plan
from planc.spec.source import UNREADABLE, Position

PlanSource = Union[str, "os.PathLike[str]", Mapping[str, Any], Plan, LoadedPlan]

PARALLEL_KEYS = ("tp_size", "ep_size", "dp_size")


def load_plan(source: PlanSource, *, parallel: Optional[Mapping[str, int]] = None) -> LoadedPlan:
    """Load a plan from a path, a YAML string, a mapping, a Plan or a LoadedPlan; raises PlanError when invalid.

    Every source except a LoadedPlan (returned as is) goes through the linter, a `Plan` built in code
    too: a plan that `planc lint` rejects does not load, and the PlanError carries the same
    diagnostics, so the compiler never repeats a lint check. Warnings are kept on `LoadedPlan.diagnostics`.

    `parallel` runs the plan at other sizes (`{"tp_size": 2, "ep_size": 2}`; keys left out keep the
    plan's values): the plan is loaded as written, then linted again with the sizes replaced, so
    the size rules (PLC500-PLC503) and the EP rules hold at the sizes that will run.
    """
    loaded = _load(source)
    return with_parallel(loaded, parallel) if parallel else loaded


def with_parallel(loaded: LoadedPlan, parallel: Mapping[str, int]) -> LoadedPlan:
    """`loaded` with its `parallel` sizes replaced, linted again; PlanError (naming the override) if that fails."""
    if not isinstance(parallel, Mapping) or not set(parallel) <= set(PARALLEL_KEYS):
        unknown = sorted(set(parallel) - set(PARALLEL_KEYS)) if isinstance(parallel, Mapping) else parallel
        raise TypeError(f"parallel= takes a mapping with the keys {', '.join(PARALLEL_KEYS)}; got {unknown!r}")
    shown = ", ".join(f"{k}={v}" for k, v in parallel.items())
    return with_values(loaded, ("parallel",), parallel, f"with parallel sizes {shown}")


def with_values(loaded: LoadedPlan, section: tuple[str, ...], values: Mapping[str, Any], why: str) -> LoadedPlan:
    """`loaded` with keys of the mapping at `section` (`("parallel",)`, `("experts", "megamoe")`) replaced by
    `values`, linted again; diagnostics about the replaced keys point at the section; PlanError (`why` appended to
    each message) if it no longer validates."""
    data = loaded.plan.model_dump(exclude_none=True)
    data.pop("extends", None)  # merged already
    node = data
    for key in section[:-1]:
        node = node[key]
    node[section[-1]] = {**node[section[-1]], **dict(values)}
    # the values no longer come from the file: diagnostics about them point at the section's key
    n = len(section)
    keys = {kp: p for kp, p in loaded.key_positions.items() if kp[:n] != section or len(kp) == n}
    positions = {kp: p for kp, p in loaded.value_positions.items() if kp[:n] != section or len(kp) == n}
    result = runner.check_context(LintContext(data, None, loaded.path, keys, positions))
    errors = [d for d in result.diagnostics if d.severity == ERROR]
    if errors or result.loaded is None:
        raise PlanError([dataclasses.replace(d, message=f"{d.message} ({why})") for d in errors or result.diagnostics])
    result.loaded.docs = loaded.docs
    result.loaded.diagnostics = list(result.diagnostics)
    return result.loaded


def _looks_like_path(text: str) -> bool:
    """One line that names a file: a .yaml/.yml suffix, an existing path, or no YAML mapping syntax at all
    (`plans/mixtral`); YAML plan text always has a `key: value`."""
    if "\n" in text:
        return False
    return text.strip().endswith((".yaml", ".yml")) or os.path.exists(text) or (":" not in text and "{" not in text)


def _not_a_plan_file(path: str) -> Optional[Diagnostic]:
    """A PLC002 Diagnostic when `path` is a directory or does not exist (with the .yaml it may mean), else None."""
    where = Position(path, 1, 1)
    try:
        if os.path.isdir(path):
            plans = sorted(n for n in os.listdir(path) if n.endswith((".yaml", ".yml")))[:3]
            example = ", ".join(f"`{os.path.join(path, n)}`" for n in plans) or "`plans/mixtral.yaml`"
            return Diagnostic(UNREADABLE, ERROR, f"`{path}` is a directory; a plan is one YAML file",
                              f"pass one plan file, e.g. {example}", where)
        if not os.path.exists(path):
            return runner.missing_path(path)
    except (ValueError, OSError):  # a NUL byte, a path too long: read_text reports it
        return None
    return None


def _load(source: PlanSource) -> LoadedPlan:
    if isinstance(source, LoadedPlan):
        return source
    if isinstance(source, Plan):
        result = runner.check_data(source.model_dump(exclude_none=True))
    elif isinstance(source, Mapping):
        result = runner.check_data(dict(source))
    elif isinstance(source, os.PathLike) or (isinstance(source, str) and _looks_like_path(source)):
        path = os.fspath(source)
        not_a_file = _not_a_plan_file(path)
        if not_a_file is not None:
            raise PlanError([not_a_file])
        result = runner.check_file(path)
    elif isinstance(source, str):
        result = runner.check_text(source)
    else:
        raise TypeError(
            f"load_plan() takes a path, YAML text, a mapping, a Plan or a LoadedPlan, not {type(source).__name__}"
        )
    errors = [d for d in result.diagnostics if d.severity == ERROR]
    if errors or result.loaded is None:
        raise PlanError(errors or result.diagnostics, loaded=result.loaded)
    result.loaded.diagnostics = list(result.diagnostics)
    return result.loaded
