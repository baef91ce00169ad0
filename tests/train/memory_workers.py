"""Rank code of the training-memory test: what a rank really holds after one AdamW step (module level: spawn
pickles functions by name). The plans are written by the test process, which also runs `planc explain --train`
on them; the ranks load the same checkpoint with the same plan and measure."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

from tests.runtime.workers import batch


def local_bytes(t) -> int:
    """Bytes of this rank's part of `t` (a DTensor's local shard; a plain tensor whole)."""
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def held_after_step(model, optimizer) -> dict:
    """Parameters, gradients and optimizer state this rank holds, each tensor once (tied parameters once)."""
    params = {id(p): p for p in model.parameters()}.values()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(t) for t in state),
        "tensors": len(optimizer.state),
    }


def measure_world(rank, world_size, cases: list[tuple[str, str]]):
    """For each (checkpoint, plan file the test wrote for this world size): planc.load, one AdamW step on this
    replica's rows, then the bytes held, before zero_grad."""
    import planc

    out = {}
    for hub, path in cases:
        try:
            model = planc.load(hub, path)
            dp_rank = planc.device_mesh(model, "dp").get_local_rank()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model.train()
            ids = batch(7, rows=4)[2 * dp_rank % 4:][:2]
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            out[Path(path).name] = held_after_step(model, optimizer)
        except Exception:  # noqa: BLE001 - every plan reported
            out[Path(path).name] = traceback.format_exc()
    return out
