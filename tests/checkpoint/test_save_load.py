"""planc.save at 2 ranks -> fill_from_dcp into a model sharded on meta at 4 ranks, 1 rank and 2 ranks.

Cases (workers.CASES): every shipped plan (plans/*.yaml; attention TP, experts EP) except those that quantize
experts to FP4 at apply time, which planc.save refuses (checked: workers.REFUSED),
mixtral with tied embeddings (the tie must survive: one tensor under both names after the load), and
mixtral with experts tensor-parallel, whose `packed_colwise` gate_up is a `_StridedShard` (the DCP
caveat: saved as one contiguous chunk it would reload scrambled at any other size).

Tolerances: reloaded under the same plan and sizes, the model holds the same bytes and runs the same
kernels, so its logits are bit-identical. At other sizes the rowwise/expert partial sums are added
in another order (fp32), so they differ by rounding: <= 1e-5 (the equivalence suite's tolerance).
"""

import pytest
import torch

from tests.checkpoint.workers import CASES, REFUSAL, REFUSED, load_world, save_world
from tests.distributed import run_distributed

TOL = 1e-5


def _ok(results: list, key: str):
    for rank, res in enumerate(results):
        assert not isinstance(res[key], str), f"{key} rank {rank} raised:\n{res[key]}"


@pytest.mark.distributed
def test_save_at_2_loads_at_4_1_and_2(tmp_path):
    saved = run_distributed(save_world, 2, str(tmp_path))
    failures = []
    for rank, res in enumerate(saved):  # a plan that quantizes at apply: refused, on every rank, with the reason
        assert set(res["refused"]) == REFUSED and all(REFUSAL in m for m in res["refused"].values()), (rank, res["refused"])
    for name, kind in CASES:
        key = f"{name}-{kind}"
        _ok(saved, key)
        s = saved[0][key]
        assert (s["applied"] - s["unsharded"]).abs().max().item() <= TOL, key  # the applied model is right
        for rank in range(2):
            if not torch.equal(saved[rank][key]["reloaded_same_plan"], s["applied"]):
                failures.append(f"{key}: reloaded at the same plan on rank {rank} is not bit-identical")
        assert s["tied"] is (kind == "tied"), f"{key}: tied after save/load: {s['tied']}"
        marker = (tmp_path / key / "planc.json").read_text()
        assert '"format": "planc-dcp"' in marker
    for world_size in (4, 1):
        loaded = run_distributed(load_world, world_size, str(tmp_path))
        for name, kind in CASES:
            key = f"{name}-{kind}"
            _ok(loaded, key)
            for rank, res in enumerate(loaded):
                if res[f"{key}/tied"] is not (kind == "tied"):
                    failures.append(f"{key}: loaded at {world_size}, rank {rank}: tied is {res[key + '/tied']}")
                via_load = (res[f"{key}/planc.load"] - saved[0][key]["applied"]).abs().max().item()
                if via_load > TOL:
                    failures.append(f"{key}: planc.load at {world_size}, rank {rank}: max |diff| {via_load}")
                diff = (res[key] - saved[0][key]["applied"]).abs().max().item()
                if diff > TOL:
                    failures.append(f"{key}: saved at 2 ranks, loaded at {world_size}, rank {rank}: max |diff| {diff}")
        bad = [res["bad/extra_layer"] for res in loaded] + [res["bad/wider"] for res in loaded]
        assert all("does not fit this MixtralForCausalLM" in m for m in bad), bad
        assert "model.layers.2.mlp.experts.gate_up_proj: the model has it, the checkpoint does not" in bad[0]
        assert "model.layers.0.mlp.experts.gate_up_proj: checkpoint shape (8, 64, 64), model shape (8, 128, 64)" in bad[-1]
    assert not failures, "\n".join(failures)
