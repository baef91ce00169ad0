"""The AdamW step the compiled plan names (planc.compiler.optimizer_step) is the one torch takes on the applied model.

One process plays rank 0 of each case's world under torch's fake process group: the shipped plan applied to its
model on `meta` (2 layers), `torch.optim.AdamW(model.parameters())` built, planc's step pre-hook run on it. Torch
steps foreach on CUDA when the group's `foreach` is left unset and every parameter is of a type its foreach path
lists (`_default_to_fused_or_foreach`); the CPU box cannot run CUDA, so the test reads those two facts and the
parameters' kinds, and compares them with what the compiler said without torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.checkout_env import checkout_env
from tests.memory.test_peak_memory import REPO

# (plan, mode, dp, the step the compiler must name)
CASES = [
    ("mixtral", "replicate", 1, "for-loop"), ("deepseek_v3", "replicate", 1, "for-loop"),  # 8 ranks: TP beside plain
    ("mixtral", "fsdp", 2, "foreach"), ("mixtral", "replicate", 2, "foreach"),  # 16: the data-parallel wrap
]


def test_the_compiled_step_is_the_one_torch_takes():
    run = subprocess.run([sys.executable, "-m", "tests.memory.test_optimizer_step", json.dumps(CASES)], cwd=REPO,
                         env=checkout_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for (family, mode, dp, expected), seen in zip(CASES, json.loads(run.stdout.strip().splitlines()[-1])):
        assert seen["compiled"]["step"] == expected == seen["torch"], (family, mode, dp, seen)
        assert seen["compiled"]["dtensor_parameters"] == seen["dtensors"], (family, mode, dp, seen)
        assert seen["compiled"]["plain_parameters"] == seen["plain"], (family, mode, dp, seen)


def test_the_step_temporaries_are_what_torch_allocates():
    """The bytes each AdamW step holds beyond parameters, gradients and state (planc.compiler.optimizer_step) against
    torch's MemTracker over a second step, on parameters in two dtypes where two large ones are neighbours (the for-loop
    step then holds three copies) and the small fp32 group follows the bf16 one (foreach then holds both groups)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from planc.compiler.optimizer_step import for_loop_temporaries, foreach_temporaries

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024, bias=False), torch.nn.Linear(1024, 256, bias=False),
                                torch.nn.Linear(256, 8, bias=False), torch.nn.Linear(8, 512, bias=False))
    model[0].to(torch.bfloat16)
    model[1].to(torch.bfloat16)
    params = list(model.parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    groups: dict[torch.dtype, int] = {}
    for p, n in zip(params, sizes):
        groups[p.dtype] = groups.get(p.dtype, 0) + n
    for foreach, expected in ((False, for_loop_temporaries(sizes)), (True, foreach_temporaries(list(groups.values())))):
        optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()  # the state exists: the second step is the one measured
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            optimizer.step()
        snapshot = tracker.get_tracker_snapshot("peak")
        held = 4 * sum(sizes) + 4 * len(params)  # parameters, gradients, exp_avg, exp_avg_sq; a float32 step each
        assert snapshot[next(iter(snapshot))]["Total"] - held == expected, (foreach, snapshot, expected)


def _steps(cases: list) -> list[dict]:
    """In the child: for each case, what the compiler names and what torch would take on CUDA."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import _foreach_supported_types
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import bench.memory_grid as memory_grid
    from planc.compiler.optimizer_step import adamw_step
    from planc.compiler.walk import walk_model
    from planc.models.build import build_meta_model
    from planc.runtime import install
    from planc.runtime.data_parallel import loop_over_mixed_groups
    from planc.verification.memory import plan_data

    out = []
    for family, mode, dp, _ in cases:
        data = plan_data(family, mode, dp=dp, root=str(REPO))
        world = data["parallel"]["tp_size"] * dp
        if dist.is_initialized() and dist.get_world_size() != world:
            dist.destroy_process_group()  # the fake world of the next size
        if not dist.is_initialized():
            dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        model = build_meta_model(data["model"]["type"], dict(memory_grid.FAMILIES[family])).to(torch.bfloat16)
        walk = walk_model(model)
        compiled = install.apply(model, install.load_plan_on_every_rank(data, what="test"))
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        loop_over_mixed_groups(optimizer)  # planc's step pre-hook, as optimizer.step() runs it
        group = optimizer.param_groups[0]
        foreach = group["foreach"] is not False and all(type(p) in _foreach_supported_types for p in params)
        dtensors = sum(isinstance(p, DTensor) for p in params)
        out.append({"compiled": adamw_step(compiled, walk).to_json(), "torch": "foreach" if foreach else "for-loop",
                    "dtensors": dtensors, "plain": len(params) - dtensors})
    return out


if __name__ == "__main__":  # python -m tests.memory.test_optimizer_step '<json list of cases>'
    print(json.dumps(_steps(json.loads(sys.argv[1]))))
