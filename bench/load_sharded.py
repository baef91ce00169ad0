"""Sharded loading: planc.load against transformers' own sharded from_pretrained
and against today's route (full from_pretrained on every rank, then planc.apply), in one run.

Two checkpoints (`--checkpoint`), both in the hub's per-expert layout (what `save_pretrained` writes:
sharded files with an index):

- `mixtral`: a random mid-size Mixtral (experts.N.w1/w2/w3), fp32, >= 1.4 GiB, loaded in fp32;
- `deepseek_v3_fp8`: a random DeepSeek-V3 in the DeepSeek FP8 format (every decoder linear float8_e4m3fn +
  `weight_scale_inv` per 128 x 128 block, `quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`),
  loaded in bf16. Without a GPU every route dequantizes it as it loads (transformers' rule), planc per shard.

Each route runs in its own fresh gloo world (peak RSS is a per-process high-water mark), one route after the other:

- `planc.load(dir, plan)` (the shipped plan of the family, sizes = world);
- transformers: `from_pretrained(dir, distributed_config=DistributedConfig(tp_size=N, ep_size=N))`
  (its built-in TP + EP plans);
- full + apply: `from_pretrained(dir)` of the whole model on every rank, then `planc.apply(plan)`.

Per rank: the process baseline (RSS after importing torch/transformers and joining the group), the
peak RSS over the load (the kernel's high-water mark VmHWM, reset right before the load) minus that baseline, the bytes the rank holds afterwards, the
largest single checkpoint tensor, and the load's wall time (the slowest rank's). Logits of planc.load
are compared with full + apply bit for bit. The bars it is held to: peak <= 1.1 x transformers' and <= local
shard bytes + largest tensor + 400 MiB; time ratio planc / transformers <= 1.0.

    python bench/load_sharded.py --workdir /tmp/planc-load-bench --world-sizes 2 4 --json load.json
    python bench/load_sharded.py --checkpoint deepseek_v3_fp8 --world-sizes 2 4 --json load-fp8.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MIB = 1 << 20
# 433M parameters, 1.61 GiB in fp32: 4 layers of 8 experts (1024 -> 3584), vocabulary 32000.
MIXTRAL = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=8, head_dim=64, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
    tie_word_embeddings=False,
)
# DeepSeek-V3 in FP8, 0.45 GiB on disk (0.85 GiB in bf16): 4 layers (1 dense + 3 of 16 experts, 2048 -> 1024), MLA
# attention; every dim a TP style splits is a multiple of 4 x 128 (on the scale grid at 2 and 4 ranks).
DEEPSEEK_V3 = dict(
    vocab_size=16000, hidden_size=2048, intermediate_size=2048, moe_intermediate_size=1024, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=16, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
    n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=384, q_lora_rank=768, qk_rope_head_dim=128,
    qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=512, tie_word_embeddings=False,
)
CHECKPOINTS = {  # name: (model type, plan file, load dtype, vocabulary)
    "mixtral": ("mixtral", "mixtral.yaml", "float32", MIXTRAL["vocab_size"]),
    "deepseek_v3_fp8": ("deepseek_v3", "deepseek_v3.yaml", "bfloat16", DEEPSEEK_V3["vocab_size"]),
}
ROUTES = ("planc.load", "transformers", "full+apply")


def write_checkpoint(path: Path, name: str = "mixtral") -> None:
    """A random model of the sizes above in the hub layout (once; reused when the directory exists)."""
    if (path / "model.safetensors.index.json").is_file():
        return
    import torch

    torch.manual_seed(0)
    if name == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(**MIXTRAL)).to(torch.float32)
        model.save_pretrained(path, max_shard_size="300MB")
        return
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    unquantized = Path(str(path) + ".bf16")
    if not (unquantized / "model.safetensors.index.json").is_file():
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_V3)).to(torch.bfloat16)
        model.save_pretrained(unquantized, max_shard_size="200MB")
        del model
    write_fp8(unquantized, path)


def write_fp8(src: Path, dst: Path) -> None:
    """The DeepSeek FP8 format of `src` (the tests' writer), written beside `dst` and renamed when complete."""
    import shutil

    from tests.runtime.load_fp8_workers import quantize_checkpoint

    tmp = Path(str(dst) + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    quantize_checkpoint(src, tmp)
    tmp.rename(dst)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _reset_peak() -> None:
    """Reset the kernel's RSS high-water mark (VmHWM), so the peak is the load's, not the imports'."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _held_bytes(model) -> int:
    """Bytes this rank holds in parameters and buffers (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        local = t.to_local() if isinstance(t, DTensor) else t
        key = local.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += local.untyped_storage().nbytes()
    return total


def _plan(world: int, name: str = "mixtral") -> dict:
    import planc

    plan_file = CHECKPOINTS[name][1]
    plan = planc.load_plan(str(REPO / "plans" / plan_file)).plan.model_dump(mode="json", exclude_none=True)
    plan.pop("extends", None)
    plan["parallel"] = {"tp_size": world, "ep_size": world}
    return plan


def _warm_imports(model_type: str) -> None:
    """Every route's lazy imports (the family's modeling module, DTensor, planc's runtime, the FP8 integration)
    happen before the clock starts and before the RSS baseline, so no route pays for them inside the load."""
    import importlib

    for module in (f"transformers.models.{model_type}.modeling_{model_type}", "torch.distributed.tensor",
                   "transformers.integrations.finegrained_fp8", "transformers.quantizers.auto",
                   "transformers.generation.utils", "planc.runtime.install", "planc.checkpoint.load"):
        importlib.import_module(module)


def route_world(rank, world, route, path, name="mixtral", profile=None):
    """One route on one rank: baseline, load, peak; the logits of a fixed batch for the equality check.

    `profile`: a directory; the load runs under cProfile and each rank writes
    `<checkpoint>-w<world>-<route>-rank<r>.prof` there (`python -m pstats FILE`; the times then include the
    profiler's overhead)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    import planc

    plan = _plan(world, name)
    dtype = getattr(torch, CHECKPOINTS[name][2])
    _warm_imports(CHECKPOINTS[name][0])
    import gc

    gc.collect()
    dist.barrier()
    base = _rss_mib()
    _reset_peak()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    if route == "planc.load":
        model = planc.load(path, plan, dtype=dtype)
    elif route == "transformers":
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=DistributedConfig(tp_size=world, ep_size=world)
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        planc.apply(model, plan)
    dist.barrier()
    seconds = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        Path(profile).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(Path(profile) / f"{name}-w{world}-{route}-rank{rank}.prof"))
    peak = _peak_mib()
    held = _held_bytes(model) / MIB
    ids = torch.randint(0, CHECKPOINTS[name][3], (1, 16), generator=torch.Generator().manual_seed(0))
    logits = None
    if route != "transformers":
        model.eval()
        with torch.no_grad():
            logits = model(ids).logits
    return {"base_mib": base, "peak_over_base_mib": peak - base, "held_mib": held, "seconds": seconds,
            "rss_after_mib": _rss_mib() - base, "logits": logits}


def largest_tensor_mib(path: Path) -> float:
    from planc.checkpoint.files import CheckpointFiles

    files = CheckpointFiles.open(path)
    try:
        return max(t.nbytes for t in files.tensors.values()) / MIB
    finally:
        files.close()


def run(path: Path, worlds, routes, name: str = "mixtral", profile=None) -> list[dict]:
    from planc.runtime.local_world import run_local_world

    import torch

    largest = largest_tensor_mib(path)
    total = sum(p.stat().st_size for p in path.glob("*.safetensors")) / MIB
    rows = []
    for world in worlds:
        logits = {}
        for route in routes:
            per_rank = run_local_world(route_world, world, route, str(path), name, profile)
            logits[route] = [r.pop("logits") for r in per_rank]
            rows.append({
                "checkpoint": name, "world": world, "route": route, "checkpoint_mib": total,
                "largest_tensor_mib": largest,
                "peak_over_base_mib": max(r["peak_over_base_mib"] for r in per_rank),
                "held_mib": max(r["held_mib"] for r in per_rank),
                "seconds": max(r["seconds"] for r in per_rank),
                "base_mib": max(r["base_mib"] for r in per_rank),
                "ranks": per_rank,
            })
        if "planc.load" in logits and "full+apply" in logits:
            same = all(torch.equal(a, b) for a, b in zip(logits["planc.load"], logits["full+apply"]))
            for r in rows:
                if r["world"] == world and r["route"] == "planc.load":
                    r["bit_identical_to_full_apply"] = same
    return rows


def markdown(rows: list[dict]) -> str:
    out = []
    for world in sorted({r["world"] for r in rows}):
        mine = {r["route"]: r for r in rows if r["world"] == world}
        peer = mine.get("transformers")
        pl = mine.get("planc.load")
        out += [
            f"**{rows[0].get('checkpoint', 'mixtral')}, {world} gloo ranks** (checkpoint "
            f"{rows[0]['checkpoint_mib']:.0f} MiB, largest tensor "
            f"{rows[0]['largest_tensor_mib']:.0f} MiB; per rank, the worst rank):",
            "",
            "| route | peak RSS over baseline MiB | held after MiB | load s | peak / transformers | time / transformers |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for route in ROUTES:
            r = mine.get(route)
            if r is None:
                continue
            pr = f"{r['peak_over_base_mib'] / peer['peak_over_base_mib']:.2f}" if peer else "n/a"
            tr = f"{r['seconds'] / peer['seconds']:.2f}" if peer else "n/a"
            out.append(f"| {route} | {r['peak_over_base_mib']:.0f} | {r['held_mib']:.0f} | {r['seconds']:.2f} | {pr} | {tr} |")
        if pl:
            bar = pl["held_mib"] + pl["largest_tensor_mib"] + 400
            out += [
                "",
                f"planc.load: peak {pl['peak_over_base_mib']:.0f} MiB vs the bar local shards + largest tensor + 400 MiB "
                f"= {bar:.0f} MiB ({'within' if pl['peak_over_base_mib'] <= bar else 'OVER'}); logits bit-identical to "
                f"full + apply: {pl.get('bit_identical_to_full_apply')}",
                "",
            ]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/planc-load-bench", help="where the checkpoint is written (kept)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    p.add_argument("--checkpoint", choices=sorted(CHECKPOINTS), default="mixtral")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--profile", metavar="DIR", help="run every load under cProfile; each rank writes "
                   "DIR/<checkpoint>-w<world>-<route>-rank<r>.prof (times then include the profiler's overhead)")
    args = p.parse_args(argv)
    path = Path(args.workdir) / ("mixtral-hub" if args.checkpoint == "mixtral" else f"{args.checkpoint}-hub")
    write_checkpoint(path, args.checkpoint)
    rows = run(path, args.world_sizes, args.routes, args.checkpoint, args.profile)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
