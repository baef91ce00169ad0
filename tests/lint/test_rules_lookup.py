"""`planc rules`: a rule's text stands alone in a wheel, a style is looked up in the style table, and a retired code
says when it was retired and what to use (ruff's rule lifecycle)."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.lint.registry import RETIRED, Rule, all_rules, register


def test_plc660_describes_both_checks_and_names_no_test_file(capsys):
    assert main(["rules", "PLC660"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tests/" not in out, out
    assert "(1) The parameters each rank holds once loaded" in out and "(2) `planc explain` only, with a workload" in out
    assert "planc explain plans/deepseek_v3.yaml --device-memory H200" in out


def test_no_rule_sends_the_user_to_a_test_file():
    """A wheel ships planc/, not tests/: a rule's doc names commands and docs instead."""
    assert [r.code for r in all_rules() if "tests/" in r.doc] == []


def test_a_style_is_looked_up_in_the_style_table(capsys):
    assert main(["rules", "colwise"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("colwise (style of `tp_plan`; targets a module)"), out
    assert "shard the output features (weight dim -2)" in out and "splits a weight on dim -2" in out
    assert "takes replicated input, gives sharded output" in out and "PLC311 (ep-style-in-tp-plan)" in out
    assert main(["rules", "megamoe_router"]) == 0
    assert "a removed style (PLC320)" in capsys.readouterr().out
    assert main(["rules", "colwse"]) == 2
    assert "no rule or style 'colwse' (did you mean colwise?)" in capsys.readouterr().err


def test_a_retired_code_says_when_and_what_to_use(capsys):
    assert main(["rules", "PLC618"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PLC618 was retired in version 0.1.0: use PLC311, PLC312"), out
    assert "did you mean" not in out
    for code, gone in RETIRED.items():
        assert all(main(["rules", use]) == 0 for use in gone.use), code  # what it points to exists
    capsys.readouterr()


def test_a_retired_code_is_never_given_again():
    with pytest.raises(ValueError, match="PLC604 is retired"):
        register(Rule("PLC604", "reused-code", "a reused code", "doc"))


def test_the_retired_codes_of_docs_compile_md_are_the_registry_s():
    import re

    from tests.checkout_env import REPO

    text = (REPO / "docs" / "compile.md").read_text()
    assert set(re.findall(r"^\| (PLC\d{3}) \| retired: ", text, re.M)) == set(RETIRED)
