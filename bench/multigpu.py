"""Every EP implementation over N ranks (NCCL on GPUs, gloo on CPU), in one torchrun job.

Why one script: the multi-GPU machines are lent rarely and briefly, so one launch must produce the whole
record: correctness of every shipped plan against the unsharded model, per-layer speed against
transformers' own EP on the same GPUs, and the shared Mega MoE buffer's footprint.

1. Correctness: tiny and mid-size Mixtral and DeepSeek-V4 (fp32), the shipped plans with sizes set to N:
   `all_to_all`, `all_reduce`, `auto` (no grad -> all_reduce; with grad -> all_to_all) logits against the
   unsharded model on one device; `deepgemm_megamoe` (`backend: reference`, `quantize: fp4`) against the
   single-process reference run of the same FP4 model (the quantization changes the numbers on purpose).
2. Performance: one DeepSeek-V4 MoE layer (hidden 7168, intermediate 3072, top-6, `--experts-per-rank` x N
   experts; 48 x 8 = the real 384 on 8 GPUs), bf16, decode 1/16/64/256 and prefill 4096 tokens (the batch
   every rank of the TP=EP group holds): planc vs transformers' `AllToAllEP`/`AllReduceEP` (installed by
   `apply_expert_parallelism`, which `maybe_distribute_model` calls), eager and, for all_reduce and
   Mega MoE, CUDA-graph replay. transformers' own `MegaMoeEP` needs DeepGEMM on SM100 and an FP8
   checkpoint, so Mega MoE (reference backend) has no peer column.
3. Buffers: a DeepSeek-V4 with several MoE layers under the Mega MoE plan: allocations and bytes of the
   shared buffer cache after forwards of growing size, against one buffer per layer.

    torchrun --nproc_per_node N bench/multigpu.py --json $OUT/multigpu_N.json
    torchrun --nproc_per_node 2 bench/multigpu.py --device cpu           # CPU/gloo, tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402 - after the sys.path setup above
import torch.distributed as dist  # noqa: E402 - after the sys.path setup above
from machine import describe  # noqa: E402  (same directory)

import gpu_ep_layer as layer_bench  # noqa: E402  (same directory: the one-layer model, routes, timers)

PLANS = REPO / "plans"
CORRECTNESS_MODELS = ("mixtral", "deepseek_v4")
MID = {
    "mixtral": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8,
                    head_dim=128, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v4": dict(hidden_size=1024, moe_intermediate_size=1024, n_routed_experts=16, num_experts_per_tok=6),
}
# Tiny configs split over 4 ranks; 8 ranks need 8 attention heads.
TINY_8 = {"mixtral": dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8)}
REL_TOL = {"fp32": 1e-4, "megamoe": 1e-3}


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


# ---- plans ---------------------------------------------------------------------------------------------------


def shipped_plan(model_type: str, world: int, impl: str) -> dict:
    """The shipped plan of `model_type` as a mapping (extends resolved), sizes = world, EP implementation = impl."""
    import planc

    name = {"mixtral": "mixtral.yaml", "deepseek_v4": "deepseek_v4_allreduce.yaml"}[model_type]
    if impl == "deepgemm_megamoe":
        name = "deepseek_v4_megamoe.yaml"
    plan = planc.load_plan(str(PLANS / name)).plan.model_dump(mode="json", exclude_none=True)
    plan.pop("extends", None)
    plan["parallel"] = {"tp_size": world, "ep_size": world}
    experts = plan["experts"]
    if impl == "deepgemm_megamoe":
        experts["ep_implementation"] = "auto"
        experts["megamoe"] = {**experts.get("megamoe", {}), "backend": "reference", "quantize": "fp4"}
    else:
        experts.update(implementation="grouped_mm", ep_implementation=impl)
        experts.pop("megamoe", None)
    return plan


def experts_plan(world: int, impl: str) -> dict:
    """An experts-only plan for the one-layer performance model."""
    experts = {"implementation": "grouped_mm", "ep_implementation": impl}
    if impl == "deepgemm_megamoe":
        experts = {"implementation": "deepgemm_megamoe", "ep_implementation": "auto",
                   "megamoe": {"backend": "reference", "quantize": "fp4"}}
    return {
        "version": 1, "model": {"type": "deepseek_v4"}, "parallel": {"tp_size": world, "ep_size": world},
        "experts": experts,
        "ep_plan": {"model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
                    "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
                    "model.layers.*.mlp.experts": "ep_dispatch_experts"},
    }


# ---- 1. correctness ------------------------------------------------------------------------------------------


def build(model_type: str, size: str, world: int, device, **extra):
    from planc.models.build import build_tiny_model

    overrides = dict(MID[model_type]) if size == "mid" else dict(TINY_8.get(model_type, {}) if world > 4 else {})
    overrides.update(extra)
    return build_tiny_model(model_type, seed=0, **overrides).to(device)


def single_process_megamoe(model):
    """The same model with every experts module on the Mega MoE reference backend, FP4, all experts local."""
    from planc.runtime.megamoe import install_megamoe_forward, megamoe_state

    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            install_megamoe_forward(m, backend="reference", quantize="fp4")
            runner = megamoe_state(m).runner
            m.forward = lambda h, i, w, _r=runner: _r(h, i, w.float(), None).to(h.dtype)
    return model


def rel_diff(out, ref) -> tuple[float, float]:
    d = float((out.float() - ref.float()).abs().max())
    return d, d / max(float(ref.float().abs().max()), 1e-30)


def run_correctness(world: int, device, sizes) -> list:
    import planc

    rows = []
    gen = torch.Generator().manual_seed(123)
    for model_type in CORRECTNESS_MODELS:
        for size in sizes:
            base = build(model_type, size, world, device)
            ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=gen).to(device)
            with torch.no_grad():
                ref = base(input_ids=ids, use_cache=False).logits
            cells = [("all_to_all", False), ("all_reduce", False), ("auto", False), ("auto", True)]
            if model_type == "deepseek_v4":
                cells.append(("deepgemm_megamoe", False))
            for impl, grad in cells:
                label = impl + (" (grad)" if grad else "")
                row = {"model": model_type, "size": size, "impl": label, "world": world}
                try:
                    reference = ref
                    if impl == "deepgemm_megamoe":
                        with torch.no_grad():
                            reference = single_process_megamoe(copy.deepcopy(base))(input_ids=ids, use_cache=False).logits
                    model = copy.deepcopy(base)
                    planc.apply(model, shipped_plan(model_type, world, impl))
                    with torch.set_grad_enabled(grad):
                        out = model(input_ids=ids, use_cache=False).logits
                    if grad:
                        out.float().sum().backward()  # the all_to_all backward runs too
                    runtime = _first_runtime(model)
                    row["ran"] = (getattr(runtime, "last_choice", None) or getattr(getattr(runtime, "strategy", None), "name", None)
                                  or "no EP wrapper")
                    row["max_abs_diff"], row["rel_diff"] = rel_diff(out.detach(), reference)
                    tol = REL_TOL["megamoe" if impl == "deepgemm_megamoe" else "fp32"]
                    row["tol"] = tol
                    row["ok"] = _all_ranks(row["rel_diff"] <= tol)
                    del model
                except Exception as e:  # noqa: BLE001 - a failing cell is recorded, the run goes on
                    row["ok"], row["error"] = False, f"{type(e).__name__}: {e}"
                    if os.environ.get("PLANC_BENCH_TRACEBACK"):
                        traceback.print_exc()
                rows.append(row)
                log(f"  correctness {model_type:11s} {size:4s} {label:18s} "
                    + (f"rel {row['rel_diff']:.1e} {'ok' if row['ok'] else 'FAIL'}" if "rel_diff" in row
                       else f"ERROR {row['error'][:300]}"))
                _cleanup()
            del base
    return rows


def _first_runtime(model):
    for m in model.modules():
        rt = getattr(getattr(m, "forward", None), "runtime", None)
        if rt is not None:
            return rt
    return None


def _all_ranks(ok: bool) -> bool:
    t = torch.tensor([0 if ok else 1], device=_dist_device())
    dist.all_reduce(t)
    return int(t.item()) == 0


def _dist_device():
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else torch.device("cpu")


def _cleanup():
    try:
        from planc.runtime.megamoe import destroy_megamoe_buffers

        destroy_megamoe_buffers()
    except ImportError:
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- 2. performance ------------------------------------------------------------------------------------------


def install_peer(model, world: int, impl: str, device_type: str):
    """transformers' own EP on the experts: `apply_expert_parallelism` with a concrete plan, as
    `maybe_distribute_model` calls it (that entry point also installs nothing on a world of one)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    mesh = init_device_mesh(device_type, (world,))
    fqn = layer_bench.EXPERTS_FQN
    plan = {f"{fqn}.gate_up_proj": "grouped_gemm", f"{fqn}.down_proj": "grouped_gemm", fqn: "ep_dispatch_experts"}
    return apply_expert_parallelism(model, mesh, mesh, plan, ep_implementation=impl)


def run_performance(world: int, device_type: str, args, notes: list) -> list:
    import planc

    shapes = dict(layer_bench.TINY if device_type == "cpu" else layer_bench.FULL)
    shapes["n_routed_experts"] = args.experts_per_rank * world
    tokens = args.tokens or ((1, 16, 64) if device_type == "cpu" else layer_bench.DECODE + layer_bench.PREFILL)
    timer = layer_bench.Timer(device_type)
    base = layer_bench.build_layer_model(shapes, device_type)
    sides, m = {}, None
    for impl in args.impls:
        try:
            if impl != "deepgemm_megamoe":
                sides[("transformers", impl)] = layer_bench.experts_of(
                    install_peer(layer_bench.share_weights_copy(base), world, impl, device_type))
        except Exception as e:  # noqa: BLE001 - a side that cannot install is reported, not timed
            log(f"  transformers {impl} install failed: {type(e).__name__}: {e}")
        try:
            m = layer_bench.share_weights_copy(base)
            planc.apply(m, experts_plan(world, impl))
            sides[("planc", impl)] = layer_bench.experts_of(m)
        except Exception as e:  # noqa: BLE001 - a side that cannot install is reported, not timed
            log(f"  planc {impl} apply failed: {type(e).__name__}: {e}")
    del base, m
    _cleanup()

    rows = []
    for t in tokens:
        x, idx, w = layer_bench.routes(t, shapes, device_type)
        inner = 1 if t >= 4096 else (2 if device_type == "cpu" else 10)
        reps = args.reps or (5 if t >= 4096 else 15)
        for impl in args.impls:
            try:
                rows += perf_cell(world, impl, t, sides, x, idx, w, timer, inner, reps, device_type, args, notes)
            except Exception as e:  # noqa: BLE001 - deterministic failures hit every rank alike; go on
                log(f"  perf {impl} T={t}: {type(e).__name__}: {e}")
                notes.append(f"{impl} T={t}: {type(e).__name__}: {e}")
                if device_type == "cuda":
                    torch.cuda.synchronize()
    del sides
    _cleanup()
    return rows


def perf_cell(world, impl, t, sides, x, idx, w, timer, inner, reps, device_type, args, notes) -> list:
    """transformers and planc on one (EP implementation, tokens) cell: eager, and graph replay where it captures."""
    rows = []
    pair = {who: sides[(who, impl)] for who in ("transformers", "planc") if (who, impl) in sides}
    if not pair:
        return rows
    with torch.no_grad():
        fns = {}
        for who, e in pair.items():
            try:
                e(x, idx, w)
                fns[who] = lambda e=e: e(x, idx, w)
            except Exception as err:  # noqa: BLE001 - a side that cannot run is reported, not timed
                log(f"  {who} {impl} T={t}: forward failed: {type(err).__name__}: {err}")
                notes.append(f"{who} {impl}: forward failed: {type(err).__name__}: {err}")
                sides.pop((who, impl), None)
        if not fns:
            return rows
        diff = None
        if len(fns) == 2:
            diff = float((fns["planc"]() - fns["transformers"]()).abs().max())
        modes = {"eager": fns}
        if device_type == "cuda" and impl != "all_to_all" and not args.no_graphs:
            graphs = {}
            for who, f in fns.items():
                try:
                    graphs[who], _ = layer_bench.capture(f)
                except Exception as e:  # noqa: BLE001 - a side that does not capture is reported, not fatal
                    log(f"  {who} {impl} T={t}: CUDA graph capture failed: {type(e).__name__}: {e}")
                    torch.cuda.synchronize()
            if graphs:
                modes["graph"] = graphs
        for mode, mfns in modes.items():
            med = layer_bench.measure(mfns, timer, warmup=2, reps=reps, inner=inner)
            # the world waits for its slowest rank
            vals = torch.tensor([med.get(k, float("nan")) for k in ("transformers", "planc")],
                                dtype=torch.float64, device=_dist_device())
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            tr, pl = (None if v != v else v * 1e6 for v in vals.tolist())
            row = {"world": world, "impl": impl, "tokens": t, "mode": mode, "transformers_us": tr,
                   "planc_us": pl, "ratio": (pl / tr) if tr and pl else None, "max_abs_diff": diff}
            rows.append(row)
            log(f"  perf {impl:16s} T={t:5d} {mode:5s} transformers {_f(tr)} us  planc {_f(pl)} us  "
                f"ratio {_f(row['ratio'], '.2f')}")
        del modes, fns
    return rows


def _f(v, spec=".1f"):
    return "n/a" if v is None else format(v, spec)


# ---- 3. shared Mega MoE buffers ------------------------------------------------------------------------------


def run_buffers(world: int, device, args) -> dict:
    import planc
    from planc.runtime.megamoe import buffer_stats, destroy_megamoe_buffers

    layers = args.buffer_layers
    model = build("deepseek_v4", "mid", world, device, num_hidden_layers=layers,
                  layer_types=["sliding_attention"] * layers, mlp_layer_types=["moe"] * layers)
    planc.apply(model, shipped_plan("deepseek_v4", world, "deepgemm_megamoe"))
    destroy_megamoe_buffers()
    cuda = device.type == "cuda"
    steps = []
    before = buffer_stats()
    for tokens in (16, 48, 200):
        mem0 = torch.cuda.memory_allocated() if cuda else None
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            model(input_ids=ids.to(device), use_cache=False)
        s = buffer_stats()
        steps.append({
            "tokens": tokens, "tokens_per_rank": -(-tokens // world), "allocations": s.allocations - before.allocations,
            "live_buffers": s.live_buffers, "live_bytes": s.live_bytes,
            "per_layer_equivalent_bytes": layers * s.live_bytes,
            "cuda_allocated_delta": None if not cuda else torch.cuda.memory_allocated() - mem0,
        })
    destroy_megamoe_buffers()
    return {"world": world, "moe_layers": layers, "steps": steps}


# ---- report --------------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    out = [f"### {result['world']} ranks, {result['machine']}", ""]
    if result.get("correctness"):
        out += ["| model | size | EP | ran | max abs diff | rel diff | tol | ok |", "| --- | --- | --- | --- | ---: | ---: | ---: | --- |"]
        for r in result["correctness"]:
            if "error" in r:
                out.append(f"| {r['model']} | {r['size']} | {r['impl']} | | | | | ERROR: {r['error'][:160]} |")
            else:
                out.append(f"| {r['model']} | {r['size']} | {r['impl']} | {r.get('ran')} | {r['max_abs_diff']:.1e} | "
                           f"{r['rel_diff']:.1e} | {r['tol']:.0e} | {'yes' if r['ok'] else 'NO'} |")
        out.append("")
    if result.get("performance"):
        s = result["perf_shapes"]
        out += [f"One DeepSeek-V4 MoE layer: hidden {s['hidden_size']}, {s['n_routed_experts']} experts, top-"
                f"{s['num_experts_per_tok']}, intermediate {s['moe_intermediate_size']}; time per call, slowest rank.", "",
                "| EP | tokens | mode | transformers us | planc us | planc / transformers |", "| --- | ---: | --- | ---: | ---: | ---: |"]
        for r in result["performance"]:
            out.append(f"| {r['impl']} | {r['tokens']} | {r['mode']} | {_f(r['transformers_us'])} | {_f(r['planc_us'])} | "
                       f"{_f(r['ratio'], '.2f')} |")
        out.append("")
    for n in result.get("notes", []):
        out.append(f"Note: {n}")
    if result.get("notes"):
        out.append("")
    b = result.get("buffers")
    if b:
        if "error" in b:
            out.append(f"Buffers: ERROR {b['error']}")
        else:
            out += [f"Mega MoE buffers, {b['moe_layers']} MoE layers (reference backend):", "",
                    "| tokens | per rank | allocations so far | live buffers | live bytes | one buffer per layer would hold |",
                    "| ---: | ---: | ---: | ---: | ---: | ---: |"]
            for s in b["steps"]:
                out.append(f"| {s['tokens']} | {s['tokens_per_rank']} | {s['allocations']} | {s['live_buffers']} | "
                           f"{s['live_bytes']} | {s['per_layer_equivalent_bytes']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--sections", nargs="+", choices=("correctness", "performance", "buffers"),
                   default=["correctness", "performance", "buffers"])
    p.add_argument("--sizes", nargs="+", choices=("tiny", "mid"), default=["tiny", "mid"])
    p.add_argument("--impls", nargs="+", default=["all_to_all", "all_reduce", "deepgemm_megamoe"],
                   choices=("all_to_all", "all_reduce", "auto", "deepgemm_megamoe"))
    p.add_argument("--experts-per-rank", type=int, help="performance layer: experts per rank (GPU 48, CPU 8)")
    p.add_argument("--tokens", type=int, nargs="+", help="performance tokens (default 1 16 64 256 4096)")
    p.add_argument("--reps", type=int)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--buffer-layers", type=int, default=6)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    if args.experts_per_rank is None:
        args.experts_per_rank = 48 if args.device == "cuda" else 8

    if "RANK" not in os.environ:  # plain `python bench/multigpu.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(29500 + os.getpid() % 1000))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", device_id=device if args.device == "cuda" else None)
    world = dist.get_world_size()
    started = time.perf_counter()
    result = {"benchmark": "multigpu", "world": world, "device": args.device, "machine": describe(args.device, world=world)}
    log(f"[multigpu] {result['machine']}, world {world}")
    def dump():  # after every section, so a run cut short still leaves what it measured
        if args.json and dist.get_rank() == 0:
            Path(args.json).write_text(json.dumps(result, indent=2))

    if "correctness" in args.sections:
        result["correctness"] = run_correctness(world, device, args.sizes)
        dump()
    if "performance" in args.sections:
        shapes = dict(layer_bench.TINY if args.device == "cpu" else layer_bench.FULL)
        shapes["n_routed_experts"] = args.experts_per_rank * world
        result["perf_shapes"] = shapes
        result["notes"] = []
        result["performance"] = run_performance(world, args.device, args, result["notes"])
        if world == 1:
            result["notes"].append("world 1: planc.apply installs no EP wrapper for all_to_all/all_reduce (nothing to "
                                   "exchange), so planc's column is the bare experts; bench/gpu_ep_layer.py times "
                                   "planc's wrapper forced onto one rank")
        dump()
    if "buffers" in args.sections:
        try:
            result["buffers"] = run_buffers(world, device, args)
        except Exception as e:  # noqa: BLE001 - the buffer table is reported as failed; the rest stands
            result["buffers"] = {"error": f"{type(e).__name__}: {e}"}
    result["wall_s"] = time.perf_counter() - started
    if dist.get_rank() == 0:
        print("\n" + markdown(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
