"""AutoEP: all_reduce at inference when the EP group shares the batch, all_to_all otherwise.

The choice is made per call from grad mode (`torch.is_grad_enabled() and hidden_states.requires_grad`),
not from `module.training`: `model.train()` under `no_grad` still takes the sync-free all_reduce path,
and a training step always takes all_to_all, whose tokens-only traffic scales with training batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from planc.runtime.ep.all_reduce import AllReduceEPRuntime
from planc.runtime.ep.all_to_all import AllToAllEPRuntime
from planc.runtime.ep.base import EPRuntime

if TYPE_CHECKING:
    from planc.runtime.mesh import Groups
    from planc.spec.ep import EPStrategy


class AutoEPRuntime(EPRuntime):
    def __init__(self, experts_module: nn.Module, strategy: EPStrategy, groups: Groups) -> None:
        super().__init__(experts_module, strategy, groups)
        self.all_to_all = AllToAllEPRuntime(experts_module, strategy, groups)
        shares = getattr(strategy, "shares_batch", True) and groups.shares_batch
        self.all_reduce = AllReduceEPRuntime(experts_module, strategy, groups) if shares else None
        self.last_choice: Optional[str] = None  # "all_reduce" or "all_to_all": what the latest call ran (tests, debugging)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        if self.all_reduce is not None and not (torch.is_grad_enabled() and hidden_states.requires_grad):
            self.last_choice = "all_reduce"
            return self.all_reduce(hidden_states, top_k_index, top_k_weights)
        self.last_choice = "all_to_all"
        return self.all_to_all(hidden_states, top_k_index, top_k_weights)
