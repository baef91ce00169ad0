"""planc.save(..., optimizer=) at 2 ranks -> planc.load + planc.load_optimizer at 4 and 1 ranks: steps 3-4 of AdamW
give the losses of the uninterrupted run (tiny fp32 Mixtral, Qwen3-MoE, DeepSeek-V3 from save_pretrained dirs,
Mixtral with tensor-parallel packed experts, and Mixtral with decay / no-decay param groups resumed into
an optimizer built with other values: each group gets its own back, a regrouped optimizer is refused); at 4 ranks also with data parallelism, (tp, ep, dp) = (2, 2, 2)
under `fsdp` and `replicate` (each replica half the batch), and the fsdp run saved again after step 3 and resumed
at 1 rank; every bad input is one CheckpointError on every rank.

Tolerance 1e-5 abs: at other sizes the rowwise/expert partial sums are added in another order (fp32 rounding), as
in the save/load test. One world per size, shared by every case: spawning ranks is the slow part.
"""

import pytest

from tests.checkpoint.optimizer_workers import (
    CASES,
    DP_CASES,
    GROUPED,
    RESAVED,
    SAVE_AFTER,
    SAVED_GROUPS,
    resume_world,
    train_and_save_world,
    write_hub_checkpoints,
)
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed
TOL = 1e-5


def _losses(results, case):
    for rank, res in enumerate(results):
        assert isinstance(res[case], list), f"{case}, rank {rank}:\n{res[case]}"
    return results[0][case]


def test_resume_at_4_and_1_ranks_continues_the_run(tmp_path):
    write_hub_checkpoints(tmp_path)
    trained = run_distributed(train_and_save_world, 2, str(tmp_path))
    uninterrupted = {case: _losses(trained, case) for case in CASES}
    marker = (tmp_path / "mixtral" / "ckpt" / "planc.json").read_text()
    assert '"class": "torch.optim.adamw.AdamW"' in marker and (tmp_path / "mixtral" / "ckpt" / "optimizer" / ".metadata").is_file()
    assert '"optimizer"' not in (tmp_path / "mixtral" / "model_only" / "planc.json").read_text()
    for world_size in (4, 1):
        resumed = run_distributed(resume_world, world_size, str(tmp_path), world_size == 4)
        for case in CASES:
            losses = _losses(resumed, case)
            assert all(res[f"{case}/step"] == [float(SAVE_AFTER)] for res in resumed), (case, world_size)
            if case == GROUPED:
                assert all(res[f"{case}/groups"] == list(SAVED_GROUPS) for res in resumed), resumed[0][f"{case}/groups"]
            for n, (got, want) in enumerate(zip(losses, uninterrupted[case][SAVE_AFTER:]), start=SAVE_AFTER + 1):
                assert abs(got - want) <= TOL, f"{case} at {world_size} ranks, step {n}: {got} vs {want}"
        dp_cases = DP_CASES if world_size == 4 else {RESAVED: DP_CASES[RESAVED]}
        for case, (family, _) in dp_cases.items():
            losses = _losses(resumed, case)
            want = uninterrupted[family][-len(losses):]
            for n, (got, w) in enumerate(zip(losses, want), start=len(uninterrupted[family]) - len(losses) + 1):
                assert abs(got - w) <= TOL, f"{case} at {world_size} ranks, step {n}: {got} vs {w}"
        # without the optimizer state the same resume drifts: the comparison above can fail
        fresh = resumed[0]["mixtral/fresh"][-1]
        assert abs(fresh - uninterrupted["mixtral"][-1]) > 1e-3, fresh
        if world_size != 4:
            continue
        expected = {
            "bad/no_state": "holds no optimizer state: it was saved by planc.save without optimizer=",
            "bad/class": "holds the state of a torch.optim.adamw.AdamW, not of this torch.optim.sgd.SGD",
            "bad/param_set": "model.layers.0.mlp.experts.gate_up_proj: updated by the checkpoint's optimizer; "
            "not a parameter this optimizer updates",
            "bad/model": "holds the optimizer state of a `mixtral` model, this model is a `qwen3_moe` one",
            "bad/foreign": "1 tensor(s) the AdamW updates are not parameters of this Qwen3MoeForCausalLM",
            "bad/unstepped": "the AdamW has taken no step yet, so it holds no state to save",
            "bad/regrouped_one": "this optimizer has 1, grouped differently: its group 0 (21 parameter(s)) holds "
            "parameters of 2 saved groups (saved group 0: `model.embed_tokens.weight`",
            "bad/regrouped_moved": "its group 0 (14 parameter(s)) lacks `model.layers.0.mlp.gate.weight`, "
            "`model.layers.1.mlp.gate.weight`, which the checkpoint's group 0 held with them",
        }
        for key, text in expected.items():
            for rank, res in enumerate(resumed):
                message = res[key]
                assert message.startswith("CheckpointError"), (key, rank, message)
                assert all(f"rank {r}: CheckpointError" in message for r in range(world_size)), (key, rank, message)
                assert text in message, (key, rank, message)
        assert all(res["bad/param_set_state"] == 0 for res in resumed)
