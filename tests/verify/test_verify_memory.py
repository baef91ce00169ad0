"""`planc verify --memory`: rank 0 at full width under the fake process group, measured beside `planc explain`'s
predicted peak, as the report's `memory` stage (flagged when the prediction is over 5% under the measurement)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planc

REPO = Path(__file__).resolve().parents[2]
# a narrow Mixtral, so that the full-width rank runs in seconds on CPU
NARROW = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
          "num_hidden_layers": 3, "num_local_experts": 4}


@pytest.mark.distributed
def test_memory_stage_beside_the_numerics():
    report = planc.verify(plan=str(REPO / "plans" / "mixtral.yaml"), parallel={"tp_size": 2, "ep_size": 2},
                          overrides=NARROW, reshard={}, memory=True)
    assert report.error is None, report.error
    memory = report.stage("memory")
    assert memory.tolerance == 0.05 and "under rank 0's measured peak" in memory.tolerance_rule
    # serving (the plan has no training section): a prefill at the real widths, 2 of 3 layers (one of each kind)
    assert "a prefill at batch 1 x seq 512, bf16, full width" in memory.detail, memory.detail
    assert "2 of 3 layers" in memory.detail, memory.detail
    assert memory.ok and report.ok, report.render_text()  # explain's peak holds on Mixtral (docs/memory.md)
    measured = json.loads(report.render_json())
    assert any(s["name"] == "memory" for s in measured["stages"]), measured


def test_the_cli_takes_memory():
    import contextlib
    import io

    from planc.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["verify", "--help"]) == 0
    text = " ".join(out.getvalue().split())
    assert "--memory" in text and "over 5% under the measured one" in text
