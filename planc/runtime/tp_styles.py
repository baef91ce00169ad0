"""Tensor-parallel styles: one small object per plan style, on torch's public DTensor API.

Modelled on `torch/distributed/tensor/parallel/style.py`, but split the way a compiled plan is: a
style's `shard_param(module, name, mesh)` turns one parameter into a DTensor holding this rank's
slice (`src_data_rank=None`: every rank already holds the full, identical weight, so no
communication), and its `install(module, mesh)` wraps the module's forward with the layout changes
its neighbours expect. Forwards see plain local tensors at module boundaries, as transformers
models expect. Parameters stay DTensors (state dicts, checkpoints and `full_tensor()` see the real
layout), but the forwards compute on their local shards (`to_local()`, differentiable) with plain
collectives: no DTensor dispatch per call. The autograd collectives of `planc.runtime.collectives` make the
backward right (summed input gradients before a colwise, all-gathered gradients after a split).

Every forward this module installs is an instance attribute `module.forward` (the class forward is
untouched), so `planc.runtime.install` can undo it by restoring the module's `__dict__`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from planc.errors import ApplyError
from planc.spec.styles import STYLE, STYLES, Style
from planc.runtime.collectives import (
    all_gather_dim,
    all_reduce_grad,
    all_reduce_sum,
    needs_grad,
    shard_bounds,
    shard_sizes,
    split_dim,
    to_local,
)


def module_path(module: nn.Module) -> str:
    """The module's path in the model for error messages (set by the install steps), else its class name."""
    return getattr(module, "_planc_fqn", type(module).__name__)


def _as_dtensor_param(param: torch.Tensor, mesh: DeviceMesh, placement: Placement) -> nn.Parameter:
    local = param.detach()
    return nn.Parameter(
        distribute_tensor(local, mesh, [placement], src_data_rank=None), requires_grad=param.requires_grad
    )


def _shard_sizes(module: nn.Module, dim: int, fallback: int, mesh: DeviceMesh) -> list[int]:
    """Every rank's width of the weight's sharded `dim` (DTensor `Shard` splits torch.chunk-style)."""
    w = module._parameters.get("weight")
    size = w.shape[dim] if w is not None else fallback
    return shard_sizes(size, mesh.size())


def _is_plain(module: nn.Module, cls: type[nn.Module]) -> bool:
    """The module runs `cls`'s own forward (no subclass forward to honour): call the functional op directly."""
    return type(module).forward is cls.forward


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


@contextlib.contextmanager
def local_parameters(module: nn.Module, recurse: bool = False, grad_scale: Optional[float] = None) -> Iterator[None]:
    """Run the module's own forward on the local shards of its DTensor parameters (`recurse`: and of its
    submodules', such as a per-expert norm inside experts).

    Kernels (grouped_mm, experts loops, deep_gemm) take plain tensors. `to_local()` is differentiable,
    so the gradients still land on the DTensor parameters. `grad_scale`: those gradients are multiplied
    by it (identity forward; the experts' data-parallel rule, planc.runtime.data_parallel).
    """
    originals: list[tuple[nn.Module, dict[str, Any]]] = [  # the DTensor parameters of each module
        (m, {n: p for n, p in m._parameters.items() if isinstance(p, DTensor)})
        for m in (module.modules() if recurse else (module,))
    ]
    scale = grad_scale is not None and grad_scale != 1 and torch.is_grad_enabled()
    for m, params in originals:
        for name, p in params.items():
            local = p.to_local()
            m._parameters[name] = (_ScaleGrad.apply(local, grad_scale)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
                                  if scale and p.requires_grad else local)
    try:
        yield
    finally:
        for m, params in originals:
            m._parameters.update(params)


class TPStyle:
    """Base: no sharding, no forward change (the `replicate` style).

    How a parameter is split is not decided here: `shard_param` reads the style's row of
    `planc.spec.styles` (the table the compiler's byte accounting and layout pass read too).
    """

    name = "replicate"

    @property
    def spec(self) -> Style:
        return STYLE[self.name]

    def shard_param(self, module: nn.Module, name: str, mesh: DeviceMesh) -> None:
        """Replace `module._parameters[name]` with this rank's slice (a DTensor parameter), as the table says."""
        spec = self.spec
        if not spec.shards:
            return
        p = module._parameters[name]
        assert p is not None, f"{name} is a parameter of {type(module).__name__}"  # the compiler matched it
        dim = spec.placement(p.ndim)
        placement: Placement
        if dim is None:
            placement = Replicate()
        elif spec.packed:
            placement = _StridedShard(dim % p.ndim, split_factor=2)
        else:
            placement = Shard(dim % p.ndim)
        module._parameters[name] = _as_dtensor_param(p, mesh, placement)

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """Wrap `module.forward` with this style's input/output layouts."""

    def _wrap(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        original = module.forward

        def tp_forward(*args: Any, **kwargs: Any) -> Any:
            return forward(original, *args, **kwargs)

        tp_forward.planc_style = self.name  # type: ignore[attr-defined]  # a function attribute: which style wrapped it
        module.forward = tp_forward

    def _shard_own_params(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """Shard the module's direct parameters the plan did not list on their own (a module-only rule)."""
        for name, p in list(module._parameters.items()):
            if p is not None and not isinstance(p, DTensor):
                self.shard_param(module, name, mesh)

    def _require_linear(self, module: nn.Module, attr: str) -> None:
        if not hasattr(module, attr):
            raise ApplyError(
                f"planc.runtime.tp_styles: `{self.name}` on {module_path(module)} ({type(module).__name__}) needs a "
                f"linear layer (`{attr}`); put `{self.name}` on an nn.Linear, or `replicate` on this module."
            )

    def _prepare_linear(self, module: nn.Module, mesh: DeviceMesh, features: str,
                        dim: int) -> tuple[dist.ProcessGroup, list[int], bool]:
        """Check and shard a linear layer; return its TP group, every rank's width of weight dim `dim`
        (`features`, e.g. `out_features`, when it has no weight), and whether it is a plain nn.Linear."""
        self._require_linear(module, features)
        self._shard_own_params(module, mesh)
        return mesh.get_group(), _shard_sizes(module, dim, getattr(module, features), mesh), _is_plain(module, nn.Linear)


class Colwise(TPStyle):
    """Shard output features (weight dim -2, bias dim -1); input replicated; output sharded or gathered."""

    def __init__(self, gather_output: bool = False) -> None:
        self.gather_output = gather_output
        self.name = "colwise_gather_output" if gather_output else "colwise"

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        group, sizes, plain = self._prepare_linear(module, mesh, "out_features", -2)
        gather = self.gather_output

        def forward(original: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(x, DTensor):
                x = x.redistribute(mesh, [Replicate()]).to_local()
            x = all_reduce_grad(x, group)  # replicated input: each rank's gradient of it is partial
            if plain and not args and not kwargs:
                out = F.linear(x, to_local(module.weight), to_local(module.bias))
            else:
                with local_parameters(module):
                    out = original(x, *args, **kwargs)
            # this rank's slice of the output features; gathered: backward keeps this rank's slice
            return all_gather_dim(out, group, sizes) if gather else out

        self._wrap(module, forward)


class Rowwise(TPStyle):
    """Shard input features (weight dim -1, bias replicated); partial outputs all-reduced.

    `split_input`: the input arrives replicated and each rank keeps its slice (`rowwise_split_input`);
    otherwise it arrives already sharded on the last dim (after a `colwise`).
    """

    def __init__(self, split_input: bool = False) -> None:
        self.split_input = split_input
        self.name = "rowwise_split_input" if split_input else "rowwise"

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        group, sizes, plain = self._prepare_linear(module, mesh, "in_features", -1)
        split = self.split_input

        def forward(original: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(x, DTensor):
                x = x.redistribute(mesh, [Shard(x.ndim - 1)]).to_local()
            elif split:
                x = split_dim(x, group, sizes)  # backward all-gathers the input gradient
            bias = module._parameters.get("bias")
            if plain and not args and not kwargs:
                out = F.linear(x, to_local(module.weight))
            elif bias is None:
                with local_parameters(module):
                    out = original(x, *args, **kwargs)
            else:
                # A subclass forward may not add the bias last (`(x W^T + b) * s`): DTensor's Partial + Replicate
                # rules place the bias right, so such a module keeps the DTensor forward.
                shape = torch.Size((*x.shape[:-1], sum(sizes)))
                stride = torch.empty(shape, device="meta").stride()
                x = DTensor.from_local(x, mesh, [Shard(x.ndim - 1)], run_check=False, shape=shape, stride=stride)
                return original(x, *args, **kwargs).redistribute(mesh, [Replicate()]).to_local()
            out = all_reduce_sum(out, group)  # a fresh partial: reduced in place without autograd
            return out if bias is None else out + to_local(bias)

        self._wrap(module, forward)


class PackedColwise(TPStyle):
    """Colwise for fused gate|up weights: each half sharded, so rank r holds gate_r | up_r.

    2-D `[2I, H]` Linear weights and 3-D `[E, 2I, H]` experts weights (dim -2), biases on dim -1.
    The forward runs on local tensors (DTensor has no matmul rule for a strided shard); the
    replicated input's gradient is partial, so it is summed over the group in backward.
    """

    name = "packed_colwise"

    def shard_param(self, module: nn.Module, name: str, mesh: DeviceMesh) -> None:
        p = module._parameters[name]
        assert p is not None, f"{name} is a parameter of {type(module).__name__}"  # the compiler matched it
        if getattr(module, "is_transposed", False):
            raise ApplyError(
                f"planc.runtime.tp_styles: `packed_colwise` on {module_path(module)}.{name}: {type(module).__name__} stores "
                "its experts transposed ([E, H, 2I]); planc shards [E, 2I, H] layouts only. Use expert parallelism "
                "(`grouped_gemm` + `ep_dispatch_experts` in ep_plan) for these experts."
            )
        placed = self.spec.placement(p.ndim)
        assert placed is not None, "packed_colwise splits every parameter it holds (spec.styles)"
        dim = placed % p.ndim
        if getattr(module, "is_concatenated", True) is False:
            raise ApplyError(
                f"planc.runtime.tp_styles: `packed_colwise` on {module_path(module)}.{name}: gate and up are interleaved, "
                "not concatenated; shard these experts with expert parallelism instead."
            )
        if p.shape[dim] % (2 * mesh.size()):
            raise ApplyError(
                f"planc.runtime.tp_styles: `packed_colwise` on {module_path(module)}.{name}: dim {dim} of size "
                f"{p.shape[dim]} does not split into gate and up halves over {mesh.size()} ranks. "
                "Pick a tp_size that divides the intermediate size."
            )
        super().shard_param(module, name, mesh)

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self._require_linear(module, "out_features")
        self._shard_own_params(module, mesh)
        group = mesh.get_group()

        def forward(original: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            x = all_reduce_grad(to_local(x), group)
            with local_parameters(module):
                return original(x, *args, **kwargs)

        self._wrap(module, forward)


class EmbeddingRowwise(TPStyle):
    """Vocab-parallel embedding: rank r holds a slice of the vocabulary; partial lookups are summed."""

    name = "embedding_rowwise"

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        if not hasattr(module, "num_embeddings"):
            raise ApplyError(
                f"planc.runtime.tp_styles: `embedding_rowwise` on {module_path(module)} ({type(module).__name__}) needs "
                "an nn.Embedding; put it on the token embedding (`model.embed_tokens`)."
            )
        self._shard_own_params(module, mesh)

        group = mesh.get_group()
        rows = module._parameters["weight"]
        assert rows is not None, "an embedding holds its weight"  # checked by num_embeddings above
        start, length = shard_bounds(rows.shape[0], mesh.get_local_rank(), mesh.size())
        end = start + length
        plain = _is_plain(module, nn.Embedding) and getattr(module, "max_norm", None) is None
        embedding = cast(nn.Embedding, module)  # an nn.Embedding or a module with its attributes (checked above)

        def forward(original: Callable[..., Any], ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(ids, DTensor):
                ids = ids.full_tensor()
            outside = (ids < start) | (ids >= end)
            local_ids = (ids - start).masked_fill_(outside, 0)
            pad = getattr(module, "padding_idx", None)
            local_pad = pad - start if pad is not None and start <= pad < end else None
            weight = to_local(module.weight)
            if length == 0:  # this rank holds no rows (a tiny vocabulary over many ranks)
                out = weight.new_zeros((*ids.shape, weight.shape[-1]))
            elif plain and not args and not kwargs:
                out = F.embedding(local_ids, weight, local_pad, None, embedding.norm_type,
                                  embedding.scale_grad_by_freq, embedding.sparse)
            else:
                has_pad = hasattr(module, "padding_idx")
                if has_pad:
                    embedding.padding_idx = local_pad  # a global padding index means nothing on this rank's rows
                try:
                    with local_parameters(module):
                        out = original(local_ids, *args, **kwargs)
                finally:
                    if has_pad:
                        embedding.padding_idx = pad
            mask = outside.unsqueeze(-1)
            out = out.masked_fill(mask, 0) if needs_grad(out) else out.masked_fill_(mask, 0)
            return all_reduce_sum(out, group)  # exactly one rank holds each id's row

        self._wrap(module, forward)


class ReplicatedWithGradAllReduce(TPStyle):
    """Replicated parameters whose gradient each rank computes only in part (e.g. Qwen3's per-head q/k norms
    over this rank's heads): the forward reads each such parameter through `all_reduce_grad` (identity
    forward, gradient summed over the group backward). In autograd rather than a hook on the Parameter, so
    it holds whatever object holds the parameter at forward time (FSDP2 swaps in its own)."""

    name = "replicated_with_grad_allreduce"

    def read(self, param: torch.Tensor, group: Any) -> torch.Tensor:
        """What the forward reads in place of `param`: the identity, its gradient summed over `group`."""
        return all_reduce_grad(param, group)

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        group = mesh.get_group()

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            params = {n: p for n, p in module._parameters.items()
                      if p is not None and not isinstance(p, DTensor) and p.requires_grad}
            for n, p in params.items():
                module._parameters[n] = cast(nn.Parameter, self.read(p, group))  # a tensor for this forward
            try:
                return original(*args, **kwargs)
            finally:
                module._parameters.update(params)

        self._wrap(module, forward)


class MlaKvAProj(TPStyle):
    """MLA's `kv_a_proj_with_mqa` (DeepSeek-V2/V3 style attention), replicated: its output is
    [compressed kv | rope key]. The compressed part feeds `kv_b_proj` (colwise: its input gradient is summed
    over TP there); the rope key goes straight to this rank's heads, so its gradient is partial on each rank
    and is summed here in backward. Forward unchanged. The rope width is `qk_rope_head_dim` of the attention
    module holding it (set by the install step as `_planc_rope_dim`)."""

    name = "mla_kv_a_proj"

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        rope = getattr(module, "_planc_rope_dim", None)
        if not isinstance(rope, int) or rope < 0:
            raise ApplyError(
                f"planc.runtime.tp_styles: `mla_kv_a_proj` on {module_path(module)} needs the rope width "
                "(`qk_rope_head_dim` of its attention module or the model config); set `qk_rope_head_dim` in the config."
            )
        group = mesh.get_group()

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if not needs_grad(out) or rope == 0:  # NoPE attention (glm5_next): no rope slice
                return out
            kv, rot = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([kv, all_reduce_grad(rot, group)], dim=-1)

        self._wrap(module, forward)


class PackedRowwise(TPStyle):
    """Parameter-only: fused gate|up weights packed on the last dim (Llama 4's transposed experts
    `gate_up_proj [E, H, 2I]`): each half sharded, so rank r holds gate_r | up_r. The module that owns
    the parameter (`moe_tp_experts`) runs its forward on the local shards."""

    name = "packed_rowwise"

    def shard_param(self, module: nn.Module, name: str, mesh: DeviceMesh) -> None:
        p = module._parameters[name]
        assert p is not None, f"{name} is a parameter of {type(module).__name__}"  # the compiler matched it
        if p.ndim < 2:
            return  # a bias stays whole, as the styles table says (dims (-1, None))
        if p.shape[-1] % (2 * mesh.size()):
            raise ApplyError(
                f"planc.runtime.tp_styles: `packed_rowwise` on {module_path(module)}.{name}: the last dim of size "
                f"{p.shape[-1]} does not split into gate and up halves over {mesh.size()} ranks. Pick a tp_size "
                "that divides the intermediate size."
            )
        module._parameters[name] = _as_dtensor_param(p, mesh, _StridedShard(p.ndim - 1, split_factor=2))


def _reduce_input_grads(args: tuple[Any, ...], kwargs: dict[str, Any],
                        group: dist.ProcessGroup) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Every floating-point tensor input as a local tensor whose gradient is summed over the group in backward.

    A module that computes on its local shards gives each rank only part of the gradient of a replicated input.
    """
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return all_reduce_grad(to_local(x), group)
        return x

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


class LocalParams(TPStyle):
    """A module whose own bare parameters are sharded with its heads (attention sinks, per-head gate biases):
    its forward runs on their local shards. Its children (colwise q/k/v, rowwise o_proj) do the communication,
    so the module's output is already complete and is returned as is."""

    name = "local_params"

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            with local_parameters(module):
                return original(*args, **kwargs)

        self._wrap(module, forward)


class AllReduce(TPStyle):
    """A module that computes a partial sum on sharded bare parameters (shared experts stored as
    `[n, I, H]` tensors, sharded on I): its forward runs on the local shards and its output is all-reduced.
    The replicated inputs' gradients are summed in backward."""

    name = "all_reduce"

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        group = mesh.get_group()

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            args, kwargs = _reduce_input_grads(args, kwargs, group)
            with local_parameters(module):
                out = original(*args, **kwargs)
            if not isinstance(out, torch.Tensor):
                raise ApplyError(
                    f"planc.runtime.tp_styles: `all_reduce` on {module_path(module)} ({type(module).__name__}) needs a "
                    f"forward that returns one tensor, got {type(out).__name__}. Write `replicate` on this module."
                )
            return all_reduce_sum(out, group)

        self._wrap(module, forward)


class MoeIdentityExpert(TPStyle):
    """An identity ("zero") expert inside `moe_tp_experts` experts (longcat_flash): every rank returns the whole
    input, which the experts' all-reduce would count tp_size times, so the input is divided by tp_size first."""

    name = "moe_identity_expert"

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        size = mesh.size()

        def forward(original: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return original(x / size, *args, **kwargs)

        self._wrap(module, forward)


class MoeTPExperts(TPStyle):
    """Tensor-parallel experts (ep_size == 1): every rank holds a slice of every expert.

    Pair with `packed_colwise` on `gate_up_proj` and `rowwise` on `down_proj`. Each rank runs all
    experts on its slice of the intermediate dim, producing a partial output that is summed over
    the group; the replicated inputs (hidden states, routing weights) get partial gradients, which
    are summed in backward.
    """

    name = "moe_tp_experts"

    def install(self, module: nn.Module, mesh: DeviceMesh) -> None:
        where = module_path(module)
        for pname in ("gate_up_proj", "up_proj", "down_proj"):
            p = module._parameters.get(pname)
            if p is not None and not isinstance(p, DTensor):
                raise ApplyError(
                    f"planc.runtime.tp_styles: `moe_tp_experts` on {where} needs `{pname}` sharded, but the plan "
                    f"leaves it whole. Add `{where}.{pname}: "
                    f"{'rowwise' if pname == 'down_proj' else 'packed_colwise'}` to tp_plan."
                )
        if module._parameters.get("down_proj_bias") is not None:
            raise ApplyError(
                f"planc.runtime.tp_styles: `moe_tp_experts` on {where}: {type(module).__name__} has a down "
                "projection bias, which every rank would add once. Use expert parallelism for these experts."
            )
        group = mesh.get_group()

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            # hidden states and routing weights (or, for experts that see every token pre-scaled, the
            # hidden states alone): replicated inputs whose gradients are partial on each rank
            args, kwargs = _reduce_input_grads(args, kwargs, group)
            with local_parameters(module):
                out = original(*args, **kwargs)
            return all_reduce_sum(out, group)

        self._wrap(module, forward)


# The runtime registry, keyed by the table's names: every `runtime` TP row has exactly one object here
# (tests/runtime/test_styles_table.py checks both directions and each object's placements).
TP_RUNTIMES: dict[str, TPStyle] = {
    style.name: style
    for style in (
        Colwise(),
        Colwise(gather_output=True),
        Rowwise(),
        Rowwise(split_input=True),
        PackedColwise(),
        EmbeddingRowwise(),
        TPStyle(),
        ReplicatedWithGradAllReduce(),
        MlaKvAProj(),
        MoeTPExperts(),
        PackedRowwise(),
        LocalParams(),
        AllReduce(),
        MoeIdentityExpert(),
    )
}


def _check_registry() -> None:
    """Fail at import if the registry and the table drift apart (a row marked `runtime` with no object)."""
    want = {s.name for s in STYLES if s.runtime and s.section == "tp"}
    if set(TP_RUNTIMES) != want:
        raise ImportError(
            f"planc.runtime.tp_styles: runtime TP styles {sorted(set(TP_RUNTIMES) ^ want)} differ from "
            "planc.spec.styles.STYLES; add the object or fix the row's `runtime` flag"
        )


_check_registry()


def tp_style(name: str, where: Optional[str] = None) -> TPStyle:
    """The style object for a plan's style name; a name the runtime does not implement is an error."""
    try:
        return TP_RUNTIMES[name]
    except KeyError:
        raise ApplyError(
            f"planc.runtime.tp_styles: style `{name}`{f' at {where}' if where else ''} has no runtime "
            f"implementation; implemented: {', '.join(sorted(TP_RUNTIMES))}. Pick one of those, or `replicate`."
        ) from None


__all__ = ["TPStyle", "TP_RUNTIMES", "tp_style", "local_parameters", "module_path"]
