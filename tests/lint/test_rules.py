"""Every registered rule: stable shape, a failing and a passing example, and precise positions."""

from __future__ import annotations

import re

import pytest

from planc.lint.diagnostic import WARNING
from planc.lint.registry import COMPILE_FAMILIES, all_rules, get
from planc.lint.runner import lint_text
from planc.spec.styles import REMOVED_STYLES

from .helpers import GOOD, codes

RULES = all_rules()
# Compile rules' examples are compiled in tests/compiler/test_rule_examples.py; here they must lint clean.
EXAMPLES = [r for r in RULES if r.bad is not None and r.family not in COMPILE_FAMILIES]
COMPILE_EXAMPLES = [r for r in RULES if r.family in COMPILE_FAMILIES and r.bad]


@pytest.mark.parametrize("r", COMPILE_EXAMPLES, ids=lambda r: r.code)
def test_compile_rule_examples_pass_lint(r):
    for text in (r.bad, r.good):
        assert [d.format() for d in lint_text(text, "example.yaml") if d.severity == "error"] == []


def test_codes_and_names_are_unique_and_well_formed():
    assert len({r.code for r in RULES}) == len(RULES)
    assert len({r.name for r in RULES}) == len(RULES)
    for r in RULES:
        assert re.fullmatch(r"PLC\d{3}", r.code), r.code
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", r.name), r.name
        assert r.title and r.doc and r.family, r.code
        assert r.severity in ("error", "warning")


def test_every_check_has_examples():
    for r in RULES:
        if r.check is not None:
            assert r.bad and r.good, f"{r.code} has a check but no failing/passing example"


@pytest.mark.parametrize("r", EXAMPLES, ids=lambda r: r.code)
def test_failing_example_triggers_the_rule(r):
    diags = lint_text(r.bad, "example.yaml")
    assert r.code in codes(diags), [d.format() for d in diags]
    for d in diags:
        assert d.hint and d.message and d.position.line >= 1 and d.position.path == "example.yaml"


@pytest.mark.parametrize("r", EXAMPLES, ids=lambda r: r.code)
def test_passing_example_is_clean(r):
    assert lint_text(r.good, "example.yaml") == []


def test_lookup_by_code_and_name():
    assert get("plc402").name == "shared-batch-needs-ep-equal-tp"
    assert get("duplicate-key").code == "PLC008"
    assert get("PLC999") is None


def only(text, code):
    found = [d for d in lint_text(text, "p.yaml") if d.code == code]
    assert len(found) == 1, [d.format() for d in lint_text(text, "p.yaml")]
    return found[0]


def test_megamoe_with_other_ep_points_at_ep_implementation():
    text = (
        "version: 1\nmodel: {type: deepseek_v4}\nparallel: {tp_size: 8, ep_size: 8}\n"
        "experts:\n  implementation: deepgemm_megamoe\n  ep_implementation: all_reduce\n"
        "ep_plan:\n  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    )
    d = only(text, "PLC400")
    assert (d.line, d.col) == (6, 22)
    assert "ep_implementation: auto" in d.hint


def test_lint_and_compile_agree_on_ep_strategy_messages():
    from planc.spec.ep import EPResolutionError, resolve_ep
    from planc.spec.model import Experts, Parallel

    text = (
        "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2, ep_size: 2}\n"
        "experts: {implementation: grouped_mm, ep_implementation: deepgemm_megamoe}\n"
        "ep_plan:\n  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    )
    d = only(text, "PLC401")
    with pytest.raises(EPResolutionError) as err:
        resolve_ep(Experts(implementation="grouped_mm", ep_implementation="deepgemm_megamoe"), Parallel(tp_size=2, ep_size=2))
    assert d.message == str(err.value) and d.hint == err.value.hint


@pytest.mark.parametrize("ep", ["all_reduce", "deepgemm_megamoe", "auto"])
def test_shared_batch_strategies_need_ep_equal_tp(ep):
    impl = "grouped_mm" if ep == "all_reduce" else "deepgemm_megamoe"
    text = (
        f"version: 1\nmodel: {{type: deepseek_v4}}\nparallel: {{tp_size: 2, ep_size: 4, dp_size: 2}}\n"
        f"experts:\n  implementation: {impl}\n  ep_implementation: {ep}\n"
        "ep_plan:\n  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    )
    d = only(text, "PLC402")
    assert d.line == 6  # the ep_implementation value
    ok = text.replace("ep_size: 4, dp_size: 2", "ep_size: 2, dp_size: 2")
    assert "PLC402" not in codes(lint_text(ok))


def test_auto_megamoe_by_default_blames_the_implementation():
    text = (
        "version: 1\nmodel: {type: deepseek_v4}\nparallel: {tp_size: 2, ep_size: 4, dp_size: 2}\n"
        "experts:\n  implementation: deepgemm_megamoe\n"
        "ep_plan:\n  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    )
    d = only(text, "PLC402")
    assert (d.line, d.col) == (5, 19)
    assert "all_to_all" not in d.hint  # all_to_all would trip PLC400 with Mega MoE experts


def test_auto_with_other_experts_accepts_any_ep_size():
    text = GOOD.replace("ep_size: 2", "ep_size: 4, dp_size: 2")
    assert lint_text(text) == []


@pytest.mark.parametrize("style", sorted(REMOVED_STYLES))
def test_removed_styles_hint_the_current_form(style):
    text = GOOD + f"  model.layers.*.mlp.gate: {style}\n"
    d = only(text, "PLC320")
    assert d.hint.startswith(REMOVED_STYLES[style]) and "planc migrate" in d.hint
    assert d.line == 10


def test_moe_tp_experts_in_ep_plan_is_reported_with_migration():
    text = GOOD.replace("model.layers.*.mlp.experts: ep_dispatch_experts", "model.layers.*.mlp.experts: moe_tp_experts")
    d = only(text, "PLC320")
    assert "ep_dispatch_experts" in d.hint
    # in tp_plan it is a valid TP style
    tp = GOOD.replace("ep_size: 2", "ep_size: 1").split("ep_plan:")[0] + "  model.layers.*.mlp.experts: moe_tp_experts\n"
    assert lint_text(tp) == []


def test_unknown_style_did_you_mean_per_table():
    text = GOOD.replace("grouped_gemm", "grouped_gem")
    d = only(text, "PLC310")
    assert d.hint == "did you mean `grouped_gemm`?"
    assert (d.line, d.col) == (8, 56)


def test_missing_dispatch_suggests_the_experts_module():
    text = GOOD.replace("  model.layers.*.mlp.experts: ep_dispatch_experts\n", "")
    d = only(text, "PLC404")
    assert "model.layers.*.mlp.experts: ep_dispatch_experts" in d.hint
    assert d.line == 3


def test_dispatch_without_ep_is_a_warning():
    text = GOOD.replace("ep_size: 2", "ep_size: 1")
    diags = lint_text(text)
    assert {d.code for d in diags} == {"PLC405"} and all(d.severity == WARNING for d in diags)


@pytest.mark.parametrize(
    "tp_pattern, hit",
    [
        ("model.layers.*.mlp.experts", True),
        ("model.layers.*.mlp.experts.down_proj", True),
        ("model.layers.0.mlp.experts.{gate_up_proj,x}", True),
        ("model.*.*.mlp.*", True),
        ("model.layers.*.mlp", False),
        ("model.layers.*.mlp.shared_experts.down_proj", False),
        ("model.layers.*.self_attn.o_proj", False),
    ],
)
def test_tp_rule_on_ep_experts(tp_pattern, hit):
    text = GOOD.replace("tp_plan:\n", f"tp_plan:\n  {tp_pattern}: rowwise\n")
    assert ("PLC406" in codes(lint_text(text))) is hit
    if hit:  # with ep_size 1 the experts are not EP-sharded
        no_ep = text.replace("ep_size: 2", "ep_size: 1")
        assert "PLC406" not in codes(lint_text(no_ep))


@pytest.mark.parametrize(
    "sizes, expected",
    [
        ("tp_size: 2, ep_size: 2", set()),
        ("tp_size: 8, ep_size: 1", set()),
        ("tp_size: 2, ep_size: 4, dp_size: 2", set()),
        ("tp_size: 4, ep_size: 2, dp_size: 2", {"PLC500"}),
        ("tp_size: 2, ep_size: 4, dp_size: 3", {"PLC501"}),
        ("tp_size: 4, ep_size: 6, dp_size: 2", {"PLC500", "PLC501"}),
    ],
)
def test_ep_size_fits_tp_and_world(sizes, expected):
    text = GOOD.replace("tp_size: 2, ep_size: 2", sizes).replace(
        "parallel:", "experts: {ep_implementation: all_to_all}\nparallel:"
    )
    if "ep_size: 1" in sizes:
        text = text.split("ep_plan:")[0]
    got = set(codes(lint_text(text))) & {"PLC500", "PLC501"}
    assert got == expected


def test_duplicate_pattern_points_at_second_occurrence():
    text = GOOD + "  model.layers.*.mlp.experts: grouped_gemm\n"
    d = only(text, "PLC008")
    assert (d.line, d.col) == (10, 3)
    assert "first at line 9" in d.message


@pytest.mark.parametrize(
    "pattern", ["model..layers", ".model", "model.", "model.{a,b", "model.a}", "model.{}", "model.q*", "model.[0-9]", "a.{b,{c}}"]
)
def test_patterns_that_can_never_match(pattern):
    text = GOOD.replace("tp_plan:\n", f"tp_plan:\n  '{pattern}': colwise\n")
    d = only(text, "PLC300")
    assert d.line == 5 and pattern in d.message


def test_pattern_with_a_newline_in_a_segment_can_never_match():
    text = GOOD.replace("tp_plan:\n", 'tp_plan:\n  "model.a\\n.b": colwise\n')
    d = only(text, "PLC300")
    assert d.line == 5 and "'\\n'" in d.message


def test_style_rules_run_even_when_validation_fails():
    text = GOOD.replace("tp_size: 2", "tp_size: zero").replace("rowwise", "rowwize")
    got = codes(lint_text(text))
    assert "PLC102" in got and "PLC310" in got


def test_shipped_plans_are_clean():
    from planc.lint.runner import lint_paths

    from .helpers import PLANS

    assert PLANS, "plans/ holds no plans"
    assert lint_paths([str(p) for p in PLANS]) == []
