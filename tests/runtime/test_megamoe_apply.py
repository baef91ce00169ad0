"""deepgemm_megamoe through planc.apply (reference backend): sliced + all-gathered == one process."""

import pytest

from tests.distributed import run_distributed
from tests.runtime.workers import megamoe_world

BATCHES = {2: [1, 3, 4, 7], 4: [1, 2, 3, 5, 9]}  # smaller than the ranks, not dividing, dividing


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_megamoe_apply_equals_single_process_reference(world_size):
    results = run_distributed(megamoe_world, world_size, BATCHES[world_size])
    for rank, res in enumerate(results):
        for t in BATCHES[world_size]:
            shape, diff = res[f"experts/T={t}"]
            assert shape == (t, 64), (rank, t, shape)
            assert diff == 0.0, (rank, t, diff)  # same FP4 experts, same tokens: bit-identical
        # through the whole model: TP-sharded attention/shared experts round differently before the FP8 inputs
        assert res["logits"] <= 1e-4 * max(1.0, res["logits_scale"]), res  # observed 1.5e-7
        assert "inference only" in res["under_grad"], res["under_grad"]
