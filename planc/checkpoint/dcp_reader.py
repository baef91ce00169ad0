"""How planc reads a torch.distributed.checkpoint directory: as data, never as code.

torch's `FileSystemReader.read_metadata` is a raw `pickle.load` of `.metadata` and `DefaultLoadPlanner.load_bytes`
a `torch.load(weights_only=False)` of every non-tensor item (torch documents DCP as trusted-environment only), so
a checkpoint copied from someone else could run their code. planc reads both through `safe_pickle`:

- `.metadata` (the model's and `optimizer/`'s): `read_metadata`, the one reader, with the allow-list of exactly
  what DCP metadata is made of (`METADATA`: torch's metadata dataclasses and `_StorageInfo`, torch.Size, dtypes,
  layouts, devices, paths) and a bound on its size; then every field's type is checked, each storage file is a
  plain name inside the checkpoint directory and no stream transform (a decompressor) is named.
- non-tensor items (the optimizer's hyperparameters, `param_groups.<param>.lr`): `read_plain_item`, a torch.save
  archive (uncompressed, no storages) whose `data.pkl` holds plain data only (no globals at all, protocol 2).

`CheckedReader` is the FileSystemReader DCP loads through (its `read_metadata` is `read_metadata`, read once)
and `PlainBytesPlanner` the LoadPlanner (its `load_bytes` is `read_plain_item`). Every refusal is a
`CheckpointError` naming the file or key and what it held. `trust_checkpoint_code=True`, the one opt-in, reads with
torch's own unpickler instead, for a checkpoint the user trusts and planc cannot read (another tool's custom
objects); it warns each time it is used (`UnsafeCheckpointWarning`).

The hyperparameters stay DCP items rather than moving to planc.json: every checkpoint planc already wrote holds
them so, JSON would turn `betas` tuples into lists and cannot hold inf/nan, and a reader for the items is needed
anyway, for the checkpoints that hold them.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import stat
import warnings
import zipfile
from pathlib import Path, PurePath
from typing import Any, Callable, Iterable, Mapping, Optional, Union, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.serialization import _get_layout

from planc.checkpoint.safe_pickle import PLAIN_DATA, Profile, UnsafePickle, check_plain, loads, plain_arguments
from planc.errors import CheckpointError, PlancError

# A model of 10^5 tensors saved by 10^3 ranks holds ~10^8 chunk entries before this; the biggest real ones are tens
# of MiB. The bound is checked on the file's size, before a byte is read.
MAX_METADATA_BYTES = 512 << 20
# One non-tensor item (a hyperparameter) is a torch.save archive of a few hundred bytes.
MAX_ITEM_BYTES = 1 << 20
OPT_IN = "trust_checkpoint_code=True"
OPT_IN_FLAG = "--trust-checkpoint-code"
_MAX_DIMS = 64


class UnsafeCheckpointWarning(PlancError, UserWarning):
    """A checkpoint read with torch's own unpickler (`trust_checkpoint_code=True`): its code could run. A PlancError
    too, as everything planc raises or warns with is (`except PlancError` and `-W error` agree)."""


def warn_trusted(directory: Union[str, os.PathLike[str]], what: str) -> None:
    """Say, each time, that `what` reads `directory` trusting its code."""
    warnings.warn(
        f"{what}: {OPT_IN}: reading {directory} with torch's own unpickler, not planc's allow-list; code in a hostile "
        "checkpoint runs with your permissions. Pass it only for a checkpoint you wrote or trust.",
        UnsafeCheckpointWarning, stacklevel=3,
    )


def _size_args(args: tuple[Any, ...]) -> None:
    if args == ():
        return
    if (len(args) != 1 or type(args[0]) not in (tuple, list) or len(args[0]) > _MAX_DIMS
            or any(type(d) is not int for d in args[0])):
        raise UnsafePickle("a torch.Size of anything but a short tuple of ints")


def _path_args(args: tuple[Any, ...]) -> None:
    if len(args) > 64 or any(type(a) is not str for a in args):
        raise UnsafePickle("a path built from anything but strings")


def _device_args(args: tuple[Any, ...]) -> None:
    if not (1 <= len(args) <= 2 and type(args[0]) is str and (len(args) == 1 or type(args[1]) is int)):
        raise UnsafePickle("a torch.device of anything but a string and an index")


def _metadata_profile() -> Profile:
    """Exactly what torch 2.13's `dcp.save` pickles into `.metadata` (listed from real planc.save checkpoints,
    model and optimizer), plus torch.device and the pure path classes a checkpoint saved elsewhere may name."""
    classes = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
               StorageMeta, MetadataIndex, dcp_filesystem._StorageInfo)
    names: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in classes}
    enc = dcp_metadata._MEM_FORMAT_ENCODING
    names[(enc.__module__, enc.__qualname__)] = enc
    names[("torch", "Size")] = torch.Size
    names[("torch", "device")] = torch.device
    names[("torch.serialization", "_get_layout")] = _get_layout
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            names[("torch", name)] = value
    paths = {"PosixPath": pathlib.PurePosixPath, "WindowsPath": pathlib.PureWindowsPath, "Path": pathlib.PurePath,
             "PurePosixPath": pathlib.PurePosixPath, "PureWindowsPath": pathlib.PureWindowsPath,
             "PurePath": pathlib.PurePath}
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes
        for name, cls in paths.items():
            names[(module, name)] = cls  # a path is only a name here: never a concrete (filesystem) one
    callables: dict[Any, Callable[[tuple[Any, ...]], None]] = {
        torch.Size: _size_args, torch.device: _device_args, _get_layout: plain_arguments(str),
        enc: plain_arguments(int), **{cls: _path_args for cls in set(paths.values())},
    }
    return Profile(name="torch.distributed.checkpoint .metadata", globals=names, callables=callables,
                   classes=frozenset(classes), protocols=frozenset({4}))


METADATA = _metadata_profile()
# .metadata is pickled with the saving Python's default protocol: 4 up to Python 3.13, 5 from 3.14 (planc.json
# records it); a checkpoint from before planc recorded it was written with 4.
METADATA_PROTOCOLS = (4, 5)
DEFAULT_METADATA_PROTOCOL = 4


def metadata_protocol(marker: Mapping[str, Any]) -> int:
    """The pickle protocol a planc.save checkpoint's `.metadata` files were written with, from its planc.json."""
    recorded = marker.get("pickle_protocol", DEFAULT_METADATA_PROTOCOL)
    return recorded if type(recorded) is int and recorded in METADATA_PROTOCOLS else DEFAULT_METADATA_PROTOCOL

# torch.save writes protocol 2 (torch.serialization.DEFAULT_PROTOCOL)
_ITEMS = "a checkpoint's non-tensor items"
_ITEM = Profile(name=PLAIN_DATA.name, globals={}, callables={}, classes=frozenset(), protocols=frozenset({2}))


def _hint(what: str) -> str:
    return (f"planc reads {what} as data, through an allow-list (docs/security.md), so nothing in it runs; this "
            "one was not written by planc.save (torch.distributed.checkpoint) or was changed since. If you wrote it "
            f"with another tool and trust it, pass {OPT_IN} (planc explain: {OPT_IN_FLAG}).")


def _refused(path: Union[str, os.PathLike[str]], held: str, what: str = "a checkpoint's .metadata") -> CheckpointError:
    return CheckpointError(f"{path}: refused, it holds {held}. {_hint(what)}")


def read_metadata(path: Union[str, os.PathLike[str]], protocol: int = DEFAULT_METADATA_PROTOCOL) -> Metadata:
    """The DCP `Metadata` pickled in `path` (a `.metadata` file) with `protocol` (`metadata_protocol(marker)`),
    read through the allow-list and type-checked; CheckpointError naming the file and what it held otherwise."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a planc.save checkpoint holds it (copy the whole directory).") from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror}).") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refused(path, "no regular file (a device, a pipe or a directory)")
    if st.st_size > MAX_METADATA_BYTES:
        raise _refused(path, f"{st.st_size} bytes, more than the {MAX_METADATA_BYTES} planc reads of a .metadata")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e.strerror}).") from None
    try:
        md = loads(data, dataclasses.replace(METADATA, protocols=frozenset({protocol})), limit=MAX_METADATA_BYTES)
        _check_metadata(md)
    except UnsafePickle as e:
        raise _refused(path, str(e)) from None
    return cast(Metadata, md)


# ---- the types of what was read ------------------------------------------------------------------------------


def _bad(what: str) -> UnsafePickle:
    return UnsafePickle(f"metadata that is not torch.distributed.checkpoint's: {what}")


def _check_size(value: Any, what: str) -> None:
    if type(value) is not torch.Size or any(type(d) is not int or d < 0 for d in value):
        raise _bad(f"{what} is a {type(value).__name__}, not a torch.Size of non-negative ints")


def _check_metadata(md: Any) -> None:
    """UnsafePickle unless `md` is a Metadata whose every field has DCP's types (each distinct object checked once:
    a memo-shared structure costs no more than its distinct parts)."""
    seen: set[int] = set()
    if type(md) is not Metadata:
        raise _bad(f"the top object is a {type(md).__name__}")
    sdm = md.__dict__.get("state_dict_metadata")
    if type(sdm) is not dict:
        raise _bad("state_dict_metadata is not a dict")
    for key, meta in sdm.items():
        if type(key) is not str:
            raise _bad(f"a state_dict_metadata key is a {type(key).__name__}")
        if id(meta) in seen:
            continue
        seen.add(id(meta))
        if type(meta) is BytesStorageMetadata:
            if meta.__dict__:
                raise _bad(f"`{key}`: a BytesStorageMetadata with fields")
            continue
        if type(meta) is not TensorStorageMetadata or set(meta.__dict__) != {"properties", "size", "chunks"}:
            raise _bad(f"`{key}`: a {type(meta).__name__}")
        _check_properties(meta.properties, key, seen)
        _check_size(meta.size, f"`{key}` size")
        if type(meta.chunks) is not list:
            raise _bad(f"`{key}` chunks are not a list")
        if id(meta.chunks) in seen:
            continue
        seen.add(id(meta.chunks))
        for chunk in meta.chunks:
            if type(chunk) is not ChunkStorageMetadata or set(chunk.__dict__) != {"offsets", "sizes"}:
                raise _bad(f"`{key}`: a chunk is a {type(chunk).__name__}")
            _check_size(chunk.offsets, f"`{key}` chunk offsets")
            _check_size(chunk.sizes, f"`{key}` chunk sizes")
            if not (len(chunk.offsets) == len(chunk.sizes) == len(meta.size)) or any(
                    o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, meta.size)):
                raise _bad(f"`{key}`: a chunk outside the tensor's size {tuple(meta.size)}")
    _check_storage_data(md.__dict__.get("storage_data"))
    _check_planner_data(md.__dict__.get("planner_data"))
    _check_storage_meta(md.__dict__.get("storage_meta"))
    version = md.__dict__.get("version")
    if version is not None and type(version) is not str:
        raise _bad("version is not a string")


def _check_properties(p: Any, key: str, seen: set[int]) -> None:
    if id(p) in seen:
        return
    seen.add(id(p))
    if type(p) is not TensorProperties:
        raise _bad(f"`{key}` properties are a {type(p).__name__}")
    d = p.__dict__
    if not (isinstance(d.get("dtype"), torch.dtype) and isinstance(d.get("layout"), torch.layout)
            and type(d.get("requires_grad")) is bool and type(d.get("pin_memory")) is bool
            and isinstance(d.get("memory_format"), torch.memory_format)):
        raise _bad(f"`{key}` properties of other types")


def _check_storage_data(storage: Any) -> None:
    if type(storage) is not dict:
        raise _bad("storage_data is not a dict")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.__dict__.get("fqn")) is not str:
            raise _bad(f"a storage_data key is a {type(index).__name__}")
        offset, hint = index.__dict__.get("offset"), index.__dict__.get("index")
        if offset is not None:
            _check_size(offset, f"`{index.fqn}` offset")
        if hint is not None and type(hint) is not int:
            raise _bad(f"`{index.fqn}` index is a {type(hint).__name__}")
        if type(info) is not dcp_filesystem._StorageInfo:
            raise _bad(f"`{index.fqn}` is stored in a {type(info).__name__}")
        d = info.__dict__
        name, start, length = d.get("relative_path"), d.get("offset"), d.get("length")
        if (type(name) is not str or not name or name in (".", "..") or "/" in name or "\\" in name
                or "\x00" in name):
            raise UnsafePickle(f"`{index.fqn}` stored in {name!r}: not a file name inside the checkpoint directory")
        if type(start) is not int or type(length) is not int or start < 0 or length < 0:
            raise _bad(f"`{index.fqn}` has a byte range that is not two non-negative ints")
        if d.get("transform_descriptors"):
            raise UnsafePickle(
                f"`{index.fqn}` stored through the stream transform(s) {d['transform_descriptors']!r} (a "
                "decompressor whose output planc cannot bound); planc.save never writes one")


def _check_planner_data(data: Any) -> None:
    if data is None:
        return
    if type(data) is not dict:
        raise _bad("planner_data is not a dict")
    for key, path in data.items():
        if type(key) is not str or type(path) not in (tuple, list) or any(type(p) not in (str, int) for p in path):
            raise _bad(f"planner_data of `{key}` is not a key path")


def _check_storage_meta(meta: Any) -> None:
    if meta is None:
        return
    if type(meta) is not StorageMeta:
        raise _bad(f"storage_meta is a {type(meta).__name__}")
    d = meta.__dict__
    if not (d.get("checkpoint_id") is None or isinstance(d.get("checkpoint_id"), (str, PurePath))):
        raise _bad("storage_meta.checkpoint_id is not a path")
    if any(d.get(k) is not None and type(d.get(k)) is not str for k in ("save_id", "load_id")):
        raise _bad("storage_meta ids are not strings")
    if type(d.get("modules", [])) is not list or any(type(m) is not str for m in d.get("modules", [])):
        raise _bad("storage_meta.modules is not a list of strings")


# ---- non-tensor items ------------------------------------------------------------------------------------------


def read_plain_item(payload: bytes, key: str, where: Union[str, os.PathLike[str]]) -> Any:
    """The plain value (None, bool, int, float, str, bytes, tuples/lists/dicts of them) a non-tensor DCP item holds:
    a torch.save archive, uncompressed and without storages, whose pickle names no global. CheckpointError naming
    `key` and what it held otherwise."""
    try:
        if len(payload) > MAX_ITEM_BYTES:
            raise UnsafePickle(f"{len(payload)} bytes, more than the {MAX_ITEM_BYTES} planc reads of one value")
        value = loads(_archived_pickle(payload), _ITEM, limit=MAX_ITEM_BYTES)
        check_plain(value)
    except UnsafePickle as e:
        raise CheckpointError(
            f"{where}: the item `{key}` refused, it holds {e}. {_hint(_ITEMS)}") from None
    return value


def _archived_pickle(payload: bytes) -> bytes:
    """The `data.pkl` of a torch.save archive holding no tensor."""
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            infos = archive.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(pickles) != 1:
                raise UnsafePickle(f"an archive with {len(pickles)} data.pkl entries (torch.save writes one)")
            root = pickles[0].filename.split("/")[0]
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:
                    raise UnsafePickle(f"the compressed archive entry {info.filename!r} (torch.save compresses none)")
                if info.filename.startswith(f"{root}/data/"):
                    raise UnsafePickle(f"tensor storage ({info.filename!r}) in a non-tensor value")
                if info.file_size > len(payload):
                    raise UnsafePickle(f"the archive entry {info.filename!r} larger than the archive")
            return archive.read(pickles[0])
    except UnsafePickle:
        raise
    except Exception as e:  # noqa: BLE001 - zipfile's errors for a damaged or foreign archive
        raise UnsafePickle(f"no torch.save archive ({type(e).__name__}: {e})") from None


# ---- the reader and planner DCP loads through ------------------------------------------------------------------


class CheckedReader(FileSystemReader):
    """DCP's FileSystemReader whose metadata comes from `read_metadata` (read once, then kept: planc's checks and
    `dcp.load` see the same object) and whose non-tensor items `read_items` reads through `read_plain_item`.
    `protocol`: the pickle protocol of its `.metadata` (`metadata_protocol(marker)`); `trust_code`: torch's own
    unpickler instead (the opt-in; the caller warns)."""

    def __init__(self, path: Union[str, os.PathLike[str]], *, protocol: int = DEFAULT_METADATA_PROTOCOL,
                 trust_code: bool = False) -> None:
        super().__init__(path)
        self.protocol = protocol
        self.trust_code = trust_code
        self.directory = Path(path)
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to a per-rank file: planc.save writes the global one only
            raise CheckpointError(f"{self.directory}: planc reads the checkpoint's global .metadata only.")
        if self._metadata is None:
            if self.trust_code:
                self._metadata = super().read_metadata()
            else:
                self._metadata = read_metadata(self.directory / ".metadata", self.protocol)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_items(self, keys: Iterable[str]) -> dict[str, Any]:
        """The non-tensor items `keys` (each a BytesStorageMetadata of the metadata), read before DCP reads any
        tensor, so a refused one leaves every tensor as it was."""
        storage = self.read_metadata().storage_data
        out: dict[str, Any] = {}
        for key in keys:
            info = storage.get(MetadataIndex(key))
            if info is None:
                raise CheckpointError(f"{self.directory / '.metadata'}: the item `{key}` has no storage entry; the "
                                      "checkpoint is damaged: save it again, or copy it again.")
            path = self.directory / info.relative_path
            want = info.length if self.trust_code else min(info.length, MAX_ITEM_BYTES + 1)
            with open(path, "rb") as f:
                f.seek(info.offset)
                payload = f.read(want)
            if len(payload) < want:
                raise CheckpointError(f"{path}: the item `{key}` runs past the file's end: it is truncated; copy it "
                                      "again.")
            if self.trust_code:
                out[key] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                out[key] = read_plain_item(payload, key, path)
        return out


class PlainBytesPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor items are read by `read_plain_item`, never `torch.load`."""

    def __init__(self, where: Union[str, os.PathLike[str]]) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes calls

        key = read_item.dest_index.fqn
        plain = read_plain_item(value.getvalue(), key, self.where)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], plain)
        else:
            self.state_dict[key] = plain


def planner_for(reader: CheckedReader) -> DefaultLoadPlanner:
    """The planner `dcp.load` takes with `reader`: torch's own when the user trusts the checkpoint's code."""
    return DefaultLoadPlanner() if reader.trust_code else PlainBytesPlanner(reader.directory)


__all__ = [
    "MAX_ITEM_BYTES", "MAX_METADATA_BYTES", "METADATA", "OPT_IN", "OPT_IN_FLAG", "CheckedReader", "PlainBytesPlanner",
    "UnsafeCheckpointWarning", "metadata_protocol", "planner_for", "read_metadata", "read_plain_item", "warn_trusted",
]
