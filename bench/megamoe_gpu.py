"""Mega MoE on one GPU: MegaMoeEP + the reference backend, eager vs CUDA-graph replay, wrapper overhead,
and a BF16 grouped_mm experts baseline on the same shapes.

One rank over NCCL (a world of 1 on a free port). Per batch size (decode 1/16/64/256, prefill 4096):
- `eager_us`: one MoE layer through `MegaMoeEPRuntime` -> installed Mega MoE forward (reference backend).
- `graph_us`: the same layer captured once in a CUDA graph and replayed. A capture fails on any host sync,
  so a successful capture proves the wrapper and the reference path have none.
- `wrapper_us`: everything but the experts computation: MegaMoeEP's slice/pad/gather plus the staging the
  kernel path does (FP8 cast of x, copies of x, x_sf, topk_idx, topk_weights into the buffer); `wrapper_share`
  is its share of the eager layer.
- `grouped_mm_us`: transformers' `grouped_mm` experts forward on the same (dequantized, BF16) weights.
Times are CUDA-event medians over `--iters` after `--warmup` runs.

GPU (DeepSeek-V4 shapes):  python bench/megamoe_gpu.py --json megamoe.json
CPU smoke test (tiny):      python bench/megamoe_gpu.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planc.runtime.ep.megamoe import MegaMoeEPRuntime  # noqa: E402
from planc.runtime.megamoe import buffer_stats, destroy_megamoe_buffers, install_megamoe_forward  # noqa: E402
from planc.runtime.megamoe import megamoe_state  # noqa: E402
from planc.runtime.megamoe.quant import pack_ue8m0, quantize_fp8  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (hidden 256, intermediate 128, 8 experts)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--tokens", default="1,16,64,256,4096")
    p.add_argument("--clamp", type=float, default=10.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.intermediate, args.experts, args.topk = 256, 128, 8, 2
        if args.tokens == p.get_default("tokens"):
            args.tokens = "1,16,64"
    args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


def init_one_rank(device: str):
    from planc.runtime.local_world import free_port

    port = free_port()
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.group.WORLD


def timer(device: str, warmup: int, iters: int):
    """fn -> median microseconds per call (CUDA events on GPU, perf_counter on CPU)."""

    def measure(fn):
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)

    return measure


def build_experts(args, device):
    """A real MixtralExperts with random BF16 weights, built on the meta device then filled (no host copy)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_local_experts=args.experts)
    with torch.device("meta"):
        m = MixtralExperts(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    m.gate_up_proj = torch.nn.Parameter(
        torch.randn(args.experts, 2 * args.intermediate, args.hidden, generator=g, device=device, dtype=torch.bfloat16)
        * args.hidden**-0.5, requires_grad=False)
    m.down_proj = torch.nn.Parameter(
        torch.randn(args.experts, args.hidden, args.intermediate, generator=g, device=device, dtype=torch.bfloat16)
        * args.intermediate**-0.5, requires_grad=False)
    return m, cfg


def grouped_mm_baseline(cfg, weights):
    """transformers' grouped_mm experts forward over the given BF16 weights (shared, not copied)."""
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    with torch.device("meta"):
        m = MixtralExperts(cfg)
    m.gate_up_proj = torch.nn.Parameter(weights.gate_up, requires_grad=False)
    m.down_proj = torch.nn.Parameter(weights.down, requires_grad=False)
    return lambda x, idx, w: grouped_mm_experts_forward(m, x, idx, w)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    group = init_one_rank(args.device)
    measure = timer(args.device, args.warmup, args.iters)
    use_graph = device.type == "cuda" and not args.no_graph

    experts, cfg = build_experts(args, device)
    undo = install_megamoe_forward(experts, backend="reference", quantize="fp4", activation_clamp=args.clamp,
                                   num_global_experts=args.experts, ep_rank=0, ep_size=1)
    del undo  # commit: frees the BF16 originals
    if device.type == "cuda":
        torch.cuda.empty_cache()
    from planc.spec.ep import MegaMoeEP

    groups = types.SimpleNamespace(ep_group=group, ep_rank=0, ep_size=1, tp_group=group, tp_size=1, shares_batch=True)
    strategy = MegaMoeEP(reason="bench")
    layer = MegaMoeEPRuntime(experts, strategy, groups)
    runner = megamoe_state(experts).runner
    baseline = grouped_mm_baseline(cfg, runner.weights(device))  # the reference's dequantized BF16 weights

    rows = []
    for n in args.tokens:
        g = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, args.hidden, generator=g, device=device, dtype=torch.bfloat16)
        scores = torch.randn(n, args.experts, generator=g, device=device)
        w, idx = torch.topk(torch.softmax(scores, -1), args.topk, dim=-1)

        with torch.no_grad():
            eager = measure(lambda: layer(x, idx, w))
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")  # any host sync in one forward raises
                layer(x, idx, w)
                torch.cuda.set_sync_debug_mode("default")

            graph_us = None
            if use_graph:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    layer(x, idx, w)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y_graph = layer(x, idx, w)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(y_graph, layer(x, idx, w)), "graph replay differs from eager"
                graph_us = measure(graph.replay)
                del graph, y_graph

            # wrapper = MegaMoeEP without the experts computation + the kernel path's staging
            y_static = torch.empty_like(x)
            hollow = MegaMoeEPRuntime(experts, strategy, groups)
            hollow.experts_forward = lambda xs, i, ws, process_group: y_static[: xs.shape[0]]
            stage = {"x": torch.empty(n, args.hidden, dtype=torch.float8_e4m3fn, device=device),
                     "x_sf": torch.empty(n, args.hidden // 128, dtype=torch.int32, device=device),
                     "idx": torch.empty_like(idx), "w": torch.empty_like(w)}

            def wrapper_only():
                hollow(x, idx, w)
                q, sf = quantize_fp8(x)
                stage["x"].copy_(q)
                stage["x_sf"].copy_(pack_ue8m0(sf))
                stage["idx"].copy_(idx)
                stage["w"].copy_(w)

            wrapper_us = measure(wrapper_only)
            grouped = measure(lambda: baseline(x, idx, w))
        rows.append(dict(
            tokens=n, eager_us=eager, graph_us=graph_us, wrapper_us=wrapper_us, wrapper_share=wrapper_us / eager,
            grouped_mm_us=grouped, reference_over_grouped_mm=eager / grouped,
        ))
        print(f"tokens {n}: eager {eager:.0f} us, graph {graph_us or float('nan'):.0f} us", file=sys.stderr)

    stats = buffer_stats()
    result = dict(
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        shapes=dict(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, topk=args.topk),
        buffer_allocations=stats.allocations, buffer_bytes=stats.live_bytes,
        rows=rows,
    )
    print(f"\nMega MoE, one layer, one rank ({result['device']}; H={args.hidden}, I={args.intermediate}, "
          f"E={args.experts}, top-{args.topk}; reference backend)\n")
    print("| tokens | MegaMoeEP eager (us) | graph replay (us) | wrapper (us) | wrapper share | "
          "bf16 grouped_mm (us) | reference / grouped_mm |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        graph = f"{r['graph_us']:.1f}" if r["graph_us"] is not None else "n/a"
        print(f"| {r['tokens']} | {r['eager_us']:.1f} | {graph} | {r['wrapper_us']:.1f} | "
              f"{100 * r['wrapper_share']:.1f}% | {r['grouped_mm_us']:.1f} | {r['reference_over_grouped_mm']:.2f}x |")
    print(f"\nbuffer allocations: {stats.allocations} ({stats.live_bytes / 2**20:.1f} MiB live)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    destroy_megamoe_buffers()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
