"""planc.apply's contract: rank agreement, all-or-nothing install, clear refusals."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from planc.errors import ApplyError
from tests.distributed import run_distributed
from tests.runtime.workers import errors_world, rollback_world


def test_apply_needs_initialized_process_group():
    # A fresh interpreter: this test process may already belong to another test's process group.
    code = (
        "import torch\n"
        "from planc import apply\n"
        "from planc.errors import ApplyError\n"
        "try:\n"
        "    apply(torch.nn.Linear(2, 2), 'plans/mixtral.yaml')\n"
        "except ApplyError as e:\n"
        "    print(e)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert "torch.distributed is not initialized" in done.stdout and "torchrun" in done.stdout, done
    # what is missing, by name, when some of torchrun's environment is there
    partial = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "RANK": "0", "WORLD_SIZE": "2"})
    assert "MASTER_ADDR, MASTER_PORT are not set (found RANK, WORLD_SIZE)" in partial.stdout, partial


@pytest.mark.distributed
def test_failure_at_each_install_step_restores_the_model_bit_for_bit():
    from planc.runtime.install import INSTALL_STEPS

    results = run_distributed(rollback_world, 2)
    for rank, res in enumerate(results):
        for model_type in ("qwen3_moe", "deepseek_v4"):
            for step in INSTALL_STEPS:
                for who in ("all", "rank1"):
                    key = f"{model_type}/{step.__name__}/{who}"
                    assert res[key] == [], (rank, key, res[key])
        assert res["qwen3_moe/apply_after_rollbacks"] <= 1e-5
        assert res["deepseek_v4/apply_after_rollbacks"] < 1.0  # FP4 experts: close, not equal


@pytest.mark.distributed
def test_refusals_raise_the_same_error_on_every_rank_and_change_nothing():
    results = run_distributed(errors_world, 2)
    expected = {
        "disagree": "ranks compiled different plans",
        "rank1_invalid_plan": "rank 1:",
        # reported alone, once, with the ranks it happened on, with sizes that fit 2 ranks
        "world_size": "ranks 0, 1: PLC503: the plan needs tp_size * dp_size = 4 * 1 = 4 processes, but the world has 2",
        "world_size_ep": "ranks 0, 1: PLC503: the plan needs tp_size * dp_size = 1 * 1 = 1 processes, but the "
        "world has 2",
        "lm_head_colwise": "PLC632",
        "rowwise_without_colwise": "PLC631",
        "deepgemm_on_cpu": "`deepgemm` runs CUDA kernels",
        "sonicmoe_on_cpu": "`sonicmoe` runs CUDA kernels",
        "double_apply": "already called on this model",
        "caller_mesh_mismatch": "the plan wants dp=1 x tp=2",
    }
    for name, fragment in expected.items():
        messages = {res[name][0] for res in results}
        assert len(messages) == 1, (name, messages)  # the same error on every rank
        (message,) = messages
        assert fragment in message, (name, message)
        for res in results:
            assert res[name][1] == [], (name, res[name][1])  # nothing changed
    world = results[0]["world_size"][0]
    assert world.count("\n  rank") == 1 and "PLC617" not in world and "tp_size: 2, ep_size: 2, dp_size: 1" in world
    world_ep = results[0]["world_size_ep"][0]  # not PLC501's "set `ep_size: 1`": 1 rank's sizes, not the world's
    assert "PLC501" not in world_ep and "tp_size: 1, ep_size: 2, dp_size: 2" in world_ep, world_ep
    for res in results:
        assert res["caller_mesh_logits"] <= 1e-5


def test_unknown_style_is_refused_by_name():
    from planc.runtime.tp_styles import tp_style

    with pytest.raises(ApplyError, match="style `colwise_rep` at tp_plan.*implemented: .*colwise"):
        tp_style("colwise_rep", "tp_plan['lm_head']")


def test_meta_model_builds_full_size_without_memory():
    from planc.models.build import build_meta_model

    model = build_meta_model("mixtral", {"num_hidden_layers": 2})
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 2 * 14336, 4096)
