"""`planc demo`: two CPU ranks apply the shipped plan and print the explain table and the logits difference."""

import re

import pytest

from planc.cli import main


@pytest.mark.distributed
def test_demo_prints_table_and_matches_unsharded(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.*.mlp.experts" in out  # the explain table lists the plan's rules
    assert "run at tp_size=2 ep_size=2 dp_size=1 (the plan's own sizes: tp_size=8 ep_size=8 dp_size=1, 8 ranks" in out
    assert "tiny random mixtral (hidden " in out and "experts 8" in out
    match = re.search(r"max \|logits - unsharded logits\| on 2 ranks: (\S+)", out)
    assert match, out
    assert float(match.group(1)) <= 1e-5


def test_demo_reports_a_bad_plan(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2, tp_sise: 2}\n")
    assert main(["demo", str(bad)]) == 1
    assert "tp_sise" in capsys.readouterr().err
