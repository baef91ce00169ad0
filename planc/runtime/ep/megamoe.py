"""MegaMoeEP at run time: the sliced forward in front of the Mega MoE experts.

Why slices: every rank of the EP group holds the same batch (`ep_size == tp_size`), but the kernel
dispatches tokens itself, so each token must enter it on exactly one rank. Rank r hands the experts rows
``[r * s, (r + 1) * s)`` with ``s = ceil(T / ep_size)`` (the tail padded with ``-1`` expert ids and zero
weights; a rank may get only padding), with global ids, unmasked weights and the EP group, then the
slices' outputs are all-gathered so every rank ends with all T rows. Example, 4 tokens on 2 ranks:
rank 0 runs [t0, t1], rank 1 runs [t2, t3], both end with [y0, y1, y2, y3].

Shapes depend only on T, nothing reads device values: no host syncs, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from planc.runtime.ep.base import EPRuntime

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def slice_for_rank(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, ep_rank: int,
                   ep_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's equal slice of the shared batch, padded to ``ceil(T / ep_size)`` rows."""
    num_tokens = hidden_states.shape[0]
    rows = -(-num_tokens // ep_size)
    start = min(ep_rank * rows, num_tokens)
    end = min(start + rows, num_tokens)
    pad = rows - (end - start)
    x, idx, w = hidden_states[start:end], top_k_index[start:end], top_k_weights[start:end]
    if pad:
        x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
        idx = torch.cat([idx, idx.new_full((pad, idx.shape[1]), -1)])
        w = torch.cat([w, w.new_zeros((pad, w.shape[1]))])
    return x, idx, w


class MegaMoeEPRuntime(EPRuntime):
    """Bound per experts module by the apply layer as ``MegaMoeEPRuntime(experts_module, strategy, groups)``.

    Bind it after `install_megamoe_forward`: the base captures ``experts_module.forward`` (the Mega MoE
    forward), so the apply layer can then route the module's forward through this runtime. The
    strategy is inference only (`MegaMoeEP.inference_only`), which the base enforces.
    """

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        num_tokens, hidden = hidden_states.shape
        x, idx, w = slice_for_rank(hidden_states, top_k_index, top_k_weights, self.ep_rank, self.ep_size)
        y: torch.Tensor = self.experts_forward(x, idx, w, process_group=self.ep_group)
        if self.ep_size == 1:
            return y[:num_tokens]
        gathered = torch.empty((self.ep_size * x.shape[0], hidden), dtype=y.dtype, device=y.device)
        _all_gather_single(gathered, y.contiguous(), group=self.ep_group)
        return gathered[:num_tokens]
