"""Schema rules: pydantic validation errors of plan format v1, mapped back to the offending line.

The pydantic models in planc.spec.model are the single source of truth; this module only turns
their errors into diagnostics that point at the key (unknown or missing keys) or the value (wrong
type, bad enum value, out of range) and say what to write instead, with a did-you-mean.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

from planc.lint.context import TABLES, LintContext
from planc.lint.diagnostic import Diagnostic
from planc.lint.registry import Rule, register, rule
from planc.lint.suggest import did_you_mean
from planc.spec.model import Choice

if TYPE_CHECKING:  # pydantic is imported when a plan fails validation, not by `import planc.lint`
    from pydantic import ValidationError
    from pydantic_core import ErrorDetails

Loc = tuple[Union[int, str], ...]  # a pydantic error location: keys and list indices

MISSING = "PLC100"
UNKNOWN_KEY = "PLC101"
WRONG_TYPE = "PLC102"
BAD_VALUE = "PLC103"
OUT_OF_RANGE = "PLC104"
VERSION = "PLC105"
OTHER = "PLC109"

_BASE = "version: 1\nmodel: {type: mixtral}\n"

register(Rule(
    MISSING, "missing-key", "A required key is missing",
    "`version`, `model.type` and `parallel.tp_size` have no default.",
    family="schema", bad=_BASE, good=_BASE + "parallel: {tp_size: 2}\n",
))
register(Rule(
    UNKNOWN_KEY, "unknown-key", "A key that plan format v1 does not have",
    "Every mapping of a plan is closed: a misspelt key would otherwise be ignored silently. The hint\n"
    "suggests the closest valid key.",
    family="schema",
    bad=_BASE + "parallel: {tp_size: 2, ep_szie: 1}\n",
    good=_BASE + "parallel: {tp_size: 2, ep_size: 1}\n",
))
register(Rule(
    BAD_VALUE, "bad-enum-value", "A value is not one of the allowed choices",
    "`experts.implementation`, `experts.ep_implementation`, `experts.megamoe.backend`,\n"
    "`experts.megamoe.quantize` and `experts.megamoe.math` take one of a fixed set of names; the hint suggests the\n"
    "closest one.",
    family="schema",
    bad=_BASE + "parallel: {tp_size: 2}\nexperts: {implementation: grouped_mmm}\n",
    good=_BASE + "parallel: {tp_size: 2}\nexperts: {implementation: grouped_mm}\n",
))
register(Rule(
    OUT_OF_RANGE, "out-of-range", "A number is out of range, or a string is empty",
    "Sizes are >= 1, `max_tokens_per_rank` >= 1, `activation_clamp` >= 0; patterns are not empty.",
    family="schema",
    bad=_BASE + "parallel: {tp_size: 0}\n",
    good=_BASE + "parallel: {tp_size: 1}\n",
))
register(Rule(
    VERSION, "unsupported-version", "`version` is not 1",
    "planc reads plan format version 1 only; a plan for another version must not be half-understood.",
    family="schema",
    bad="version: 2\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n",
    good="version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n",
))
register(Rule(
    OTHER, "schema-error", "Any other schema violation",
    "A validation error of the plan models that none of the rules above describes more precisely.",
    family="schema",
))

_EXAMPLES = {
    "version": "version: 1",
    "model": "model: {type: mixtral}",
    "parallel": "parallel: {tp_size: 8}",
    "type": "type: mixtral",
    "tp_size": "tp_size: 8",
}
_RANGE_TYPES = {"greater_than_equal", "greater_than", "less_than", "less_than_equal", "string_too_short",
                "too_short", "too_long", "string_too_long"}
_KINDS = {int: "a whole number", float: "a number", str: "a string"}  # scalar field types, in words


def _where(loc: Loc) -> str:
    """`experts.megamoe.backend`, or `tp_plan['model.x']` inside a rule table."""
    out = ""
    for i, part in enumerate(loc):
        if i == 1 and loc[0] in TABLES:
            out += f"[{part!r}]"
        elif part == "[key]":
            out += " key"
        else:
            out += ("." if out else "") + str(part)
    return out or "the plan"


def _unwrap(annotation: Any) -> Any:
    """Optional[X] -> X."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        return args[0]
    return annotation


def _model_at(loc: Loc) -> Any:
    """The pydantic model class a location points into (None inside rule tables or scalars)."""
    from pydantic import BaseModel

    from planc.spec.model import Plan

    model: Any = Plan
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        model = _unwrap(fields[part].annotation)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            model = None
    return model


def _field(loc: Loc) -> Any:
    parent = _model_at(loc[:-1]) if loc else None
    if parent is None or not loc or loc[-1] not in parent.model_fields:
        return None
    return parent.model_fields[loc[-1]]


def _choices(loc: Loc) -> Optional[list[Any]]:
    info = _field(loc)
    if info is None:
        return None
    choice = next((m for m in info.metadata if isinstance(m, Choice)), None)
    if choice is not None:  # a table of planc.spec.choices, read now
        return list(choice.names)
    ann = _unwrap(info.annotation)
    return list(typing.get_args(ann)) if typing.get_origin(ann) is typing.Literal else None


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def from_validation(err: ValidationError, ctx: LintContext) -> list[Diagnostic]:
    """Diagnostics for a pydantic ValidationError; `ctx` gives positions (a LintContext)."""
    out = []
    for e in err.errors(include_url=False):
        loc = tuple(e.get("loc", ()))
        typ = e.get("type", "")
        where = _where(loc)
        value = e.get("input")
        keypath = tuple(p for p in loc if p != "[key]")
        if "[key]" in loc:
            out.append(ctx.diag(WRONG_TYPE, f"pattern {_show(keypath[-1])} in {loc[0]} is not a string",
                                "write the pattern as a dotted path, e.g. `model.layers.*.mlp.experts`", keypath))
        elif typ == "missing":
            name = loc[-1] if loc else "?"
            parent = _where(loc[:-1])  # "the plan" at the top level
            example = _EXAMPLES.get(str(name), f"{name}: ...")
            out.append(ctx.diag(MISSING, f"{parent} is missing the required key `{name}`",
                                f"add `{example}`" + (f" under `{parent}`" if len(loc) > 1 else ""),
                                loc[:-1]))
        elif typ == "extra_forbidden":
            model = _model_at(loc[:-1])
            valid = sorted(model.model_fields) if model else []
            parent = f"`{_where(loc[:-1])}`" if len(loc) > 1 else "a plan"
            guess = did_you_mean(str(loc[-1]), valid)
            hint = f"did you mean `{guess}`? " if guess else ""
            hint += f"{parent} takes: {', '.join(valid)}" if valid else "remove it"
            table = _table_above(ctx, loc) if len(loc) == 1 else None
            if table is not None:  # a rule that lost its indentation: it is read as a top-level key
                guess, hint = None, (f"this is a rule: indent it two spaces under `{table[0]}:` (line {table[1]}), "
                                     f"like `  {loc[-1]}: ...`")
            where_key = f"in {parent}" if len(loc) > 1 else "at the top level of the plan"
            out.append(ctx.diag(UNKNOWN_KEY, f"unknown key `{loc[-1]}` {where_key}", hint, loc, fix=guess))
        elif typ == "literal_error" and loc == ("version",):
            out.append(ctx.diag(VERSION, f"unsupported plan format version {_show(value)}",
                                "write `version: 1` (planc reads format v1 only)", loc, at_value=True))
        elif typ in ("literal_error", "enum"):
            choices = _choices(loc) or []
            guess = did_you_mean(str(value), [str(c) for c in choices])
            listed = ", ".join(f"`{c}`" for c in choices)
            hint = f"did you mean `{guess}`? one of: {listed}" if guess else f"write one of: {listed}"
            if loc == ("experts", "ep_implementation") and not guess:
                hint += ("; a strategy of your own is a registered row: name the module that calls "
                         "`planc.register_ep_strategy` in pyproject.toml's [tool.planc] extensions (docs/extending.md)")
            out.append(ctx.diag(BAD_VALUE, f"`{where}` is {_show(value)}, not an allowed value", hint, loc, at_value=True,
                                fix=guess))
        elif typ in _RANGE_TYPES:
            out.append(ctx.diag(OUT_OF_RANGE, f"`{where}`: {e['msg']}, got {_show(value)}",
                                _range_hint(loc, e), keypath, at_value=True))
        elif typ == "dict_type" and value is None and loc in (("tp_plan",), ("ep_plan",)):
            out.append(ctx.diag(WRONG_TYPE, f"`{where}:` has no rules under it",
                                f"indent each rule two spaces under `{where}:`, e.g. `  model.layers.*.mlp.gate: ...`; "
                                f"or remove the empty `{where}:`", keypath))
        elif typ.endswith(("_type", "_parsing")) or typ in ("int_from_float", "finite_number"):
            out.append(ctx.diag(WRONG_TYPE, f"`{where}`: {e['msg']}, got {_show(value)}",
                                _type_hint(loc), keypath, at_value=True))
        else:
            out.append(ctx.diag(OTHER, f"`{where}`: {e['msg']}", "see docs/plan-format.md", keypath, at_value=True))
    return out


def _table_above(ctx: LintContext, loc: Loc) -> Optional[tuple[str, int]]:
    """(table, line) when the unknown top-level key `loc` is a module pattern written below an empty `tp_plan:` or
    `ep_plan:` key: a rule whose indentation was lost."""
    key = str(loc[-1])
    if not any(c in key for c in ".*{"):
        return None
    here = ctx.key_positions.get(tuple(loc))
    above = [(str(t), p.line) for (t,), p in ((k, p) for k, p in ctx.key_positions.items() if len(k) == 1)
             if t in ("tp_plan", "ep_plan") and here is not None and p.line < here.line and ctx.data.get(t) is None]
    return max(above, key=lambda a: a[1]) if above else None


def _range_hint(loc: Loc, e: ErrorDetails) -> str:
    if loc and loc[-1] in ("tp_size", "ep_size", "dp_size"):
        return f"write `{loc[-1]}: 1` or more"
    if e.get("type") == "string_too_short":
        return "write a non-empty value"
    limit = (e.get("ctx") or {}).get("ge")
    return f"write a value >= {limit}" if limit is not None else "write a value in range"


def _type_hint(loc: Loc) -> str:
    if len(loc) >= 2 and loc[0] in TABLES:
        return "write `pattern: style` with the style as a plain string, e.g. `model.layers.*.mlp.down_proj: rowwise`"
    if len(loc) == 1 and loc[0] in (*TABLES, "experts", "parallel", "model"):
        return f"`{loc[0]}` is a mapping of keys to values (see docs/plan-format.md)"
    info = _field(loc)
    ann: Any = _unwrap(info.annotation) if info is not None else None
    if hasattr(ann, "model_fields"):
        return f"`{_where(loc)}` is a mapping with the keys: {', '.join(ann.model_fields)}"
    if ann in _KINDS:
        return f"write {_KINDS[ann]}" + (" (quote it if YAML reads it as something else)" if ann is str else "")
    return "see docs/plan-format.md for the type of this key"


@rule(
    WRONG_TYPE, "wrong-type", "A value has the wrong type",
    bad=_BASE + "parallel: {tp_size: \"8\"}\n",
    good=_BASE + "parallel: {tp_size: 8}\n",
)
def check_strict_types(ctx: LintContext) -> Iterator[Diagnostic]:
    """Sizes are integers, names are strings, `experts`, `parallel`, `tp_plan` and `ep_plan` are
    mappings, `version` is the integer 1. pydantic alone would quietly accept `tp_size: "8"`,
    `tp_size: true` or `version: true` (lax mode); planc rejects them like the JSON Schema does, so
    editors, check-jsonschema and planc agree. (Values that YAML 1.1 and 1.2 read differently, such as
    `010`, are PLC011.)"""
    from planc.spec.model import Plan

    yield from _strict(ctx, Plan, ctx.data, ())


def _strict(ctx: LintContext, model: Any, data: Any, prefix: Loc) -> Iterator[Diagnostic]:
    if not isinstance(data, dict):
        return
    for name, info in model.model_fields.items():
        if name not in data or data[name] is None:
            continue
        value, loc = data[name], prefix + (name,)
        ann = _unwrap(info.annotation)
        if hasattr(ann, "model_fields"):
            yield from _strict(ctx, ann, value, loc)
            continue
        example = 8
        if typing.get_origin(ann) is typing.Literal and all(type(c) is int for c in typing.get_args(ann)):
            # `version: 1`: pydantic's Literal[1] takes `true` and `1.0` (== 1); the JSON Schema does not
            ann, example = int, typing.get_args(ann)[0]
        want = {int: (int,), float: (int, float), str: (str,)}.get(ann)
        if want and (isinstance(value, bool) or not isinstance(value, want)):
            kind = _KINDS[ann]
            hint = (f"quote the value: `{name}: \"{value}\"`" if ann is str
                    else f"write {kind}, e.g. `{name}: {example}` (no quotes)")
            yield ctx.diag(WRONG_TYPE, f"`{_where(loc)}` must be {kind}, got {_show(value)}", hint, loc, at_value=True)
