"""An EP strategy is one row in planc.spec.choices plus one runtime object: lint, the schema, compile and
install all accept a row added here, with no other file touched."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from planc.runtime.ep import EP_RUNTIMES
from planc.runtime.ep.all_to_all import AllToAllEPRuntime
from planc.spec.choices import EPStrategyRow
from tests.distributed import run_distributed

PLAN = Path(__file__).resolve().parents[2] / "plans" / "mixtral.yaml"
ROW = EPStrategyRow("counted_all_to_all", "CountedAllToAllEP", "all_to_all that counts its calls (a test's row)")


class CountedAllToAllRuntime(AllToAllEPRuntime):
    """The row's runtime object: all_to_all's exchange, counting the calls it runs."""

    calls = 0

    def forward(self, hidden_states, top_k_index, top_k_weights):
        type(self).calls += 1
        return super().forward(hidden_states, top_k_index, top_k_weights)


@contextlib.contextmanager
def throwaway_row():
    """The row and its runtime object, registered for the duration (one call: planc.register_ep_strategy)."""
    import planc
    from planc.spec.extensions import unregister

    planc.register_ep_strategy(ROW, CountedAllToAllRuntime)
    try:
        yield
    finally:
        unregister(ROW.name)
        EP_RUNTIMES.pop(ROW.name, None)


def _plan_text(tp: int) -> str:
    text = PLAN.read_text().replace("ep_implementation: auto", f"ep_implementation: {ROW.name}")
    return text.replace("tp_size: 8", f"tp_size: {tp}").replace("ep_size: 8", f"ep_size: {tp}")


def test_a_new_ep_strategy_row_is_linted_written_to_the_schema_and_compiled():
    from planc.commands.schema import schema_text
    import planc
    from planc.lint.runner import check_text
    from planc.models.build import build_meta_model

    text = _plan_text(8)
    assert check_text(text).diagnostics[0].code == "PLC103"  # unknown before the row: a bad enum value
    with throwaway_row():
        assert check_text(text).diagnostics == []
        ep = json.loads(schema_text())["$defs"]["Experts"]["properties"]["ep_implementation"]
        assert ep["enum"][-1] == ROW.name and ep["enumDescriptions"][-1] == ROW.doc
        compiled = planc.compile(build_meta_model("mixtral", {"num_hidden_layers": 2}), text)
        strategies = {e.strategy.describe() for e in compiled.experts if e.strategy is not None}
        assert strategies == {f"CountedAllToAllEP: ep_implementation: {ROW.name}"}
    assert ROW.name not in json.loads(schema_text())["$defs"]["Experts"]["properties"]["ep_implementation"]["enum"]


def _install_world(rank, world_size):
    from tests.runtime.workers import batch, fresh, logits_diff

    with throwaway_row():
        from planc import apply

        model, ref = fresh("mixtral")
        apply(model, _plan_text(world_size))
        diff = logits_diff(model, ref, batch(0))
        return {"diff": diff, "calls": CountedAllToAllRuntime.calls}


@pytest.mark.distributed
def test_a_new_ep_strategy_row_installs_and_runs_its_runtime_object():
    for rank, res in enumerate(run_distributed(_install_world, 2)):
        assert res["diff"] < 1e-5, (rank, res)
        assert res["calls"] == 2, (rank, res)  # the tiny mixtral's MoE layers, one forward
