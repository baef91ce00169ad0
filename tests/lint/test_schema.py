"""The checked-in JSON Schema: current, and it agrees with planc on the structure of the shipped plans."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from planc.commands.schema import schema_text

from .helpers import PLANS, REPO


def test_checked_in_schema_is_not_stale():
    assert (REPO / "schemas" / "plan.schema.json").read_text() == schema_text(), (
        "schemas/plan.schema.json is stale: run `planc schema -o schemas/plan.schema.json`"
    )


def test_schema_lists_styles_and_allows_extends_children():
    schema = json.loads(schema_text())
    assert "ep_dispatch_experts" in schema["properties"]["ep_plan"]["additionalProperties"]["enum"]
    assert schema["required"] == ["version"]
    assert {"required": ["extends"]} in schema["anyOf"]


def test_shipped_plans_carry_the_modeline():
    for p in PLANS:
        assert p.read_text().startswith("# yaml-language-server: $schema=../schemas/plan.schema.json\n"), p


@pytest.mark.skipif(shutil.which("check-jsonschema") is None and not (REPO / ".venv/bin/check-jsonschema").exists(),
                    reason="check-jsonschema not installed")
def test_check_jsonschema_accepts_shipped_plans_and_rejects_a_bad_one(tmp_path):
    exe = shutil.which("check-jsonschema") or str(REPO / ".venv/bin/check-jsonschema")
    schema = str(REPO / "schemas" / "plan.schema.json")
    ok = subprocess.run([exe, "--schemafile", schema, *map(str, PLANS)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodel: {type: m}\nparallel: {tp_size: 0}\n")
    assert subprocess.run([exe, "--schemafile", schema, str(bad)], capture_output=True).returncode == 1
