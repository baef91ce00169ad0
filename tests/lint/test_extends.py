"""`extends`: merge semantics, positions of the winning key, and the directory-tree fence."""

from __future__ import annotations

import os

import pytest

from planc.errors import PlanError
from planc.lint.runner import lint_file, lint_paths
from planc.lint.plan_loader import load_plan
from planc.spec.loaded_plan import LoadedPlan

from .helpers import GOOD, codes

CHILD = """\
version: 1
extends: base.yaml
parallel: {tp_size: 4, ep_size: 4}
tp_plan:
  model.layers.*.self_attn.o_proj: colwise
"""


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "base.yaml").write_text(GOOD)
    (tmp_path / "child.yaml").write_text(CHILD)
    return tmp_path


def test_child_wins_key_by_key_and_tables_merge_by_pattern(tree):
    loaded = load_plan(str(tree / "child.yaml"))
    assert isinstance(loaded, LoadedPlan)
    plan = loaded.plan
    assert (plan.parallel.tp_size, plan.parallel.ep_size) == (4, 4)
    assert plan.model.type == "mixtral"
    assert plan.tp_plan["model.layers.*.self_attn.o_proj"] == "colwise"
    assert plan.tp_plan["model.layers.*.self_attn.{q,k,v}_proj"] == "colwise"
    assert len(plan.ep_plan) == 2
    assert plan.extends == "base.yaml"


def test_positions_follow_the_winning_key(tree):
    loaded = load_plan(str(tree / "child.yaml"))
    child, base = str(tree / "child.yaml"), str(tree / "base.yaml")
    assert loaded.position(("tp_plan", "model.layers.*.self_attn.o_proj")) .path == child
    assert loaded.position(("tp_plan", "model.layers.*.self_attn.{q,k,v}_proj")).path == base
    assert loaded.position(("model", "type")).path == base
    assert loaded.position(("parallel", "ep_size")).path == child


def test_replaced_subtrees_lose_parent_positions(tmp_path):
    base = GOOD.replace("parallel: {tp_size: 2, ep_size: 2}", "parallel: {tp_size: 2, ep_size: 2}\n"
                        "experts:\n  implementation: deepgemm_megamoe\n  megamoe: {backend: reference}")
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "child.yaml").write_text("version: 1\nextends: base.yaml\ntp_plan: {}\nexperts: {megamoe: null}\n")
    loaded = load_plan(str(tmp_path / "child.yaml"))
    assert len(loaded.plan.tp_plan) == 2  # an empty mapping merges: the parent's rules stay
    assert loaded.plan.experts.megamoe is None and loaded.plan.experts.implementation == "deepgemm_megamoe"
    assert ("experts", "megamoe", "backend") not in loaded.key_positions
    assert loaded.position(("experts", "megamoe")).path.endswith("child.yaml")
    assert loaded.position(("experts", "implementation")).path.endswith("base.yaml")


def test_diagnostic_in_parent_points_at_parent_line(tree):
    (tree / "base.yaml").write_text(GOOD.replace("o_proj: rowwise", "o_proj: rowwize"))
    (tree / "child.yaml").write_text("version: 1\nextends: base.yaml\n")
    [d] = lint_file(str(tree / "child.yaml"))
    assert d.code == "PLC310" and d.path == str(tree / "base.yaml") and d.line == 6


def test_semantic_rule_uses_merged_values(tree):
    (tree / "child.yaml").write_text("version: 1\nextends: base.yaml\nparallel: {tp_size: 2, ep_size: 1}\n")
    assert codes(lint_file(str(tree / "child.yaml"))) == ["PLC405"]


def test_parent_problems_are_reported_once_across_files(tree):
    (tree / "base.yaml").write_text(GOOD.replace("o_proj: rowwise", "o_proj: rowwize"))
    (tree / "child.yaml").write_text("version: 1\nextends: base.yaml\n")
    assert codes(lint_paths([str(tree)])) == ["PLC310"]


def test_extends_outside_tree(tmp_path):
    (tmp_path / "base.yaml").write_text(GOOD)
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "child.yaml").write_text("version: 1\nextends: ../base.yaml\n")
    [d] = lint_file(str(sub / "child.yaml"))
    assert d.code == "PLC200" and (d.line, d.col) == (2, 10)


def test_extends_absolute_path(tree):
    (tree / "child.yaml").write_text(f"version: 1\nextends: {tree / 'base.yaml'}\n")
    assert codes(lint_file(str(tree / "child.yaml"))) == ["PLC200"]


def test_extends_symlink_out_of_tree(tmp_path):
    (tmp_path / "base.yaml").write_text(GOOD)
    sub = tmp_path / "sub"
    sub.mkdir()
    os.symlink(tmp_path / "base.yaml", sub / "link.yaml")
    (sub / "child.yaml").write_text("version: 1\nextends: link.yaml\n")
    assert codes(lint_file(str(sub / "child.yaml"))) == ["PLC200"]


def test_extends_below_is_allowed_and_stays_in_first_tree(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "b.yaml").write_text(GOOD)
    (tmp_path / "base" / "mid.yaml").write_text("version: 1\nextends: b.yaml\n")
    (tmp_path / "child.yaml").write_text("version: 1\nextends: base/mid.yaml\n")
    assert lint_file(str(tmp_path / "child.yaml")) == []
    # mid.yaml reaching back up to the first plan's directory is inside the first plan's tree
    (tmp_path / "top.yaml").write_text(GOOD)
    (tmp_path / "base" / "mid.yaml").write_text("version: 1\nextends: ../top.yaml\n")
    assert lint_file(str(tmp_path / "child.yaml")) == []


@pytest.mark.parametrize("files", [{"a.yaml": "a.yaml"}, {"a.yaml": "b.yaml", "b.yaml": "a.yaml"}])
def test_extends_cycle(tmp_path, files):
    for name, parent in files.items():
        (tmp_path / name).write_text(f"version: 1\nextends: {parent}\n")
    [d] = lint_file(str(tmp_path / "a.yaml"))
    assert d.code == "PLC201" and "cycle" in d.message


def test_extends_missing_parent(tree):
    (tree / "child.yaml").write_text("version: 1\nextends: nope.yaml\n")
    assert codes(lint_file(str(tree / "child.yaml"))) == ["PLC202"]


def test_parent_that_is_not_yaml(tree):
    (tree / "base.yaml").write_bytes(b"\xff\xfe")
    [d] = lint_file(str(tree / "child.yaml"))
    assert d.code == "PLC003" and d.path == str(tree / "base.yaml")


def test_extends_wrong_type_is_a_schema_error(tree):
    (tree / "child.yaml").write_text(GOOD + "extends: [a]\n")
    assert codes(lint_file(str(tree / "child.yaml"))) == ["PLC102"]


def test_load_plan_raises_plan_error_with_diagnostics(tree):
    (tree / "child.yaml").write_text("version: 1\nextends: nope.yaml\n")
    with pytest.raises(PlanError) as err:
        load_plan(str(tree / "child.yaml"))
    assert [d.code for d in err.value.diagnostics] == ["PLC202"]
    assert "child.yaml:2:10: PLC202 error" in str(err.value)


def test_load_plan_sources(tree):
    text_plan = load_plan(GOOD)
    assert text_plan.plan.parallel.ep_size == 2 and text_plan.position(("tp_plan",)).line == 4
    assert load_plan(text_plan) is text_plan
    assert load_plan({"version": 1, "model": {"type": "m"}, "parallel": {"tp_size": 1}}).plan.parallel.tp_size == 1
    with pytest.raises(PlanError) as err:
        load_plan({"version": 1, "model": {"type": "m"}, "parallel": {"tp_size": 2, "ep_size": 2}})
    assert [d.code for d in err.value.diagnostics] == ["PLC404"]
    warned = load_plan(GOOD.replace("ep_size: 2", "ep_size: 1"))
    assert [d.code for d in warned.diagnostics] == ["PLC405"]
    with pytest.raises(TypeError):
        load_plan(42)


# ---- `extends: planc:NAME`: a shipped plan as the parent ----------------------------------------------------


SHIPPED_CHILD = """\
version: 1
extends: planc:deepseek_v3
parallel: {tp_size: 4, ep_size: 4}
tp_plan:
  lm_head: colwise
"""


def test_extends_reaches_a_shipped_plan_by_name(tmp_path):
    from planc.spec.shipped import shipped_plan

    (tmp_path / "mine.yaml").write_text(SHIPPED_CHILD)
    assert lint_paths(str(tmp_path / "mine.yaml")) == []
    loaded = load_plan(str(tmp_path / "mine.yaml"))
    assert loaded.plan.model.type == "deepseek_v3" and loaded.plan.parallel.tp_size == 4
    assert loaded.plan.tp_plan["lm_head"] == "colwise"
    assert loaded.plan.ep_plan == load_plan(str(shipped_plan("deepseek_v3"))).plan.ep_plan
    # a shipped plan that extends another shipped plan: its own `extends` stays among the shipped plans
    (tmp_path / "mega.yaml").write_text("version: 1\nextends: planc:deepseek_v4_megamoe\n")
    assert load_plan(str(tmp_path / "mega.yaml")).plan.experts.implementation == "deepgemm_megamoe"


def test_a_problem_in_a_shipped_parent_names_the_shipped_file(tmp_path):
    from planc.spec.shipped import shipped_plan

    # ep_size 1 leaves the shipped plan's `ep_dispatch_experts` rule without EP: PLC405 at that rule, in its file
    (tmp_path / "mine.yaml").write_text("version: 1\nextends: planc:mixtral\nparallel: {tp_size: 2, ep_size: 1}\n")
    (d,) = lint_paths(str(tmp_path / "mine.yaml"))
    assert d.code == "PLC405" and d.position is not None and d.position.path == str(shipped_plan("mixtral")), d
    assert shipped_plan("mixtral").read_text().splitlines()[d.position.line - 1].strip().startswith(
        "model.layers.*.mlp.experts:"), d


def test_an_unknown_shipped_name_lists_the_shipped_plans(tmp_path):
    (tmp_path / "mine.yaml").write_text("version: 1\nextends: planc:deepseek-v3\n")
    (d,) = lint_paths(str(tmp_path / "mine.yaml"))
    assert d.code == "PLC202" and "planc ships no plan named `deepseek-v3`" in d.message, d
    assert "deepseek_v3" in d.hint and "mixtral" in d.hint, d


def test_planc_compile_takes_a_plan_that_extends_a_shipped_one(tmp_path):
    import planc
    from planc.models.build import build_meta_model

    (tmp_path / "mine.yaml").write_text("version: 1\nextends: planc:mixtral\nparallel: {tp_size: 4, ep_size: 4}\n")
    compiled = planc.compile(build_meta_model("mixtral"), str(tmp_path / "mine.yaml"))
    assert compiled.parallel.tp_size == 4 and compiled.model_type == "mixtral" and compiled.experts


def test_a_shipped_plan_by_name_wherever_a_plan_path_is_taken(tmp_path, monkeypatch, capsys):
    from planc.cli import main
    from planc.spec.shipped import shipped_plan

    monkeypatch.chdir(tmp_path)  # no plans/ here: the name reaches the package's plans
    assert load_plan("planc:qwen3_moe").path == str(shipped_plan("qwen3_moe"))
    assert main(["lint", "planc:mixtral"]) == 0
    assert "1 file checked: no problems" in capsys.readouterr().out
    assert main(["lint", "planc:mixtrl"]) == 2
    out = capsys.readouterr().out
    assert "planc:mixtrl:1:1: PLC002 error: planc ships no plan named `mixtrl`" in out, out
    assert "did you mean `planc:mixtral`?" in out, out
    with pytest.raises(PlanError, match="planc ships no plan named `nope`"):
        load_plan("planc:nope")
