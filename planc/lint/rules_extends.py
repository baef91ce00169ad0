"""Extends rules: problems resolving a plan's `extends` chain (emitted by planc.spec.loaded_plan)."""

from __future__ import annotations

from planc.lint.registry import Rule, register
from planc.spec import loaded_plan

register(Rule(
    loaded_plan.EXTENDS_OUTSIDE, "extends-outside-tree", "`extends` points outside the linted plan's directory tree",
    "A parent plan must be a relative path that stays inside the directory of the plan that was\n"
    "linted first (symlinks are resolved). This keeps a plan from making the linter read arbitrary\n"
    "files, and keeps a repository's plans self-contained. Absolute paths are refused. A shipped plan is\n"
    "reached by name instead: `extends: planc:deepseek_v3`.",
    family="extends",
))
register(Rule(
    loaded_plan.EXTENDS_CYCLE, "extends-cycle", "`extends` forms a cycle (or a chain deeper than 16)",
    "A plan that extends itself, directly or through other plans, has no defined content.",
    family="extends",
))
register(Rule(
    loaded_plan.EXTENDS_MISSING, "extends-missing", "The `extends` parent does not exist",
    "The path is relative to the directory of the plan that contains `extends`; `planc:NAME` names a\n"
    "plan planc ships (`planc lint` with no path lists them). A value that cannot be a path (a NUL or\n"
    "another control character) is reported here too, at the value.",
    family="extends",
))
