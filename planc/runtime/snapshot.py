"""The one rollback path: a snapshot of everything an install may change, restored bit for bit.

`planc.apply` takes one over the whole model before its install steps; `install_megamoe_forward`,
called on its own, takes one over the experts module. Both undo through `Snapshot.restore`.
"""

from __future__ import annotations

from typing import Any

from torch import nn


_CONTAINERS = (dict, list, set)


def _copy_attrs(obj: object) -> dict[str, tuple[Any, Any]]:
    """`obj.__dict__` with a copy of the contents of each container (params, buffers, hooks), one level deep.

    The containers themselves are kept too: a hook handle taken before `apply` holds a weak reference
    to the very `_forward_hooks` dict, so restore must refill that object, not install a copy.
    """
    out: dict[str, tuple[Any, Any]] = {}
    for k, v in obj.__dict__.items():
        out[k] = (v, type(v)(v)) if isinstance(v, _CONTAINERS) else (v, None)
    return out


def _restore_attrs(obj: object, attrs: dict[str, tuple[Any, Any]]) -> None:
    """Put back every attribute as the same object, with the contents each container had."""
    obj.__dict__.clear()
    for k, (v, contents) in attrs.items():
        if contents is not None:
            if isinstance(v, list):
                v[:] = contents
            else:
                v.clear()
                v.update(contents)
        obj.__dict__[k] = v


def _configs(model: nn.Module) -> list[Any]:
    seen: set[int] = set()
    out: list[Any] = []
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        c = stack.pop()
        if c is None or id(c) in seen or not hasattr(c, "to_dict"):
            continue
        seen.add(id(c))
        out.append(c)
        stack.extend(v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    return out


class Snapshot:
    """Everything an install may change, restorable exactly: every module's attributes (parameters,
    buffers, submodules, hooks, forwards), every config's attributes, and each tensor's own Python
    attributes and `requires_grad` (the steps never write tensor data in place), and each module's class
    (FSDP2 and `replicate` swap it for a subclass)."""

    def __init__(self, model: nn.Module):
        self.modules = [(m, _copy_attrs(m)) for m in model.modules()]
        self.classes = [(m, type(m)) for m in model.modules()]
        self.configs = [(c, _copy_attrs(c)) for c in _configs(model)]
        tensors = {id(t): t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values())}
        self.tensors = [(t, dict(t.__dict__), t.requires_grad) for t in tensors.values() if t is not None]

    def restore(self) -> None:
        for m, cls in self.classes:
            if type(m) is not cls:
                m.__class__ = cls
        for obj, attrs in (*self.modules, *self.configs):
            _restore_attrs(obj, attrs)
        for t, attrs, requires_grad in self.tensors:
            t.__dict__.clear()
            t.__dict__.update(attrs)
            if t.requires_grad != requires_grad:
                t.requires_grad_(requires_grad)
