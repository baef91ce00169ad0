"""AllToAllEP: only the routed tokens move, so it works for any layout (ep_size equal to tp_size or above it).

Per call:
1. The ranks of a TP group hold the same batch; each keeps its own row slice (`Shard(0)`), so every
   token is sent once (the slice's backward all-gathers the row gradients).
2. (token, expert) pairs are sorted by global expert id, which groups them by owner rank; the
   per-expert counts are exchanged (one all-to-all, one host sync for the split sizes).
3. The tokens go to their experts' ranks (differentiable all-to-all); the receiver rebuilds the
   local expert id of each row from the counts and runs its experts top-1 with unit weights.
4. The outputs come back by the reverse all-to-all; the routing weights are applied on the sender,
   so their gradient stays local; the TP row slices are all-gathered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from planc.runtime.ep.base import EPRuntime
from planc.runtime.collectives import all_gather_dim, all_to_all, shard_sizes, split_dim


class AllToAllEPRuntime(EPRuntime):
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        g = self.groups
        num_tokens, hidden = hidden_states.shape
        if g.tp_size > 1:
            # DTensor's Shard(0) row split (torch.chunk), on plain tensors: backward all-gathers the row gradients
            rows = shard_sizes(num_tokens, g.tp_size)
            hidden_states, top_k_index, top_k_weights = (
                split_dim(t, g.tp_group, rows, 0) for t in (hidden_states, top_k_index, top_k_weights)
            )
        num_local, ep = self.num_local_experts, g.ep_size
        top_k = top_k_index.shape[-1]

        expert_ids = top_k_index.reshape(-1)
        num_weighted = num_local * ep
        # parameter-free experts (ids past the experts with weights: longcat_flash's identities) sort last and stay
        extra = expert_ids >= num_weighted
        order = torch.argsort(torch.where(extra, num_weighted, expert_ids), stable=True)
        send_counts = torch.zeros(num_weighted, dtype=torch.long, device=hidden_states.device)
        send_counts.scatter_add_(0, expert_ids.masked_fill(extra, 0), (~extra).long())
        send_counts = send_counts.view(ep, num_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=g.ep_group)
        send_sizes, recv_sizes = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        routed = sum(send_sizes)
        stay = order[routed:]
        order = order[:routed]
        send_tokens = hidden_states[order // top_k]

        recv_tokens = all_to_all(send_tokens, recv_sizes, send_sizes, g.ep_group)
        local_ids = torch.arange(num_local, device=hidden_states.device).repeat(ep)
        local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
        unit = torch.ones(local_ids.shape, dtype=recv_tokens.dtype, device=recv_tokens.device)
        expert_out = self.top1_forward(recv_tokens, local_ids, unit)

        back = all_to_all(expert_out, send_sizes, recv_sizes, g.ep_group)
        per_slot = back.new_empty((expert_ids.shape[0], hidden))
        per_slot[order] = back
        if stay.numel():
            ones = torch.ones((stay.shape[0], 1), dtype=hidden_states.dtype, device=hidden_states.device)
            per_slot[stay] = self.top1_forward(hidden_states[stay // top_k], expert_ids[stay].unsqueeze(-1), ones)
        per_slot = per_slot.view(*top_k_weights.shape, hidden)
        output = (per_slot * top_k_weights.unsqueeze(-1).to(per_slot.dtype)).sum(dim=1)
        if g.tp_size == 1:
            return output
        # Shard(0) -> Replicate: one all-gather of the (possibly uneven or empty) row slices; backward keeps ours.
        return all_gather_dim(output, g.tp_group, rows, 0)
