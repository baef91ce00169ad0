"""Where a sharded model first differs from its twin: by module in forward order, by parameter in backward order.

Forward: both models get a forward hook on every module; each call records the module's first tensor input and
first tensor output. A DTensor is gathered (`full_tensor()` under no_grad: every rank calls the same modules in the
same order, so the collectives line up); a rank-local shard is compared with the piece of the twin's tensor this
rank should hold (its coordinate on the tp or ep mesh; contiguous, or interleaved as packed projections are). The
worst error over the ranks decides. The culprit is the first module, in order of completion, whose input matches
the twin's and whose output does not: a child completes before its parent, so that is the innermost such module
(a norm over a sharded dimension, an attention reading a fused projection's rows in the wrong order).

Backward: every parameter's gradient, gathered to full, against the twin's, in backward order (modules in reverse
order of completion): the first over tolerance is named, with the module that owns it (a replicated parameter whose
gradient needs a reduction shows up here, its forward being exact).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from planc.verification.compare import rel_error

Key = tuple[str, int]  # (module path, call index)


def first_tensor(value: Any) -> Optional[torch.Tensor]:
    """The first tensor in a module's input or output (a tensor, a tuple/list, a dict or ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            t = first_tensor(v)
            if t is not None:
                return t
    if isinstance(value, dict):
        for v in value.values():
            t = first_tensor(v)
            if t is not None:
                return t
    return None


def _gathered(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(t, DTensor):
            t = t.full_tensor()
        return t.detach().clone()


class Recorder:
    """Records every module call's first input and output tensors, by (module path, call index)."""

    def __init__(self, model: torch.nn.Module, *, skip_root: bool = True) -> None:
        self.records: dict[Key, tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = {}
        self.order: list[Key] = []
        self._calls: dict[str, int] = {}
        self._handles = []
        for name, module in model.named_modules():
            if skip_root and not name:
                continue
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            index = self._calls.get(name, 0)
            self._calls[name] = index + 1
            inp = first_tensor(args)
            if inp is None:
                inp = first_tensor(kwargs.get("hidden_states")) if "hidden_states" in kwargs else first_tensor(kwargs)
            key = (name, index)
            self.records[key] = (_gathered(inp), _gathered(first_tensor(output)))
            self.order.append(key)
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _pieces(ref: torch.Tensor, local: torch.Tensor, coords: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The pieces of `ref` a rank holding `local` may hold: for a mesh coordinate (index, size) and the dim whose
    size is `size` times smaller, the contiguous chunk and the packed (2 or 3 parts, each chunked) one."""
    out: list[torch.Tensor] = []
    if ref.ndim != local.ndim:
        return out
    for index, size in coords:
        if size <= 1:
            continue
        for d in range(ref.ndim):
            if ref.shape[d] != local.shape[d] * size or any(
                    ref.shape[e] != local.shape[e] for e in range(ref.ndim) if e != d):
                continue
            out.append(ref.chunk(size, d)[index])
            for parts in (2, 3):
                if ref.shape[d] % (parts * size) == 0:
                    out.append(torch.cat([p.chunk(size, d)[index] for p in ref.chunk(parts, d)], d))
    return out


def tensor_error(got: Optional[torch.Tensor], want: Optional[torch.Tensor], coords: list[tuple[int, int]]) -> float:
    """Relative error of a recorded tensor against the twin's; -1 when they cannot be compared (no tensor, shapes
    that no shard of the twin's explains)."""
    if got is None or want is None:
        return -1.0
    if got.shape == want.shape:
        return rel_error(got, want)
    pieces = _pieces(want, got, coords)
    if not pieces:
        return -1.0
    return min(rel_error(got, p) for p in pieces)


def agree_max(values: list[float]) -> list[float]:
    """The elementwise max over every rank (each rank's list in the same order)."""
    if not values:
        return []
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def forward_culprit(got: Recorder, want: Recorder, coords: list[tuple[int, int]], tol: float
                    ) -> Optional[tuple[str, float]]:
    """(module path, output error) of the first module, in order of completion, whose input matches the twin's and
    whose output does not, agreed over every rank; None when every compared module matches."""
    keys = list(want.order)
    ins, outs = [], []
    for key in keys:
        g = got.records.get(key, (None, None))
        w = want.records[key]
        ins.append(tensor_error(g[0], w[0], coords))
        outs.append(tensor_error(g[1], w[1], coords))
    ins, outs = agree_max(ins), agree_max(outs)
    for key, i, o in zip(keys, ins, outs):
        if o > tol and i <= tol:
            return key[0], o
    for key, o in zip(keys, outs):  # no module with a matching input: the first one off at all
        if o > tol:
            return key[0], o
    return None


def backward_order(order: list[Key]) -> dict[str, int]:
    """Module path -> its position in backward order (the reverse of forward completion, last call counted)."""
    last: dict[str, int] = {}
    for i, (name, _) in enumerate(order):
        last[name] = i
    return {name: -i for name, i in last.items()}


def backward_culprit(errors: dict[str, float], order: dict[str, int], tol: float) -> Optional[tuple[str, float]]:
    """(parameter, error) of the first parameter over `tol` in backward order (`errors` agreed over the ranks)."""
    def position(param: str) -> tuple[int, int]:
        owner = param.rpartition(".")[0]
        while owner and owner not in order:
            owner = owner.rpartition(".")[0]
        return order.get(owner, 1), 0

    bad = [(position(p), i, p) for i, (p, e) in enumerate(errors.items()) if e > tol]
    if not bad:
        return None
    name = min(bad)[2]
    return name, errors[name]
