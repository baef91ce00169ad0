"""Expert parallelism for experts that take every token pre-scaled (Llama 4, planc.runtime.ep.dense), 2 gloo ranks.

transformers declares no EP plan for Llama 4; `planc init` derives one from its TP rules on the experts, and
each rank runs its half of the experts on their rows of the pre-scaled input, the outputs gathered. Logits,
loss and every gradient of a training step must match the unsharded model.
"""

import pytest

from tests.distributed import run_distributed
from tests.runtime.mla_llama4_workers import dense_ep_world
from tests.runtime.workers import TOL

pytestmark = pytest.mark.distributed


def test_llama4_experts_expert_parallel_match_unsharded():
    for rank, res in enumerate(run_distributed(dense_ep_world, 2)):
        assert res["ep_size"] == 2 and res["experts per rank"] * 2 == 8, (rank, res)
        for strategy in ("all_to_all", "all_reduce"):
            logits, loss, grads = res[strategy]
            assert logits <= TOL and loss <= TOL and grads <= TOL, (rank, strategy, res)
