"""A user's job as torchrun runs it (tests/checkpoint/test_torchrun_exit.py): load, a forward, optionally an export;
no destroy_process_group at the end, as many scripts leave it out. `python -m tests.checkpoint.torchrun_job SRC
[EXPORT_DIR]`; `--failing-loads`: only two planc.load calls that fail on every rank (a plan of another model), caught."""

import sys

import torch
import torch.distributed as dist

import planc
from planc.errors import PlancError
from tests.runtime.workers import batch, shipped_plan

if __name__ == "__main__":
    dist.init_process_group("gloo")
    if "--failing-loads" in sys.argv:
        sys.argv.remove("--failing-loads")
        for _ in range(2):
            try:
                planc.load(sys.argv[1], shipped_plan("qwen3_moe", tp=dist.get_world_size()))
                raise SystemExit("a qwen3_moe plan loaded a mixtral checkpoint")
            except PlancError as e:
                print(f"rank {dist.get_rank()}: caught {type(e).__name__}", flush=True)
        print(f"rank {dist.get_rank()}: done", flush=True)
        raise SystemExit(0)
    model = planc.load(sys.argv[1], shipped_plan("mixtral", tp=dist.get_world_size()), dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch(1)).logits
    if len(sys.argv) > 2:
        planc.export(model, sys.argv[2])
    print(f"rank {dist.get_rank()}: done {tuple(logits.shape)}", flush=True)
