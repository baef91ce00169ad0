"""A model walk as JSON data, and back: what `planc explain` reads from the model, without the model.

Building a full-size model on `meta` costs seconds of torch and transformers imports; the compiler and the memory
model read only the walk (planc.compiler.walk) and the model's config. `walk_to_data` writes both as plain JSON (never
pickle: a cached walk is data, nothing in it runs) and `walk_from_data` reads them back into a ModelWalk the compiler
cannot tell from the live one: the same modules, parameters, generic index and experts, and a `ConfigSnapshot` that
answers what the compiler asks a transformers config (attributes, the class's plans and sub-configs,
`get_text_config()`, `to_dict()`). planc.models.walk_cache decides when a stored walk may stand in for the live one.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Optional

from planc.compiler.walk import ExpertsInfo, ModelWalk, ParamInfo, WalkIndex
from planc.errors import PlancError

# Bumped whenever the data below changes meaning; a stored walk of another format is never read.
WALK_FORMAT = 1


class Unencodable(PlancError):
    """A value JSON cannot hold exactly (an object, a NaN): the walk is not stored, the live one is used. Never
    reaches a user: planc.models.walk_cache turns it into a miss."""


def encode(value: Any) -> Any:
    """`value` as JSON that `decode` turns back into an equal value of the same types: tuples, sets and dicts with
    keys other than strings are tagged (`{"__tuple__": [...]}`); anything else raises Unencodable."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if not math.isfinite(value):
            raise Unencodable(repr(value))
        return value
    if kind is list:
        return [encode(v) for v in value]
    if kind is tuple:
        return {"__tuple__": [encode(v) for v in value]}
    if kind in (set, frozenset):
        return {f"__{kind.__name__}__": [encode(v) for v in sorted(value, key=repr)]}
    if kind is dict:
        if all(type(k) is str and not k.startswith("__") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
    raise Unencodable(f"a {kind.__name__}")


def decode(data: Any) -> Any:
    """The inverse of `encode`."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, items), = data.items()
        if tag == "__tuple__":
            return tuple(decode(v) for v in items)
        if tag == "__set__":
            return {decode(v) for v in items}
        if tag == "__frozenset__":
            return frozenset(decode(v) for v in items)
        if tag == "__items__":
            return {decode(k): decode(v) for k, v in items}
    return {k: decode(v) for k, v in data.items()}


class ConfigSnapshot:
    """A transformers config read back from data. Each snapshot's class is made per config class, named like it and
    holding its class-level data (`base_model_tp_plan`, `sub_configs`), so `type(config).X` reads as on the real
    config; the instance holds every attribute value the real one gave, sub-configs as snapshots."""

    def get_text_config(self) -> Any:
        node: Any = self
        for name in self.__dict__["_planc_text_path"]:
            node = getattr(node, name)
        return node

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = decode(self.__dict__["_planc_to_dict"])
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__} (snapshot)"


def _is_config(value: Any) -> bool:
    return callable(getattr(value, "to_dict", None)) and callable(getattr(value, "get_text_config", None))


def config_to_data(config: Any, depth: int = 0) -> dict[str, Any]:
    """What the compiler may read from a transformers config, as JSON: every attribute (dir() and `attribute_map`
    aliases) whose value encodes, the class's own data, the sub-configs, which one `get_text_config()` returns, and
    `to_dict()`. Unencodable when an attribute read raises something other than AttributeError (a read the snapshot
    could not repeat) or `to_dict()` does not encode. transformers' deprecation notices for the old names read here
    are silenced (the live run never reads them)."""
    cls = type(config)
    subs = [n for n in (getattr(cls, "sub_configs", None) or {}) if isinstance(n, str)]
    names = sorted({n for n in dir(config) if not n.startswith("__")} | set(getattr(cls, "attribute_map", None) or {}))
    values: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in names:
                try:
                    value = getattr(config, name)
                except AttributeError:
                    continue
                except Exception as e:  # noqa: BLE001 - the snapshot cannot raise what this raised
                    raise Unencodable(f"{cls.__name__}.{name} raises {type(e).__name__}") from None
                if name in subs and _is_config(value):
                    if depth > 3:
                        raise Unencodable("sub-configs nested too deep")
                    nested[name] = config_to_data(value, depth + 1)
                    continue
                if callable(value):
                    continue
                try:
                    values[name] = encode(value)
                except Unencodable:
                    continue  # an object (a dtype, a per-layer view): not data the compiler reads
            class_values = {}
            for name in dir(cls):
                raw = getattr(cls, name, None)
                if name.startswith("__") or name == "sub_configs" or callable(raw) or isinstance(raw, property):
                    continue
                try:
                    class_values[name] = encode(raw)
                except Unencodable:
                    continue
            text = config.get_text_config()
            to_dict = encode(config.to_dict())
    finally:
        logger.setLevel(level)
    return {
        "class": cls.__name__,
        "class_values": class_values,
        "values": values,
        "sub_configs": subs,
        "nested": nested,
        "text_path": _path_to(config, text),
        "to_dict": to_dict,
    }


def _path_to(config: Any, target: Any, depth: int = 0) -> list[str]:
    """The attribute names from `config` to `target` (its `get_text_config()`) through sub-configs."""
    if target is config:
        return []
    if depth <= 3:
        for name in getattr(type(config), "sub_configs", None) or {}:
            sub = getattr(config, name, None)
            if sub is not None and _is_config(sub):
                try:
                    return [name, *_path_to(sub, target, depth + 1)]
                except Unencodable:
                    continue
    raise Unencodable("get_text_config() returns a config outside the sub-configs")


def config_from_data(data: dict[str, Any]) -> ConfigSnapshot:
    """The snapshot `config_to_data` wrote; ValueError for names it never writes (a class name that is not an
    identifier, a dunder or internal attribute), which would reach Python's own machinery."""
    names = [*data["class_values"], *data["values"], *data["nested"], *data["sub_configs"]]
    if not str(data["class"]).isidentifier() or any(not isinstance(n, str) or n.startswith(("__", "_planc_"))
                                                     for n in names):
        raise ValueError("a config snapshot with a name config_to_data never writes")
    nested = {name: config_from_data(sub) for name, sub in data["nested"].items()}
    namespace = {name: decode(v) for name, v in data["class_values"].items()}
    namespace["sub_configs"] = {name: type(nested[name]) if name in nested else None for name in data["sub_configs"]}
    cls = type(data["class"], (ConfigSnapshot,), namespace)
    snapshot: ConfigSnapshot = cls()
    snapshot.__dict__.update({name: decode(v) for name, v in data["values"].items()})
    snapshot.__dict__.update(nested)
    snapshot.__dict__["_planc_text_path"] = list(data["text_path"])
    snapshot.__dict__["_planc_to_dict"] = data["to_dict"]
    return snapshot


def walk_to_data(walk: ModelWalk) -> dict[str, Any]:
    """`walk` as JSON data (Unencodable when its config cannot be); tied parameters share a tensor number."""
    tensors: dict[int, int] = {}
    modules = []
    for m in walk.modules.values():
        params = []
        for fqn in m.params:
            p = walk.params[fqn]
            params.append([p.name, list(p.shape), p.numel, p.nbytes, p.dtype, tensors.setdefault(p.tensor_id, len(tensors))])
        experts = None
        if m.experts is not None:
            e = m.experts
            experts = [e.num_experts, e.has_gate, e.is_transposed, e.hidden_size, e.intermediate_size, e.is_fp4, e.top_k,
                       e.dispatch]
        modules.append([m.fqn, m.class_name, params, experts, list(m.head_dims) if m.head_dims is not None else None])
    return {
        "format": WALK_FORMAT,
        "model_class": walk.model_class,
        "model_type": walk.model_type,
        "can_switch_experts": walk.can_switch_experts,
        "config": config_to_data(walk.config) if walk.config is not None else None,
        "modules": modules,
    }


def walk_from_data(data: dict[str, Any]) -> ModelWalk:
    """The ModelWalk `walk_to_data` wrote (same module order, generic index, experts; the config as a snapshot)."""
    if data.get("format") != WALK_FORMAT:
        raise ValueError(f"a model walk of format {data.get('format')!r}, this planc reads format {WALK_FORMAT}")
    config = config_from_data(data["config"]) if data["config"] is not None else None
    walk = ModelWalk(model_class=data["model_class"], model_type=data["model_type"], config=config,
                     can_switch_experts=data["can_switch_experts"])
    index = WalkIndex(walk)
    for mname, class_name, params, experts, head_dims in data["modules"]:
        own: dict[str, ParamInfo] = {}
        for pname, shape, numel, nbytes, dtype, tensor in params:
            fqn = f"{mname}.{pname}" if mname else pname
            own[fqn] = ParamInfo(fqn, mname, pname, tuple(shape), numel, nbytes, dtype, tensor)
        info: Optional[ExpertsInfo] = ExpertsInfo(*experts) if experts is not None else None
        index.add(mname, class_name, own, info, tuple(head_dims) if head_dims is not None else None)
    return walk

