"""`planc migrate`: one test per removed style; untouched lines stay byte for byte; results lint clean."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.lint.runner import lint_text
from planc.spec.migrate import MigrateError, migrate_text
from planc.spec.source import parse_yaml

HEAD = """\
# Written for transformers 5.22 -- keep this comment
version: 1
model:
  type: deepseek_v4   # the family
parallel:
  tp_size: 8
  ep_size: 8
"""


def lint_errors(text):
    return [d.format() for d in lint_text(text) if d.severity == "error"]


def untouched(before: str, after: str, changed: set[str]) -> None:
    """Every line of `before` that is not in `changed` appears in `after`, byte for byte and in order."""
    kept = [ln for ln in before.splitlines(keepends=True) if ln not in changed]
    it = iter(after.splitlines(keepends=True))
    for ln in kept:
        assert any(ln == other for other in it), f"line lost or altered: {ln!r}"


def test_megamoe_router_dropped_and_megamoe_experts_rewritten():
    text = HEAD + (
        "experts:\n  megamoe:\n    quantize: fp4   # bf16 checkpoint\n"
        "ep_plan:\n"
        "  model.layers.*.mlp.gate: megamoe_router   # passes global ids\n"
        "  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
        "  model.layers.*.mlp.experts: megamoe_experts\n"
    )
    assert lint_errors(text)
    m = migrate_text(text)
    assert lint_errors(m.text) == []
    data = parse_yaml(m.text).data
    assert data["ep_plan"] == {
        "model.layers.*.mlp.experts.{gate_up_proj,down_proj}": "grouped_gemm",
        "model.layers.*.mlp.experts": "ep_dispatch_experts",
    }
    assert data["experts"]["implementation"] == "deepgemm_megamoe"
    assert "  # passes global ids\n" in m.text  # the dropped rule's comment survives
    untouched(
        text, m.text,
        {"  model.layers.*.mlp.gate: megamoe_router   # passes global ids\n", "  model.layers.*.mlp.experts: megamoe_experts\n"},
    )


def test_megamoe_experts_in_tp_plan_moves_to_ep_plan_and_fixes_ep_implementation():
    text = HEAD + (
        "experts:\n  implementation: grouped_mm\n  ep_implementation: all_to_all  # old\n  megamoe: {quantize: fp4}\n"
        "tp_plan:\n  model.layers.*.mlp.experts: megamoe_experts\n"
        "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    )
    m = migrate_text(text)
    assert lint_errors(m.text) == []
    data = parse_yaml(m.text).data
    assert data["experts"]["implementation"] == "deepgemm_megamoe"
    assert data["experts"]["ep_implementation"] == "auto"
    assert "  ep_implementation: auto  # old\n" in m.text  # the value changes, the comment stays
    assert data["tp_plan"] == {} and "tp_plan: {}\n" in m.text  # an emptied table stays valid
    assert data["ep_plan"]["model.layers.*.mlp.experts"] == "ep_dispatch_experts"


def test_ep_router_with_moe_tp_experts_becomes_all_reduce_ep():
    text = HEAD.replace("deepseek_v4", "mixtral") + (
        "ep_plan:\n"
        "  model.layers.*.mlp.gate: ep_router\n"
        "  model.layers.*.mlp.experts.gate_up_proj: grouped_gemm\n"
        "  model.layers.*.mlp.experts.down_proj: grouped_gemm\n"
        "  model.layers.*.mlp.experts: moe_tp_experts   # masked all-reduce\n"
    )
    m = migrate_text(text)
    assert lint_errors(m.text) == []
    data = parse_yaml(m.text).data
    assert data["ep_plan"]["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
    assert "model.layers.*.mlp.gate" not in data["ep_plan"]
    assert data["experts"] == {"ep_implementation": "all_reduce"}
    assert "  model.layers.*.mlp.experts: ep_dispatch_experts   # masked all-reduce\n" in m.text


def test_ep_router_alone_is_dropped():
    text = HEAD.replace("deepseek_v4", "mixtral") + (
        "ep_plan:\n"
        "  model.layers.*.mlp.gate: ep_router\n"
        "  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
        "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    )
    m = migrate_text(text)
    assert lint_errors(m.text) == []
    assert m.text == text.replace("  model.layers.*.mlp.gate: ep_router\n", "")
    assert m.diff("p.yaml").startswith("--- a/p.yaml\n+++ b/p.yaml\n")


def test_moe_tp_experts_in_ep_plan_moves_to_tp_plan():
    text = HEAD.replace("deepseek_v4", "mixtral").replace("ep_size: 8", "ep_size: 1") + (
        "tp_plan:\n"
        "  model.layers.*.mlp.experts.gate_up_proj: packed_colwise\n"
        "  model.layers.*.mlp.experts.down_proj: rowwise\n"
        "\n# tensor-parallel experts\n"
        "ep_plan:\n"
        "  model.layers.*.mlp.experts: moe_tp_experts\n"
    )
    m = migrate_text(text)
    assert lint_errors(m.text) == []
    data = parse_yaml(m.text).data
    assert data["tp_plan"]["model.layers.*.mlp.experts"] == "moe_tp_experts"
    assert data["ep_plan"] == {} and "ep_plan: {}\n" in m.text  # an emptied table stays valid
    untouched(text, m.text, {"  model.layers.*.mlp.experts: moe_tp_experts\n", "ep_plan:\n"})


def test_current_plan_is_left_alone(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    text = HEAD + "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    path.write_text(text)
    assert main(["migrate", str(path)]) == 0
    assert "nothing to migrate" in capsys.readouterr().out
    assert path.read_text() == text


def test_cli_prints_a_diff_and_writes_only_with_write(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    text = HEAD + (
        "experts: {megamoe: {quantize: fp4}}\n"
        "ep_plan:\n  model.layers.*.mlp.gate: megamoe_router\n"
        "  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n  model.layers.*.mlp.experts: megamoe_experts\n"
    )
    path.write_text(text)
    # a flow-style `experts` block cannot take a new key by line edits: refused, file untouched
    assert main(["migrate", str(path)]) == 2
    assert "flow style" in capsys.readouterr().err
    text = text.replace("experts: {megamoe: {quantize: fp4}}\n", "experts:\n  megamoe: {quantize: fp4}\n")
    path.write_text(text)
    assert main(["migrate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "-  model.layers.*.mlp.gate: megamoe_router\n" in out and "+  implementation: deepgemm_megamoe\n" in out
    assert path.read_text() == text
    assert main(["migrate", str(path), "--write"]) == 0
    assert lint_errors(path.read_text()) == []


def test_flow_style_rule_table_is_refused():
    with pytest.raises(MigrateError, match="block style"):
        migrate_text(HEAD + "ep_plan: {model.layers.*.mlp.gate: ep_router}\n")
