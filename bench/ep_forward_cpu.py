"""planc's EP forward against transformers' own, on CPU over gloo.

Why this shape of measurement: a user picks planc only if it is at least as fast as what they already
run, so each cell times planc and transformers' `AllToAllEP` / `AllReduceEP` in the same processes, on
the same weights, tokens and world, with the repetitions interleaved (peer, planc, planc, peer, ...)
so that drift on a shared box hits both sides alike. The peer is installed the way transformers does it
(`prepare_distribute_model` + `maybe_distribute_model` on a seeded model built from config); planc by
`planc.apply` with the shipped Mixtral plan, sizes and `ep_implementation` set per cell.

Models: one MoE layer (the `MixtralSparseMoeBlock`: router + experts + EP) of a mid-size Mixtral-like
config (hidden 1024, 8 experts, top-2, intermediate 2816), and a full tiny Mixtral (`planc.models.build`).
Each rank times its own call; a cell's time is the median over repetitions of the slowest rank, and its
ratio the median over repetitions of planc / transformers (adjacent in time, so drift cancels).
Torch runs one thread per rank so ranks do not fight over the cores.

    python bench/ep_forward_cpu.py --json ep_forward_cpu.json          # 2 and 4 ranks, ~5 min on 2 cores
    python bench/ep_forward_cpu.py --world-sizes 2 --quick               # smoke run
    python bench/ep_forward_cpu.py --profile 2 all_reduce layer 2048     # torch.profiler of both sides of one cell
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
for _p in (str(REPO), str(REPO / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from machine import describe  # noqa: E402  (same directory)

WORLD_SIZES = (2, 4)
TOKENS = (1, 16, 256, 2048)
IMPLS = ("all_to_all", "all_reduce")
MODELS = ("layer", "tiny")
# (warmup, repetitions) per token count: big cells cost ~0.5 s a call on one core, keep them few.
REPS = {1: (3, 40), 16: (3, 40), 256: (2, 15), 2048: (1, 5)}
QUICK_REPS = {1: (1, 3), 16: (1, 3), 256: (1, 3), 2048: (1, 2)}

MID_CONFIG = dict(
    vocab_size=128, hidden_size=1024, intermediate_size=2816, num_hidden_layers=1, num_attention_heads=8,
    num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=4096, tie_word_embeddings=False,
)


# ---- models and installs -----------------------------------------------------------------------------------


def bench_model(kind: str, seed: int = 0):
    """The unsharded model of `kind`, identical on every rank (same seed), fp32, eval."""
    import torch

    if kind == "tiny":
        from planc.models.build import build_tiny_model

        return build_tiny_model("mixtral", seed=seed, experts_implementation="grouped_mm", max_position_embeddings=4096)
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**MID_CONFIG)
    config._attn_implementation = "eager"
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).eval()


def planc_plan(world: int, impl: str) -> dict:
    """The shipped Mixtral plan as a mapping, with sizes set to the world and the EP implementation of the cell."""
    import yaml

    plan = yaml.safe_load((REPO / "plans" / "mixtral.yaml").read_text())
    plan["parallel"] = {"tp_size": world, "ep_size": world}
    plan["experts"] = {**plan["experts"], "implementation": "grouped_mm", "ep_implementation": impl}
    return plan


def install_peer(model, world: int, impl: str):
    """transformers' own TP + EP: the model's built-in plans, `ep_implementation=impl`."""
    from transformers import DistributedConfig

    dc = DistributedConfig(tp_size=world, ep_size=world, ep_implementation=impl)
    cls = type(model)
    dc, _, mesh_manager = cls.prepare_distribute_model(dc)
    return cls.maybe_distribute_model(model, dc, mesh_manager)


def install_planc(model, world: int, impl: str):
    import planc

    planc.apply(model, planc_plan(world, impl))
    return model


def forward_fn(kind: str, model, tokens: int, seed: int = 1):
    """A no-arg callable running the timed forward on fixed inputs (same on every rank)."""
    import torch

    gen = torch.Generator().manual_seed(seed + tokens)
    if kind == "layer":
        block = model.model.layers[0].mlp
        x = torch.randn(1, tokens, model.config.hidden_size, generator=gen)
        return lambda: block(x)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)
    return lambda: model(input_ids=ids, use_cache=False).logits


def _tensor(out):
    return out[0] if isinstance(out, tuple) else out


# ---- timing --------------------------------------------------------------------------------------------------


def time_interleaved(fns: dict, warmup: int, reps: int) -> dict:
    """Per-side call times of this rank, repetitions interleaved (ABBA) so drift hits both sides alike."""
    import torch.distributed as dist

    names = list(fns)
    times = {n: [] for n in names}
    for _ in range(warmup):
        for n in names:
            fns[n]()
    for r in range(reps):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            dist.barrier()
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def slowest_rank(times: dict) -> dict:
    """Element-wise max over ranks of each side's per-repetition times (the world waits for its slowest rank)."""
    import torch
    import torch.distributed as dist

    out = {}
    for n, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[n] = t.tolist()
    return out


def run_cells(rank: int, world: int, models, impls, tokens, reps_table, profile=None) -> list:
    """Every (model, impl, tokens) cell of one world size; returns rows (rank 0's are the ones printed)."""
    import torch

    rows = []
    for kind in models:
        base = bench_model(kind)
        for impl in impls:
            peer = install_peer(copy.deepcopy(base), world, impl)
            try:
                ours = install_planc(copy.deepcopy(base), world, impl)
                planc_error = None
            except Exception as e:  # noqa: BLE001 - a missing or failing planc still prints the peer's numbers
                ours, planc_error = None, f"{type(e).__name__}: {e}"
                if rank == 0:
                    print(f"[ep_forward_cpu] planc.apply failed ({kind}, {impl}): {planc_error}", file=sys.stderr)
            for t in tokens:
                fns = {"peer": forward_fn(kind, peer, t)}
                if ours is not None:
                    fns["planc"] = forward_fn(kind, ours, t)
                with torch.no_grad():
                    diff = None
                    if ours is not None:
                        diff = float((_tensor(fns["peer"]()) - _tensor(fns["planc"]())).abs().max())
                    if profile is not None:
                        rows.append(profile_cell(rank, fns, f"{world}-{kind}-{impl}-{t}"))
                        continue
                    warmup, reps = reps_table[t]
                    times = slowest_rank(time_interleaved(fns, warmup, reps))
                peer_s = statistics.median(times["peer"])
                planc_s = statistics.median(times["planc"]) if "planc" in times else None
                # Each repetition ran both sides back to back: the median of the per-repetition ratios cancels
                # the drift of a shared box better than the ratio of the medians (both are kept).
                paired = None
                if planc_s is not None:
                    paired = statistics.median(p / q for p, q in zip(times["planc"], times["peer"]))
                row = dict(
                    world=world, model=kind, impl=impl, tokens=t, reps=reps, peer_ms=peer_s * 1e3,
                    planc_ms=None if planc_s is None else planc_s * 1e3, ratio=paired,
                    ratio_of_medians=None if planc_s is None else planc_s / peer_s, max_abs_diff=diff,
                    planc_error=planc_error, peer_times_ms=[x * 1e3 for x in times["peer"]],
                    planc_times_ms=[x * 1e3 for x in times.get("planc", [])],
                )
                rows.append(row)
                if rank == 0:
                    print(_row_line(row), flush=True)
            del peer, ours
    return rows


def profile_cell(rank: int, fns: dict, label: str):
    """torch.profiler tables of both sides of one cell (rank 0 prints), to find what makes planc slower."""
    from torch.profiler import ProfilerActivity, profile

    for f in fns.values():
        f()
    tables = {}
    for name, f in fns.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                f()
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        if rank == 0:
            print(f"==== {label} {name} (3 calls, self CPU time) ====\n{tables[name]}", flush=True)
    return {"profile": label, **tables}


def _row_line(r: dict) -> str:
    planc_ms = "n/a" if r["planc_ms"] is None else f"{r['planc_ms']:.2f}"
    ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
    return f"  world={r['world']} {r['model']:5s} {r['impl']:10s} T={r['tokens']:5d}  peer {r['peer_ms']:9.2f} ms  planc {planc_ms:>9s} ms  ratio {ratio}"


# ---- spawn harness ----------------------------------------------------------------------------------------------


def spawn(fn, world: int, *args):
    """`fn(rank, world, *args)` on `world` gloo ranks (planc's own local-world launcher); rank 0's return value."""
    from planc.runtime.local_world import run_local_world

    return run_local_world(fn, world, *args)[0]


# ---- report --------------------------------------------------------------------------------------------------


def markdown_table(rows: list, world: int) -> str:
    lines = [
        f"**{world} gloo ranks**: median time of the slowest rank per call; ratio = median over repetitions of "
        "planc / transformers (the two run back to back in each repetition); <= 1.0 is as fast or faster",
        "",
        "| model | EP | tokens | transformers ms | planc ms | ratio | max abs diff |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r["world"] != world or "profile" in r:
            continue
        planc_ms = "n/a" if r["planc_ms"] is None else f"{r['planc_ms']:.2f}"
        ratio = "n/a" if r["ratio"] is None else f"**{r['ratio']:.2f}**" if r["ratio"] >= 1.005 else f"{r['ratio']:.2f}"
        diff = "n/a" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        model = "MoE layer (1024/8x2816)" if r["model"] == "layer" else "tiny Mixtral"
        lines.append(f"| {model} | {r['impl']} | {r['tokens']} | {r['peer_ms']:.2f} | {planc_ms} | {ratio} | {diff} |")
    return "\n".join(lines)


def machine() -> str:
    return describe("cpu", load=True) + ", 1 torch thread per rank"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--quick", action="store_true", help="a few repetitions per cell (smoke test)")
    p.add_argument("--reps", type=int, help="repetitions for every cell (default: 40 for small batches ... 5 for 2048)")
    p.add_argument("--json", metavar="OUT", help="write every row (and the machine) as JSON")
    p.add_argument("--profile", nargs=4, metavar=("WORLD", "IMPL", "MODEL", "TOKENS"),
                   help="profile both sides of one cell instead of timing")
    args = p.parse_args(argv)

    reps = dict(QUICK_REPS if args.quick else REPS)
    for t in args.tokens:
        reps.setdefault(t, (2, 10))
        if args.reps:
            reps[t] = (reps[t][0], args.reps)
    if args.profile:
        w, impl, kind, t = args.profile
        spawn(run_cells, int(w), [kind], [impl], [int(t)], reps, True)
        return 0

    started = time.perf_counter()
    rows = []
    for world in args.world_sizes:
        print(f"[ep_forward_cpu] {world} ranks", flush=True)
        rows += spawn(run_cells, world, args.models, args.impls, args.tokens, reps)
    print(f"\nMachine: {machine()}; wall {time.perf_counter() - started:.0f} s\n")
    for world in args.world_sizes:
        print(markdown_table(rows, world) + "\n")
    worst = max((r["ratio"] for r in rows if r.get("ratio") is not None), default=None)
    if worst is not None:
        print(f"worst ratio planc/transformers: {worst:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "ep_forward_cpu", "machine": machine(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
