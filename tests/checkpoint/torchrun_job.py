"""A user's job as torchrun runs it (tests/checkpoint/test_torchrun_exit.py): load, a forward, optionally an export;
no destroy_process_group at the end, as many scripts leave it out. `python -m tests.checkpoint.torchrun_job SRC
[EXPORT_DIR]`."""

import sys

import torch
import torch.distributed as dist

import planc
from tests.runtime.workers import batch, shipped_plan

if __name__ == "__main__":
    dist.init_process_group("gloo")
    model = planc.load(sys.argv[1], shipped_plan("mixtral", tp=dist.get_world_size()), dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch(1)).logits
    if len(sys.argv) > 2:
        planc.export(model, sys.argv[2])
    print(f"rank {dist.get_rank()}: done {tuple(logits.shape)}", flush=True)
