"""Code that runs on every rank of a spawned gloo world for the checkpoint tests (module level: spawn pickles
functions by name). Worlds return logits and messages; the tests compare them across worlds."""

from __future__ import annotations

import copy
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tests.runtime.workers import SHIPPED, batch, shipped_case_plan, tiny_for_case


def plan_for(kind: str, name: str, world_size: int) -> dict:
    """`ep`: the shipped plan `plans/<name>.yaml` at tp = ep = world; `packed`: mixtral with experts
    tensor-parallel (`packed_colwise` gate_up: a `_StridedShard`, the DCP caveat), ep 1; `tied`: the shipped plan
    without its embedding / lm_head rules (a tied tensor stays whole), for a model with tied embeddings."""
    if kind in ("ep", "tied"):
        plan = shipped_case_plan(name, tp=world_size)
        if kind == "tied":
            plan["tp_plan"] = {k: v for k, v in plan["tp_plan"].items() if k not in ("model.embed_tokens", "lm_head")}
        return plan
    plan = shipped_case_plan(name, tp=world_size, ep=1)
    plan["ep_plan"] = {}
    plan["tp_plan"].update(
        {
            "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
            "model.layers.*.mlp.experts.down_proj": "rowwise",
            "model.layers.*.mlp.experts": "moe_tp_experts",
        }
    )
    return plan


def _quantizes_at_apply(name: str) -> bool:
    return (shipped_case_plan(name, tp=1)["experts"].get("megamoe") or {}).get("quantize") == "fp4"


# Plans that quantize experts to FP4 at apply time: planc.save/export refuse the applied model (it no longer holds
# the weights the plan starts from); the tests check the refusal.
REFUSED = {f"{name}-ep" for name in SHIPPED if _quantizes_at_apply(name)}
REFUSAL = "quantizes the experts to FP4 at apply time (`experts.megamoe.quantize: fp4`)"
# Every other shipped plan as saved/exported at 2 ranks, plus mixtral's packed-TP experts and tied embeddings.
CASES = [(name, "ep") for name in SHIPPED if f"{name}-ep" not in REFUSED] + [("mixtral", "packed"), ("mixtral", "tied")]


def model_for(name: str, kind: str, seed: int):
    return tiny_for_case(name, seed=seed, **({"tie_word_embeddings": True} if kind == "tied" else {}))


def is_tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def logits(model, seed: int = 11) -> torch.Tensor:
    with torch.no_grad():
        return model(batch(seed)).logits.detach().clone()


def load_on_meta(directory, plan, *, dtype=torch.float32, **config_overrides):
    """What planc.load does with a planc.save directory: the model on meta from the checkpoint's config,
    compiled and sharded on meta (install's own step), filled by fill_from_dcp, then the other install steps."""
    from transformers import AutoConfig

    from planc import compile as planc_compile
    from planc.checkpoint.dcp import fill_from_dcp
    from planc.runtime import install
    from planc.runtime.mesh import build_groups

    config = AutoConfig.from_pretrained(directory)
    config._attn_implementation = "eager"
    for name, value in config_overrides.items():
        setattr(config, name, value)
    from planc.models.build import model_class_for

    with torch.device("meta"):
        model = model_class_for(config)._from_config(config, dtype=dtype)
    compiled = planc_compile(model, plan)
    groups = build_groups(compiled.parallel)
    state = install.InstallState(model=model, compiled=compiled, groups=groups)
    shard = install.INSTALL_STEPS.index(install.step_shard_parameters)
    for step in install.INSTALL_STEPS[: shard + 1]:
        step(state)
    fill_from_dcp(model, directory, compiled=compiled, groups=groups)
    for step in install.INSTALL_STEPS[shard + 1 :]:
        step(state)
    return model.eval()


def _refusals(world_size, root, action) -> dict:
    """{case: the error of planc.save/export (`action`) on each refused case, applied at `world_size`}."""
    import planc

    out = {}
    for key in sorted(REFUSED):
        model = model_for(key[: -len("-ep")], "ep", seed=3)
        planc.apply(model, plan_for("ep", key[: -len("-ep")], world_size))
        try:
            getattr(planc, action)(model, Path(root) / "refused" / key)
            out[key] = "written"
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out[key] = f"{type(e).__name__}: {e}"
    return out


def save_world(rank, world_size, root):
    """Apply each case at `world_size`, record its logits (and the unsharded model's), save it; then reload it
    in this same world under the same plan (bit-identical)."""
    import planc

    out = {"refused": _refusals(world_size, root, "save")}
    for name, kind in CASES:
        key = f"{name}-{kind}"
        try:
            model = model_for(name, kind, seed=3)
            unsharded = logits(model)
            plan = plan_for(kind, name, world_size)
            planc.apply(model, plan)
            applied = logits(model)
            path = planc.save(model, Path(root) / key)
            again = load_on_meta(path, plan)
            out[key] = {"unsharded": unsharded, "applied": applied, "reloaded_same_plan": logits(again),
                        "tied": is_tied(model) and is_tied(again)}
        except Exception:  # noqa: BLE001 - report every case
            out[key] = traceback.format_exc()
    return out


def load_world(rank, world_size, root):
    """Load every saved case at this world size (other sizes than it was saved at) and return the logits."""
    out = {}
    for name, kind in CASES:
        key = f"{name}-{kind}"
        try:
            model = load_on_meta(Path(root) / key, plan_for(kind, name, world_size))
            out[key] = logits(model)
            out[f"{key}/tied"] = is_tied(model)
            import planc  # and through planc.load itself, which detects the planc.json and calls fill_from_dcp

            out[f"{key}/planc.load"] = logits(planc.load(Path(root) / key, plan_for(kind, name, world_size)))
        except Exception:  # noqa: BLE001 - report every case
            out[key] = traceback.format_exc()
    # A model that does not fit the checkpoint: the same CheckpointError on every rank, naming the keys.
    from planc.errors import CheckpointError

    for name, overrides in (("extra_layer", {"num_hidden_layers": 3}), ("wider", {"intermediate_size": 64})):
        try:
            load_on_meta(Path(root) / "mixtral-ep", plan_for("ep", "mixtral", world_size), **overrides)
            out[f"bad/{name}"] = "loaded"
        except CheckpointError as e:
            out[f"bad/{name}"] = str(e)
    return out


# ---- export, guards, interrupted saves ------------------------------------------------------------------------


def export_world(rank, world_size, root):
    """Export every case (mixtral-ep in 100 KB files, so with an index; exported twice: the second replaces
    the first) and return the applied logits; the tests load the exports with plain from_pretrained."""
    import planc

    out = {"refused": _refusals(world_size, root, "export")}
    for name, kind in CASES:
        key = f"{name}-{kind}"
        try:
            model = model_for(name, kind, seed=5)
            planc.apply(model, plan_for(kind, name, world_size))
            out[key] = logits(model)
            target = Path(root) / "export" / key
            if key == "mixtral-ep":
                planc.export(model, target)  # one file, then replaced by the sharded export
                planc.export(model, target, max_shard_size="100KB")
            else:
                planc.export(model, target)
        except Exception:  # noqa: BLE001 - report every case
            out[key] = traceback.format_exc()
    return out


class Injected(RuntimeError):
    pass


def _attempt(fn) -> str:
    try:
        fn()
        return "no error"
    except Exception as e:  # noqa: BLE001 - the tests read the type and message
        return f"{type(e).__name__}: {e}"


def _fingerprint_files(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def guards_world(rank, world_size, root):
    """save_pretrained and deepcopy refused; interrupted saves keep the old checkpoint; planc never replaces a
    directory it did not write."""
    import planc
    from planc.checkpoint import save as save_module
    from planc.models.build import build_tiny_model

    root = Path(root)
    out = {}
    plan = plan_for("ep", "mixtral", world_size)
    unapplied = build_tiny_model("mixtral", seed=1)
    out["save_unapplied"] = _attempt(lambda: planc.save(unapplied, root / "never"))
    model_a = build_tiny_model("mixtral", seed=1)
    model_a_copy = copy.deepcopy(model_a)  # before apply: still fine
    planc.apply(model_a, plan)
    out["save_pretrained"] = _attempt(lambda: model_a.save_pretrained(root / "sp"))
    out["save_pretrained_wrote"] = (root / "sp").exists()
    out["deepcopy_model"] = _attempt(lambda: copy.deepcopy(model_a))
    out["deepcopy_layer"] = _attempt(lambda: copy.deepcopy(model_a.model.layers[0].self_attn))
    out["copy_before_apply_is_plain"] = type(model_a_copy.model.layers[0].self_attn.q_proj.weight).__name__
    logits_a = logits(model_a)
    target = root / "ckpt"
    planc.save(model_a, target)
    before = _fingerprint_files(target)

    model_b = build_tiny_model("mixtral", seed=2)
    planc.apply(model_b, plan)
    logits_b = logits(model_b)
    original_write_metadata, original_write_shards = save_module._write_metadata, save_module._write_shards

    def metadata_then_fail(*args):
        original_write_metadata(*args)
        raise Injected("injected after writing planc.json")

    def shards_then_fail_on_rank1(state, directory):
        original_write_shards(state, directory)
        if rank == 1:
            raise Injected("injected on rank 1 after writing the shards")

    for name, patch in (("after_metadata", ("_write_metadata", metadata_then_fail)),
                        ("after_shards_rank1", ("_write_shards", shards_then_fail_on_rank1))):
        setattr(save_module, *patch)
        try:
            out[f"interrupted/{name}"] = _attempt(lambda: planc.save(model_b, target))
        finally:
            save_module._write_metadata, save_module._write_shards = original_write_metadata, original_write_shards
        dist.barrier()
        out[f"interrupted/{name}/unchanged"] = _fingerprint_files(target) == before
        out[f"interrupted/{name}/leftovers"] = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    out["interrupted/reload"] = (logits(load_on_meta(target, plan)) - logits_a).abs().max().item()

    # A crash between the two renames of a swap left only `.ckpt.planc-old`: the next save puts it back
    # first, so a save that then fails still leaves the previous checkpoint in place.
    dist.barrier()
    if rank == 0:
        target.rename(root / ".ckpt.planc-old")
        (root / ".ckpt.planc-partial").mkdir()  # and a partial one from the crashed save
        (root / ".ckpt.planc-partial" / "junk").write_text("x")
    dist.barrier()
    save_module._write_metadata = metadata_then_fail
    try:
        out["recover/failed_save"] = _attempt(lambda: planc.save(model_b, target))
    finally:
        save_module._write_metadata = original_write_metadata
    out["recover/restored"] = _fingerprint_files(target) == before
    # then a complete save replaces it
    planc.save(model_b, target)
    out["replaced/reload"] = (logits(load_on_meta(target, plan)) - logits_b).abs().max().item()
    out["replaced/leftovers"] = sorted(p.name for p in root.iterdir() if p.name.startswith("."))

    # never replace what planc did not write
    other = root / "notes"
    if rank == 0:
        other.mkdir()
        (other / "notes.txt").write_text("mine")
    dist.barrier()
    out["foreign/save"] = _attempt(lambda: planc.save(model_b, other))
    out["foreign/export"] = _attempt(lambda: planc.export(model_b, other))
    out["foreign/export_over_checkpoint"] = _attempt(lambda: planc.export(model_b, target))
    out["foreign/kept"] = sorted(p.name for p in other.iterdir())
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().contiguous().view(torch.uint8)


def fp8_kept_world(rank, world_size, root):
    """An FP8 checkpoint loaded with FP8 kept (`dequantize=False`), then planc.save -> planc.load (FP8 kept) and
    planc.export. Returns what differs between the reloaded and the kept model (every local shard, bit for bit),
    the reloaded modules' classes, and the refusal of a dequantized reload; the test reads the export back."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    import planc
    from tests.runtime.workers import shipped_plan

    out = {}
    path = Path(root) / "fp8"
    plan = shipped_plan("deepseek_v3", tp=world_size)
    try:
        kept = planc.load(path, plan, dtype=torch.float32, dequantize=False)
        planc.save(kept, Path(root) / "saved")
        reloaded = planc.load(Path(root) / "saved", plan, dtype=torch.float32)  # FP8 kept: the checkpoint's mode
        mine, theirs = dict(kept.named_parameters()), dict(reloaded.named_parameters())
        out["keys"] = sorted(set(mine) ^ set(theirs))
        out["dtypes"] = sorted({str(p.dtype) for p in theirs.values()})
        out["differ"] = [n for n in mine if n in theirs and (mine[n].dtype != theirs[n].dtype or not torch.equal(
            _bits(mine[n]), _bits(theirs[n])))]
        out["fp8_modules"] = [sum(isinstance(m, cls) for m in model.modules()) for model in (kept, reloaded)
                              for cls in (FP8Linear, FP8Experts)]
        out["quantization_config"] = getattr(reloaded.config, "quantization_config", None) is not None
        out["fingerprint"] = kept._planc_plan.fingerprint == reloaded._planc_plan.fingerprint
        out["dequantized_reload"] = _attempt(
            lambda: planc.load(Path(root) / "saved", plan, dtype=torch.float32, dequantize=True))
        planc.export(kept, Path(root) / "exported", max_shard_size="300KB")
    except Exception:  # noqa: BLE001 - report the traceback to the test
        out["error"] = traceback.format_exc()
    return out


def gloo_workers_after_drain(rank: int, world_size: int) -> tuple[int, bool]:
    """An all_reduce, then planc's exit drain: how many gloo worker threads the drain watched, and whether they all
    sleep after it (the drain finds them by torch's thread name; a rename would make it watch nothing)."""
    import os

    from planc.runtime.exit_drain import GLOO_WORKER_THREAD, drain_gloo_workers, gloo_workers_asleep

    import time

    def named() -> int:
        names = []
        for t in os.listdir("/proc/self/task"):
            try:
                names.append(open(f"/proc/self/task/{t}/comm").read().strip())
            except OSError:
                pass  # a thread that ended meanwhile
        return names.count(GLOO_WORKER_THREAD)

    dist.all_reduce(torch.ones(4))
    # each of the group's two workers names itself when it first runs; on loaded cores the one that served no
    # work may not have run yet (seen once: 1 named), so give it a moment before counting
    deadline = time.monotonic() + 10
    while named() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    drain_gloo_workers()
    return named(), bool(gloo_workers_asleep())
