"""`mla_kv_a_proj` (MLA's kv_a_proj_with_mqa, DeepSeek-V2 style attention tensor-parallel), on 2 gloo ranks.

The projection stays replicated; its output's rope slice feeds this rank's heads only, so without the style
its gradient is partial on each rank (transformers' MlaKvAProjParallel sums it in backward). A training step
of the sharded model must match the unsharded one with the style, and must not with the style's forward taken off
(the check can fail); a plan that writes `replicate` there is refused by the compiler (PLC636).
"""

import pytest

from tests.distributed import run_distributed
from tests.runtime.mla_llama4_workers import mla_world
from tests.runtime.workers import TOL

pytestmark = pytest.mark.distributed


def test_mla_kv_a_proj_sums_the_rope_gradient():
    for rank, res in enumerate(run_distributed(mla_world, 2)):
        assert res["installed"] == "mla_kv_a_proj", rank
        loss, kv_a, every = res["mla_kv_a_proj"]
        assert loss <= TOL and kv_a <= TOL and every <= TOL, (rank, res)
        _, kv_a_without, _ = res["unwrapped"]
        assert kv_a_without > 10 * TOL, (rank, res)  # the partial rope gradient the style exists for
        # and the compiler refuses a plan without the style, before anything is installed, naming the fix
        assert "PLC636" in res["refused"] and "nothing was installed" in res["refused"], (rank, res)
        assert "kv_a_proj_with_mqa: mla_kv_a_proj` to tp_plan" in res["refused"], (rank, res)
