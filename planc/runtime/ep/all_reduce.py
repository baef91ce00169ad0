"""AllReduceEP: every rank runs its own experts over the whole shared batch; outputs are summed.

Needs the EP group to be the TP group (ep_size == tp_size: every rank holds the same batch). The
routes to other ranks' experts are masked: local id = the sentinel `num_local_experts` (skipped by
the experts kernels), weight 0. No tokens move and no split size is read back, so there is no host
sync and the step is CUDA-graph capturable; the cost is every rank touching every token.

Backward: each rank differentiates through its own experts only, so the gradients of the shared
inputs (hidden states, routing weights) are partial and get summed over the group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from planc.runtime.ep.base import EPRuntime, sentinel_safe
from planc.runtime.collectives import all_reduce_grad, all_reduce_sum

if TYPE_CHECKING:
    from planc.runtime.mesh import Groups
    from planc.spec.ep import EPStrategy


class AllReduceEPRuntime(EPRuntime):
    def __init__(self, experts_module: nn.Module, strategy: EPStrategy, groups: Groups) -> None:
        super().__init__(experts_module, strategy, groups)
        # GPT-OSS eager cannot take the sentinel: park off-rank slots on local expert 0 with weight 0 instead.
        self.sentinel = self.num_local_experts if sentinel_safe(experts_module) else 0

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        g = self.groups
        hidden_states = all_reduce_grad(hidden_states, g.ep_group)
        top_k_weights = all_reduce_grad(top_k_weights, g.ep_group)
        # parameter-free experts (ids past the experts with weights) keep their id; EP rank 0 alone counts them
        extra = top_k_index >= self.num_local_experts * g.ep_size
        off_rank = (torch.div(top_k_index, self.num_local_experts, rounding_mode="floor") != g.ep_rank) & ~extra
        local_index = torch.where(extra, top_k_index,
                                  torch.where(off_rank, self.sentinel, top_k_index % self.num_local_experts))
        masked = off_rank | extra if g.ep_rank else off_rank
        output = self.experts_forward(hidden_states, local_index, top_k_weights.masked_fill(masked, 0.0))
        return all_reduce_sum(output, g.ep_group)
