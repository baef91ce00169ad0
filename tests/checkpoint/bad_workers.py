"""Rank code and damaged checkpoints for tests/checkpoint/test_bad_checkpoints.py.

Every damaged checkpoint is a copy of one tiny Mixtral written by `save_pretrained` (hub layout: per-expert
`block_sparse_moe.experts.N.w1/w2/w3`, sharded with an index), damaged the way users' checkpoints break.
Each rank records, per case, what `planc.load` raised, whether it is a PlancError, and how many tensor slices it
read (`MappedSlice.reads`, counted by files.py for every slice indexed: 0 means no tensor byte was read).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from tests.runtime.workers import batch, shipped_plan

INDEX = "model.safetensors.index.json"
EXPERT = "model.layers.0.block_sparse_moe.experts.{i}.{w}.weight"


def write_good(path: Path) -> None:
    from planc.models.build import build_tiny_model

    build_tiny_model("mixtral", seed=0).save_pretrained(path, max_shard_size="40KB")


def _rewrite(d: Path, fn) -> None:
    """Apply `fn(tensors) -> tensors` to the shard holding expert 0's w1 (the index follows the keys)."""
    from safetensors.torch import load_file, save_file

    index = json.loads((d / INDEX).read_text())
    file = index["weight_map"][EXPERT.format(i=0, w="w1")]
    tensors = fn(load_file(d / file))
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, d / file, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file}
    index["weight_map"].update({k: file for k in tensors})
    (d / INDEX).write_text(json.dumps(index))


def write_damaged(good: Path, root: Path) -> dict[str, str]:
    """{case: directory} for every safetensors-route case; the good checkpoint is never touched."""
    cases = {}

    def copy(name):
        d = root / name
        shutil.copytree(good, d, symlinks=True)
        cases[name] = str(d)
        return d

    w1 = EXPERT.format(i=0, w="w1")
    # 1. same byte length, another dtype: read as is, it would load and give wrong logits
    _rewrite(copy("expert_i32"), lambda t: {**t, w1: t[w1].view(torch.int32)})
    # 2. per-expert problems
    _rewrite(copy("expert_missing"), lambda t: {k: v for k, v in t.items() if k != w1})
    _rewrite(copy("expert_extra"), lambda t: {**t, EXPERT.format(i=8, w="w1"): t[w1].clone()})
    _rewrite(copy("expert_shape"), lambda t: {**t, w1: t[w1][:-1]})
    # 6. misleading messages
    d = copy("dangling_link")
    single = root / "single_source"
    from planc.models.build import build_tiny_model

    build_tiny_model("mixtral", seed=0).save_pretrained(single)
    for f in d.glob("model*.safetensors*"):
        f.unlink()
    os.symlink(single / "gone.safetensors", d / "model.safetensors")
    d = copy("swap_interrupted")  # the swap's first rename done, the second not: the old copy beside it
    os.rename(d, d.parent / ".swap_interrupted.planc-old")
    d = copy("header_dtype_vs_length")
    _header_dtype_lies(d)
    return cases


def _header_dtype_lies(d: Path) -> None:
    """Change one tensor's header dtype from F32 to F16 (half the bytes its range holds), same header length."""
    index = json.loads((d / INDEX).read_text())
    file = d / index["weight_map"]["model.norm.weight"]
    data = bytearray(file.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["model.norm.weight"]["dtype"] = "F16"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    data[8 : 8 + n] = text
    file.write_bytes(bytes(data))


def _outcome(fn) -> dict:
    from planc.checkpoint.files import MappedSlice
    from planc.errors import PlancError

    before = MappedSlice.reads
    try:
        fn()
        out = {"error": None}
    except BaseException as e:  # noqa: BLE001 - the test asserts what it is
        out = {"error": f"{type(e).__name__}: {e}", "planc": isinstance(e, PlancError)}
    out.update(reads=MappedSlice.reads - before)
    return out


def load_outcome(path: str, **kw) -> dict:
    from planc import load

    return _outcome(lambda: load(path, shipped_plan("mixtral", tp=dist.get_world_size()), dtype=torch.float32, **kw))


def bad_world(rank: int, world: int, cases: dict[str, str], fp8: str) -> dict:
    out = {name: load_outcome(path) for name, path in cases.items()}
    # 3. the quantization mode decided per rank (FP8 kept on rank 0, dequantized on rank 1): different fills
    out["quantization_disagrees"] = load_outcome(fp8, dequantize=rank == 1)
    # 5. the plan fails to load on rank 1 only (a plan file with an unknown style): the same error on every rank,
    # naming the file, line and column, before the checkpoint is opened
    import tempfile

    import yaml

    from planc import load

    plan = shipped_plan("mixtral", tp=world)
    with tempfile.TemporaryDirectory(prefix="planc-bad-plan-") as tmp:
        if rank == 1:
            plan["tp_plan"]["lm_head"] = "colwise_gather_outputs"
            path = Path(tmp) / "mixtral.yaml"
            path.write_text(yaml.safe_dump({k: v for k, v in plan.items() if v is not None}, sort_keys=False))
            plan = str(path)
        out["plan_invalid_on_rank1"] = _outcome(lambda: load(fp8, plan, dtype=torch.float32))
    return out


def dcp_world(rank: int, world: int, hub: str, model_layout: str, root: str) -> dict:
    """planc.save checkpoints damaged after saving, a save failing under EFBIG, and ranks that see different
    checkpoints (route, headers): every outcome per rank."""
    from planc import load, save

    root_path = Path(root)
    out = {}
    model = load(hub, shipped_plan("mixtral", tp=world), dtype=torch.float32)
    with torch.no_grad():
        out["logits"] = model(batch(1)).logits
    good = root_path / "saved"
    save(model, good)
    if rank == 0:
        for name in ("distcp_missing", "distcp_truncated", "damaged_marker"):
            shutil.copytree(good, root_path / name)
        (root_path / "damaged_marker" / "planc.json").write_text('{"format": "planc-dcp", "format_ver')
        os.remove(root_path / "distcp_missing" / "__1_0.distcp")
        f = root_path / "distcp_truncated" / "__1_0.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    dist.barrier()
    for name in ("distcp_missing", "distcp_truncated", "damaged_marker"):
        out[name] = load_outcome(str(root_path / name))
    # 3. the route (DCP or safetensors) decided per rank: rank 0 a hub checkpoint, rank 1 a planc.save one
    out["route_disagrees"] = load_outcome(hub if rank == 0 else str(good))
    # ... and which checkpoint each rank sees (the same model in another layout)
    out["checkpoint_disagrees"] = load_outcome(hub if rank == 0 else model_layout)
    # 4. a save that fails with EFBIG on rank 1 (file size limit; SIGXFSZ ignored so write() fails instead)
    before = _listing(good)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        out["save_efbig"] = _outcome(lambda: save(model, good))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, old_handler)
    dist.barrier()
    out["save_efbig"]["intact"] = _listing(good) == before
    out["save_efbig"]["left"] = sorted(p.name for p in root_path.iterdir() if p.name.startswith("."))
    reloaded = load(str(good), shipped_plan("mixtral", tp=world), dtype=torch.float32)
    with torch.no_grad():
        out["reloaded_same"] = torch.equal(reloaded(batch(1)).logits, out.pop("logits"))
    return out


def _listing(d: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.iterdir())}


def property_world(rank: int, world: int, good: str, scratch: str, max_examples: int) -> dict:
    """Random byte flips in the safetensors headers and the index, and random truncations of any file: a load
    never hangs (the world is bounded), never raises anything but a PlancError, and never returns a model whose
    logits differ from the good checkpoint's."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from planc import load
    from planc.errors import PlancError

    plan = shipped_plan("mixtral", tp=world)
    good_path = Path(good)
    ids = batch(1)
    with torch.no_grad():
        reference = load(good, plan, dtype=torch.float32)(ids).logits
    names = sorted(p.name for p in good_path.iterdir()
                   if p.suffix in (".safetensors", ".json") and p.name != "config.json")
    outcomes = {"refused": 0, "loaded": 0}

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def damaged_never_lies(data):
        name = data.draw(st.sampled_from(names), label="file")
        raw = bytearray((good_path / name).read_bytes())
        if data.draw(st.booleans(), label="truncate"):
            raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="keep bytes")]
        else:
            end = len(raw) if name.endswith(".json") else 8 + int.from_bytes(raw[:8], "little")
            at = data.draw(st.integers(0, end - 1), label="byte")
            raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        case = Path(scratch) / f"rank{rank}"
        shutil.rmtree(case, ignore_errors=True)
        shutil.copytree(good_path, case)
        (case / name).write_bytes(bytes(raw))
        try:
            model = load(str(case), plan, dtype=torch.float32)
        except PlancError as e:
            assert "Traceback" not in str(e), str(e)
            outcomes["refused"] += 1
            return
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference), f"{name} damaged, loaded, and the logits differ"
        outcomes["loaded"] += 1

    damaged_never_lies()
    return outcomes
