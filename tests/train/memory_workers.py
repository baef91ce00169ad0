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


def watch_gathered(model) -> dict:
    """While units run (fsdp): the most bytes of one decoder layer's gathered parameters and of the root's own,
    read in a forward pre-hook of every module inside each layer (FSDP2 has all-gathered the units around it by
    then: the layer's, the root's, and the experts' when the experts module is about to run). Gathered: the
    tensors FSDP2 registers in place of the sharded parameters while a unit runs."""
    from planc.runtime.data_parallel import decoder_layers

    layers = decoder_layers(model, model._planc_plan)
    names = {id(layer): name for name, layer in model.named_modules()}
    prefixes = tuple(names[id(layer)] + "." for layer in layers)
    sharded = {id(p) for p in model.parameters()}
    seen = {"layer": 0, "root": 0}

    def gathered(params) -> int:
        return sum(local_bytes(p) for p in params if id(p) not in sharded)

    def hook(layer):
        def record(module, args):
            seen["layer"] = max(seen["layer"], gathered(layer.parameters()))
            root = gathered(p for n, p in model.named_parameters() if not n.startswith(prefixes))
            seen["root"] = max(seen["root"], root)
        return record

    for layer in layers:
        for module in layer.modules():
            module.register_forward_pre_hook(hook(layer))
    # each FSDP unit inside the layers (the layer, its EP experts, a dtype-odd module): its own parameters gathered,
    # read in a pre-hook that runs after FSDP2's (fully_shard prepends its own)
    from torch.distributed.fsdp import FSDPModule

    seen["unit"] = 0
    units = [m for layer in layers for m in layer.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}

        def record_unit(module, args, nested=nested):
            own = (p for p in module.parameters() if id(p) not in nested)
            seen["unit"] = max(seen["unit"], gathered(own))

        unit.register_forward_pre_hook(record_unit)
    return seen


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
            gathered = watch_gathered(model)
            model.train()
            ids = batch(7, rows=4)[2 * dp_rank % 4:][:2]
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            out[Path(path).name] = {**held_after_step(model, optimizer), **{f"gathered_{k}": v for k, v in gathered.items()}}
        except Exception:  # noqa: BLE001 - every plan reported
            out[Path(path).name] = traceback.format_exc()
    return out
