"""The runtime's TP styles and the spec table (`planc.spec.styles`) say the same thing.

The compiler counts bytes and checks uneven shards from the table; the runtime shards by it too. This
runs every runtime style's `shard_param` on real 2-rank gloo meshes and compares each parameter's
local shape with what the table's placement gives.
"""

from __future__ import annotations

import pytest

from planc.spec.styles import STYLES
from tests.distributed import run_distributed


def test_runtime_registry_is_keyed_by_the_table():
    from planc.runtime.tp_styles import TP_RUNTIMES

    want = {s.name for s in STYLES if s.runtime and s.section == "tp"}
    assert set(TP_RUNTIMES) == want
    assert all(TP_RUNTIMES[name].spec.name == name for name in want)


def shard_world(rank, world_size):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from planc.runtime.extensions import forward_probe_problems, shard_probe_problems
    from planc.runtime.tp_styles import TP_RUNTIMES

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, style in TP_RUNTIMES.items():
        module = nn.Linear(8, 12, bias=True)
        module.scale = nn.Parameter(torch.ones(8))  # a 1-D parameter that is not a bias
        for pname in ("weight", "bias", "scale"):
            style.shard_param(module, pname, mesh)
            p = module._parameters[pname]
            local = p.to_local() if isinstance(p, DTensor) else p
            out[(name, pname)] = tuple(local.shape)
        # the library checks a registered style passes at planc.apply (planc.runtime.extensions), on planc's own
        # (the forward probe is an nn.Linear: planc's Linear styles; embedding_rowwise needs an embedding)
        out[(name, "probes")] = shard_probe_problems(style.spec, style, mesh) + (
            forward_probe_problems(style.spec, style, mesh) if name != "embedding_rowwise" else [])
    return out


@pytest.mark.distributed
def test_every_style_shards_as_its_row_says():
    results = run_distributed(shard_world, 2)
    full = {"weight": (12, 8), "bias": (12,), "scale": (8,)}
    for res in results:
        for (name, pname), shape in res.items():
            if pname == "probes":
                assert shape == [], (name, shape)
                continue
            row = next(s for s in STYLES if s.name == name)
            dim = row.placement(len(full[pname]))
            want = list(full[pname])
            if dim is not None:
                want[dim] //= 2
            assert shape == tuple(want), (name, pname, shape, want)
    # the fixed disagreement: rowwise leaves every 1-D parameter whole, as the compiler counts it
    assert results[0][("rowwise", "scale")] == (8,)
