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


def test_schema_lists_each_tables_styles_and_allows_extends_children():
    from planc.spec.styles import TABLE_STYLES

    schema = json.loads(schema_text())
    for table in ("tp_plan", "ep_plan"):
        values = schema["properties"][table]["additionalProperties"]
        assert values["enum"] == list(TABLE_STYLES[table])  # only the styles legal in this table
        assert values["enumDescriptions"] == list(TABLE_STYLES[table].values())  # each its own doc
    assert "ep_dispatch_experts" not in schema["properties"]["tp_plan"]["additionalProperties"]["enum"]
    assert "colwise" not in schema["properties"]["ep_plan"]["additionalProperties"]["enum"]
    assert schema["required"] == ["version"]
    assert {"if": {"required": ["extends"]}, "else": {"required": ["model", "parallel"]}} in schema["allOf"]


def test_schema_pattern_grammar_is_the_parsers():
    """The rule-table keys' regex (what editors check) accepts exactly what `Pattern` parses."""
    import re

    from planc.lint.registry import all_rules
    from planc.spec.patterns import Pattern, try_pattern

    keys = json.loads(schema_text())["properties"]["tp_plan"]["propertyNames"]
    texts = ["model.layers.*.self_attn.{q,k,v}_proj", "a..b", "a.{b", "q*", "{a,b}{c,d}.x", "*", "a.{b.c}", "a,b",
             "{,a}", "a\n", "a.b}", ".a", "a.", "lm_head", "a-b.c_d", "{a,*}", "a.{b{c}}", "a b", "a/b", "a[0]"]
    for r in all_rules():  # every pattern of every rule example, good and bad
        for example in (r.bad, r.good):
            texts += re.findall(r"^  (\S+):", example or "", re.M)
    assert len(texts) > 60
    for text in texts:
        assert bool(re.fullmatch(keys["pattern"][1:-1], text)) == isinstance(try_pattern(text), Pattern), text


def test_schema_pairings_come_from_the_lint_table():
    """Each cross-key pairing the lint rules check is an if/then fragment of the schema, with its code."""
    from planc.commands.schema import pairing_fragments
    from planc.spec.pairings import PAIRINGS

    schema = json.loads(schema_text())
    for p in PAIRINGS:
        for fragment in pairing_fragments(p):
            assert fragment in schema["allOf"]
            assert p.code in json.dumps(fragment["then"])


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
