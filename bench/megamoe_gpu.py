"""Mega MoE on one GPU: the Triton and reference backends behind MegaMoeEP, bf16 grouped_mm, and the bound.

One rank over NCCL (a world of 1 on a free port), one layer, FP4 experts (the same FP4 parameters for both
backends; the Triton module reorders them once into its layout on its first call, the reference dequantizes
them once to BF16). Per batch size (decode 1/16/64/256, prefill 4096), CUDA-event medians over `--iters` after
`--warmup`, in µs:
- `triton_us` / `reference_us`: one MoE layer through `MegaMoeEPRuntime` -> installed forward, CUDA-graph
  replay (a capture fails on any host sync; one eager forward also runs under
  `torch.cuda.set_sync_debug_mode("error")`); `triton_eager_us`: the same without the graph.
- `grouped_mm_us`: transformers' `grouped_mm` experts forward on the reference's dequantized BF16 weights
  (graph replay).
- `bound_us`: the FP4 HBM-read bound, expected distinct experts of uniform top-k routing
  ``E * (1 - (1 - k/E)**T)`` times the FP4 bytes per expert (e2m1 + UE8M0 scales) at `--hbm-tbps`; or the
  dense BF16 math at `--bf16-tflops` when that is larger (prefill). `ratio` = triton / bound.
- `calc_diff`: Triton against the reference backend (DeepGEMM's metric; the contract is < 1e-4).
`--ceiling` also times cuBLAS's dense GEMMs of the same math per batch size (`dense_ceiling`): what the vendor's
best kernels take with no routing, padding or FP4 expansion, in BF16 and in FP8 with the finest block scaling
Hopper's cuBLAS has (1x128 x 128x128; the kernel's 1x32 MX scales are SM100-only, and the attempt is recorded).
Peers: SGLang's FP8 `fused_moe` runs first, in a child process (`sglang_peer`: bench/sglang_fused_moe.py, SGLang
0.5.23's Triton kernels from its PyPI wheel, on the same FP4 experts cast to its block-FP8 layout, the same batches):
`sglang_us` (its own tile config), `sglang_best_us` (with `--sglang-configs` too), `calc_diff_vs_sglang`. Then, on
sm_90 with its source archive (`--deepgemm-sm90` or $PLANC_DEEPGEMM_SM90), DeepGEMM's SM90 Mega MoE kernels in a child
process (`deepgemm_peer`: bench/deepgemm_sm90_mega_moe.py, SGLang's fork of DeepGEMM built there): FP8 x FP4 on the same
FP4 bytes and FP8 x FP8 on them cast to block FP8, per kernel `deepgemm_<kind>_us` (its input copies and kernel),
`deepgemm_<kind>_kernel_us`, `calc_diff_vs_deepgemm_<kind>`. A peer's time is a ratio against planc only where its
output is within DeepGEMM's FP8 bound of planc's (`PEER_BOUND`). Without a wheel or an archive the bench says so and
goes on.
`--sweep` times each candidate tile config of the Triton kernels per batch size instead (graph replay of the
experts computation alone) and prints the best: the table in `planc.kernels.megamoe.triton.config` comes from it.
`--routes` times the routing alone (`routing.route` against the torch ops it replaced above 2048 pairs).

GPU, DeepSeek-V4 layer:  python bench/megamoe_gpu.py --json megamoe.json
GPU, mid-size layer:     python bench/megamoe_gpu.py --hidden 2048 --intermediate 1408 --experts 64
CPU smoke test (tiny):   TRITON_INTERPRET=1 python bench/megamoe_gpu.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planc.kernels.megamoe.quant import calc_diff, float_to_ue8m0_bytes, quantize_fp8
from planc.kernels.megamoe.triton import config as triton_config
from planc.kernels.megamoe.triton import routing
from planc.kernels.megamoe.triton.config import KernelConfig
from planc.kernels.megamoe.triton.forward import device_config, triton_local_experts_forward
from planc.runtime.ep.megamoe import MegaMoeEPRuntime
from planc.runtime.megamoe import buffer_stats, destroy_megamoe_buffers, install_megamoe_forward
from planc.runtime.megamoe import megamoe_state


def add_layer_args(p: argparse.ArgumentParser) -> None:
    """The layer's shapes (DeepSeek-V4 by default, `--tiny` for a CPU smoke test) and device: shared with
    bench/megamoe_profile.py; `tiny_shapes` applies `--tiny`."""
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (hidden 256, intermediate 128, 8 experts, top-2)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--topk", type=int, default=6)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The layer (`add_layer_args`), its batches and their timing: this bench's flags and every peer's, the ones
    `layer_flags` forwards to a peer's process."""
    add_layer_args(p)
    p.add_argument("--tokens", default="1,16,64,256,4096")
    p.add_argument("--clamp", type=float, default=10.0, help="the SwiGLU limit (planc's activation clamp)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--captures", type=int, default=3, metavar="N",
                   help="time each layer row over N fresh CUDA-graph captures and take the median (`graph_or_eager`)")
    p.add_argument("--json", default=None, help="write the results here")


def tiny_shapes(args) -> None:
    if args.tiny:
        args.hidden, args.intermediate, args.experts, args.topk = 256, 128, 8, 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the bound (H200: 4.8 TB/s)")
    p.add_argument("--bf16-tflops", type=float, default=989.0, help="dense BF16 rate for the bound (H200: 989)")
    p.add_argument("--no-reference", action="store_true", help="skip the reference and grouped_mm columns")
    p.add_argument("--ceiling", action="store_true",
                   help="also time cuBLAS's dense BF16 / FP8 GEMMs of the same math (the compute ceiling)")
    p.add_argument("--sweep", action="store_true", help="time the Triton tile configs instead (see above)")
    p.add_argument("--configs", default=None,
                   metavar="BT,L1N,L1K,L2N,L2K,WARPS,STAGES[,SPLIT[,MAXNREG[,PREFETCH[,GLUON[,L2_MAXNREG]]]]];...",
                   help="with --sweep: these KernelConfig fields instead of the built-in candidates")
    p.add_argument("--fp8-config", default=None, metavar="INTS",
                   help="put this config in the FP8 path's table row (`config.FP8_CONFIGS`) for this run: "
                        "KernelConfig's fields as comma-separated ints, as in --configs; the row's bound is kept, or "
                        "--fp8-rows where the table has no row")
    p.add_argument("--fp8-rows", type=int, default=48, metavar="ROWS",
                   help="with --fp8-config and an empty FP8 row: from this many rows per local expert on average "
                        "(48: V4 from ~3100 tokens on one rank)")
    p.add_argument("--general-only", action="store_true",
                   help="run the general kernels at every batch size (no split-K decode rows: `general_path_only`)")
    p.add_argument("--decode-variant", default=None, choices=list(DECODE_VARIANTS),
                   help="run the decode rows as this variant (`DECODE_VARIANTS`) throughout, e.g. with --profile")
    p.add_argument("--no-variants", action="store_true",
                   help="do not time the decode rows' variants (`DECODE_VARIANTS`: the path before, each new part)")
    p.add_argument("--variants", default=None, metavar="NAMES",
                   help="time only these decode variants (comma-separated names of `DECODE_VARIANTS`)")
    p.add_argument("--decode-rows", type=int, default=None, metavar="ROWS",
                   help="the decode row of the config table (`config.DECODE_CONFIGS`) up to this many (token, slot) "
                        "rows for this run, e.g. 48 to time the decode variants at 8 tokens of top-6")
    p.add_argument("--profile", type=int, default=None, metavar="TOKENS",
                   help="print the GPU kernels of Triton layer calls at this batch size (torch.profiler) and stop")
    p.add_argument("--read-patterns", action="store_true",
                   help="time load-only kernels with the decode grids' access pattern beside a plain read stream "
                        "(`decode_read_patterns`) and stop")
    p.add_argument("--routes", action="store_true",
                   help="time the routing of --tokens batches (`routing.route`: one program, or the chunked launches "
                        "above FUSED_ROUTE_MAX_SLOTS) beside the torch ops it replaced (`route_torch`) and stop")
    p.add_argument("--fp8-accumulation", action="store_true",
                   help="time nothing: print how far cuBLAS's FP8 GEMMs, promoting and not (`use_fast_accum`), leave "
                        "exact sums (`fp8_accumulation`: what the row-scaled kernels' accumulation costs) and stop")
    p.add_argument("--sglang-wheel", default=None, metavar="WHL",
                   help="SGLang's wheel for the peer (bench/sglang_fused_moe.py `find_wheel`: else $PLANC_SGLANG_WHEEL "
                        "or .whl/)")
    p.add_argument("--sglang-configs", default=None, metavar="M,N,K,GROUP,WARPS,STAGES;...",
                   help="tile configs the peer also times beside its own pick (bench/sglang_fused_moe.py --configs)")
    p.add_argument("--no-sglang", action="store_true", help="do not run the SGLang peer")
    p.add_argument("--deepgemm-sm90", default=os.environ.get("PLANC_DEEPGEMM_SM90"), metavar="ARCHIVE",
                   help="the DeepGEMM fork's source archive for its SM90 Mega MoE peer (bench/deepgemm_sm90_mega_moe.py"
                        " --assemble writes it; default: $PLANC_DEEPGEMM_SM90)")
    p.add_argument("--deepgemm-cache", default=None, metavar="DIR",
                   help="where that peer stages and builds it (its `_C.so` and JIT cache are kept there)")
    p.add_argument("--no-deepgemm", action="store_true", help="do not run the DeepGEMM peer")
    args = p.parse_args(argv)
    tiny_shapes(args)
    if args.tiny:
        args.no_graph = True
        if args.tokens == p.get_default("tokens"):
            args.tokens = "1,16,64"
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.variants = list(DECODE_VARIANTS) if args.variants is None else args.variants.split(",")
    unknown = [v for v in args.variants if v not in DECODE_VARIANTS]
    if unknown:
        p.error(f"--variants: no decode variant {', '.join(unknown)} (known: {', '.join(DECODE_VARIANTS)})")
    if args.decode_rows is not None:
        triton_config.DECODE_CONFIGS = tuple((args.decode_rows, c) for _, c in triton_config.DECODE_CONFIGS)
    if args.configs:
        args.configs = [KernelConfig(*(int(v) for v in c.split(","))) for c in args.configs.split(";") if c.strip()]
    if args.fp8_config:
        cfg = KernelConfig(*(int(v) for v in args.fp8_config.split(",")))
        rows = triton_config.FP8_CONFIGS or ((args.fp8_rows, cfg),)  # rows of None (the BF16 tables) are kept
        triton_config.FP8_CONFIGS = tuple((bound, None if c is None else cfg) for bound, c in rows)
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


def sharing_fp4(experts, cfg):
    """A second experts module holding the same FP4 parameters (no copy), for another backend."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    with torch.device("meta"):
        m = MixtralExperts(cfg)
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        if name in m._parameters:
            del m._parameters[name]
        m.register_parameter(name, getattr(experts, name))
    return m


def fp4_bytes(m) -> int:
    return sum(getattr(m, n).nbytes for n in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj",
                                               "down_proj_scale_inv"))


def fp8_layout_bytes(state, device) -> int:
    """The bytes of the Triton backend's FP8-layout copy of the experts (0 where no batch took the FP8 path)."""
    weights = state.runner.weights(device)
    return getattr(weights, "fp8_layout_nbytes", 0)


def bound_us(args, n, bytes_per_expert) -> tuple[float, str]:
    """max(FP4 HBM read of the expected distinct experts, dense BF16 math) in µs, and which one binds."""
    touched = args.experts * (1 - (1 - args.topk / args.experts) ** n)
    memory = touched * bytes_per_expert / (args.hbm_tbps * 1e12) * 1e6
    flops = 2 * n * args.topk * (2 * args.intermediate * args.hidden + args.hidden * args.intermediate) * 1.0
    compute = flops / (args.bf16_tflops * 1e12) * 1e6
    return (memory, "fp4 read") if memory >= compute else (compute, "bf16 math")


def copy_bandwidth(device, measure, nbytes: int = 2 << 30) -> float:
    """TB/s of a device-to-device copy of `nbytes` (bytes read + written over the time): the rate a plain stream of
    these bytes reaches on this card, beside the datasheet's `--hbm-tbps`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    us = measure(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e12


if torch.cuda.is_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _read_stream_kernel(p, n_words, out, BLOCK: tl.constexpr):
        """XOR of every int32 word, BLOCK words (16-byte loads) per step, a grid-stride loop (`read_bandwidth`)."""
        acc = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in tl.range(tl.program_id(0) * BLOCK, n_words, tl.num_programs(0) * BLOCK, num_stages=4):
            offs = start + tl.arange(0, BLOCK)
            acc ^= tl.load(p + offs, mask=offs < n_words, other=0, cache_modifier=".cg")
        tl.store(out + tl.program_id(0), tl.xor_sum(acc, axis=0))

    @triton.jit
    def _decode_pattern_kernel(w_ptr, s_ptr, out, NUM_G: tl.constexpr, K_STEPS: tl.constexpr, TILES: tl.constexpr,
                               SPLIT: tl.constexpr, STAGES: tl.constexpr, UP: tl.constexpr):
        """The loads of a split-K decode program (`decode.decode_l1_kernel` / `decode_l2_kernel` at 64-row tiles,
        grid (expert x N tile, slice)) and nothing else: per 64-deep K step its 64 rows' 2 KB of words and 128 bytes
        of scale words, L1 (UP > 0) also the up rows' UP groups further, XOR-reduced (`decode_read_patterns`)."""
        tile = tl.program_id(0)
        sid = tl.program_id(1)
        w_base = w_ptr + (tile // TILES).to(tl.int64) * (K_STEPS * NUM_G * 128)
        s_base = s_ptr + (tile // TILES).to(tl.int64) * (K_STEPS * NUM_G * 8)
        g0 = (tile % TILES) * 4
        acc = tl.zeros((512,), dtype=tl.int32)
        sacc = tl.zeros((32,), dtype=tl.int32)
        steps = K_STEPS // SPLIT
        for kc in tl.range(sid * steps, sid * steps + steps, num_stages=STAGES):
            acc ^= tl.load(w_base + (kc * NUM_G + g0) * 128 + tl.arange(0, 512))
            sacc ^= tl.load(s_base + (kc * NUM_G + g0) * 8 + tl.arange(0, 32))
            if UP:
                acc ^= tl.load(w_base + (kc * NUM_G + g0 + UP) * 128 + tl.arange(0, 512))
                sacc ^= tl.load(s_base + (kc * NUM_G + g0 + UP) * 8 + tl.arange(0, 32))
        tl.store(out + (tile * SPLIT + sid) * 512 + tl.arange(0, 512), acc ^ tl.xor_sum(sacc, axis=0))


def read_bandwidth(device, measure, nbytes: int = 256 << 20) -> float:
    """TB/s of a plain read stream of `nbytes` in Triton (each word read once and XOR-reduced, one program of 8 warps
    per SM, 32 KB per step; graph replay of 4 launches): the rate a kernel that only reads weights of a decode
    batch's size reaches on this card, beside the datasheet's `--hbm-tbps`. On an H100 (2026-12-06, Triton 3.6) 210.6
    MB (1 V4 token's experts) read at 3.04 TB/s, 2 GiB at 3.22: this shape was the fastest of 12 grids and steps."""
    words = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=device)
    grid = torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(grid, dtype=torch.int32, device=device)

    def run():
        for _ in range(4):
            _read_stream_kernel[(grid,)](words, words.numel(), out, BLOCK=8192, num_warps=8)

    us, _ = graph_or_eager(device, measure, run, True)
    return 4 * nbytes / (us * 1e-6) / 1e12


def decode_read_patterns(args, device, measure) -> list[dict]:
    """Graph-replay µs of load-only kernels with the split-K decode grids' access pattern (`_decode_pattern_kernel`)
    over one token's experts (top-k of them, FP4 words and scale words as the layer holds them), per GEMM and slice
    count, beside the plain read stream of the same bytes (`read_bandwidth`): how fast the decode kernels could read
    their weights if their expansion and MMAs cost nothing (graph replays of 4 launches, as `read_bandwidth`)."""
    stages = triton_config.DECODE_CONFIGS[0][1].num_stages
    rows = []
    for gemm, n, k, splits in (("L1", 2 * args.intermediate, args.hidden, (1, 2, 4, 8)),
                               ("L2", args.hidden, args.intermediate, (1, 2, 4))):
        words = torch.randint(-2**31, 2**31 - 1, (args.topk, n * k // 8), dtype=torch.int32, device=device)
        scales = torch.randint(-2**31, 2**31 - 1, (args.topk, n * k // 128), dtype=torch.int32, device=device)
        nbytes = words.nbytes + scales.nbytes
        tiles = (n // 2 if gemm == "L1" else n) // 64
        for split in splits:
            grid = (args.topk * tiles, split)
            out = torch.empty(grid[0] * split * 512, dtype=torch.int32, device=device)

            def run(grid=grid, split=split, out=out, words=words, scales=scales, n=n, k=k):
                for _ in range(4):  # as `read_bandwidth`: one replay's start is not counted whole in each launch
                    _decode_pattern_kernel[grid](words, scales, out, n // 16, k // 64, tiles, split, stages,
                                                 n // 32 if gemm == "L1" else 0, num_warps=4)

            us = graph_or_eager(device, measure, run, True)[0] / 4
            rows.append(dict(gemm=gemm, split=split, programs=grid[0] * split, us=us, mb=nbytes / 1e6,
                             tbps=nbytes / (us * 1e-6) / 1e12))
    stream = read_bandwidth(device, measure, nbytes=int(sum(r["mb"] for r in rows if r["split"] == 1) * 1e6) // 4 * 4)
    print(f"\nLoad-only kernels with the decode grids' access pattern, 1 token ({args.topk} experts), "
          f"{stages} cp.async stages, graph replay; the plain read stream of the same bytes: {stream:.2f} TB/s")
    print("| GEMM | slices | programs | MB | µs | TB/s | plain stream's µs for these bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        r["stream_us"] = r["mb"] / stream
        print(f"| {r['gemm']} | {r['split']} | {r['programs']} | {r['mb']:.1f} | {r['us']:.1f} | {r['tbps']:.2f} | "
              f"{r['stream_us']:.1f} |")
    return rows


def route_times(args, device, measure) -> list[dict]:
    """Graph-replay µs of routing each --tokens batch over the layer's experts on one rank (the table's block rows
    for that batch): `routing.route` (what the layer runs) beside `route_torch`, and their ratio."""
    rows = []
    for n in args.tokens:
        _, _, idx = random_batch(args, n, device, seed=n)
        block_t = device_config(n * args.topk, args.experts, args.hidden, args.intermediate, device).block_t
        kw = dict(first_expert=0, num_local_experts=args.experts, block_t=block_t)
        us = {name: graph_or_eager(device, measure, lambda fn=fn: fn(idx, **kw), True, captures=3)[0]
              for name, fn in (("route", routing.route), ("torch", routing.route_torch))}
        how = "one program" if idx.numel() <= routing.FUSED_ROUTE_MAX_SLOTS else "chunked"
        rows.append(dict(tokens=n, pairs=idx.numel(), how=how, block_t=block_t, route_us=us["route"],
                         torch_us=us["torch"]))
    print(f"\nRouting on one rank ({args.experts} experts, top-{args.topk}), graph replay, median of 3 captures, µs")
    print("| tokens | pairs | route | µs | torch ops (route_torch) µs | torch / route |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['pairs']} | {r['how']} | {r['route_us']:.1f} | {r['torch_us']:.1f} | "
              f"{r['torch_us'] / r['route_us']:.2f}x |")
    return rows


def fp8_accumulation(device, ks=(512, 1024, 7168), rows: int = 64, cols: int = 512) -> list[dict]:
    """How far an FP8 GEMM's sums are from exact ones when the tensor cores accumulate all of K (cuBLAS's
    `use_fast_accum`, what the row-scaled kernels' wgmma chain does) and when its sums are promoted to FP32 along K:
    e4m3 operands from N(0, 1), [rows x K] x [K x cols], the error over each output row's largest exact sum."""
    g = torch.Generator(device=device).manual_seed(0)
    one = torch.ones((), device=device)
    out = []
    for k in ks:
        a = torch.randn(rows, k, generator=g, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(cols, k, generator=g, device=device).to(torch.float8_e4m3fn)
        exact = a.double() @ b.double().t()
        for fast in (False, True):
            got = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
            err = (got.double() - exact).abs() / exact.abs().amax(dim=1, keepdim=True)
            out.append(dict(k=k, fast_accum=fast, rms=float(err.pow(2).mean().sqrt()), max=float(err.max()),
                            bf16_differ=float((got.bfloat16() != exact.bfloat16()).double().mean())))
    print(f"\ncuBLAS FP8 GEMMs [{rows} x K] x [K x {cols}] (e4m3 from N(0, 1)) against exact sums: error / row's largest")
    print("| K | accumulation | rms | max | BF16 roundings that differ |")
    print("|---:|---|---:|---:|---:|")
    for r in out:
        how = "tensor cores over all of K (use_fast_accum)" if r["fast_accum"] else "promoted to FP32 along K"
        print(f"| {r['k']} | {how} | {r['rms']:.2e} | {r['max']:.2e} | {r['bf16_differ']:.2%} |")
    return out


def dense_ceiling(args, n, device, measure, use_graph) -> dict:
    """cuBLAS's dense GEMMs of the layer's math at `n` tokens, µs: the ceiling for any kernel of these numerics.

    The n * top-k rows as one [R, H] x [H, 2I] and one [R, I] x [I, H] GEMM: the same multiply-adds as the experts,
    without routing, without padding rows to tiles, without reading or expanding FP4 (one expert-sized weight pair,
    reused by every row). `bf16`: the MMA the Triton backend runs. `fp8_1x128`: FP8 e4m3 with per-1x128 activation
    and per-128x128 weight scales, the finest block scaling Hopper's cuBLAS offers; the experts' numerics need
    per-1x32 scales on both operands, which `fp8_1x32` tries (MX scaling: cuBLAS has it from SM100 on).
    """
    rows, h, i = n * args.topk, args.hidden, args.intermediate
    g = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(rows, h, generator=g, device=device, dtype=torch.bfloat16)
    a = torch.randn(rows, i, generator=g, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(2 * i, h, generator=g, device=device, dtype=torch.bfloat16) * h**-0.5
    w2 = torch.randn(h, i, generator=g, device=device, dtype=torch.bfloat16) * i**-0.5
    out = dict(rows=rows, tflop=2 * rows * 3 * h * i / 1e12)
    out["bf16_us"], _ = graph_or_eager(device, measure, lambda: (x @ w1.t(), a @ w2.t()), use_graph)

    f8 = torch.float8_e4m3fn
    xq, aq, w1q, w2q = (t.to(f8) for t in (x, a, w1, w2))

    def scales(m, k, layout):  # ones: the values do not change the time; cuBLAS wants a given memory order
        return torch.ones(m, k, device=device) if layout == "row" else torch.ones(k, m, device=device).t()

    def blockwise(lhs, w, la, lw):  # lhs [M, K] per 1x128, w [N, K] per 128x128
        (m, k), nw = lhs.shape, w.shape[0]
        return torch._scaled_mm(lhs, w.t(), scales(m, k // 128, la), scales(k // 128, nw // 128, lw),
                                out_dtype=torch.bfloat16)

    # SM90's blockwise kernels want the scales in a given memory order: the first that cuBLAS takes
    for la, lw in (("outer", "outer"), ("outer", "row"), ("row", "outer"), ("row", "row")):
        try:
            out["fp8_1x128_us"], _ = graph_or_eager(
                device, measure, lambda: (blockwise(xq, w1q, la, lw), blockwise(aq, w2q, la, lw)), use_graph)
            out["fp8_1x128_scales"] = f"{la}/{lw}"
            out.pop("fp8_1x128_error", None)
            break
        except (RuntimeError, ValueError) as e:
            out["fp8_1x128_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

        def ue8m0(m, k):  # the swizzled per-1x32 scale layout, padded to 128 x 4 blocks
            return torch.full((-(-m // 128) * 128 * (-(-k // 32 // 4) * 4),), 127, dtype=torch.uint8,
                              device=device).view(torch.float8_e8m0fnu)

        scaled_mm(xq, w1q.t(), ue8m0(rows, h), ScalingType.BlockWise1x32, ue8m0(2 * i, h), ScalingType.BlockWise1x32,
                  swizzle_a=SwizzleType.SWIZZLE_32_4_4, swizzle_b=SwizzleType.SWIZZLE_32_4_4,
                  output_dtype=torch.bfloat16)
        out["fp8_1x32"] = "ran"
    except (ImportError, RuntimeError, ValueError, NotImplementedError) as e:
        out["fp8_1x32"] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


@contextlib.contextmanager
def general_path_only():
    """The Triton backend without the split-K decode rows (`config.DECODE_CONFIGS`) and the FP8 path's rows: the
    general kernels at every batch size, what it ran before the decode kernels, timed in the same process and on the
    same card as the table with them."""
    saved = triton_config.DECODE_CONFIGS, triton_config.FP8_CONFIGS
    triton_config.DECODE_CONFIGS, triton_config.FP8_CONFIGS = (), ()
    try:
        yield
    finally:
        triton_config.DECODE_CONFIGS, triton_config.FP8_CONFIGS = saved


@contextlib.contextmanager
def decode_row(**fields):
    """The split-K decode rows of the config table (`config.DECODE_CONFIGS`) with these `KernelConfig` fields
    replaced: `prologue=0, persistent=0` is the decode path as it was before the prologue and the persistent kernel
    (five launches for the experts: routing, FP8 dequantization, the output's fill, L1, L2), timed in the same
    process and on the same card as the table's own rows."""
    saved = triton_config.DECODE_CONFIGS
    triton_config.DECODE_CONFIGS = tuple((bound, dataclasses.replace(cfg, **fields)) for bound, cfg in saved)
    try:
        yield
    finally:
        triton_config.DECODE_CONFIGS = saved


# The decode variants the layer rows time beside the table's pick (`decode_row`): the path before the prologue, the
# prologue (the split-K grid), the persistent kernel, PDL, and the stream-K schedule at 4, 5 and 6 programs per SM
# (also with PDL). On an H100 (2026-12-06, main 562fe97) the first four and five more (L2 stages, N tiles of 128, the
# persistent kernel with PDL) ran: none beat the prologue by more than 1%; the stream-K ones ran 9-16% slower than it
# at 1-8 tokens tile by tile (commit 7579272) and 12-32% in the row's K slices (1e0c38f; docs/megamoe.md); any other is
# a `--sweep --configs` away. `--variants` times a subset.
DECODE_VARIANTS = {
    "three_launches": dict(prologue=0, persistent=0, stream_k=0),
    "prologue": dict(prologue=1, persistent=0, stream_k=0),
    "persistent": dict(prologue=1, persistent=1, stream_k=0),
    "prologue_pdl": dict(prologue=1, persistent=0, stream_k=0, pdl=1),
    "stream_k4": dict(prologue=1, persistent=0, stream_k=4, pdl=0),
    "stream_k5": dict(prologue=1, persistent=0, stream_k=5, pdl=0),
    "stream_k6": dict(prologue=1, persistent=0, stream_k=6, pdl=0),
    "stream_k5_pdl": dict(prologue=1, persistent=0, stream_k=5, pdl=1),
    # the split-K grid as warp-specialized Gluon kernels (`hopper_decode`): 4 programs per SM (64 registers a thread,
    # the MMA warps 104), 4 or 6 stages; 5 per SM at 48 (the MMA warps 72)
    "ws4": dict(prologue=1, persistent=0, stream_k=0, decode_ws=1, maxnreg=64, num_stages=4),
    "ws6": dict(prologue=1, persistent=0, stream_k=0, decode_ws=1, maxnreg=64, num_stages=6),
    "ws4_r48": dict(prologue=1, persistent=0, stream_k=0, decode_ws=1, maxnreg=48, num_stages=4),
    # the same on mma.sync, each MMA warp on its own (`decode_ws=2`): 4, 5 or 6 programs per SM (64, 48, 40)
    "sync_r64": dict(prologue=1, persistent=0, stream_k=0, decode_ws=2, maxnreg=64, num_stages=4),
    "sync_r48": dict(prologue=1, persistent=0, stream_k=0, decode_ws=2, maxnreg=48, num_stages=4),
    "sync_r48_s6": dict(prologue=1, persistent=0, stream_k=0, decode_ws=2, maxnreg=48, num_stages=6),
    "sync_r40": dict(prologue=1, persistent=0, stream_k=0, decode_ws=2, maxnreg=40, num_stages=4),
    "sync_r48_bt8": dict(prologue=1, persistent=0, stream_k=0, decode_ws=2, maxnreg=48, num_stages=4, block_t=8),
    "sync_r48_bt8_s6": dict(prologue=1, persistent=0, stream_k=0, decode_ws=2, maxnreg=48, num_stages=6, block_t=8),
    "sync_r40_bt8": dict(prologue=1, persistent=0, stream_k=0, decode_ws=2, maxnreg=40, num_stages=4, block_t=8),
}
# The variant the others are compared with in the variants table: the split-K grid with the prologue.
SPLIT_K_VARIANT = "prologue"


# DeepGEMM's bound for its FP8 GEMMs against BF16 (calc_diff): a peer whose output is further from planc's than this
# computed another layer, and its time is no ratio (`peer_ratio`; the peers' tests hold them to it too).
PEER_BOUND = 1e-2


def peer_ratio(peer_us: float | None, planc_us: float, diff: float) -> str:
    """A peer's time over planc's, as the bench's tables print it: only where the peer computed the layer."""
    if peer_us is None:
        return "-"
    return f"{peer_us / planc_us:.2f}x" if diff < PEER_BOUND else "not the layer"


def child_peer(script: str, flags: list[str], prefix: str) -> dict:
    """Run a peer's script (bench/<script>) in a child process on this layer and these batches, with `--json` and
    `--outputs` into a temporary directory (removed after): its result and each batch's output (`tokens_<n>`, with a
    suffix of its own where it runs several kernels), or why not. The child runs and exits before this process builds
    its layer: it holds the GPU's memory while it runs (V4's experts in BF16, then FP4 and its block-FP8 copy)."""
    import shutil
    import subprocess
    import tempfile

    work = tempfile.mkdtemp(prefix=prefix)
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), script), *flags,
           "--json", os.path.join(work, "peer.json"), "--outputs", os.path.join(work, "outputs.safetensors")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(done.stderr)
        if done.returncode != 0:
            sys.stderr.write("".join(done.stdout.splitlines(keepends=True)[-40:]))  # e.g. a compiler's messages
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return dict(available=False, why=f"the peer's process failed ({done.returncode}): {last[:200]}")
        print(done.stdout)
        from safetensors.torch import load_file

        with open(os.path.join(work, "peer.json")) as f:
            result = json.load(f)
        outputs = load_file(os.path.join(work, "outputs.safetensors"))  # in memory: the files can go
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dict(available=True, why=result["peer"], rows={r["tokens"]: r for r in result["rows"]}, outputs=outputs,
                result=result)


def add_peer_args(p: argparse.ArgumentParser) -> None:
    """A peer script's flags: the bench's own (`add_run_args`, which `layer_flags` passes) and where `child_peer`
    reads its results back (`--json`, `--outputs`: `write_peer`)."""
    add_run_args(p)
    p.add_argument("--outputs", default=None, help="write each batch's output here (safetensors, `tokens_<n>`)")


def write_peer(args, result: dict, outputs: dict) -> dict:
    """A peer's result to `--json` and each batch's output to `--outputs`, where `child_peer` reads them."""
    if args.outputs:
        from safetensors.torch import save_file

        save_file(outputs, args.outputs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def layer_flags(args) -> list[str]:
    """The layer's shapes, batches and timing as a peer script's flags (`add_run_args`)."""
    return ["--device", args.device, "--tokens", ",".join(map(str, args.tokens)), "--hidden", str(args.hidden),
            "--intermediate", str(args.intermediate), "--experts", str(args.experts), "--topk", str(args.topk),
            "--clamp", str(args.clamp), "--warmup", str(args.warmup), "--iters", str(args.iters), "--captures",
            str(args.captures)]


def sglang_peer(args) -> dict:
    """SGLang's FP8 `fused_moe` on this layer and these batches (bench/sglang_fused_moe.py, `child_peer`)."""
    from bench.sglang_fused_moe import find_wheel

    if args.no_sglang:
        return dict(available=False, why="--no-sglang")
    try:
        wheel = find_wheel(args.sglang_wheel)
    except FileNotFoundError as e:
        return dict(available=False, why=str(e))
    flags = ["--wheel", wheel, *layer_flags(args)]
    if args.sglang_configs:
        flags += ["--configs", args.sglang_configs]
    peer = child_peer("sglang_fused_moe.py", flags, "sglang_peer_")
    if peer["available"]:
        peer["wheel_sha256"] = peer.pop("result")["wheel_sha256"]
    return peer


def deepgemm_peer(args) -> dict:
    """DeepGEMM's SM90 Mega MoE kernels (FP8 x FP4, FP8 x FP8) on this layer and these batches
    (bench/deepgemm_sm90_mega_moe.py, `child_peer`): on sm_90 with the fork's source archive (`--deepgemm-sm90` or
    $PLANC_DEEPGEMM_SM90), else why not."""
    if args.no_deepgemm:
        return dict(available=False, why="--no-deepgemm")
    if not args.deepgemm_sm90:
        return dict(available=False, why="no source archive (--deepgemm-sm90 or $PLANC_DEEPGEMM_SM90; "
                                         "bench/deepgemm_sm90_mega_moe.py --assemble writes one)")
    if args.device != "cuda" or torch.cuda.get_device_capability()[0] != 9:
        return dict(available=False, why="the kernel is sm_90's (Hopper) only")
    flags = ["--source", args.deepgemm_sm90, *layer_flags(args)]
    if args.deepgemm_cache:
        flags += ["--cache", args.deepgemm_cache]
    peer = child_peer("deepgemm_sm90_mega_moe.py", flags, "deepgemm_peer_")
    if peer["available"]:
        result = peer.pop("result")
        peer["source"], peer["kinds"] = result["source"], result["kinds"]
    return peer


@contextlib.contextmanager
def bf16_path_only():
    """The Triton backend without the FP8 path's rows of the config table (`config.FP8_CONFIGS`): what it ran before
    that path existed, timed in the same process and on the same card as the table with them."""
    saved = triton_config.FP8_CONFIGS
    triton_config.FP8_CONFIGS = ()
    try:
        yield
    finally:
        triton_config.FP8_CONFIGS = saved


def capture_graph(fn):
    """A CUDA graph of `fn` (after one warm call outside the capture, on a side stream), replayed once, and the
    output tensors the graph writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def graph_or_eager(device, measure, fn, use_graph, captures=1, spread=None):
    """Median µs of `fn` by CUDA-graph replay (`capture_graph`), else eager. With `captures` > 1: the median over that
    many graphs, each captured afresh (its own memory pool, so its buffers at other addresses), each timed by
    `measure`; `spread` (a list) gets each graph's time. Why: at prefill sizes one capture of the V4 layer timed up to
    17% apart from another of the same kernels in the same process, while replays of one graph repeat within ~1%."""
    if not use_graph:
        return measure(fn), None
    times, out = [], None
    for _ in range(max(captures, 1)):
        graph, out = capture_graph(fn)
        times.append(measure(graph.replay))
        del graph
    if spread is not None:
        spread.extend(times)
    return statistics.median(times), out


# The candidates of the last tuning (docs/benchmarks.md, H200, 2026-12-03), picks first; the
# sweep skips blocks of more than 16 rows below 64 tokens. Run it under each Triton version users get (torch 2.11:
# 3.6, 2.13: 3.7). From Triton 3.5 `prefetch=0` is the cp.async pipeline that register prefetch replaced.
SWEEP = (
    KernelConfig(16, 64, 64, 64, 64, 4, 4),
    KernelConfig(32, 64, 64, 64, 64, 4, 5),
    KernelConfig(64, 128, 64, 128, 64, 8, 4, maxnreg=128),
    KernelConfig(16, 64, 64, 64, 64, 4, 4, prefetch=0),
    KernelConfig(64, 128, 64, 128, 64, 8, 4, maxnreg=128, prefetch=0),
    KernelConfig(128, 128, 64, 128, 64, 8, 4),
    KernelConfig(16, 64, 64, 64, 64, 4, 4, maxnreg=56),
    KernelConfig(64, 128, 64, 128, 64, 8, 4),
    KernelConfig(64, 128, 64, 128, 64, 8, 3, maxnreg=128),
    KernelConfig(16, 64, 64, 64, 64, 4, 3),
    KernelConfig(16, 64, 64, 64, 64, 4, 5),
    KernelConfig(16, 64, 64, 64, 64, 4, 6),
    KernelConfig(16, 64, 128, 64, 128, 4, 3),
    KernelConfig(16, 128, 64, 128, 64, 8, 4),
    KernelConfig(16, 64, 64, 64, 64, 4, 4, 2),
    KernelConfig(32, 128, 64, 128, 64, 8, 4),
    KernelConfig(32, 128, 128, 128, 128, 8, 3),
    KernelConfig(64, 128, 64, 128, 64, 8, 3),
    KernelConfig(128, 64, 64, 64, 64, 4, 3),
)


def random_batch(args, n: int, device, seed: int):
    """`n` random BF16 tokens and their top-k routing (weights, expert ids) over `args.experts` experts."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, args.hidden, generator=g, device=device, dtype=torch.bfloat16)
    scores = torch.randn(n, args.experts, generator=g, device=device)
    w, idx = torch.topk(torch.softmax(scores, -1), args.topk, dim=-1)
    return x, w, idx


def kernel_table(device, fn, calls: int, rows: int) -> str:
    """torch.profiler's table of `calls` calls of `fn` (after the caller's warm-up), by total device time; on a GPU
    also the calls' wall time (CUDA events) beside the kernels' summed time: the difference is the GPU idle between
    kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for _ in range(calls):
            fn()
        if cuda:
            end.record()
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    if cuda:
        kernels = sum(e.self_device_time_total for e in prof.key_averages()) / calls
        wall = start.elapsed_time(end) * 1e3 / calls
        table += f"\nper call: {wall:.1f} µs wall, {kernels:.1f} µs in kernels ({wall - kernels:.1f} µs idle)"
    return table


def profile(args, device, layer, use_graph):
    """Where one layer call's GPU time goes: every kernel of 5 calls (graph replays where graphs are on, as the
    timed rows run), by total device time."""
    x, w, idx = random_batch(args, args.profile, device, seed=0)
    with torch.no_grad():
        for _ in range(3):
            layer(x, idx, w)
        fn = lambda: layer(x, idx, w)  # noqa: E731
        if use_graph:
            fn = capture_graph(fn)[0].replay
        print(kernel_table(device, fn, calls=5, rows=30))


def sweep(args, device, measure, packed):
    """Per batch size: graph-replay µs of the experts computation for each candidate config."""
    results = []
    for n in args.tokens:
        x, w, idx = random_batch(args, n, device, seed=n)
        q, sf = quantize_fp8(x)
        sf = float_to_ue8m0_bytes(sf)
        picked = device_config(n * args.topk, args.experts, args.hidden, args.intermediate, device)
        bf16 = device_config(n * args.topk, args.experts, args.hidden, args.intermediate, device, fp8=False)
        with general_path_only():
            general = device_config(n * args.topk, args.experts, args.hidden, args.intermediate, device)
        row = {"tokens": n, "picked": picked.__dict__, "bf16_picked": bf16.__dict__, "general_picked": general.__dict__,
               "configs": []}
        first = None  # the BF16-path pick's output: every other config's calc_diff is against it
        for cfg in dict.fromkeys([bf16, picked, general, *(args.configs or SWEEP)]):
            if n < 64 and cfg.block_t > 16:
                continue  # big token tiles for a decode batch: never competitive
            try:
                fit = cfg.fit(args.hidden, args.intermediate)
                def run(fit=fit):
                    return triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0,
                                                        activation_clamp=args.clamp, config=fit)

                us, _ = graph_or_eager(device, measure, run, device.type == "cuda")
                out = run()
            except Exception as e:  # noqa: BLE001 - a config that fails to compile (shared memory, registers): skip it
                print(f"  T={n} {cfg}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                continue
            first = out if first is None else first
            diff = calc_diff(out.float(), first.float())
            row["configs"].append({"config": fit.__dict__, "us": us, "calc_diff": diff})
            print(f"  T={n} {fit}: {us:.1f} us, calc_diff vs the BF16 pick {diff:.1e}", file=sys.stderr)
        best = min(row["configs"], key=lambda c: c["us"])
        row["best"] = best
        print(f"T={n}: best {best['us']:.1f} us {best['config']}; picked {picked}", file=sys.stderr)
        results.append(row)
    print_sweep(results)
    return results


def print_sweep(results):
    """The sweep as one Markdown table: a row per config, a column per batch size (µs; * the fastest, p the picked)."""
    fields = tuple(f.name for f in dataclasses.fields(KernelConfig))  # not ClassVars such as GLUON_BLOCK_ROWS
    key = lambda c: tuple(c[f] for f in fields)  # noqa: E731
    configs = list(dict.fromkeys(key(c["config"]) for r in results for c in r["configs"]))
    print("\n| " + ",".join(fields) + " | " + " | ".join(f"T={r['tokens']}" for r in results) + " |")
    print("|---|" + "---:|" * len(results))
    for cfg in configs:
        cells = []
        for r in results:
            us = {key(c["config"]): c["us"] for c in r["configs"]}.get(cfg)
            mark = ("*" if cfg == key(r["best"]["config"]) else "") + ("p" if cfg == key(r["picked"]) else "")
            cells.append("-" if us is None else f"{us:.1f}{mark}")
        print("| " + ",".join(map(str, cfg)) + " | " + " | ".join(cells) + " |")


def main(argv=None):
    args = parse_args(argv)
    if args.general_only:
        triton_config.DECODE_CONFIGS = ()
    if args.decode_variant:
        fields = DECODE_VARIANTS[args.decode_variant]
        triton_config.DECODE_CONFIGS = tuple((b, dataclasses.replace(c, **fields))
                                             for b, c in triton_config.DECODE_CONFIGS)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    group = init_one_rank(args.device)
    measure = timer(args.device, args.warmup, args.iters)
    use_graph = device.type == "cuda" and not args.no_graph
    if args.read_patterns:
        if device.type != "cuda":
            raise SystemExit("--read-patterns needs a CUDA GPU")
        return finish(args, dict(read_patterns=decode_read_patterns(args, device, measure)))
    if args.fp8_accumulation:
        if device.type != "cuda":
            raise SystemExit("--fp8-accumulation needs a CUDA GPU with FP8 MMAs")
        return finish(args, dict(fp8_accumulation=fp8_accumulation(device)))
    if args.routes:
        if device.type != "cuda":
            raise SystemExit("--routes needs a CUDA GPU (elsewhere `route` is `route_torch`)")
        return finish(args, dict(routes=route_times(args, device, measure)))

    run_peers = args.profile is None and not args.sweep
    skipped = dict(available=False, why="not run with --profile or --sweep")
    peer = sglang_peer(args) if run_peers else skipped
    print(f"SGLang fused_moe peer: {'measured' if peer['available'] else 'not measured'} ({peer['why']})",
          file=sys.stderr)
    dg_peer = deepgemm_peer(args) if run_peers else skipped
    print(f"DeepGEMM SM90 Mega MoE peer: {'measured' if dg_peer['available'] else 'not measured'} ({dg_peer['why']})",
          file=sys.stderr)
    experts, cfg = build_experts(args, device)
    undo = install_megamoe_forward(experts, backend="reference", quantize="fp4", activation_clamp=args.clamp,
                                   num_global_experts=args.experts, ep_rank=0, ep_size=1)
    del undo  # commit: frees the BF16 originals
    tri = sharing_fp4(experts, cfg)
    install_megamoe_forward(tri, backend="triton", activation_clamp=args.clamp, num_global_experts=args.experts,
                            ep_rank=0, ep_size=1)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    from planc.spec.ep import MegaMoeEP

    groups = types.SimpleNamespace(ep_group=group, ep_rank=0, ep_size=1, tp_group=group, tp_size=1, shares_batch=True)
    strategy = MegaMoeEP(reason="bench")
    ref_layer = MegaMoeEPRuntime(experts, strategy, groups)
    tri_layer = MegaMoeEPRuntime(tri, strategy, groups)
    tri_state = megamoe_state(tri)
    resident_fp4 = fp4_bytes(tri)
    bytes_per_expert = resident_fp4 / args.experts

    if args.profile is not None:
        profile(args, device, tri_layer, use_graph)
        return finish(args, None)

    if args.sweep:
        rows = sweep(args, device, measure, tri_state.runner.weights(device))
        result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      torch=torch.__version__, shapes=dict(hidden=args.hidden, intermediate=args.intermediate,
                                                           experts=args.experts, topk=args.topk), sweep=rows)
        return finish(args, result)

    reference_bytes = None
    baseline = None
    if not args.no_reference:
        weights = megamoe_state(experts).runner.weights(device)  # the reference's dequantized BF16 cache
        reference_bytes = resident_fp4 + weights.gate_up.nbytes + weights.down.nbytes
        baseline = grouped_mm_baseline(cfg, weights)

    copy_tbps = copy_bandwidth(device, measure) if device.type == "cuda" else None
    read_tbps = read_bandwidth(device, measure) if device.type == "cuda" else None
    rows = []
    for n in args.tokens:
        x, w, idx = random_batch(args, n, device, seed=n)
        row = dict(tokens=n, distinct_experts=int(torch.unique(idx).numel()))

        def timed(fn, key, row=row):
            """`graph_or_eager` over `--captures` graphs; each graph's µs under ``row[key + "_captures"]``."""
            row[key + "_captures"] = []
            return graph_or_eager(device, measure, fn, use_graph, args.captures, row[key + "_captures"])

        with torch.no_grad():
            row["triton_eager_us"] = measure(lambda: tri_layer(x, idx, w))
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")  # any host sync in one forward raises
                try:
                    tri_layer(x, idx, w)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            row["triton_us"], y_tri = timed(lambda: tri_layer(x, idx, w), "triton")
            if y_tri is None:
                y_tri = tri_layer(x, idx, w)
            if triton_config.FP8_CONFIGS:
                with bf16_path_only():  # the backend before its FP8 path, in this process on this card
                    row["bf16_path_us"], y_bf16 = timed(lambda: tri_layer(x, idx, w), "bf16_path")
                    if y_bf16 is None:
                        y_bf16 = tri_layer(x, idx, w)
            else:  # no FP8 rows in the table: the same kernels
                row["bf16_path_us"], y_bf16 = row["triton_us"], y_tri
            row["calc_diff_vs_bf16_path"] = calc_diff(y_tri.float(), y_bf16.float())
            picked = device_config(n * args.topk, args.experts, args.hidden, args.intermediate, device)
            row["path"] = "fp8" if picked.fp8 else "decode" if picked.decode else "bf16"
            row["picked"] = picked.__dict__
            if picked.decode:  # the general kernels on this batch, as before the decode rows (`general_path_only`)
                with general_path_only():
                    row["general_us"], y_gen = timed(lambda: tri_layer(x, idx, w), "general")
                    if y_gen is None:
                        y_gen = tri_layer(x, idx, w)
                row["calc_diff_vs_general"] = calc_diff(y_tri.float(), y_gen.float())
            else:  # the same kernels either way
                row["general_us"], row["calc_diff_vs_general"] = row["triton_us"], 0.0
            if picked.decode and not args.no_variants:  # the decode path's variants, each on the same batch
                row["variants"] = {}
                for name in args.variants:
                    fields = DECODE_VARIANTS[name]
                    try:
                        with decode_row(**fields):
                            us, y_var = timed(lambda: tri_layer(x, idx, w), f"variant_{name}")
                            if y_var is None:
                                y_var = tri_layer(x, idx, w)
                        row["variants"][name] = dict(us=us, same_bits=bool(torch.equal(y_var, y_tri)),
                                                     calc_diff=calc_diff(y_var.float(), y_tri.float()))
                    except Exception as e:  # noqa: BLE001 - a variant that fails on this Triton: say so, go on
                        row["variants"][name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    print(f"  tokens {n} decode variant {name}: {row['variants'][name]}", file=sys.stderr)
                if device.type == "cuda":
                    from planc.kernels.megamoe.triton import decode as decode_kernels

                    row["persistent_stalls"] = int(decode_kernels.stalls(device).item())
            if baseline is not None:
                row["reference_us"], y_ref = timed(lambda: ref_layer(x, idx, w), "reference")
                if y_ref is None:
                    y_ref = ref_layer(x, idx, w)
                row["calc_diff"] = calc_diff(y_tri.float(), y_ref.float())
                try:
                    row["grouped_mm_us"], _ = timed(lambda: baseline(x, idx, w), "grouped_mm")
                    row["grouped_mm_mode"] = "graph" if use_graph else "eager"
                except Exception as e:  # noqa: BLE001 - report the eager time if the baseline cannot be captured
                    print(f"grouped_mm capture failed ({type(e).__name__}: {e}); timing it eagerly", file=sys.stderr)
                    row["grouped_mm_us"], row["grouped_mm_mode"] = measure(lambda: baseline(x, idx, w)), "eager"
        if peer["available"]:
            p = peer["rows"][n]
            row["sglang_us"], row["sglang_config"] = p.get("us"), p["config_source"]
            row["sglang_best_us"] = p["best"] and p["best"]["us"]
            row["sglang_align_us"] = p.get("align_us")
            row["calc_diff_vs_sglang"] = calc_diff(y_tri.float().cpu(), peer["outputs"][f"tokens_{n}"].float())
        if dg_peer["available"]:
            for kind in dg_peer["kinds"]:
                p = dg_peer["rows"][n][kind]
                row[f"deepgemm_{kind}_us"], row[f"deepgemm_{kind}_kernel_us"] = p["us"], p["kernel_us"]
                row[f"calc_diff_vs_deepgemm_{kind}"] = calc_diff(y_tri.float().cpu(),
                                                                 dg_peer["outputs"][f"tokens_{n}_{kind}"].float())
        if args.ceiling and device.type == "cuda":
            row["ceiling"] = dense_ceiling(args, n, device, measure, use_graph)
        row["bound_us"], row["bound"] = bound_us(args, n, bytes_per_expert)
        row["ratio"] = row["triton_us"] / row["bound_us"]
        if copy_tbps is not None and row["bound"] == "fp4 read":  # the same bytes at a plain copy's rate
            row["copy_bound_us"] = row["bound_us"] * args.hbm_tbps / copy_tbps
            row["read_bound_us"] = row["bound_us"] * args.hbm_tbps / read_tbps
        rows.append(row)
        if args.json:  # the rows so far, in case a time limit stops the run before the end
            with open(args.json, "w") as f:
                json.dump(dict(partial=True, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               rows=rows), f, indent=2)
        print(f"tokens {n}: triton {row['triton_us']:.1f} us ({row['path']}), general kernels {row['general_us']:.1f} "
              f"us, bound {row['bound_us']:.1f} us ({row['ratio']:.2f}x; general {row['general_us'] / row['bound_us']:.2f}x)"
              f", copy bound {row.get('copy_bound_us', float('nan')):.1f} us, calc_diff vs general "
              f"{row['calc_diff_vs_general']:.1e}, vs reference {row.get('calc_diff', float('nan')):.2e}", file=sys.stderr)

    stats = buffer_stats()
    fp8_copy = fp8_layout_bytes(tri_state, device)  # made by the batches above that took the FP8 path
    result = dict(
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        shapes=dict(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, topk=args.topk),
        backend_reason=tri_state.reason,
        copy_tbps=copy_tbps,
        read_tbps=read_tbps,
        sglang={k: v for k, v in peer.items() if k != "outputs"},
        deepgemm={k: v for k, v in dg_peer.items() if k != "outputs"},
        resident_bytes=dict(triton=resident_fp4, triton_fp8_layout=fp8_copy, reference=reference_bytes),
        buffer_allocations=stats.allocations, buffer_bytes=stats.live_bytes,
        rows=rows,
    )
    print(f"\nMega MoE, one layer, one rank ({result['device']}; H={args.hidden}, I={args.intermediate}, "
          f"E={args.experts}, top-{args.topk}; {'graph replay' if use_graph else 'eager'}, µs)\n")
    print("| tokens | triton | path | triton, BF16 path only | BF16 path / triton | triton eager | reference | "
          "bf16 grouped_mm | bound | bound is | triton / bound | grouped_mm / triton | calc_diff | "
          "calc_diff vs BF16 path |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")

    def f(v, spec=".1f"):
        return "n/a" if v is None else format(v, spec)

    for r in rows:
        gm = r.get("grouped_mm_us")
        print(f"| {r['tokens']} | {f(r['triton_us'])} | {r['path']} | {f(r['bf16_path_us'])} | "
              f"{r['bf16_path_us'] / r['triton_us']:.2f}x | {f(r['triton_eager_us'])} | {f(r.get('reference_us'))} | "
              f"{f(gm)} | {f(r['bound_us'])} | {r['bound']} | {r['ratio']:.2f}x | "
              f"{f(gm / r['triton_us'] if gm else None, '.2f')} | {f(r.get('calc_diff'), '.1e')} | "
              f"{r['calc_diff_vs_bf16_path']:.1e} |")
    if use_graph and args.captures > 1:
        print(f"\nEach time above is the median over {args.captures} graphs, each captured afresh; their spread (µs):\n")
        print("| tokens | triton: min | max | max / min | BF16 path only: min | max | max / min |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            t, b = r.get("triton_captures") or [r["triton_us"]], r.get("bf16_path_captures") or [r["bf16_path_us"]]
            print(f"| {r['tokens']} | {min(t):.1f} | {max(t):.1f} | {max(t) / min(t):.3f} | {min(b):.1f} | "
                  f"{max(b):.1f} | {max(b) / min(b):.3f} |")
    print(f"\nSplit-K decode against the general kernels (same process, same card). bound: the FP4 read at "
          f"{args.hbm_tbps} TB/s; copy bound: the same bytes at the rate a device-to-device copy reached here "
          f"({f(copy_tbps, '.2f')} TB/s, bytes read + written); read bound: at the rate a plain Triton read stream "
          f"reached here ({f(read_tbps, '.2f')} TB/s, `read_bandwidth`)\n")
    print("| tokens | path | triton | general kernels | general / triton | bound | triton / bound | general / bound | "
          "copy bound | triton / copy bound | read bound | triton / read bound | calc_diff vs general |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cb, rb = r.get("copy_bound_us"), r.get("read_bound_us")
        print(f"| {r['tokens']} | {r['path']} | {f(r['triton_us'])} | {f(r['general_us'])} | "
              f"{r['general_us'] / r['triton_us']:.2f}x | {f(r['bound_us'])} | {r['ratio']:.2f}x | "
              f"{r['general_us'] / r['bound_us']:.2f}x | {f(cb)} | {f(r['triton_us'] / cb if cb else None, '.2f')} | "
              f"{f(rb)} | {f(r['triton_us'] / rb if rb else None, '.2f')} | {r['calc_diff_vs_general']:.1e} |")
    varied = [r for r in rows if r.get("variants")]
    if varied:
        names = args.variants
        base_name = SPLIT_K_VARIANT if SPLIT_K_VARIANT in names else None
        print(f"\nDecode variants (the layer, same process, same card, µs; three_launches: the decode path before the "
              f"prologue and the persistent kernel; {base_name or 'picked'} / variant: the speed-up over "
              f"{'the split-K grid with the prologue' if base_name else 'the pick'}; variant / bound: against the FP4 "
              f"read at {args.hbm_tbps} TB/s; bits: the same output as the pick)\n")
        others = [k for k in names if k != base_name]
        print("| tokens | picked | " + " | ".join(names) + " | "
              + " | ".join(f"{base_name or 'picked'} / {v}" for v in others) + " | "
              + " | ".join(f"{v} / bound" for v in ["picked", *names]) + " | bits |")
        print("|---:|---:|" + "---:|" * (len(names) + len(others) + len(names) + 1) + "---|")
        for r in varied:
            v = r["variants"]
            us = {k: v[k].get("us") for k in names}
            base = us[base_name] if base_name else r["triton_us"]
            ratios = [f(base / us[k] if base and us[k] else None, ".2f") for k in others]
            bounds = [f(u / r["bound_us"] if u else None, ".2f") for u in [r["triton_us"], *us.values()]]
            bits = ", ".join(f"{k} differs (calc_diff {v[k]['calc_diff']:.1e})" for k in names
                             if v[k].get("same_bits") is False) or "same"
            errors = [f"{k}: {v[k]['error']}" for k in names if "error" in v[k]]
            print(f"| {r['tokens']} | {f(r['triton_us'])} | " + " | ".join(f(us[k]) for k in names) + " | "
                  + " | ".join(ratios) + " | " + " | ".join(bounds)
                  + f" | {bits}{'; ' + '; '.join(errors) if errors else ''} |")
        stalls = [r.get("persistent_stalls") for r in varied if r.get("persistent_stalls")]
        print(f"persistent kernel stalls (L2 items that stopped waiting; must be 0): {max(stalls) if stalls else 0}")
    if peer["available"]:
        print(f"\nAgainst SGLang's FP8 fused_moe (its process, run just before on this card: {peer['why']}, sha256 "
              f"{peer['wheel_sha256'][:12]}; SGLang's own tile config, and the best of it and --sglang-configs; µs)\n")
        print("| tokens | planc | SGLang | SGLang / planc | SGLang, best config | best / planc | SGLang's align step | "
              "calc_diff planc vs SGLang |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            s, b, diff = r.get("sglang_us"), r.get("sglang_best_us"), r["calc_diff_vs_sglang"]
            print(f"| {r['tokens']} | {f(r['triton_us'])} | {f(s)} | {peer_ratio(s, r['triton_us'], diff)} | {f(b)} | "
                  f"{peer_ratio(b, r['triton_us'], diff)} | {f(r.get('sglang_align_us'))} | {diff:.1e} |")
        if device.type == "cpu":
            print("(On CPU Triton's interpreter multiplies SGLang's BF16 values as raw bits, so its output is not "
                  "SGLang's: tests/kernels/megamoe/test_sglang_peer.py)")
    else:
        print(f"SGLang fused_moe: not measured: {peer['why']}")
    if dg_peer["available"]:
        src = dg_peer["source"]
        repo = src["deepgemm"]["url"].rstrip("/").split("/")[-2]
        print(f"\nAgainst DeepGEMM's SM90 Mega MoE kernels (their process, run just before on this card: {repo}/DeepGEMM "
              f"{src['deepgemm']['commit'][:12]}, CUTLASS {src['cutlass']['commit'][:12]}; one rank; fp4: FP8 x FP4 on "
              f"planc's FP4 bytes, fp8: FP8 x FP8 on them as block FP8; planc: the layer with its FP8 cast, DeepGEMM: "
              f"its input copies and kernel, its FP8 cast not counted; µs)\n")
        print("| kernel | tokens | planc | DeepGEMM | DeepGEMM / planc | DeepGEMM kernel alone | calc_diff planc vs DeepGEMM |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for kind in dg_peer["kinds"]:
            for r in rows:
                d, diff = r.get(f"deepgemm_{kind}_us"), r[f"calc_diff_vs_deepgemm_{kind}"]
                print(f"| {kind} | {r['tokens']} | {f(r['triton_us'])} | {f(d)} | {peer_ratio(d, r['triton_us'], diff)} "
                      f"| {f(r.get(f'deepgemm_{kind}_kernel_us'))} | {diff:.1e} |")
    else:
        print(f"DeepGEMM SM90 Mega MoE: not measured: {dg_peer['why']}")
    if peer["available"] or dg_peer["available"]:
        print(f"(A peer's ratio only where its output is within {PEER_BOUND:g} of planc's in calc_diff, DeepGEMM's "
              f"bound for FP8 GEMMs against BF16: elsewhere it computed another layer.)")
    ceilings = [r for r in rows if "ceiling" in r]
    if ceilings:
        print("\nThe same math as cuBLAS dense GEMMs (no routing, padding or FP4; µs, and TFLOP/s of the layer's math)\n")
        print("| tokens | rows | triton layer | cuBLAS BF16 | cuBLAS FP8 1x128 | triton TFLOP/s | BF16 TFLOP/s | "
              "FP8 TFLOP/s | triton / cuBLAS BF16 |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in ceilings:
            c = r["ceiling"]
            rate = lambda us: None if us is None else c["tflop"] / us * 1e6  # noqa: E731
            print(f"| {r['tokens']} | {c['rows']} | {f(r['triton_us'])} | {f(c['bf16_us'])} | "
                  f"{f(c.get('fp8_1x128_us'))} | {f(rate(r['triton_us']), '.0f')} | {f(rate(c['bf16_us']), '.0f')} | "
                  f"{f(rate(c.get('fp8_1x128_us')), '.0f')} | {r['triton_us'] / c['bf16_us']:.2f}x |")
        c = ceilings[-1]["ceiling"]
        print(f"FP8 1x128 scales: {c.get('fp8_1x128_scales') or c.get('fp8_1x128_error')}; "
              f"FP8 per-1x32 (MX) scales: {c['fp8_1x32']}")
    print(f"\nresident expert bytes per layer: triton {resident_fp4 / 1e9:.2f} GB (FP4 + UE8M0"
          + (f"; + {fp8_copy / 1e9:.2f} GB, the FP8 path's copy of them, made for its batches)" if fp8_copy
             else ", no other copy)")
          + (f", reference {reference_bytes / 1e9:.2f} GB (FP4 + its BF16 cache)" if reference_bytes else ""))
    print(f"buffer allocations: {stats.allocations} ({stats.live_bytes / 2**20:.1f} MiB live)")
    return finish(args, result)


def finish(args, result):
    """Every mode's exit: `result` to `--json` (when there is one), the symmetric buffers freed, the group left."""
    if args.json and result is not None:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    destroy_megamoe_buffers()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
