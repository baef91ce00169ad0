"""Expert parallelism for experts that take every token pre-scaled (Llama 4's `forward(hidden_states)`).

The MoE block hands the experts `[E * T, H]`: every token repeated once per expert, each copy scaled by that
expert's router score (0 off the top-k), and sums the `[E, T, H]` output over experts. There are no routed
(token, expert) pairs to dispatch, so whatever `ep_implementation` says, each rank of the EP group (which is
the TP group: every rank holds the same batch) runs its own `E / ep` experts on their rows of the input, and the
outputs are all-gathered along the expert rows: the block sees exactly the unsharded output.

Backward: each rank differentiates through its own rows only, so the replicated input's gradient is summed over
the group (`all_reduce_grad`); the gather keeps this rank's slice of the output gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from planc.errors import ApplyError
from planc.runtime.collectives import all_gather_dim, all_reduce_grad, to_local
from planc.runtime.tp_styles import local_parameters, module_path

if TYPE_CHECKING:
    from planc.runtime.mesh import Groups
    from planc.spec.ep import EPStrategy


def install_dense_ep_forward(module: nn.Module, strategy: EPStrategy, groups: Groups, num_experts: int) -> None:
    """Replace the experts forward (an instance attribute, undone by restoring `__dict__`)."""
    if not groups.shares_batch:
        raise ApplyError(
            f"planc.runtime.ep.dense: {module_path(module)} takes every token pre-scaled; its experts can only be "
            "expert-parallel over ranks that hold the same batch (ep_size == tp_size)."
        )
    local = int(to_local(module.gate_up_proj).shape[0])  # grouped_gemm left this rank's experts
    ep, rank, group = groups.ep_size, groups.ep_rank, groups.ep_group
    if local * ep != num_experts:
        raise ApplyError(
            f"planc.runtime.ep.dense: {module_path(module)} holds {local} experts per rank, but {num_experts} experts "
            f"over {ep} EP ranks is {num_experts // ep}: shard every expert tensor with `grouped_gemm`."
        )
    original = module.forward

    def dense_ep_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = all_reduce_grad(to_local(hidden_states), group)
        rows = x.shape[0] // num_experts  # tokens per expert
        mine = x[rank * local * rows:(rank + 1) * local * rows]
        with local_parameters(module):
            out = original(mine, *args, **kwargs)
        return all_gather_dim(out, group, [local * rows] * ep, dim=0)

    dense_ep_forward.strategy = strategy  # type: ignore[attr-defined]  # a function attribute, read by explain
    module.forward = dense_ep_forward


__all__ = ["install_dense_ep_forward"]
