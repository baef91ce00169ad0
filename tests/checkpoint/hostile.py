"""Hostile planc.save checkpoints, and the rank code that loads them (module level: spawn pickles functions by name).

Each case is a copy of one real planc.save checkpoint (tiny Mixtral, with AdamW state) where one pickle was
replaced the way an attacker would: the model's `.metadata`, the optimizer's `optimizer/.metadata`, or one
optimizer hyperparameter (`param_groups.<param>.lr`, a DCP byte item: a torch.save archive appended to a
`.distcp` and pointed to by a rewritten `.metadata`). Every gadget would create its own marker file
(`<root>/markers/<case>`): the oracle is that none ever exists, and every load is refused with a CheckpointError
naming the file (or key) and what it held, the same on every rank.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tests.runtime.workers import batch, shipped_plan

LR_KEY = "param_groups.model.embed_tokens.weight.lr"
LR = 1e-2


class Reduce:
    """An object whose pickle is a call: `fn(*args)` when unpickled."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _short(s: str) -> bytes:
    b = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b


def _stack_global_call(module: str, name: str, arg: str, proto: int = 4) -> bytes:
    """`module.name(arg)` in protocol `proto` opcodes, written by hand (names pickle itself would never write)."""
    return (pickle.PROTO + bytes([proto]) + _short(module) + _short(name) + pickle.STACK_GLOBAL + _short(arg)
            + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


def gadgets(marker: Path, real: bytes, real_object: Any) -> dict[str, bytes]:
    """name -> pickle bytes; `real`/`real_object`: the genuine pickle this replaces (and what it holds)."""
    touch = f"touch {marker}"
    out = {
        "os_system": pickle.dumps(Reduce(os.system, touch), protocol=4),
        "builtins_eval": pickle.dumps(Reduce(eval, f"__import__('os').system({touch!r})"), protocol=4),
        "builtins_exec_protocol0": f"cbuiltins\nexec\n(V__import__('os').system({touch!r})\ntR.".encode(),
        "subprocess_popen": pickle.dumps(Reduce(subprocess.Popen, ["touch", str(marker)]), protocol=4),
        # a global of a module the allow-list draws from, not on the list (a dotted name reaches its `os`)
        "allowed_module_os": _stack_global_call("torch.distributed.checkpoint.filesystem", "os.system", touch),
        "allowed_module_load": _stack_global_call("torch.serialization", "load", str(marker)),
        "allowed_class_globals": _stack_global_call(
            "torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__", touch),
        # an allowed class called as a function, and BUILD setting what is not one of its fields
        "allowed_class_called": _stack_global_call("torch.distributed.checkpoint.metadata", "StorageMeta", touch),
        "allowed_class_build": (pickle.PROTO + b"\x04" + _short("torch.distributed.checkpoint.metadata")
                                + _short("StorageMeta") + pickle.STACK_GLOBAL + pickle.EMPTY_TUPLE + pickle.NEWOBJ
                                + pickle.EMPTY_DICT + _short("__setstate__") + _short(touch) + pickle.SETITEM
                                + pickle.BUILD + pickle.STOP),
        "protocol5_gadget": pickle.dumps(Reduce(os.system, touch), protocol=5),
        "protocol5_buffer": pickle.dumps(pickle.PickleBuffer(bytearray(b"x" * 64)), protocol=5),
        "truncated": real[: len(real) // 2],
        "trailing_pickle": real + pickle.dumps(Reduce(os.system, touch), protocol=4),
    }
    if real_object is not None:  # a gadget deep inside a genuine structure: it would run mid-load
        import copy

        embedded = copy.copy(real_object)
        embedded.version = Reduce(os.system, touch)
        out["embedded_in_metadata"] = pickle.dumps(embedded, protocol=4)
        traversal = copy.deepcopy(real_object)
        for info in traversal.storage_data.values():
            info.relative_path = "../../" + info.relative_path
        out["path_traversal"] = pickle.dumps(traversal, protocol=4)
        zstd = copy.deepcopy(real_object)
        for info in zstd.storage_data.values():
            info.transform_descriptors = ["zstd"]
        out["stream_transform"] = pickle.dumps(zstd, protocol=4)
        build = bytearray(pickle.dumps(real_object, protocol=4))
        out["protocol5_genuine"] = bytes(build[:1]) + b"\x05" + bytes(build[2:])
    return out


def _torch_save(obj: Any, **kw: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    return buf.getvalue()


def item_gadgets(marker: Path, real: bytes) -> dict[str, bytes]:
    """name -> a byte item's payload (a torch.save archive) that replaces the genuine `real` one."""
    touch = f"touch {marker}"
    return {
        "os_system": _torch_save(Reduce(os.system, touch)),
        "builtins_eval": _torch_save(Reduce(eval, f"__import__('os').system({touch!r})")),
        "subprocess_popen": _torch_save(Reduce(subprocess.Popen, ["touch", str(marker)])),
        # allowed by torch's weights_only unpickler: 2 GiB from a few bytes
        "weights_only_bytearray": _torch_save(Reduce(bytearray, 2**31)),
        "tensor_storage": _torch_save(torch.zeros(4)),
        "protocol5": _torch_save(0.01, pickle_protocol=5),
        "truncated": real[: len(real) // 2],
        "oversized": _torch_save("x" * (2 << 20)),
        "memo_dag": _archive(_dag_pickle(40)),
    }


def _dag_pickle(levels: int) -> bytes:
    """[L, L] nested `levels` deep through the memo: a few hundred bytes, 2**levels paths to walk."""
    out = pickle.PROTO + b"\x02" + pickle.EMPTY_LIST + pickle.BINPUT + b"\x00"
    for i in range(1, levels + 1):
        get = pickle.BINGET + bytes([i - 1])
        out += pickle.EMPTY_LIST + get + pickle.APPEND + get + pickle.APPEND + pickle.BINPUT + bytes([i])
    return out + pickle.STOP


def _archive(data_pkl: bytes) -> bytes:
    """A torch.save-shaped archive (stored entries) around a hand-written data.pkl."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def _rewrite_item(case: Path, key: str, payload: bytes) -> None:
    """Append `payload` to a `.distcp` of the optimizer state and point `key` at it (a genuine DCP structure)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta_path = case / "optimizer" / ".metadata"
    md = pickle.loads(meta_path.read_bytes())  # our own genuine file
    info = md.storage_data[MetadataIndex(key)]
    target = case / "optimizer" / info.relative_path
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(payload)
    info.offset, info.length = offset, len(payload)
    meta_path.write_bytes(pickle.dumps(md, protocol=4))


def write_corpus(good: Path, root: Path) -> dict[str, list[str]]:
    """case -> [what it attacks ('model', 'optimizer', 'item'), its directory, its marker file]."""
    cases: dict[str, list[str]] = {}
    markers = root / "markers"
    markers.mkdir(parents=True, exist_ok=True)

    def copy(name: str) -> Path:
        d = root / name
        shutil.copytree(good, d)
        return d

    for where, sub in (("model", ""), ("optimizer", "optimizer")):
        real = (good / sub / ".metadata").read_bytes()
        for name in gadgets(markers / "-", real, pickle.loads(real)):
            case = f"{where}/{name}"
            marker = markers / case.replace("/", "-")
            data = gadgets(marker, real, pickle.loads(real))[name]
            d = copy(case.replace("/", "-"))
            (d / sub / ".metadata").write_bytes(data)
            cases[case] = [where, str(d), str(marker)]
        case = f"{where}/oversized"  # a sparse file past the bound: refused on its size, never read
        d = copy(case.replace("/", "-"))
        from planc.checkpoint.dcp_reader import MAX_METADATA_BYTES

        os.truncate(d / sub / ".metadata", MAX_METADATA_BYTES + 1)
        cases[case] = [where, str(d), str(markers / case.replace("/", "-"))]
        case = f"{where}/rank_file_only"  # DCP's fallback: `__0.metadata` and no `.metadata`
        d = copy(case.replace("/", "-"))
        os.rename(d / sub / ".metadata", d / sub / "__0.metadata")
        (d / sub / "__0.metadata").write_bytes(pickle.dumps(Reduce(os.system, f"touch {markers / case.replace('/', '-')}")))
        cases[case] = [where, str(d), str(markers / case.replace("/", "-"))]
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    case = "model/extra_item"  # a non-tensor item added to the model's state, holding a gadget
    d = copy(case.replace("/", "-"))
    md = pickle.loads((d / ".metadata").read_bytes())
    md.state_dict_metadata["extra"] = BytesStorageMetadata()
    target = d / "__0_0.distcp"
    payload = _torch_save(Reduce(os.system, f"touch {markers / case.replace('/', '-')}"))
    md.storage_data[MetadataIndex("extra")] = type(next(iter(md.storage_data.values())))(
        "__0_0.distcp", target.stat().st_size, len(payload))
    with open(target, "ab") as f:
        f.write(payload)
    (d / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    cases[case] = ["model", str(d), str(markers / case.replace("/", "-"))]

    md = pickle.loads((good / "optimizer" / ".metadata").read_bytes())
    info = md.storage_data[MetadataIndex(LR_KEY)]
    with open(good / "optimizer" / info.relative_path, "rb") as f:
        f.seek(info.offset)
        real_item = f.read(info.length)
    for name in item_gadgets(markers / "-", real_item):
        case = f"item/{name}"
        marker = markers / case.replace("/", "-")
        payload = item_gadgets(marker, real_item)[name]
        d = copy(case.replace("/", "-"))
        _rewrite_item(d, LR_KEY, payload)
        cases[case] = ["item", str(d), str(marker)]
    return cases


def _outcome(fn: Callable[[], Any]) -> dict:
    from planc.errors import PlancError

    try:
        fn()
        return {"error": None}
    except BaseException as e:  # noqa: BLE001 - the test asserts what it is
        return {"error": f"{type(e).__name__}: {e}", "planc": isinstance(e, PlancError)}


def save_good(root: Path, world: int) -> Path:
    """root/good: a planc.save checkpoint of a tiny Mixtral with AdamW state after one step (every rank)."""
    import planc

    if dist.get_rank() == 0:
        from planc.models.build import build_tiny_model

        build_tiny_model("mixtral", seed=0).save_pretrained(root / "hub")
    dist.barrier()
    model = planc.load(root / "hub", shipped_plan("mixtral", tp=world), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = batch(1)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    planc.save(model, root / "good", optimizer=optimizer)
    return root / "good"


def hostile_world(rank: int, world: int, root: str, save: bool) -> dict:
    """Every case of the corpus through planc.load (model cases) or planc.load_optimizer (optimizer and item
    cases) on every rank; `save`: write the good checkpoint and the corpus first."""
    import planc

    root_path = Path(root)
    if save:
        good = save_good(root_path, world)
        if rank == 0:
            write_corpus(good, root_path / "corpus")
            from fractions import Fraction

            shutil.copytree(good, root_path / "trusted_fraction")
            _rewrite_item(root_path / "trusted_fraction", LR_KEY, _torch_save(Fraction(1, 100)))
        dist.barrier()
    cases = {}
    for d in sorted((root_path / "corpus").iterdir()):
        if d.name != "markers":
            where, _, name = d.name.partition("-")
            cases[f"{where}/{name}"] = (where, str(d))
    plan = shipped_plan("mixtral", tp=world)
    model = planc.load(root_path / "good", plan, dtype=torch.float32)
    out: dict[str, Any] = {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR / 10)
    out["good"] = _outcome(lambda: planc.load_optimizer(model, optimizer, root_path / "good"))
    out["good"]["lr"] = optimizer.param_groups[0]["lr"]
    # the opt-in: a checkpoint planc cannot read as data (a Fraction hyperparameter) loads when trusted, and warns
    import warnings

    trusted = root_path / "trusted_fraction"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = torch.optim.AdamW(model.parameters(), lr=LR / 10)
        out["trusted"] = _outcome(lambda: planc.load_optimizer(model, fresh, trusted, trust_checkpoint_code=True))
        out["trusted"]["lr"] = repr(fresh.param_groups[0]["lr"])
    out["trusted"]["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    fresh = torch.optim.AdamW(model.parameters(), lr=LR / 10)
    out["untrusted"] = _outcome(lambda: planc.load_optimizer(model, fresh, trusted))
    for case, (where, path) in sorted(cases.items()):
        if where == "model":
            out[case] = _outcome(lambda p=path: planc.load(p, plan, dtype=torch.float32))
        else:
            fresh = torch.optim.AdamW(model.parameters(), lr=LR / 10)
            out[case] = _outcome(lambda o=fresh, p=path: planc.load_optimizer(model, o, p))
            out[case]["restored"] = len(fresh.state)  # a refused load leaves no state behind
    return out


__all__ = ["LR_KEY", "hostile_world", "write_corpus"]
