"""`planc schema`: the JSON Schema of plan format v1, generated from the pydantic models.

Two additions to pydantic's output: keys a parent plan can supply are required only when the plan has
no `extends` (a schema validator cannot follow the reference; `planc lint` does), written as
`if`/`else` so that an editor says which key is missing; and the cross-key pairings of
`planc.spec.pairings` (the table the lint rules read) as `if`/`then` fragments, so an editor with only
the schema reports them on the value that breaks them, with the rule's code.

`schemas/plan.schema.json` is this output, checked in for editors (yaml-language-server) and
check-jsonschema; a test fails when it is stale.
"""

from __future__ import annotations

import argparse

DRAFT = "https://json-schema.org/draft/2020-12/schema"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")


def schema_text() -> str:
    import json

    from planc.spec.model import Plan

    from planc.spec.pairings import PAIRINGS
    from planc.spec.patterns import PATTERN_REGEX, PATTERN_SYNTAX

    schema = {"$schema": DRAFT, **Plan.model_json_schema()}
    # Editors check the pattern grammar of rule-table keys as you type; pydantic does not (a `pattern` there would
    # turn the table into patternProperties), so lint reports the precise problem (PLC300).
    for table in ("tp_plan", "ep_plan"):
        schema["properties"][table]["propertyNames"].update(
            pattern=PATTERN_REGEX, patternErrorMessage=f"PLC300: not a valid pattern. {PATTERN_SYNTAX}")
    # A plan with `extends` may leave required keys (model, parallel) to its parent: the schema
    # cannot follow the file reference, so it requires them only when there is no `extends`.
    inherited = [k for k in schema.get("required", []) if k != "version"]
    rules: list[dict] = []
    if inherited:
        schema["required"] = [k for k in schema["required"] if k not in inherited]
        rules.append({"if": {"required": ["extends"]}, "else": {"required": inherited}})
    for p in PAIRINGS:
        rules += pairing_fragments(p)
    schema["allOf"] = rules
    return json.dumps(schema, indent=2, sort_keys=False) + "\n"


def _nest(path: tuple, leaf: dict, *, required: bool) -> dict:
    """`leaf` at key path `path` of an object schema (each key required on the way when `required`)."""
    for key in reversed(path):
        leaf = {**({"required": [key]} if required else {}), "properties": {key: leaf}}
    return leaf


def pairing_fragments(p) -> list[dict]:
    """The JSON Schema of one pairing: when its condition holds, the constrained key takes only the allowed
    values; and, when the default is not allowed and no parent can supply the key, the key must be written."""
    when = _nest(p.when, {} if p.value is None else {"const": p.value}, required=True)
    message = f"{p.code}: {p.why}; write one of: {', '.join(p.allowed)}"
    out = [{"if": when, "then": _nest(p.key, {"enum": list(p.allowed), "errorMessage": message}, required=False)}]
    if p.default not in p.allowed:
        written = _nest(p.key[:-1], {"required": [p.key[-1]], "errorMessage": message}, required=False)
        out.append({"if": {**when, "not": {"required": ["extends"]}}, "then": written})
    return out


def run(args: argparse.Namespace) -> int:
    import sys

    text = schema_text()
    if args.output:
        from planc.commands.files import OutputError, write_file

        try:
            write_file(args.output, text.encode("utf-8"), overwrite=True)  # regenerating is the point
        except OutputError as e:
            sys.stderr.write(f"planc schema: {e}\n")
            return 2
    else:
        sys.stdout.write(text)
    return 0
