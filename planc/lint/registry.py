"""The rules: one `Rule` per stable code, for the loader, lint and the compiler, each registered beside its check.

Lint rules are registered by the `rules_*` modules here; the rules the compiler emits by the compiler
modules that check them (`compile_rule`), which a later layer names with `register_rule_modules`.

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
# emits (`compile`, `layout`; registered with `compile_rule` beside their checks in planc.compiler).
FAMILIES = (
    "source", "schema", "model", "extends", "patterns", "styles", "removed", "ep", "sizes", "training", "compile",
    "layout",
)
COMPILE_FAMILIES = ("compile", "layout")
# The lint modules that register rules (planc.lint.rules_<name>).
_MODULES = ("source", "schema", "model", "extends", "patterns", "styles", "removed", "ep", "sizes", "training")

_RULES: dict[str, "Rule"] = {}
_loaded = False
# Modules of later layers that register rules (the compiler's), named by a layer that may import them
# (planc/__init__.py); imported on the first lookup that needs every rule, so this layer names none of them
# and `planc lint`, which needs only lint's checks, never imports them.
_later: list[str] = []
_later_loaded: set[str] = set()


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


def compile_rule(code: str, name: str, title: str, doc: str, bad: Optional[str] = None, good: Optional[str] = None, *,
                 family: str = "compile", severity: str = ERROR, config: Optional[dict[str, Any]] = None) -> str:
    """Register a rule the compiler emits and return its code, the constant its check reports. It has no lint
    check (it needs the model); `bad` and `good` are compiled against the tiny model of their `model.type`."""
    register(Rule(code, name, title, doc, None, severity, family, True, bad, good, config=config))
    return code


def register_rule_modules(*modules: str) -> None:
    """Name modules of a later layer that register rules; they are imported when every rule is looked up."""
    _later.extend(m for m in modules if m not in _later)


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


def _load(*, later: bool = True) -> None:
    """Import the lint modules that register rules, and (`later`) the later layers' modules."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _MODULES:
            importlib.import_module(f"planc.lint.rules_{module}")
    for module in _later if later else ():
        if module not in _later_loaded:
            importlib.import_module(module)
            _later_loaded.add(module)


def _in_order(rules: Iterable[Rule]) -> list[Rule]:
    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(rules, key=lambda r: (order.get(r.family, len(order)), r.code))


def all_rules() -> list[Rule]:
    """Every rule, by family then code."""
    _load()
    return _in_order(_RULES.values())


def get(code_or_name: str) -> Optional[Rule]:
    """The rule of a code or a name; lint's modules are searched first, so lint's own lookups import no more."""
    key = code_or_name.strip()
    for later in (False, True):
        _load(later=later)
        found = _RULES.get(key.upper())
        if found is None:
            found = next((r for r in _RULES.values() if r.name == key.lower()), None)
        if found is not None:
            return found
    return None


def severity_of(code: str) -> str:
    r = get(code)
    return r.severity if r else ERROR


def checks() -> Iterable[Rule]:
    """The rules lint runs (only lint's modules have checks)."""
    _load(later=False)
    return [r for r in _in_order(_RULES.values()) if r.check is not None]
