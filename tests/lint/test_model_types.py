"""Lint knows transformers' model types without importing it (PLC110), and did-you-mean matches like a human."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.lint.runner import lint_text
from planc.lint.suggest import close_matches, did_you_mean


def test_the_shipped_model_types_are_the_installed_transformers():
    import transformers
    from packaging.version import Version

    from planc.models.model_types import TARGET, render
    from planc.spec.transformers_model_types import TRANSFORMERS_VERSION

    if Version(transformers.__version__) < Version(TRANSFORMERS_VERSION):
        pytest.skip(f"the list is written from transformers {TRANSFORMERS_VERSION}; an older one "
                    f"({transformers.__version__}) has fewer model types and cannot check it")
    assert TARGET.read_text(encoding="utf-8") == render(), (
        "planc/spec/transformers_model_types.py is stale for the installed transformers: "
        "run `python -m planc.models.model_types`")


@pytest.mark.parametrize(("written", "meant"), [("mixtrl", "mixtral"), ("deepseek-v3", "deepseek_v3"),
                                                 ("Qwen3_MoE", "qwen3_moe"), ("gptoss", "gpt_oss")])
def test_an_unknown_model_type_warns_with_the_type_it_means(tmp_path, capsys, written, meant):
    plan = tmp_path / "p.yaml"
    plan.write_text(f"version: 1\nmodel: {{type: {written}}}\nparallel: {{tp_size: 2}}\n")
    assert main(["lint", str(plan)]) == 0  # a warning: the hook fails on it only with --strict
    out = capsys.readouterr().out
    assert f"{plan}:2:15: PLC110 warning: `{written}` is not a model type of transformers" in out, out
    assert f"did you mean `{meant}`?" in out, out
    assert main(["lint", "--strict", str(plan)]) == 1
    capsys.readouterr()


def test_a_type_far_from_any_gets_no_guess_and_a_custom_type_lints_clean():
    (d,) = lint_text("version: 1\nmodel: {type: notamodel}\nparallel: {tp_size: 2}\n")
    assert d.code == "PLC110" and "did you mean" not in d.hint and "custom: true" in d.hint, d
    assert lint_text("version: 1\nmodel: {type: notamodel, custom: true}\nparallel: {tp_size: 2}\n") == []
    (fixed,) = lint_text("version: 1\nmodel: {type: mixtrl}\nparallel: {tp_size: 2}\n", "p.yaml")
    assert fixed.fix == "mixtral"


@pytest.mark.parametrize(("word", "choices", "meant"), [
    ("my_plan", ["llama4", "binary", "mixtral"], None),
    ("big", ["binary", "bigger_plan"], None),
    ("notamodel", ["EvollaModel", "mixtral"], None),
    ("mixtrl", ["mistral", "mixtral"], "mixtral"),  # the fewest edits wins (1 against 2)
    ("ep_szie", ["tp_size", "ep_size"], "ep_size"),  # a swap of neighbours is one edit
    ("row_wise", ["colwise", "rowwise"], "rowwise"),
    ("xlm_roberta", ["xlm-roberta-xl", "xlm-roberta"], "xlm-roberta"),  # `-`/`_` and case are no difference
    ("PLC31", ["PLC310", "PLC311"], "PLC310"),
    ("num_layers", ["num_experts", "num_hidden_layers"], "num_hidden_layers"),  # a word left out
])
def test_did_you_mean_suggests_only_what_a_human_would(word, choices, meant):
    assert did_you_mean(word, choices) == meant


def test_close_matches_are_closest_first():
    assert close_matches("deepseek-v3", ["deepseek_v2", "deepseek_v32", "deepseek_v3"]) == [
        "deepseek_v3", "deepseek_v2", "deepseek_v32"]


def test_a_missing_plan_is_not_matched_to_an_unrelated_name(tmp_path, capsys):
    for name in ("binary.yaml", "bigger_than_life.yaml"):
        (tmp_path / name).write_text("version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\n")
    assert main(["lint", str(tmp_path / "big.yaml"), str(tmp_path / "my_plan.yaml")]) == 2
    out = capsys.readouterr().out
    assert "did you mean" not in out and "planc ships" not in out, out
    assert main(["lint", str(tmp_path / "binry.yaml")]) == 2
    assert f"did you mean `{tmp_path / 'binary.yaml'}`?" in capsys.readouterr().out


def test_an_unknown_model_type_in_explain_names_no_class(tmp_path, capsys):
    plan = tmp_path / "p.yaml"
    plan.write_text("version: 1\nmodel: {type: notamodel}\nparallel: {tp_size: 2}\n")
    assert main(["explain", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "transformers knows no model type `notamodel`" in err and "EvollaModel" not in err, err
