"""Expert parallelism over the model's own experts forward (longcat_flash), 2 gloo ranks.

LongcatFlashForCausalLM "does not support setting experts implementation": its experts class is not wrapped by
transformers' kernels, and its router also picks parameter-free "zero" experts (identities) past the routed
ones. The EP runtimes run its own forward on local ids (no off-rank sentinel: it promises nothing about it),
keep the parameter-free routes on the token's rank, and shard only the routed experts' rows. Logits, loss and
every gradient of a training step must match the unsharded model for each strategy.
"""

import pytest

from tests.distributed import run_distributed
from tests.runtime.mla_llama4_workers import own_forward_ep_world
from tests.runtime.workers import TOL

pytestmark = pytest.mark.distributed


def test_longcat_experts_expert_parallel_match_unsharded():
    for rank, res in enumerate(run_distributed(own_forward_ep_world, 2)):
        assert res["ep_size"] == 2 and res["experts per rank"] * 2 == 8, (rank, res)
        assert res["zero experts hit"] > 0, res  # the batch routes tokens to the parameter-free experts
        for strategy in ("all_to_all", "all_reduce", "auto"):
            logits, loss, grads = res[strategy]
            assert logits <= TOL and loss <= TOL and grads <= TOL, (rank, strategy, res)
