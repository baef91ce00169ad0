"""Size hints are found by compiling the plan at sizes the user never wrote: a refusal there (Mega MoE's EP
strategy at sizes where the EP group does not share one batch) only rules those sizes out, never escapes."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.commands.explain import _meta_model_at
from planc.compiler.resolve import compile_plan
from planc.errors import CompileError
from planc.lint.plan_loader import load_plan
from tests.checkout_env import REPO

MEGAMOE = str(REPO / "plans" / "deepseek_v4_megamoe.yaml")


def test_explain_megamoe_at_sizes_that_do_not_divide_gives_diagnostics_and_a_hint(capsys):
    assert main(["explain", MEGAMOE, "--parallel", "tp_size=3,ep_size=3"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "EPResolutionError" not in err and "ep_size=1" not in err, err
    assert "PLC606 error: 256 experts cannot be split evenly over ep_size=3 ranks" in err, err
    assert ("hint: no expert-parallel sizes on 3 ranks pass the other checks; launch 2 ranks with "
            "`parallel: {tp_size: 2, ep_size: 2, dp_size: 1}`") in err, err


@pytest.mark.parametrize("sizes, hint", [
    ({"tp_size": 6, "ep_size": 6}, "on 6 ranks, write `parallel: {tp_size: 2, ep_size: 2, dp_size: 3}`"),
    ({"tp_size": 3, "ep_size": 3}, "keep 3 ranks without expert parallelism: `parallel: {tp_size: 1, ep_size: 1, "
                                   "dp_size: 3}`"),
])
def test_compile_megamoe_hints_only_sizes_where_the_ep_group_shares_a_batch(sizes, hint):
    """What planc.apply raises on every rank: its compile is this one."""
    model = _meta_model_at("deepseek_v4", {}, "config")
    with pytest.raises(CompileError) as e:
        compile_plan(model, load_plan(MEGAMOE, parallel=sizes))
    assert hint in str(e.value), str(e.value)


def test_apply_world_hint_skips_sizes_mega_moe_cannot_run_at():
    """planc.apply on a world the plan does not fit (PLC503) names sizes from the same solver: on 4 ranks only
    sizes whose EP group shares a batch, and no exception from the ones that do not."""
    from planc.compiler.resolve import sizes_for_world

    model = _meta_model_at("deepseek_v4", {}, "config")
    found = sizes_for_world(load_plan(MEGAMOE), model, 4)
    assert found and all(s.ep in (1, s.tp) for s in found), found
