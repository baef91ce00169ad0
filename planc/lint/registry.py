"""The rules: one `Rule` per stable code, for the loader, lint and the compiler, registered by the `rules_*` modules.

Like ruff, a code never changes meaning once published; `planc rules` lists them, `planc rules CODE`
prints the doc, and docs/lint.md is generated from (and tested against) this registry. Each rule
carries a failing and a passing example plan, which the tests run and the docs show.

Rules with a `check` run over a `LintContext`. Rules without one document a diagnostic that the
loader or the schema validation emits (a YAML syntax error cannot be found by a check over a plan).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from planc.lint.diagnostic import ERROR

if TYPE_CHECKING:
    from planc.lint.context import LintContext
    from planc.lint.diagnostic import Diagnostic

# A rule's check: the diagnostics it finds in one plan.
Check = Callable[["LintContext"], Iterable["Diagnostic"]]

# Families, in the order `planc rules` lists them: loader and lint rules, then the rules the compiler
# emits (`compile`, `layout`; documented and exampled here, checked in planc.compiler).
FAMILIES = (
    "source", "schema", "model", "extends", "patterns", "styles", "removed", "ep", "sizes", "training", "compile",
    "layout",
)
COMPILE_FAMILIES = ("compile", "layout")
# The modules that register them (`layout` rules live in rules_compile).
_MODULES = (
    "source", "schema", "model", "extends", "patterns", "styles", "removed", "ep", "sizes", "training", "compile",
)

_RULES: dict[str, "Rule"] = {}
_loaded = False


@dataclass(frozen=True)
class Rule:
    code: str  # PLCnnn, stable
    name: str  # kebab-case, stable too (`planc rules NAME` works as well)
    title: str  # one line
    doc: str  # why it matters and what to write instead
    check: Optional[Check] = None  # None: emitted by the loader
    severity: str = ERROR
    family: str = ""
    needs_plan: bool = True  # skip when the document does not validate (the check reads ctx.plan)
    bad: Optional[str] = None  # example plan that triggers the rule
    good: Optional[str] = None  # the same plan, fixed
    # compile rules: config overrides of the tiny model of the example's `model.type` (tests compile against it)
    config: Optional[dict[str, Any]] = None


def rule(code: str, name: str, title: str, *, severity: str = ERROR, needs_plan: bool = True,
         bad: Optional[str] = None, good: Optional[str] = None, doc: Optional[str] = None) -> Callable[[Check], Check]:
    """Register a check function (its docstring is the rule's doc)."""

    def deco(fn: Check) -> Check:
        register(Rule(code, name, title, doc or _dedent(fn.__doc__ or ""), fn, severity,
                      fn.__module__.rsplit("rules_", 1)[-1], needs_plan, bad, good))
        return fn

    return deco


@dataclass(frozen=True)
class RetiredRule:
    """A code no check emits any more (ruff's rule lifecycle): the version that retired it and what reports the
    plans it reached now. A retired code is never given to another rule."""

    code: str
    version: str
    use: tuple[str, ...]  # the codes that report it now
    why: str


RETIRED: dict[str, RetiredRule] = {r.code: r for r in (
    RetiredRule("PLC604", "0.1.0", ("PLC406",), "a tp_plan rule on experts that ep_plan shards is a lint error now"),
    RetiredRule("PLC614", "0.1.0", ("PLC400", "PLC401", "PLC402"),
                "an EP strategy that cannot run is a lint error now (lint and the compiler call one resolve_ep)"),
    RetiredRule("PLC618", "0.1.0", ("PLC311", "PLC312"), "a style in the wrong table is a lint error now"),
    RetiredRule("PLC619", "0.1.0", ("PLC300",), "an invalid pattern is a lint error now"),
    RetiredRule("PLC620", "0.1.0", ("PLC500", "PLC501", "PLC502"),
                "sizes are checked by one function (planc.spec.sizes.check_sizes), reported with lint's codes"),
)}


def retired(code: str) -> Optional[RetiredRule]:
    return RETIRED.get(code.strip().upper())


def register(r: Rule) -> Rule:
    """Add a rule; a code or a name registered twice, or a retired code given again, is a programming error."""
    if r.code in RETIRED:
        raise ValueError(f"rule {r.code} ({r.name}): {r.code} is retired; take a new code")
    if r.code in _RULES or any(o.name == r.name for o in _RULES.values()):
        raise ValueError(f"rule {r.code} ({r.name}) registered twice")
    _RULES[r.code] = r
    return r


def _dedent(text: str) -> str:
    import inspect

    return inspect.cleandoc(text)


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _MODULES:
            importlib.import_module(f"planc.lint.rules_{module}")


def all_rules() -> list[Rule]:
    """Every rule, by family then code."""
    _load()
    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(_RULES.values(), key=lambda r: (order.get(r.family, len(order)), r.code))


def get(code_or_name: str) -> Optional[Rule]:
    _load()
    key = code_or_name.strip()
    found = _RULES.get(key.upper())
    if found is None:
        found = next((r for r in _RULES.values() if r.name == key.lower()), None)
    return found


def severity_of(code: str) -> str:
    r = get(code)
    return r.severity if r else ERROR


def checks() -> Iterable[Rule]:
    return [r for r in all_rules() if r.check is not None]
