"""What every EP runtime shares: expert-dim sharding of the experts' tensors and the installed forward.

`grouped_gemm` keeps each rank's contiguous slice of the expert dimension (rank r of the EP group
owns experts `[r * E/ep, (r + 1) * E/ep)`) of every tensor with a leading expert dim: weights,
biases, FP8/FP4 scales. The experts module then holds `num_experts = E/ep` and the flag
`_is_expert_parallel`, which transformers' experts kernels read to skip the sentinel id
`num_experts` (an off-rank slot). Runtimes call the experts' own forward on local expert ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from planc.errors import ApplyError
from planc.runtime.collectives import needs_grad, to_local
from planc.runtime.tp_styles import local_parameters, module_path

if TYPE_CHECKING:
    from planc.runtime.mesh import Groups
    from planc.spec.ep import EPStrategy


def shard_expert_tensor(module: nn.Module, name: str, groups: Groups, num_experts: Optional[int] = None,
                        experts_module: bool = True) -> None:
    """`grouped_gemm`: keep this rank's slice of the leading (expert) dim of parameter or buffer `name`.

    `num_experts` (the compiler's count of experts with weights): a tensor allocated with more leading rows
    (longcat_flash's gate_up_proj also counts the parameter-free experts its forward runs as identities)
    keeps only the rows of the experts with weights, split like the others; its forward never reads the rest.
    `experts_module` False: a per-expert tensor of a module inside the experts (ergo's `post_expert_norm.weight`),
    sliced the same way; that module is not marked expert-parallel (its experts module is)."""
    ep = groups.ep_size
    tensor: Optional[torch.Tensor] = module._parameters.get(name)
    is_param = tensor is not None
    if not is_param:
        tensor = module._buffers.get(name)
    if tensor is None:
        raise ApplyError(
            f"planc.runtime.ep.base: `grouped_gemm` names {module_path(module)}.{name}, which is neither a parameter "
            "nor a buffer of the experts module. Point the rule at the experts' tensors (gate_up_proj, down_proj, "
            "their biases and scales)."
        )
    if isinstance(tensor, DTensor):
        raise ApplyError(
            f"planc.runtime.ep.base: {module_path(module)}.{name} is already sharded (a DTensor); a tensor takes one "
            "style. Keep either the tp_plan or the ep_plan rule for it."
        )
    num = tensor.shape[0] if tensor.ndim else 0
    if num_experts is not None and 0 < num_experts < num:
        tensor, num = tensor[:num_experts], num_experts
    if num == 0 or num % ep:
        raise ApplyError(
            f"planc.runtime.ep.base: cannot shard {module_path(module)}.{name} (shape {tuple(tensor.shape)}) by expert over "
            f"{ep} EP ranks: its leading dim {num} is not a multiple of ep_size. Pick an ep_size that divides the "
            "number of experts."
        )
    if is_param:
        module._parameters[name] = nn.Parameter(
            distribute_tensor(tensor.detach().contiguous(), groups.ep_mesh, [Shard(0)], src_data_rank=None),
            requires_grad=tensor.requires_grad,
        )
    else:
        # Buffers (e.g. FP4 scales stored as buffers) stay plain tensors: the local slice.
        module._buffers[name] = tensor.chunk(ep, dim=0)[groups.ep_rank].clone()
    if experts_module:
        module.num_experts = num // ep  # type: ignore[assignment]  # a plain int (torch types attributes as tensors)
        module._is_expert_parallel = True  # type: ignore[assignment]  # a plain flag (torch types attributes as tensors or modules)


class EPRuntime:
    """Base of every EP runtime: `RuntimeCls(experts_module, strategy, groups)`, then
    `runtime(hidden_states [T, H], top_k_index [T, K] global ids, top_k_weights [T, K]) -> [T, H]`.

    Ids at or above the number of experts with weights (`num_local_experts * ep_size`) are parameter-free
    experts that the experts' own forward computes without a weight (longcat_flash's zero experts: the
    identity). They never travel: the rank that holds the token runs the own forward on them with their
    original id (all_reduce: rank 0 of the EP group does, the others mask them).

    Bound after `grouped_gemm` has sharded the experts, so `experts.num_experts` is the local count.
    The checks every strategy shares run here once: the batch sharing it needs, experts sharded by
    expert, and `strategy.inference_only` (a kernel without backward refuses a forward that needs
    gradients). Subclasses implement `forward`.
    """

    def __init__(self, experts_module: nn.Module, strategy: EPStrategy, groups: Groups) -> None:
        self.experts = experts_module
        self.strategy = strategy
        self.groups = groups
        self.ep_group, self.ep_rank, self.ep_size = groups.ep_group, groups.ep_rank, groups.ep_size
        self.experts_forward = experts_module.forward  # the experts' own forward, on local expert ids
        # a forward of the model's own is written for the model's top-k width: longcat_flash's squeezes the k dim
        # away, so one slot per row breaks it. Rows run top-1 (all_to_all) get a second, weight-0 copy of their
        # slot there (twice the experts' work on the receiving rank, for such models only).
        self.pad_top1 = not dispatches_experts_implementation(experts_module)
        local = getattr(experts_module, "num_experts", None)
        self.num_local_experts = int(local) if local is not None else int(cast(torch.Tensor, experts_module.gate_up_proj).shape[0])
        if strategy.needs_shared_batch and not groups.shares_batch:
            raise ApplyError(
                f"planc.runtime.ep: {type(self).__name__} on {module_path(experts_module)} needs every rank of the EP "
                f"group to hold the same batch (ep_size == tp_size), got ep_size={groups.ep_size}, "
                f"tp_size={groups.tp_size}. Use `ep_implementation: all_to_all`, or set ep_size = tp_size."
            )
        if not getattr(experts_module, "_is_expert_parallel", False) and groups.ep_size > 1:
            raise ApplyError(
                f"planc.runtime.ep: {module_path(experts_module)} is dispatched over {groups.ep_size} EP ranks but its "
                "tensors are not sharded by expert. Add `grouped_gemm` rules for its gate_up_proj/down_proj "
                "(and biases, scales) to ep_plan; they must come before the `ep_dispatch_experts` rule."
            )

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if self.strategy.inference_only and needs_grad(hidden_states):
            raise RuntimeError(
                f"planc.runtime.ep: the {self.strategy.name} EP implementation on {module_path(self.experts)} is "
                "inference only (the kernel has no backward): run under `torch.no_grad()` / "
                "`torch.inference_mode()`, or train with `experts.ep_implementation: all_to_all`"
            )
        return self.forward(hidden_states, top_k_index, top_k_weights)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        raise NotImplementedError

    def top1_forward(self, tokens: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """The experts' forward on rows of one (token, expert) slot each: ids and weights [N, 1]."""
        if self.pad_top1:
            expert_ids = torch.cat([expert_ids, expert_ids], dim=-1)
            weights = torch.cat([weights, torch.zeros_like(weights)], dim=-1)
        return empty_safe_forward(self.experts_forward, tokens, expert_ids, weights)


def install_ep_forward(module: nn.Module, runtime: EPRuntime) -> None:
    """Replace the experts forward with `runtime` (an instance attribute, undone by restoring `__dict__`)."""

    def ep_forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, **kwargs: Any) -> Tensor:
        hidden_states, top_k_weights = to_local(hidden_states), to_local(top_k_weights)
        # the experts' own tensors and the per-expert tensors of modules inside them (a per-expert norm)
        # the experts' data-parallel gradient rule (planc.runtime.data_parallel); None until a plan trains over dp
        with local_parameters(module, recurse=True, grad_scale=getattr(module, "_planc_grad_scale", None)):
            output = runtime(hidden_states, top_k_index, top_k_weights)
        return output.to(hidden_states.dtype)

    ep_forward.strategy = runtime.strategy  # type: ignore[attr-defined]  # function attributes: what runs, for explain
    ep_forward.runtime = runtime  # type: ignore[attr-defined]
    module.forward = ep_forward


def dispatches_experts_implementation(module: nn.Module) -> bool:
    """Whether the experts class is wrapped by transformers' `@use_experts_implementation` (its forward picks
    the kernel named by `config._experts_implementation`; the decorator gives the class `_apply_gate`).
    A class without it (longcat_flash: the model "does not support setting experts implementation") runs
    only its own forward, which promises nothing about ids beyond its local experts."""
    return callable(getattr(type(module), "_apply_gate", None))


def sentinel_safe(module: nn.Module) -> bool:
    """Whether the experts forward skips the off-rank sentinel id `num_experts`.

    transformers' experts kernels and the eager forwards of the classes they wrap skip it, except GPT-OSS
    eager, which one-hots ids with `num_classes=num_experts` ("Class values must be smaller than
    num_classes"). A forward of the model's own (a class transformers does not wrap) is not trusted with it.
    """
    if not dispatches_experts_implementation(module):
        return False
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return not (impl in (None, "eager") and type(module).__name__ == "GptOssExperts")


def empty_safe_forward(experts_forward: Callable[..., Tensor], tokens: Tensor, expert_ids: Tensor, weights: Tensor
                       ) -> Tensor:
    """Run the experts on rows that may be empty, keeping the empty result connected to autograd."""
    if tokens.shape[0]:
        return experts_forward(tokens, expert_ids, weights)
    k = expert_ids.shape[-1]
    out = experts_forward(tokens.sum(0, keepdim=True), expert_ids.new_zeros((1, k)), weights.new_ones((1, k)))
    return out[:0]


__all__ = ["EPRuntime", "install_ep_forward", "shard_expert_tensor", "sentinel_safe", "empty_safe_forward",
           "dispatches_experts_implementation"]
