"""How long planc.apply takes against transformers' own install, and compile time.

Why: apply runs once per process start, on every rank; it must not be the slow part of bringing a
model up. Each repetition installs onto a fresh deep copy of the same seeded tiny model (the copy is not
timed), alternating transformers (`prepare_distribute_model` + `maybe_distribute_model`, i.e. meshes
and plan resolution included, as planc.apply builds its groups and compiles) and `planc.apply` with the
shipped plan (sizes set to the world). A repetition's time is its slowest rank's; the table shows medians.
transformers uses the model's built-in plans; the "sharded tensors" columns show both installs shard
the same kind of thing.

`planc.compile` on the full-size meta models is `bench/compile_fullsize.py` (the compiler's benchmark,
against transformers' own plan resolution); the "of which compile" column here is the tiny model's.

    python bench/apply_time.py --json apply_time.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from ep_forward_cpu import machine, spawn  # noqa: E402  (same directory: the gloo spawn harness)

MODELS = ("mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v4")
PLAN_FILES = {
    "mixtral": "mixtral.yaml", "qwen3_moe": "qwen3_moe.yaml", "deepseek_v3": "deepseek_v3.yaml",
    "deepseek_v4": "deepseek_v4_allreduce.yaml", "gpt_oss": "gpt_oss.yaml",
}


def plan_for(model_type: str, world: int) -> dict:
    """The shipped plan as a mapping (extends resolved), sizes = world."""
    import planc

    plan = planc.load_plan(str(REPO / "plans" / PLAN_FILES[model_type])).plan.model_dump(mode="json", exclude_none=True)
    plan.pop("extends", None)
    plan["parallel"] = {"tp_size": world, "ep_size": world}
    return plan


def sharded_tensors(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum(isinstance(p, DTensor) for p in model.parameters())


def install_peer(model, world: int):
    from transformers import DistributedConfig

    dc, _, mesh_manager = type(model).prepare_distribute_model(DistributedConfig(tp_size=world, ep_size=world))
    return type(model).maybe_distribute_model(model, dc, mesh_manager)


def time_apply(rank: int, world: int, models, reps: int) -> list:
    import torch
    import torch.distributed as dist

    import planc
    from planc.models.build import build_tiny_model

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the built-in plans' "rule matches nothing" warnings, once per repetition
    rows = []
    for model_type in models:
        base = build_tiny_model(model_type, seed=0)
        plan = plan_for(model_type, world)
        times = {"transformers": [], "planc": [], "planc.compile": []}
        counts = {}
        for r in range(reps + 1):  # the first repetition is warmup (imports, first group creation)
            order = ("transformers", "planc") if r % 2 == 0 else ("planc", "transformers")
            for side in order:
                m = copy.deepcopy(base)
                dist.barrier()
                t0 = time.perf_counter()
                if side == "planc":
                    planc.apply(m, plan)
                else:
                    install_peer(m, world)
                dt = time.perf_counter() - t0
                counts[side] = sharded_tensors(m)
                if r:
                    times[side].append(dt)
                del m
            m = copy.deepcopy(base)
            t0 = time.perf_counter()
            planc.compile(m, plan)
            if r:
                times["planc.compile"].append(time.perf_counter() - t0)
        agg = {}
        for side, ts in times.items():
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            agg[side] = statistics.median(t.tolist()) * 1e3
        row = {"model": model_type, "world": world, "reps": reps, "transformers_ms": agg["transformers"],
               "planc_ms": agg["planc"], "planc_compile_ms": agg["planc.compile"],
               "ratio": agg["planc"] / agg["transformers"], "transformers_sharded": counts["transformers"],
               "planc_sharded": counts["planc"]}
        rows.append(row)
        if rank == 0:
            print(f"  {model_type:12s} transformers {row['transformers_ms']:8.1f} ms  planc.apply {row['planc_ms']:8.1f} ms "
                  f"(compile {row['planc_compile_ms']:.1f})  ratio {row['ratio']:.2f}", flush=True)
    return rows


def markdown(apply_rows) -> str:
    out = []
    if apply_rows:
        out += ["| tiny model | transformers ms | planc.apply ms | of which compile ms | planc / transformers | "
                "sharded tensors (transformers / planc) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in apply_rows:
            out.append(f"| {r['model']} | {r['transformers_ms']:.1f} | {r['planc_ms']:.1f} | {r['planc_compile_ms']:.1f} | "
                       f"{r['ratio']:.2f} | {r['transformers_sharded']} / {r['planc_sharded']} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(PLAN_FILES))
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    started = time.perf_counter()
    print(f"[apply_time] planc.apply vs transformers on {args.world} gloo ranks", flush=True)
    apply_rows = spawn(time_apply, args.world, args.models, args.reps) if args.models else []
    print(f"\nMachine: {machine()}; wall {time.perf_counter() - started:.0f} s\n")
    print(markdown(apply_rows))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"benchmark": "apply_time", "machine": machine(), "apply": apply_rows},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
