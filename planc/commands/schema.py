"""`planc schema`: the JSON Schema of plan format v1, generated from the pydantic models.

One adjustment to pydantic's output: keys a parent plan can supply are required only when the plan
has no `extends` (a schema validator cannot follow the reference; `planc lint` does).

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

    schema = {"$schema": DRAFT, **Plan.model_json_schema()}
    # A plan with `extends` may leave required keys (model, parallel) to its parent: the schema
    # cannot follow the file reference, so it requires them only when there is no `extends`.
    inherited = [k for k in schema.get("required", []) if k != "version"]
    if inherited:
        schema["required"] = [k for k in schema["required"] if k not in inherited]
        schema["anyOf"] = [{"required": ["extends"]}, {"required": inherited}]
    return json.dumps(schema, indent=2, sort_keys=False) + "\n"


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
