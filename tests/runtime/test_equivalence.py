"""Sharded == unsharded: the shipped plans on tiny random models, 2 and 4 gloo ranks, every EP strategy.

One spawned world per (model, world size) runs all strategies (see workers.equivalence_world); each
check is a max abs difference against an unsharded copy of the same model (fp32, <= 1e-5).
"""

import pytest

from tests.distributed import run_distributed
from tests.runtime.workers import TOL, equivalence_world

MODELS = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v4"]


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model_type", MODELS)
def test_sharded_equals_unsharded(model_type, world_size):
    results = run_distributed(equivalence_world, world_size, model_type)
    expected_checks = {f"tp{world_size}/ep{world_size}/{s}/{c}" for s in ("all_to_all", "all_reduce", "auto")
                       for c in ("logits", "loss", "grads")}
    for rank, res in enumerate(results):
        assert expected_checks <= set(res), sorted(expected_checks - set(res))
        for key, value in res.items():
            if key.endswith("no_grad_choice"):
                assert value == {"all_reduce"}, (rank, key, value)
            elif key.endswith("grad_choice"):
                assert value == {"all_to_all"}, (rank, key, value)
            elif key == "refuses_transformers_sharded":
                assert value.startswith("ApplyError") and "another tool" in value, value
            else:
                assert value <= TOL, f"rank {rank}: {key} = {value}"
    if model_type == "mixtral":
        extra = "tp2/ep1/moe_tp_experts/grads" if world_size == 2 else "tp2/ep4/dp2/all_to_all/expert_grads"
        assert extra in results[0]
    if model_type in ("mixtral", "qwen3_moe") and world_size == 2:
        assert "tp2/ep2/all_to_all/vs_transformers" in results[0]
