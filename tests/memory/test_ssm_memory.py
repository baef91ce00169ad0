"""Mamba2's chunked scan priced from transformers' code (planc.compiler.ssm_memory) against the mixer really running:
Granite MoE hybrid's and Nemotron-H's Mamba2 mixers at their default widths, bf16, a short prefill and a training
forward, torch's MemTracker counting what the mixer allocates beyond its parameters."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.distributed._tools.mem_tracker import MemTracker

from planc.compiler.ssm_memory import mamba2_prefill_bytes, mamba2_saved_bytes
from planc.verification.memory import no_backward_hooks_without_grad


def _mixer(family: str):
    if family == "granitemoehybrid":
        from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

        config = transformers.CONFIG_MAPPING[family](num_hidden_layers=2, layer_types=["mamba", "attention"])
        widths = dict(heads=config.mamba_n_heads, head_dim=config.mamba_d_head, d_state=config.mamba_d_state,
                      groups=config.mamba_n_groups, chunk=config.mamba_chunk_size)
        return GraniteMoeHybridMambaLayer(config, 0).to(torch.bfloat16), config, widths
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    config = transformers.CONFIG_MAPPING[family]()
    widths = dict(heads=config.mamba_num_heads, head_dim=config.mamba_head_dim, d_state=config.ssm_state_size,
                  groups=config.n_groups, chunk=config.chunk_size)
    return NemotronHMamba2Mixer(config, 0).to(torch.bfloat16), config, widths


def _allocated(mixer, run) -> tuple[int, int]:
    """(the peak, what is live at the end) of what `run` allocates beyond the mixer's parameters."""
    tracker = MemTracker()
    tracker.track_external(mixer)
    with tracker:
        out = run()
        live = tracker.get_tracker_snapshot("current")
    peak = tracker.get_tracker_snapshot("peak")
    dev = next(iter(peak))
    params = sum(n for k, n in peak[dev].items() if "PARAM" in str(k) or "BUFFER" in str(k))
    kept = sum(n for k, n in live[dev].items() if k != "Total" and "PARAM" not in str(k) and "BUFFER" not in str(k))
    return peak[dev]["Total"] - params, kept - out.numel() * out.element_size()


@pytest.mark.parametrize("family, batch, seq", [("nemotron_h", 2, 200), ("granitemoehybrid", 1, 300)])
def test_mamba2_prefill_and_training_forward_are_priced_from_the_scan(family, batch, seq):
    mixer, config, widths = _mixer(family)
    x = torch.randn(batch, seq, config.hidden_size, dtype=torch.bfloat16)
    with no_backward_hooks_without_grad(), torch.no_grad():  # as the memory grid measures a prefill
        peak, _ = _allocated(mixer.eval(), lambda: mixer(x))
    rule = mamba2_prefill_bytes(batch=batch, seq=seq, a=2, **widths)
    assert -0.02 <= rule / peak - 1 <= 0.05, (peak, rule)
    _, kept = _allocated(mixer.train(), lambda: mixer(x.clone().requires_grad_(True)))
    rule = mamba2_saved_bytes(batch=batch, seq=seq, a=2, **widths)
    assert -0.02 <= rule / kept - 1 <= 0.05, (kept, rule)
