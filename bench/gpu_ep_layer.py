"""AllReduceEP on one DeepSeek-V4 MoE layer on one rank over NCCL.

Why one rank: it isolates what planc adds around the experts kernel. With a world of one the all-reduce
sums nothing, so the EP forward's time minus the bare experts call's time is the wrapper: masking of the
routes, parameter swaps, the collective call, dtype casts and Python. Eager shows it as launch and Python
cost; CUDA-graph replay shows what is left of it on the GPU. transformers' own `AllReduceEP` is timed the
same way as the peer, on the same weights and routes, interleaved with planc's.

Installs: transformers through `apply_expert_parallelism` with a concrete plan (what
`maybe_distribute_model` calls; with a world of one it installs nothing itself), planc through
`planc.apply` with an experts-only plan at ep_size 1. The experts are transformers' `DeepseekV4Experts`
with `grouped_mm` in bf16. The Mega MoE (reference backend) cells are in `bench/megamoe_gpu.py`.

    python bench/gpu_ep_layer.py --json $OUT/gpu_ep_layer.json              # H200: 384 experts
    python bench/gpu_ep_layer.py --device cpu --tiny                         # CPU smoke test, gloo
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (str(REPO), str(REPO / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402 - after the sys.path setup above
import torch.distributed as dist  # noqa: E402 - after the sys.path setup above
from machine import describe  # noqa: E402  (same directory)

FULL = dict(hidden_size=7168, n_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=3072)
TINY = dict(hidden_size=256, n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=128)
DECODE = (1, 16, 64, 256)
PREFILL = (4096,)
EXPERTS_FQN = "model.layers.0.mlp.experts"


def init_world(device: str) -> None:
    """A one-rank process group (NCCL on GPU, gloo on CPU) unless torchrun already made one."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        from planc.runtime.local_world import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise SystemExit("gpu_ep_layer.py runs on one rank; bench/multigpu.py covers several")


def dtype_for(device: str):
    """bf16 on GPU (the kernels that matter); fp32 on CPU, where bf16 grouped GEMMs are slow and only smoke-tested."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def build_layer_model(shapes: dict, device: str):
    """A one-layer DeepSeek-V4 (all-`moe` MLP, tiny attention) in bf16 (fp32 on CPU) on `device`, random weights.

    Built on meta and materialised with `to_empty`, so a 50 GB expert stack costs one allocation
    and no CPU memory; only the experts module is ever run.
    """
    from transformers import AutoModelForCausalLM

    from planc.models.build import tiny_config

    config = tiny_config(
        "deepseek_v4", num_hidden_layers=1, layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"],
        **shapes,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype_for(device), experts_implementation="grouped_mm")
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
        for b in model.buffers():
            b.zero_()
    return model.eval()


def share_weights_copy(model):
    """A deep copy whose parameters are the same tensors (no extra weight memory)."""
    memo = {id(p): p for p in model.parameters()}
    return copy.deepcopy(model, memo)


def experts_of(model):
    return model.get_submodule(EXPERTS_FQN)


def install_peer(model, device: str):
    """transformers' AllReduceEP on a one-rank EP mesh, via the function `maybe_distribute_model` calls."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    mesh = init_device_mesh(device, (1,))
    plan = {f"{EXPERTS_FQN}.gate_up_proj": "grouped_gemm", f"{EXPERTS_FQN}.down_proj": "grouped_gemm",
            EXPERTS_FQN: "ep_dispatch_experts"}
    return apply_expert_parallelism(model, mesh, mesh, plan, ep_implementation="all_reduce")


def planc_plan() -> dict:
    return {
        "version": 1,
        "model": {"type": "deepseek_v4"},
        "parallel": {"tp_size": 1, "ep_size": 1},
        "experts": {"implementation": "grouped_mm", "ep_implementation": "all_reduce"},
        "ep_plan": {
            "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
            "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
            "model.layers.*.mlp.experts": "ep_dispatch_experts",
        },
    }


def install_planc(model):
    """`planc.apply` at ep_size 1: planc installs nothing on the experts there (no copy, no wrapper)."""
    import planc

    planc.apply(model, planc_plan())
    return model


def install_planc_wrapper(model):
    """planc's AllReduceEP wrapper bound the way `planc.apply` binds it at ep_size > 1 (expert tensors sharded
    into DTensors, runtime, installed forward), forced onto the one-rank group so its cost can be measured."""
    from planc.spec.ep import AllReduceEP
    from planc.runtime.ep.all_reduce import AllReduceEPRuntime
    from planc.runtime.ep.base import install_ep_forward, shard_expert_tensor
    from planc.runtime.mesh import build_groups
    from planc.spec.model import Parallel

    groups = build_groups(Parallel(tp_size=1, ep_size=1))
    experts = experts_of(model)
    for name in ("gate_up_proj", "down_proj"):
        shard_expert_tensor(experts, name, groups)
    install_ep_forward(experts, AllReduceEPRuntime(experts, AllReduceEP(reason="bench: forced at ep_size 1"), groups))
    return model


def rebind_to_local(src_experts, dst_experts) -> None:
    """Point `dst_experts`' weights at `src_experts`' local shards, so the unsharded copy's memory can go."""
    for name in ("gate_up_proj", "down_proj"):
        t = getattr(src_experts, name)
        t = t.to_local() if hasattr(t, "to_local") else t
        dst_experts._parameters[name] = torch.nn.Parameter(t, requires_grad=False)


def routes(tokens: int, shapes: dict, device: str, seed: int = 0):
    """Hidden states and top-k routes as the DeepSeek-V4 router would hand them: distinct experts per token."""
    gen = torch.Generator(device=device).manual_seed(seed + tokens)
    e, k, h = shapes["n_routed_experts"], shapes["num_experts_per_tok"], shapes["hidden_size"]
    x = torch.randn(tokens, h, device=device, dtype=dtype_for(device), generator=gen)
    idx = torch.rand(tokens, e, device=device, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(tokens, k, device=device, generator=gen)
    w = (1.5 * w / w.sum(-1, keepdim=True)).to(dtype_for(device))
    return x, idx, w


# ---- timing ----------------------------------------------------------------------------------------------------


class Timer:
    """Seconds per call of `fn`, `inner` calls per sample: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sample(self, fn, inner: int) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner


def capture(fn):
    """A replay callable of `fn` captured in a CUDA graph (static inputs are closed over), or the error."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def measure(fns: dict, timer: Timer, warmup: int, reps: int, inner: int) -> dict:
    """Median seconds per call of each fn, samples interleaved in rotating order."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    samples = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[: r % len(names)]:
            samples[n].append(timer.sample(fns[n], inner))
    return {n: statistics.median(s) for n, s in samples.items()}


def run(args) -> dict:
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_world(device)
    shapes = dict(TINY if args.tiny else FULL)
    if args.experts:
        shapes["n_routed_experts"] = args.experts
    tokens = list(args.tokens or ((1, 16, 64) if args.tiny else DECODE + PREFILL))
    if device == "cuda":
        e, h, i = shapes["n_routed_experts"], shapes["hidden_size"], shapes["moe_intermediate_size"]
        free_gb = torch.cuda.mem_get_info()[0] / 2**30

        def peak_gb(n):  # the unsharded stack plus one installed copy (see below), activations, graph pools
            return 2 * n * 3 * h * i * 2 / 2**30 + 12

        while peak_gb(e) > free_gb and e > 8:
            e //= 2
        if e != shapes["n_routed_experts"]:
            print(f"[gpu_ep_layer] {shapes['n_routed_experts']} experts need ~{peak_gb(shapes['n_routed_experts']):.0f} GB "
                  f"at peak, {free_gb:.0f} GB free: scaled down to {e} experts", flush=True)
            shapes["n_routed_experts"] = e

    t0 = time.perf_counter()
    base = build_layer_model(shapes, device)
    # Installing copies the weights (distribute_tensor keeps a contiguous local chunk even on one rank), so
    # keep at most two stacks alive: the base is rebound to the peer's shards before planc installs.
    peer = install_peer(share_weights_copy(base), device)
    rebind_to_local(experts_of(peer), experts_of(base))
    planc_error = None
    sides = {"bare": experts_of(base), "transformers": experts_of(peer)}
    try:
        ours = install_planc(share_weights_copy(base))
        sides["planc.apply"] = experts_of(ours)
        sides["planc"] = experts_of(install_planc_wrapper(share_weights_copy(base)))
    except Exception as e:  # noqa: BLE001 - still time the peer
        ours, planc_error = None, f"{type(e).__name__}: {e}"
        print(f"[gpu_ep_layer] planc failed: {planc_error}", file=sys.stderr, flush=True)
    setup_s = time.perf_counter() - t0
    planc_wraps = ours is not None and hasattr(experts_of(ours).forward, "runtime")
    timer = Timer(device)
    result = {
        "benchmark": "gpu_ep_layer", "device": device, "dtype": str(dtype_for(device)).removeprefix("torch."),
        "machine": describe(device, threads=device != "cuda"), "shapes": shapes, "setup_s": setup_s, "planc_error": planc_error,
        "planc_installs_wrapper": planc_wraps, "rows": [],
    }
    if args.profile:
        profile_sides(args.profile, sides, shapes, device)
        return result
    for t in tokens:
        try:
            result["rows"] += run_cell(t, sides, shapes, device, timer, args)
        except Exception as e:  # noqa: BLE001 - one failing cell must not cost the others
            print(f"[gpu_ep_layer] T={t}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            result["rows"].append({"tokens": t, "error": f"{type(e).__name__}: {e}"})
            if device == "cuda":
                torch.cuda.synchronize()
        if args.json:  # written after every cell, so a run cut short still leaves its numbers
            Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def profile_sides(t: int, sides: dict, shapes: dict, device: str, reps: int = 5) -> None:
    """Where each side's time goes at `t` tokens: torch.profiler's top operators, device time first."""
    from torch.profiler import ProfilerActivity, profile

    x, idx, w = routes(t, shapes, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    with torch.no_grad():
        for name, m in sides.items():
            for _ in range(2):
                m(x, idx, w)
            if device == "cuda":
                torch.cuda.synchronize()
            with profile(activities=activities) as prof:
                for _ in range(reps):
                    m(x, idx, w)
                if device == "cuda":
                    torch.cuda.synchronize()
            print(f"\n### {name}, {t} tokens, {reps} calls\n", flush=True)
            print(prof.key_averages().table(sort_by=sort, row_limit=14), flush=True)


def run_cell(t: int, sides: dict, shapes: dict, device: str, timer: Timer, args) -> list:
    """Eager (and on GPU, CUDA-graph) timings of every side for `t` tokens."""
    rows = []
    x, idx, w = routes(t, shapes, device)
    with torch.no_grad():
        fns = {n: (lambda m=m: m(x, idx, w)) for n, m in sides.items()}
        ref = fns["bare"]()
        diffs = {n: float((f() - ref).abs().max()) for n, f in fns.items() if n != "bare"}
        inner = 1 if t >= 4096 else 10
        reps = args.reps or (5 if t >= 4096 else 15)
        modes = {"eager": fns}
        if device == "cuda" and not args.no_graphs:
            graphs = {}
            for n, f in fns.items():
                try:
                    graphs[n], _ = capture(f)
                except Exception as e:  # noqa: BLE001 - a side that does not capture is reported, not fatal
                    print(f"[gpu_ep_layer] {n} T={t}: CUDA graph capture failed: {type(e).__name__}: {e}",
                          file=sys.stderr, flush=True)
                    torch.cuda.synchronize()
            if "bare" in graphs:
                modes["graph"] = graphs
        for mode, mfns in modes.items():
            med = measure(mfns, timer, warmup=2, reps=reps, inner=inner)
            row = {"tokens": t, "mode": mode, "bare_us": med["bare"] * 1e6}
            if "planc.apply" in med:
                row["planc_apply_us"] = med["planc.apply"] * 1e6
            for n in ("transformers", "planc"):
                if n in med:
                    row[f"{n}_us"] = med[n] * 1e6
                    row[f"{n}_overhead_us"] = (med[n] - med["bare"]) * 1e6
                    row[f"{n}_overhead_share"] = (med[n] - med["bare"]) / med[n]
                    row[f"{n}_max_abs_diff"] = diffs[n]
            if "planc_us" in row and "transformers_us" in row:
                row["ratio"] = row["planc_us"] / row["transformers_us"]
            rows.append(row)
            print(_line(row), flush=True)
    return rows



def _fmt(v, spec=".1f"):
    return "n/a" if v is None else format(v, spec)


def _line(r: dict) -> str:
    return (f"  T={r['tokens']:5d} {r['mode']:5s} bare {r['bare_us']:9.1f} us | transformers {_fmt(r.get('transformers_us'))} us"
            f" (+{_fmt(r.get('transformers_overhead_us'))}) | planc {_fmt(r.get('planc_us'))} us"
            f" (+{_fmt(r.get('planc_overhead_us'))}) | ratio {_fmt(r.get('ratio'), '.2f')}")


def markdown(result: dict) -> str:
    s = result["shapes"]
    head = (f"DeepSeek-V4 MoE layer experts (hidden {s['hidden_size']}, {s['n_routed_experts']} experts, top-"
            f"{s['num_experts_per_tok']}, intermediate {s['moe_intermediate_size']}), {result['dtype']} grouped_mm, AllReduceEP on "
            f"one rank; {result['machine']}. Overhead = EP forward - bare experts call (share of the EP forward).")
    lines = [head, "",
             "| tokens | mode | bare experts us | transformers us | transformers overhead us (share) | planc us | "
             "planc overhead us (share) | planc / transformers |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['tokens']} | error | {r['error'][:100]} | | | | | |")
            continue

        def ov(n):
            if f"{n}_overhead_us" not in r:
                return "n/a"
            return f"{r[f'{n}_overhead_us']:.1f} ({100 * r[f'{n}_overhead_share']:.0f}%)"
        lines.append(f"| {r['tokens']} | {r['mode']} | {r['bare_us']:.1f} | {_fmt(r.get('transformers_us'))} | "
                     f"{ov('transformers')} | {_fmt(r.get('planc_us'))} | {ov('planc')} | {_fmt(r.get('ratio'), '.2f')} |")
    lines.append("\nplanc = planc's AllReduceEP runtime bound as `planc.apply` binds it at ep_size > 1, forced onto "
                 "the one-rank group.")
    if result["planc_error"]:
        lines.append(f"planc failed: {result['planc_error']}")
    elif not result["planc_installs_wrapper"]:
        apply_us = ", ".join(f"{r['tokens']} {r['mode']}: {r['planc_apply_us']:.1f} us" for r in result["rows"]
                             if "planc_apply_us" in r)
        lines.append(f"`planc.apply` itself installs no EP wrapper at ep_size 1 (the experts run bare): {apply_us}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (hidden 256, 16 experts) for a CPU smoke test")
    p.add_argument("--experts", type=int, help="routed expert count (default 384; scaled down if memory needs it)")
    p.add_argument("--tokens", type=int, nargs="+", help="default: decode 1 16 64 256 and prefill 4096")
    p.add_argument("--reps", type=int, help="samples per cell (default 15, 5 for prefill)")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--profile", type=int, metavar="TOKENS",
                   help="instead of timing, print torch.profiler's top kernels of every side at TOKENS tokens")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu --tiny")
    if args.device == "cpu":
        torch.set_num_threads(1)  # steadier on a shared box
    started = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - started
    print("\n" + markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
