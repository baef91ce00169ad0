"""pydantic errors mapped back to the offending key or value, with did-you-mean."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from planc.lint.runner import diagnostics_from_validation, lint_text
from planc.spec.model import Plan
from planc.spec.source import parse_yaml

from .helpers import GOOD


def diag(text):
    diags = lint_text(text, "p.yaml")
    assert len(diags) == 1, [d.format() for d in diags]
    return diags[0]


def test_unknown_key_with_did_you_mean_at_the_key():
    d = diag(GOOD.replace("ep_size", "ep_szie"))
    assert (d.code, d.line, d.col) == ("PLC101", 3, 24)
    assert d.hint.startswith("did you mean `ep_size`?")


def test_unknown_top_level_key():
    d = diag(GOOD + "tp_plans: {}\n")
    assert (d.code, d.line, d.col) == ("PLC101", 10, 1)
    assert "did you mean `tp_plan`?" in d.hint


def test_bad_enum_at_the_value_with_did_you_mean():
    d = diag(GOOD + "experts:\n  ep_implementation: all2all\n")
    assert (d.code, d.line, d.col) == ("PLC103", 11, 22)
    assert "`all_to_all`" in d.hint


def test_bad_enum_without_close_match_lists_choices():
    d = diag(GOOD + "experts: {implementation: xyz}\n")
    assert d.code == "PLC103" and d.hint.startswith("write one of:") and "`grouped_mm`" in d.hint


def test_missing_required_key_points_at_the_parent():
    d = diag("version: 1\nmodel: {type: mixtral}\nparallel: {ep_size: 1}\n")
    assert (d.code, d.line, d.col) == ("PLC100", 3, 1)
    assert "tp_size" in d.message and "tp_size: 8" in d.hint


def test_wrong_type_in_table_value():
    d = diag(GOOD.replace("o_proj: rowwise", "o_proj: [rowwise]"))
    assert (d.code, d.line) == ("PLC102", 6)


def test_version():
    d = diag(GOOD.replace("version: 1", "version: 2"))
    assert (d.code, d.line, d.col) == ("PLC105", 1, 10)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_sizes_are_positive(value):
    d = diag(GOOD.replace("tp_size: 2", f"tp_size: {value}"))
    assert d.code == "PLC104" and d.hint == "write `tp_size: 1` or more"


def test_megamoe_settings_validated():
    text = GOOD.replace("ep_size: 2}", "ep_size: 2}\nexperts:\n  implementation: deepgemm_megamoe\n"
                        "  megamoe: {backend: deepgemm, activation_clamp: -1, quantise: fp4}")
    got = {(d.code, d.line) for d in lint_text(text)}
    assert got == {("PLC103", 6), ("PLC104", 6), ("PLC101", 6)}


def test_diagnostics_from_validation_accepts_plain_key_positions():
    doc = parse_yaml("version: 1\nmodel: {type: m}\nparallel: {tp_size: 1}\nbogus: 1\n", "f.yaml")
    with pytest.raises(ValidationError) as err:
        Plan.model_validate(doc.data)
    [d] = diagnostics_from_validation(err.value, "f.yaml", doc.key_positions)
    assert str(d.position) == "f.yaml:4:1" and d.code == "PLC101"
    [d] = diagnostics_from_validation(err.value, None, {})  # a plan given as a mapping: located by its key path
    assert d.position is None and d.where == "<mapping>['bogus']", d.where


@pytest.mark.parametrize("value", ["true", '"8"', "'8'"])
def test_lax_coercions_are_wrong_types(value):
    d = diag(GOOD.replace("tp_size: 2", f"tp_size: {value}"))
    assert (d.code, d.line, d.col) == ("PLC102", 3, 21)
    assert "`tp_size: 8` (no quotes)" in d.hint


def test_numbers_where_strings_belong():
    d = diag(GOOD.replace("type: mixtral", "type: 3"))
    assert (d.code, d.line) == ("PLC102", 2)


def test_a_mapping_plan_is_located_by_its_key_path():
    from planc.errors import PlanError
    from planc.lint.plan_loader import load_plan

    data = {"version": 1, "model": {"type": "mixtral"}, "parallel": {"tp_size": 2, "ep_size": 2},
            "experts": {"ep_implementation": "bogus"}}
    with pytest.raises(PlanError) as err:
        load_plan(data)
    assert str(err.value).startswith("<mapping>['experts']['ep_implementation']: PLC103 error:"), str(err.value)
    assert "<string>" not in str(err.value)
