"""`planc.export(model, directory)`: consolidated safetensors in the hub layout, streamed tensor group by group.

The applied model's state is in transformers' in-memory layout (Mixtral's fused `gate_up_proj`); the
hub layout (per-expert `w1`/`w3`) comes from transformers' own `revert_weight_conversion`, the inverse
of the conversion `from_pretrained` applies, so every family transformers can load is written the way
it expects to read it. No rank ever holds the whole model:

1. Plan on `meta`: the reverse conversion runs on meta tensors of every global shape, group by group
   (a group: one decoder layer's tensors, or one top-level tensor), which gives every hub tensor's
   name, shape and dtype, hence the shard files, their headers and the index, before any data moves.
2. Stream: for each group, every rank takes part in gathering its tensors (`DTensor.full_tensor()`, one
   group at a time); rank 0 converts the group and writes each resulting tensor at its planned offset
   in its shard file (`_ShardWriter`). Every rank holds at most one group's full tensors.
3. `config.json` (with `dtype` and `architectures` as `save_pretrained` writes them),
   `generation_config.json`, and `model.safetensors.index.json` when there are several files.

Tied weights are written once (the key transformers re-ties on load); `_keys_to_ignore_on_save` are
left out; non-persistent buffers are not written (from_pretrained recomputes them). The directory is
written beside the target and renamed into place on success (`atomic.py`).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
import os
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable, Optional, Union, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from planc.checkpoint.applied import applied_plan
from planc.checkpoint.atomic import agree, atomic_directory
from planc.checkpoint.state import (
    ep_buffer_dtensor,
    expert_sharded_buffers,
    refuse_unsavable,
)
from planc.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from planc.compiler.compiled import CompiledPlan
    from planc.runtime.mesh import Groups

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_EXPORT_FILES = {"config.json", "generation_config.json", SINGLE_FILE, INDEX_FILE}
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def is_export_dir(path: Path) -> bool:
    """A directory holding only what planc.export (or save_pretrained) writes: safe to replace."""
    return all(p.name in _EXPORT_FILES or _SHARD_NAME.fullmatch(p.name) for p in path.iterdir())


def _export_state(model: nn.Module, compiled: CompiledPlan, groups: Groups) -> dict[str, torch.Tensor]:
    """key -> tensor (DTensor or plain) of everything the hub checkpoint holds, tied weights once."""
    live = model.state_dict(keep_vars=True)
    for fqn, (module, name) in expert_sharded_buffers(model, compiled, groups).items():
        live[fqn] = ep_buffer_dtensor(module._buffers[name], groups)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        live.pop(key, None)
    # Tied weights: one tensor object under several keys. Keep the source transformers ties the others to
    # (`all_tied_weights_keys` maps target -> source), as remove_tied_weights_from_state_dict does; that
    # helper finds ties by storage pointer, which a DTensor shard does not share with its tied twin's key.
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    by_id: dict[int, list[str]] = {}
    for key, t in live.items():
        by_id.setdefault(id(t), []).append(key)
    for keys in by_id.values():
        if len(keys) > 1:
            keep = [k for k in keys if k not in tied_targets] or keys[:1]
            for k in keys:
                if k != keep[0]:
                    del live[k]
    return {k: (t.detach() if isinstance(t, torch.Tensor) else t) for k, t in live.items()}


def _group_keys(keys: Iterable[str]) -> list[list[str]]:
    """Keys grouped by decoder layer (a reverse conversion may need several tensors of one layer), in order."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        m = _LAYER.match(key)
        groups.setdefault(m.group(1) if m else key, []).append(key)
    return list(groups.values())


def _revert(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    reverted: dict[str, torch.Tensor] = revert_weight_conversion(cast("PreTrainedModel", model), tensors)
    return reverted


@dataclass
class _Layout:
    """The hub tensors of every group and the shard file of every hub tensor, planned on meta."""

    files: list[str]
    file_of: dict[str, int]
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    remaining: list[set[str]] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)

    @property
    def total_size(self) -> int:
        return sum(torch.Size(s).numel() * d.itemsize for s, d in self.meta.values())


def _plan(model: nn.Module, state: dict[str, torch.Tensor], key_groups: list[list[str]], max_shard_size: int) -> _Layout:
    order, meta = [], {}
    for keys in key_groups:
        fake = {k: torch.empty(state[k].shape, dtype=state[k].dtype, device="meta") for k in keys}
        for name, t in _revert(model, fake).items():
            if name in meta:
                raise CheckpointError(
                    f"planc.export: two tensor groups both convert to the hub key {name}; transformers' reverse "
                    "conversion for this model mixes decoder layers, which planc.export does not stream yet."
                )
            meta[name] = (tuple(t.shape), t.dtype)
            order.append(name)
    file_index, size, assignment = 0, 0, {}
    for name in order:
        shape, dtype = meta[name]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if size and size + nbytes > max_shard_size:
            file_index, size = file_index + 1, 0
        assignment[name] = file_index
        size += nbytes
    count = file_index + 1
    files = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    remaining: list[set[str]] = [set() for _ in files]
    for name, i in assignment.items():
        remaining[i].add(name)
    return _Layout(files, assignment, meta, remaining)


# The safetensors format's dtype names (https://github.com/huggingface/safetensors, "Format").
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class _ShardWriter:
    """Rank 0: writes each converted tensor straight into its shard file, at the offset the layout planned.

    Written by hand because safetensors' own writers (`save_file`, `save`) take a complete dict: the
    header, with every tensor's offsets, comes first, so they would need a whole file's tensors in memory
    at once (the whole model, for a model that fits one file). The layout already knows every name,
    shape and dtype, so the header is written first and each tensor's bytes as it arrives; the format is
    an 8-byte little-endian header length, the JSON header (padded with spaces to 8 bytes), then the data.
    `from_pretrained` and `safe_open` read the files back in the tests.
    """

    def __init__(self, directory: Path, layout: _Layout):
        self.directory, self.layout = directory, layout
        self.offsets: dict[str, tuple[int, int]] = {}
        self.data_start: list[int] = []
        self.current: Optional[tuple[int, BinaryIO]] = None  # (file index, open file)
        for names in self._names_by_file():
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            pos = 0
            for name in names:
                shape, dtype = layout.meta[name]
                if dtype not in _ST_DTYPES:
                    raise CheckpointError(
                        f"planc.export: {name} is {dtype}, which the safetensors format has no name for here; "
                        "cast the model to a supported dtype (bf16, fp16, fp32, fp8, int8) first."
                    )
                nbytes = torch.Size(shape).numel() * dtype.itemsize
                header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
                self.offsets[name] = (pos, nbytes)
                pos += nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            self.data_start.append(8 + len(text))
            layout.headers.append(len(text).to_bytes(8, "little") + text)

    def _names_by_file(self) -> list[list[str]]:
        names: list[list[str]] = [[] for _ in self.layout.files]
        for name, i in self.layout.file_of.items():  # planned order
            names[i].append(name)
        return names

    def _file(self, i: int) -> BinaryIO:
        if self.current is not None and self.current[0] == i:
            return self.current[1]
        if self.current is not None:
            self.current[1].close()
        f = open(self.directory / self.layout.files[i], "wb")
        f.write(self.layout.headers[i])
        self.current = (i, f)
        return f

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            planned = self.layout.meta.get(name)
            if planned is None or planned != (tuple(t.shape), t.dtype):
                raise CheckpointError(
                    f"planc.export: the reverse conversion gave {name} {tuple(t.shape)} {t.dtype}, planned "
                    f"{planned}; the model changed during export?"
                )
            i = self.layout.file_of[name]
            offset, nbytes = self.offsets[name]
            f = self._file(i)
            f.seek(self.data_start[i] + offset)
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(data.numpy().data if nbytes else b"")  # a memoryview: no copy of the bytes
            self.layout.remaining[i].discard(name)

    def finish(self) -> None:
        if self.current is not None:
            self.current[1].close()
            self.current = None
        unwritten = [self.layout.files[i] for i, r in enumerate(self.layout.remaining) if r]
        if unwritten:
            raise CheckpointError(f"planc.export: shard files {unwritten} never received all their tensors.")
        if len(self.layout.files) > 1:
            index = {
                "metadata": {"total_size": self.layout.total_size},
                "weight_map": {n: self.layout.files[i] for n, i in sorted(self.layout.file_of.items())},
            }
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _full(t: torch.Tensor) -> torch.Tensor:
    """The global tensor (a collective for a DTensor: every rank of its mesh must call it). One-byte float dtypes
    (FP8 weights kept by `planc.load(..., dequantize=False)`) travel as their uint8 bits: gloo has no float8 type."""
    if not isinstance(t, DTensor):
        return t
    if t.dtype.is_floating_point and t.element_size() == 1:
        local = t.to_local().view(torch.uint8)
        bits = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
        return bits.full_tensor().view(t.dtype)
    return t.full_tensor()


def _write_configs(model: nn.Module, directory: Path) -> None:
    """config.json as save_pretrained writes it (dtype, architectures), on a copy: the model's own is untouched."""
    config = getattr(model, "config", None)
    if config is not None:
        config = copy.deepcopy(config)
        dtype = next((p.dtype for p in model.parameters()), None)
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")
        config.architectures = [type(model).__name__]
        config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)()
    if generation is not None and can_generate:
        generation.save_pretrained(directory)


def _max_shard_bytes(max_shard_size: Union[int, str]) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    size: int = convert_file_size_to_int(max_shard_size)
    if size <= 0:
        raise CheckpointError(f"planc.export: max_shard_size must be positive, got {max_shard_size!r}.")
    return size


def export(model: nn.Module, directory: Union[str, os.PathLike[str]], *, max_shard_size: Union[int, str] = "5GB") -> Path:
    """Write `model` (applied) as hub-layout safetensors that `from_pretrained(directory)` loads unsharded.

    Every rank must call it (the tensors are gathered one group at a time); rank 0 writes. An existing
    `directory` is replaced only once the new export is complete, and only if it holds nothing but an
    export (config, safetensors, index). Returns the absolute path.
    """
    what = f"planc.export({str(directory)!r})"
    compiled, groups = applied_plan(model, what)
    error: Optional[BaseException] = None
    layout = None
    try:
        refuse_unsavable(model, compiled, what)
        limit = _max_shard_bytes(max_shard_size)
        state = _export_state(model, compiled, groups)
        key_groups = _group_keys(state)
        layout = _plan(model, state, key_groups, limit)
    except Exception as e:  # noqa: BLE001 - every rank refuses together, before any collective
        error = e
    agree(error, what)
    rank0 = dist.get_rank() == 0
    with atomic_directory(directory, what, replaceable=is_export_dir) as partial:
        assert layout is not None  # agree() raised otherwise
        writer = _ShardWriter(partial, layout) if rank0 else None
        failure: Optional[BaseException] = None
        for keys in key_groups:
            full = {k: _full(state[k]) for k in keys}  # every rank, every group: the gathers are collectives
            if writer is not None and failure is None:
                try:
                    writer.add(_revert(model, full))
                except Exception as e:  # noqa: BLE001 - keep taking part in the gathers, raise after them
                    failure = e
            del full
        if failure is not None:
            raise failure
        if writer is not None:
            writer.finish()
            _write_configs(model, partial)
    return Path(directory).absolute()


__all__ = ["export", "is_export_dir"]
