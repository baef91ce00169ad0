"""Seeded bugs in a project's own TP style and EP strategy, registered through `planc.register_tp_style` /
`planc.register_ep_strategy`, beside the same extensions written right (the corpus `planc.verify` must tell apart).

- `all_to_all_drops_weights`: all_to_all whose combine on EP rank 1 ignores the routing weights (every routed
  expert output counted at weight 1): the tokens that rank combines come out wrong, the others right.
- `replicated_grad_reduced_twice`: `replicated_with_grad_allreduce` whose parameter gradient is summed over the TP
  group twice (tp times the right gradient): forward exact, the gradient wrong on every rank.
The right versions: `all_to_all_counted` (tests/runtime/custom_extensions.py) and `replicated_grad_reduced`.
"""

from __future__ import annotations

from typing import Any

import torch

from planc.runtime.collectives import all_reduce_grad
from planc.runtime.ep.all_to_all import AllToAllEPRuntime
from planc.runtime.tp_styles import ReplicatedWithGradAllReduce
from planc.spec.choices import EPStrategyRow
from planc.spec.styles import Style

DROPS_WEIGHTS = EPStrategyRow("all_to_all_drops_weights", "DropsWeightsEP",
                              "all_to_all whose combine drops the routing weights on EP rank 1 (a seeded bug)")
REDUCED_TWICE = Style("replicated_grad_reduced_twice", "tp", "module",
                      "replicated parameters, gradient summed over the TP group twice (a seeded bug)", runtime=True)
REDUCED = Style("replicated_grad_reduced", "tp", "module",
                "replicated parameters, gradient summed over the TP group once (the right version)", runtime=True)


class DropsWeightsAllToAll(AllToAllEPRuntime):
    """all_to_all; on EP rank 1 the combine takes weight 1 for every routed slot."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.ep_rank == 1:  # still connected to the router (a zero gradient): the ranks' backward collectives match
            top_k_weights = torch.ones_like(top_k_weights) + 0 * top_k_weights
        return super().forward(hidden_states, top_k_index, top_k_weights)


class GradReduced(ReplicatedWithGradAllReduce):
    """`replicated_with_grad_allreduce` under a project's own name (the right version)."""

    def __init__(self) -> None:
        self.name = REDUCED.name


class GradReducedTwice(ReplicatedWithGradAllReduce):
    """The parameters read through `all_reduce_grad` twice: their gradient summed over the group twice."""

    def __init__(self) -> None:
        self.name = REDUCED_TWICE.name

    def read(self, param: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce_grad(all_reduce_grad(param, group), group)


def register() -> None:
    """The seeded bugs and the right versions (runtime halves as objects), with tests/runtime/custom_extensions'."""
    import planc
    from tests.runtime import custom_extensions

    custom_extensions.register()
    planc.register_ep_strategy(DROPS_WEIGHTS, DropsWeightsAllToAll)
    planc.register_tp_style(REDUCED_TWICE, GradReducedTwice())
    planc.register_tp_style(REDUCED, GradReduced())
