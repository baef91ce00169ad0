"""Experts `planc init` plans tensor-parallel (an expert count no size divides), 2 gloo ranks.

From transformers 5.25 the configs declare only EP rules on their experts (`moe_tp_experts` is deprecated);
init derives the TP rules from the experts' layout (planc.models.synthesis). Logits, loss and every gradient of a
training step under the plan it writes must match the unsharded model, for each layout: gate|up fused,
transposed ([E, H, 2I]: aria_text), and no gate (nemotron_h).
"""

import pytest

from tests.distributed import run_distributed
from tests.runtime.workers import TOL

pytestmark = pytest.mark.distributed

# (family, its config's expert-count field): 3 experts split over no size
CASES = [("hunyuan_v1_moe", "num_experts"), ("aria_text", "moe_num_experts"), ("nemotron_h", "n_routed_experts")]


def tp_experts_world(rank, world_size):
    """{family: (plan's ep_size, its experts styles, logits diff, loss diff, grads diff)} for CASES."""
    import copy

    import yaml

    from planc import apply
    from planc.models.synthesis import init_plan
    from planc.models.families import family
    from planc.models.build import build_tiny_model, tiny_config
    from tests.runtime.workers import batch, logits_diff, train_step_diff

    out = {}
    for name, count in CASES:
        fam = family(name)
        plan = yaml.safe_load(init_plan(fam.model_type, tiny_config(fam, **{count: 3}).to_dict(), sizes=(world_size,)))
        base = build_tiny_model(fam, seed=3, **{count: 3})
        model, ref = copy.deepcopy(base), copy.deepcopy(base)
        apply(model, plan)
        styles = sorted({v for k, v in plan["tp_plan"].items() if ".experts" in k})
        loss, grads = train_step_diff(model, ref, batch(4))
        out[name] = (plan["parallel"].get("ep_size", 1), styles, logits_diff(model, ref, batch(3)), loss, grads)
    return out


def test_tensor_parallel_experts_from_init_match_unsharded():
    for rank, res in enumerate(run_distributed(tp_experts_world, 2)):
        assert set(res) == {name for name, _ in CASES}
        for name, (ep_size, styles, logits, loss, grads) in res.items():
            assert ep_size == 1 and "moe_tp_experts" in styles, (rank, name, styles)
            assert logits <= TOL and loss <= TOL and grads <= TOL, (rank, name, res[name])
