"""A read-only, duck-typed snapshot of a model's module tree for the compiler.

The compiler must not import torch (the linter and `planc explain` stay light, and the layering rule
keeps the runtime the only torch user), so the model is read through the few methods every
`nn.Module` has: `named_modules()`, `named_parameters(recurse=False)`, `p.shape`, `p.numel()`,
`p.element_size()`, `p.dtype`, and `model.config`. Nothing is written to the model.

Paths are also indexed by their *generic* form (numeric segments -> `*`, as transformers'
`replace_layer_number_by_wildcard`), so a plan rule is matched against a few dozen generic paths
instead of thousands of concrete ones.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Optional, Union

_NUMERIC = re.compile(r"^\d+$")


def generic_path(fqn: str) -> str:
    """`model.layers.3.mlp` -> `model.layers.*.mlp` (only whole numeric segments: ModuleList indices)."""
    return ".".join("*" if _NUMERIC.match(s) else s for s in fqn.split("."))


class ParamInfo(NamedTuple):  # NamedTuple: thousands per walk, 3x cheaper to build than a frozen dataclass
    fqn: str
    owner: str  # fqn of the module that holds it directly
    name: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    dtype: str
    tensor_id: int  # identity of the tensor, to find tied parameters (never stored in the CompiledPlan)


# How an experts module's forward takes its tokens (see ExpertsInfo.dispatch).
Dispatch = Literal["routed", "dense"]


@dataclass(frozen=True)
class ExpertsInfo:
    """An experts module under transformers' experts contract."""

    num_experts: int
    has_gate: bool
    is_transposed: bool
    hidden_size: Optional[int]
    intermediate_size: Optional[int]
    is_fp4: bool
    top_k: Optional[int]
    # "routed": forward(hidden_states, top_k_index, top_k_weights), transformers' contract. "dense": forward(hidden_states)
    # on every token pre-scaled by its router score, each expert on all tokens (Llama 4): TP only, no EP dispatch.
    dispatch: Dispatch = "routed"


class ModuleInfo(NamedTuple):
    fqn: str
    class_name: str
    params: tuple[str, ...]  # fqns of its direct parameters, in registration order
    experts: Optional[ExpertsInfo] = None
    generic: str = ""  # `model.layers.*.mlp`
    # (head_dim, v_head_dim) read from the module itself (attention modules): per-layer configs (gemma4)
    # have no single global head_dim, and MLA attention has a v_head_dim of its own.
    head_dims: Optional[tuple[Optional[int], Optional[int]]] = None


@dataclass
class ModelWalk:
    """Every module and parameter of a model, in `named_modules()` order, plus generic-path indexes."""

    model_class: str
    model_type: Optional[str]
    config: Any
    # transformers' `_can_set_experts_implementation()` of the model class; None when the model has no such method
    can_switch_experts: Optional[bool] = None
    modules: dict[str, ModuleInfo] = field(default_factory=dict)
    params: dict[str, ParamInfo] = field(default_factory=dict)
    # generic path -> concrete fqns (modules and parameters share one namespace)
    by_generic: dict[str, list[str]] = field(default_factory=dict)

    @property
    def experts(self) -> list[ModuleInfo]:
        return [m for m in self.modules.values() if m.experts is not None]


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(p: Any) -> str:
    dtype = getattr(p, "dtype", "unknown")
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _nbytes(p: Any) -> int:
    numel = int(p.numel())
    size = getattr(p, "element_size", None)
    if callable(size):
        return numel * int(size())
    return numel * int(getattr(getattr(p, "dtype", None), "itemsize", 4))


_CONTRACT_CACHE: dict[type, Union[Dispatch, Literal[False]]] = {}


def _has_experts_forward(module: Any) -> Union[Dispatch, Literal[False]]:
    """"routed" for `forward(hidden_states, top_k_index, top_k_weights)` (three positional inputs after self;
    gpt_oss names the last two `router_indices`/`routing_weights`, so their names are not checked), "dense" for
    `forward(hidden_states)` alone, else False.
    """
    cls = type(module)
    cached = _CONTRACT_CACHE.get(cls)
    if cached is not None:
        return cached
    hit: Union[Dispatch, Literal[False]] = False
    fwd = getattr(cls, "forward", None)
    try:
        sig = inspect.signature(fwd) if fwd is not None else None
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        names = [
            n for n, p in sig.parameters.items() if n != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if names and names[0] == "hidden_states":
            hit = "routed" if len(names) >= 3 else ("dense" if len(names) == 1 else False)
    _CONTRACT_CACHE[cls] = hit
    return hit


def config_attr(config: Any, name: str) -> Any:
    """getattr that tolerates per-layer configs, which raise for a global attribute (gemma4)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - such configs raise their own error type
        return None


def _config_int(config: Any, *names: str) -> Optional[int]:
    for n in names:
        v = config_attr(config, n)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _experts_info(module: Any, own: dict[str, ParamInfo], config: Any) -> Optional[ExpertsInfo]:
    local = {p.name: p for p in own.values()}
    if "down_proj" not in local or not ("gate_up_proj" in local or "up_proj" in local):
        return None
    dispatch = _has_experts_forward(module)
    if not dispatch:
        return None
    first = local.get("gate_up_proj") or local["up_proj"]
    down = local["down_proj"]
    if len(first.shape) != 3 or len(down.shape) != 3:
        return None  # per-expert tensors are [E, out, in]
    has_gate = bool(getattr(module, "has_gate", "gate_up_proj" in local))
    is_transposed = bool(getattr(module, "is_transposed", False)) or (
        dispatch == "dense" and first.shape[1] == down.shape[2]  # [E, H, 2I] and [E, I, H]
    )
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int):
        # the experts with weights: each needs a row of every projection. A tensor allocated with more rows
        # (longcat_flash's gate_up_proj also counts its parameter-free "zero" experts, which its forward runs as
        # identities without reading a weight) holds rows the forward never reads.
        num_experts = min(first.shape[0], down.shape[0])
    # down_proj is [E, H, I], or [E, I, H] when transposed (gpt_oss)
    hidden, inter = (down.shape[2], down.shape[1]) if is_transposed else (down.shape[1], down.shape[2])
    if first.dtype in ("int8", "uint8"):
        inter = inter * 2  # FP4 packs two values per byte along the reduction dim
    return ExpertsInfo(
        num_experts=num_experts,
        has_gate=has_gate,
        is_transposed=is_transposed,
        hidden_size=hidden,
        intermediate_size=inter,
        is_fp4=first.dtype == "int8",
        top_k=_config_int(config, "num_experts_per_tok", "top_k", "moe_topk"),
        dispatch=dispatch,
    )


def _head_dims(module: Any) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(head_dim, v_head_dim) of an attention module (one with a q_proj or q_b_proj child), from the module."""
    children = getattr(module, "_modules", None)
    if not isinstance(children, dict) or not ({"q_proj", "q_b_proj", "o_proj"} & set(children)):
        return None
    hd = getattr(module, "head_dim", None)
    vd = getattr(module, "v_head_dim", None)
    hd = hd if isinstance(hd, int) and not isinstance(hd, bool) and hd > 0 else None
    vd = vd if isinstance(vd, int) and not isinstance(vd, bool) and vd > 0 else None
    return (hd, vd) if hd or vd else None


def can_switch_experts(model_class: Any) -> Optional[bool]:
    """transformers' `_can_set_experts_implementation()` of a model class: whether its experts class takes the
    kernels (`grouped_mm`, Mega MoE) or runs only its own forward. None when the class has no such method."""
    can = getattr(model_class, "_can_set_experts_implementation", None)
    if not callable(can):
        return None
    try:
        return bool(can())
    except Exception:  # noqa: BLE001 - transformers' own heuristic failed: it cannot switch either
        return False


def walk_model(model: Any) -> ModelWalk:
    """Snapshot `model` (an nn.Module or anything with the methods listed above); reads only."""
    if not all(callable(getattr(model, m, None)) for m in ("named_modules", "named_parameters")):
        raise TypeError(
            f"planc.compile(model, plan): model must be a torch.nn.Module (anything with named_modules() and "
            f"named_parameters()), got {type(model).__name__}; build it first, e.g. "
            "AutoModelForCausalLM.from_config(config)"
        )
    config = getattr(model, "config", None)
    walk = ModelWalk(
        model_class=type(model).__name__,
        model_type=getattr(config, "model_type", None),
        config=config,
        can_switch_experts=can_switch_experts(type(model)),
    )
    index = WalkIndex(walk)
    for mname, module in model.named_modules():
        own: dict[str, ParamInfo] = {}
        # `_parameters` is nn.Module's own dict (no generator, no memo): 3x faster than
        # named_parameters(recurse=False) on a 1500-module model; other objects use the public method.
        raw = getattr(module, "_parameters", None)
        items = raw.items() if isinstance(raw, dict) else module.named_parameters(recurse=False)
        for pname, p in items:
            if p is None:
                continue
            fqn = f"{mname}.{pname}" if mname else pname
            own[fqn] = ParamInfo(
                fqn=fqn,
                owner=mname,
                name=pname,
                shape=tuple(p.shape),
                numel=int(p.numel()),
                nbytes=_nbytes(p),
                dtype=_dtype_name(p),
                tensor_id=id(p),
            )
        experts = _experts_info(module, own, config) if own else None
        index.add(mname, type(module).__name__, own, experts, _head_dims(module))
    return walk


class WalkIndex:
    """Adds modules to a ModelWalk in `named_modules()` order with their generic paths: the one indexing of the live
    walk and of a walk read back from data (planc.compiler.walk_data)."""

    def __init__(self, walk: ModelWalk):
        self.walk = walk
        self.generic_of: dict[str, str] = {"": ""}  # parents come before children in named_modules()

    def add(self, mname: str, class_name: str, own: dict[str, ParamInfo], experts: Optional[ExpertsInfo],
            head_dims: Optional[tuple[Optional[int], Optional[int]]]) -> None:
        walk, by_generic = self.walk, self.walk.by_generic
        parent, _, leaf = mname.rpartition(".")
        pgen = self.generic_of.get(parent)
        if pgen is None:
            mgen = generic_path(mname)
        else:
            leaf = "*" if leaf.isdigit() else leaf
            mgen = f"{pgen}.{leaf}" if pgen else leaf
        self.generic_of[mname] = mgen
        walk.modules[mname] = ModuleInfo(mname, class_name, tuple(own), experts, mgen, head_dims)
        if mname:
            by_generic.setdefault(mgen, []).append(mname)
        for fqn, info in own.items():
            walk.params[fqn] = info
            pname = "*" if info.name.isdigit() else info.name
            by_generic.setdefault(f"{mgen}.{pname}" if mgen else pname, []).append(fqn)
