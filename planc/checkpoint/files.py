"""A local safetensors checkpoint directory, opened for sliced reads and checked before any tensor is read.

`CheckpointFiles.open(path)` finds `config.json` and the weights (one `model.safetensors`, or a
`model.safetensors.index.json` with its shards), checks that every file named by the index exists and
that every file's header parses and covers the file (a truncated shard fails here, naming the file),
and keeps one `safe_open` handle per file. `slices()` gives every key as a lazy safetensors slice:
transformers' loader reads only the byte ranges a rank's DTensor placements ask for.

Tensors are read through safetensors' `mmap` backend, and every storage a slice hands out is recorded
(`mapped_storages`). A slice read through `mmap` is a view of the whole mapped tensor (a 40 KB row slice keeps the
full 4 MB tensor, and the file, mapped while it lives), so the loader (load.py) copies whatever reaches the model
as such a view and calls `unmap()` after each decoder layer: converters (stack, concatenate, dequantize) read the
page cache directly, and at most one layer's mapped pages count in a rank's RSS. Why not safetensors' `pread`
backend, which copies just the requested bytes: it reads at ~0.5 GB/s, where a mapped slice + `clone()` copies
at ~2.5 GB/s (a 64 MiB embedding shard: 130 ms against 26 ms, this 2-core box).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection

from planc.errors import CheckpointError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class TensorInfo:
    """One checkpoint tensor as its file header describes it (no bytes read)."""

    key: str
    file: str
    dtype: str  # safetensors' dtype name: BF16, F32, F8_E4M3, I8, U8, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPE_BYTES.get(self.dtype, 1)


_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "F4": 1,
}


@dataclass
class CheckpointFiles:
    """The files of one checkpoint directory, their tensors (from headers) and open slice handles."""

    root: Path
    tensors: dict[str, TensorInfo]
    _mapped_handles: dict[str, Any] = field(default_factory=dict, repr=False)
    mapped_storages: set[int] = field(default_factory=set, repr=False)  # data_ptr of every mmap storage handed out

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "CheckpointFiles":
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(missing_directory(root))
        if not (root / CONFIG_NAME).is_file():
            raise CheckpointError(
                _dangling(root / CONFIG_NAME)
                or f"{root}: no {CONFIG_NAME}; the model is built from it. Copy it beside the weights."
            )
        files = _weight_files(root)
        tensors: dict[str, TensorInfo] = {}
        for name, expected in files.items():
            infos = _read_header(root / name)
            if expected is not None:
                absent = sorted(expected - set(infos))
                if absent:
                    raise CheckpointError(
                        f"{root / INDEX_NAME}: names tensor `{absent[0]}` in {name}, but {name} does not hold it"
                        + (f" (nor {len(absent) - 1} more)" if len(absent) > 1 else "")
                        + ". The index and the shards come from different saves: re-copy the checkpoint."
                    )
            for key, info in infos.items():
                if expected is not None and key not in expected:
                    continue  # the index is the truth about which file holds a key
                if key in tensors:
                    raise CheckpointError(
                        f"{root}: tensor `{key}` is stored in both {tensors[key].file} and {name}; keep one."
                    )
                tensors[key] = info
        return cls(root, tensors)

    def digest(self) -> str:
        """A short hash of every tensor's key, file, dtype and shape: ranks that see different checkpoints differ."""
        import hashlib

        text = "\n".join(f"{k} {i.file} {i.dtype} {list(i.shape)}" for k, i in sorted(self.tensors.items()))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_NAME

    def read_config(self) -> dict[str, Any]:
        try:
            config: dict[str, Any] = json.loads(self.config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.config_path}: cannot be read as JSON ({e}).") from None
        return config

    def slices(self, keys: Collection[str] | None = None) -> dict[str, Any]:
        """Every key (or those in `keys`) as a lazy `mmap` slice (nothing is read until it is indexed) that records
        the storage of every tensor it returns in `mapped_storages`: the caller copies those before they reach the
        model (load.py's `_own_copies`) and calls `unmap()` when done."""
        out = {}
        for key in self.tensors if keys is None else keys:
            out[key] = MappedSlice(self._mapped(self.tensors[key].file).get_slice(key), self.mapped_storages)
        return out

    def _mapped(self, name: str) -> Any:
        handle = self._mapped_handles.get(name)
        if handle is None:
            handle = _safe_open(self.root / name)
            self._mapped_handles[name] = handle
        return handle

    def unmap(self) -> None:
        """Close the `mmap` handles: once no tensor views them, the mapped pages leave this process's RSS. The
        loader calls it after each decoder layer, so at most one layer's mapped bytes are resident at a time."""
        for handle in self._mapped_handles.values():
            handle.__exit__(None, None, None)
        self._mapped_handles.clear()
        self.mapped_storages.clear()

    def where(self, key: str) -> str:
        """`file:tensor` for messages."""
        info = self.tensors.get(key)
        return f"{self.root / info.file}: `{key}`" if info else f"{self.root}: `{key}`"

    def close(self) -> None:
        self.unmap()


class MappedSlice:
    """A safetensors `mmap` slice that records the storage of every tensor it returns (a view of the mapped file).

    `MappedSlice.reads` counts the slices indexed in this process: a load refused before reading leaves it as it was
    (the tests check every refusal so)."""

    reads = 0

    def __init__(self, source: Any, storages: set[int]) -> None:
        self.source = source
        self.storages = storages

    def get_shape(self) -> list[int]:
        shape: list[int] = self.source.get_shape()
        return shape

    def get_dtype(self) -> str:
        dtype: str = self.source.get_dtype()
        return dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor: torch.Tensor = self.source[index]
        MappedSlice.reads += 1
        self.storages.add(tensor.untyped_storage().data_ptr())
        return tensor


def _weight_files(root: Path) -> dict[str, set[str] | None]:
    """File name -> the keys the index assigns to it (None for a single-file checkpoint)."""
    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a `weight_map` ({e}).") from None
        files: dict[str, set[str]] = {}
        for key, name in weight_map.items():
            if not isinstance(name, str) or Path(name).name != name:
                raise CheckpointError(f"{index}: `{key}` maps to {name!r}; shards must be file names beside the index.")
            files.setdefault(name, set()).add(key)
        for name in files:
            if not (root / name).is_file():
                raise CheckpointError(
                    f"{index}: names shard {name} (for `{sorted(files[name])[0]}` and {len(files[name]) - 1} more "
                    f"tensors), which is missing from {root}"
                    + (f" ({_dangling(root / name)})" if _dangling(root / name) else "")
                    + ". Copy the whole checkpoint."
                )
        return files  # type: ignore[return-value]
    if (root / SINGLE_NAME).is_file():
        return {SINGLE_NAME: None}
    dangling = _dangling(root / SINGLE_NAME) or _dangling(index)
    if dangling:
        raise CheckpointError(dangling)
    others = sorted(p.name for p in root.glob("*.safetensors"))
    raise CheckpointError(
        f"{root}: no {SINGLE_NAME} and no {INDEX_NAME}"
        + (f" (found {', '.join(others[:3])} without an index)" if others else "")
        + ". planc.load reads safetensors checkpoints as save_pretrained writes them."
    )


def missing_directory(root: Path) -> str:
    """The message for a checkpoint path that is not a directory: where an interrupted save left the previous one."""
    from planc.checkpoint.atomic import OLD_SUFFIX, PARTIAL_SUFFIX, sibling

    old, partial = sibling(root, OLD_SUFFIX), sibling(root, PARTIAL_SUFFIX)
    if old.is_dir():
        return (
            f"{root}: missing, but {old} holds the checkpoint that was there: a planc.save/export was interrupted "
            f"while swapping the new checkpoint in. Rename it back (`mv {old} {root}`; the next planc.save or "
            f"planc.export to {root} does it itself), then load {root}."
        )
    link = _dangling(root)
    if link:
        return link
    return (
        f"{root}: not a checkpoint directory"
        + (f" ({partial} is an unfinished save, not a checkpoint)" if partial.exists() else "")
        + f". planc.load takes a local directory holding config.json and {SINGLE_NAME} (or {INDEX_NAME} with its "
        "shards), as save_pretrained writes it, or a planc.save directory."
        + _hub_id_hint(root)
    )


def _hub_id_hint(root: Path) -> str:
    """For a path that reads as a hub id (`org/name`, nothing of it on disk): how to download it first."""
    text = str(root)
    parts = text.split("/")
    if len(parts) != 2 or not all(parts) or text.startswith((".", "~")) or Path(parts[0]).exists():
        return ""
    return (f" `{text}` looks like a Hugging Face hub id: planc.load reads local files only, so download it first, "
            f"`hf download {text} --local-dir {parts[1]}` (or huggingface_hub.snapshot_download(\"{text}\")), "
            f"then planc.load(\"{parts[1]}\", ...).")


def _dangling(path: Path) -> str | None:
    """The message for a symbolic link whose target is missing, else None."""
    if not path.is_symlink() or path.exists():
        return None
    return (
        f"{path} is a symbolic link to {os.readlink(path)}, which does not exist. Restore the file it points to "
        "(or copy the file itself beside config.json)."
    )


def _safe_open(path: Path, backend: str = "mmap") -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        handle: Any = safe_open(str(path), framework="pt", device="cpu", backend=backend)
        handle.__enter__()
    except (SafetensorError, OSError) as e:
        detail = _header_problem(path) or f"not a readable safetensors file ({e})"
        raise CheckpointError(f"{path}: {detail}; it is truncated or damaged. Re-copy it.") from None
    return handle


def _header_problem(path: Path) -> str | None:
    """The tensor a damaged header describes wrongly (dtype x shape vs its byte range, a range past the end), read
    from the header itself: safetensors' own message does not name the tensor."""
    import struct

    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                return None
            header = json.loads(f.read(n))
        data = size - 8 - n
        for key, entry in header.items():
            if key == "__metadata__" or not isinstance(entry, dict):
                continue
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            count = 1
            for d in shape:
                count *= d
            want = count * _DTYPE_BYTES.get(dtype, 0)
            if dtype in _DTYPE_BYTES and want != end - begin:
                return (
                    f"tensor `{key}`: its header says {dtype} {list(shape)} ({want} bytes), but its byte range "
                    f"[{begin}, {end}) holds {end - begin} bytes"
                )
            if end > data:
                return f"tensor `{key}`: its byte range [{begin}, {end}) ends past the data ({data} bytes)"
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return None


def _read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor's dtype and shape from the file's header (safetensors checks that it covers the file)."""
    handle = _safe_open(path, backend="pread")  # headers only: no mapping is made
    try:
        infos = {}
        for key in handle.keys():
            s = handle.get_slice(key)
            infos[key] = TensorInfo(key, path.name, s.get_dtype(), tuple(s.get_shape()))
        return infos
    finally:
        handle.__exit__(None, None, None)


__all__ = [
    "CheckpointFiles", "MappedSlice", "TensorInfo", "INDEX_NAME", "SINGLE_NAME", "CONFIG_NAME", "missing_directory",
]
