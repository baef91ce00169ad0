"""Predicted peak memory per rank (`planc explain --train/--serve`) against rank 0 really running, full width.

Each point runs in its own process (`python -m planc.verification.memory`): rank 0 of the plan at its real tp/ep
(and dp 2 under fsdp) under torch's fake process group, real CPU tensors, torch's MemTracker/FSDPMemTracker
(planc/verification/memory.py says what runs). The prediction is `planc.compiler.peak_memory` on the same config.
Points run one at a time (each stays under ~6 GiB). Prints one row per point and the largest error.

    python bench/memory_grid.py                 # the full grid (about 30 minutes on 2 cores)
    python bench/memory_grid.py --only mixtral  # one family
    python bench/memory_grid.py --cache bench/memory_grid_measured.json  # the measured grid of docs/memory.md:
                                                # a rerun predicts again, measuring only points whose plan changed
    python bench/memory_grid.py --device cuda --jobs 4  # on one GPU: torch.cuda.max_memory_allocated (and the
                                                # allocator's reserved high-water mark), 4 points at a time
    python bench/memory_grid.py --device cuda --cache bench/memory_grid_measured_h100.json  # the H100 grid of
                                                # docs/memory.md, predicted again (no GPU needed: every point is cached)

CPU points are predicted with `--device-type cpu` (torch's for-loop AdamW step, no cuBLAS workspaces), CUDA points
with `--device-type cuda` (the AdamW step the plan leads torch to, the cuBLAS workspaces of sm_90).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from machine import describe  # noqa: E402  (same directory)

# Every shipped plan (its file's stem names it), full hidden width, 2 decoder layers (and, for DeepSeek-V3 training,
# fewer routed experts: 2 per EP rank) so that a point stays under ~6 GiB on the shared machine. Two layers of each
# kind a family mixes: Qwen3-Next one linear-attention and one full-attention layer, GLM-4.5 and DeepSeek one dense
# and one MoE layer; gpt-oss alternates sliding and full by default.
FAMILIES = {
    "mixtral": {"num_hidden_layers": 2},
    "qwen3_moe": {"num_hidden_layers": 2},
    "deepseek_v3": {"num_hidden_layers": 2, "first_k_dense_replace": 1},
    "gpt_oss": {"num_hidden_layers": 2},
    "minimax_m2": {"num_hidden_layers": 2},
    "glm4_moe": {"num_hidden_layers": 2, "first_k_dense_replace": 1},
    "qwen3_next": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
    "llama4": {"num_hidden_layers": 2},
    "deepseek_v2": {"num_hidden_layers": 2, "first_k_dense_replace": 1, "num_experts_per_tok": 6,
                    "moe_intermediate_size": 1408},  # 1407 (the default) breaks grouped_mm's 16-byte strides
    "qwen3_vl_moe": {"text_config.num_hidden_layers": 2, "vision_config.depth": 1},
    "deepseek_v4_allreduce": {"num_hidden_layers": 2},
    # 64 routed experts (8 per EP rank): the reference backend keeps each layer's experts dequantized (fp32 on CPU)
    "deepseek_v4_megamoe": {"num_hidden_layers": 2, "n_routed_experts": 64},
}
# Plan edits a family's points run with: Mega MoE's `auto` picks the reference backend on a CPU; the plan names it so
# that the prediction prices the backend that runs
PLAN_EDITS = {"deepseek_v4_megamoe": {"backend": "reference"}}
# Training holds parameters, gradients and AdamW state: fewer routed experts where the full count would not fit
# the shared machine (2-4 per EP rank); the prediction runs on the same config.
TRAIN_OVERRIDES = {"deepseek_v3": {"n_routed_experts": 16}, "gpt_oss": {"num_local_experts": 32},
                   "minimax_m2": {"num_local_experts": 32}, "qwen3_next": {"num_experts": 128},
                   "deepseek_v4_allreduce": {"n_routed_experts": 16}}
POINTS = {"mixtral": [(1, 1024), (2, 512)], "qwen3_moe": [(1, 1024), (2, 256)], "deepseek_v3": [(1, 512), (2, 128)],
          "gpt_oss": [(1, 1024), (2, 512)], "minimax_m2": [(1, 1024), (2, 256)], "glm4_moe": [(1, 1024), (2, 256)],
          "qwen3_next": [(1, 1024), (2, 256)], "llama4": [(1, 1024), (2, 256)], "deepseek_v2": [(1, 512), (2, 128)],
          "qwen3_vl_moe": [(1, 1024), (2, 256)], "deepseek_v4_allreduce": [(1, 512), (2, 128)],
          "deepseek_v4_megamoe": [(1, 512), (2, 128)]}
# Plans whose experts run an inference-only EP strategy (Mega MoE): no training modes.
SERVE_ONLY = {"deepseek_v4_megamoe"}
MODES = ("serve", "replicate", "fsdp", "checkpoint")


def grid(only=None, modes=MODES, points=None):
    for family, overrides in FAMILIES.items():
        if only and family not in only:
            continue
        for mode in modes:
            if mode != "serve" and family in SERVE_ONLY:
                continue
            for batch, seq in POINTS[family][:points]:
                extra = TRAIN_OVERRIDES.get(family, {}) if mode != "serve" else {}
                yield {"family": family, "mode": mode, "batch": batch, "seq": seq, "overrides": {**overrides, **extra},
                       "dp": 2 if mode == "fsdp" else 1}


def plan_of(point: dict) -> dict:
    """The point's own plan (the families section stores the one `planc init` wrote), else the shipped plan."""
    import copy

    from planc.verification.memory import plan_data

    if "plan" in point:  # the families section stores the plan `planc init` wrote
        return copy.deepcopy(point["plan"])
    data = plan_data(point["family"], point["mode"], dp=point["dp"], root=str(REPO))
    if point["family"] in PLAN_EDITS:
        data["experts"]["megamoe"] = {**data["experts"].get("megamoe", {}), **PLAN_EDITS[point["family"]]}
    return data


def cache_key(point: dict) -> str:
    """The point and a digest of the plan it runs: a cached measurement of an older plan is measured again."""
    plan = plan_of(point)
    if not plan["model"].get("custom"):  # a lint-only flag (a model type transformers does not ship): no bytes change
        plan["model"].pop("custom", None)
    digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:12]
    return json.dumps({**point, "plan": digest}, sort_keys=True)


def predict(point: dict, *extra: str) -> dict:
    """`planc explain` on the same plan and config, as users ask (`extra`: more flags, e.g. `--device-memory`)."""
    import contextlib
    import io
    import tempfile

    import yaml

    from planc.cli import main

    data = plan_of(point)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        args = ["explain", str(path), "--format", "json", "--batch", str(point["batch"]), "--seq", str(point["seq"]),
                "--train" if point["mode"] != "serve" else "--serve"]
        args += ["--device-type", point.get("device", "cpu")]  # CPU: the for-loop AdamW step, no cuBLAS workspaces
        for k, v in point["overrides"].items():
            args += ["--set", f"{k}={v}"]
        args += extra
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(args)
        assert rc == 0, out.getvalue()
    return json.loads(out.getvalue())["memory"]


def predict_all(points: list[dict]) -> list[dict]:
    """`predict` for many points, each plan and config compiled once: the functions `planc explain` runs
    (`explain_one`, `train_memory`, `workload_peak`), with its flags' meanings (`--set` read by `parse_overrides`)."""
    import tempfile

    import yaml

    from planc.commands.explain import explain_one, parse_overrides, workload_peak
    from planc.compiler.train_memory import train_memory

    compiled_for: dict[str, tuple] = {}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for point in points:
            key = json.dumps([point["family"], point["mode"], point["dp"], point["overrides"]], sort_keys=True)
            if key not in compiled_for:
                path = Path(tmp) / f"plan{len(compiled_for)}.yaml"
                path.write_text(yaml.safe_dump(plan_of(point), sort_keys=False))
                overrides = parse_overrides([f"{k}={v}" for k, v in point["overrides"].items()])
                rc, compiled, model = explain_one(str(path), {}, overrides, "config")
                assert rc == 0, point
                compiled_for[key] = (compiled, model, train_memory(compiled, model) if point["mode"] != "serve" else None)
            compiled, model, train = compiled_for[key]
            workload = {"workload": "serve" if point["mode"] == "serve" else "train", "batch": point["batch"],
                        "seq": point["seq"], "search": "batch", "capacity_factor": 1.0, "reserve": None,
                        "device_type": point.get("device", "cpu")}
            out.append(workload_peak(compiled, model, train, workload, None, "plan").to_json())
    return out


def measure(point: dict) -> dict:
    from tests.checkout_env import checkout_env

    env = checkout_env()
    edited = {"plan": plan_of(point)} if point["family"] in PLAN_EDITS else {}
    run = subprocess.run([sys.executable, "-m", "planc.verification.memory",
                          json.dumps({**point, **edited, "root": str(REPO)})],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if run.returncode:
        raise RuntimeError(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--points", type=int, help="only the first N (batch, seq) points of each family")
    parser.add_argument("--cache", help="a JSON file of measured points, read and extended")
    parser.add_argument("--families", action="store_true",
                        help="the families section (bench/memory_grid_families.py): families without a shipped plan, "
                             "each on the plan `planc init` writes; its points are stored with their measurements")
    parser.add_argument("--shapes", nargs="*", help="only points of these BATCHxSEQ shapes (e.g. 2x512)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--jobs", type=int, default=1, help="points measured at once (each in its own process)")
    args = parser.parse_args()
    cache = json.loads(Path(args.cache).read_text()) if args.cache and Path(args.cache).exists() else {}
    cuda = args.device == "cuda"
    machine = describe("cuda" if cuda else "cpu")
    print(machine)
    print(f"{'family':12s} {'mode':10s} {'batch':>5s} {'seq':>5s} {'predicted':>10s} {'measured':>10s} {'error':>7s}"
          + (f" {'reserved':>10s}" if cuda else "") + "  moment")
    if args.families:
        import memory_grid_families

        chosen = memory_grid_families.points(args.only, [m for m in args.modes if m in memory_grid_families.POINTS])
    else:
        chosen = list(grid(args.only, args.modes, args.points))
    if args.shapes:
        chosen = [p for p in chosen if f"{p['batch']}x{p['seq']}" in args.shapes]
    points = [{**p, "device": args.device} if cuda else p for p in chosen]
    pending = [p for p in points if cache_key(p) not in cache]
    t0 = time.perf_counter()
    failed: dict[str, str] = {}
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # each point is its own process: threads only wait
        futures = {pool.submit(_measure_or_error, p): p for p in pending}
        for done in as_completed(futures):
            point, result = futures[done], done.result()
            key = cache_key(point)
            if isinstance(result, str):
                failed[key] = result
                continue
            # a point with its own plan is kept whole: predicting it again needs no `planc init`
            cache[key] = {**result, "point": point} if "plan" in point else result
            cache[key]["machine"] = machine
            if args.cache:  # written as points finish (merged by key): a stopped run keeps what it measured
                on_disk = json.loads(Path(args.cache).read_text()) if Path(args.cache).exists() else {}
                Path(args.cache).write_text(json.dumps({**on_disk, key: cache[key]}, indent=1))
    worst = 0.0
    measured = [p for p in points if cache_key(p) in cache]
    predictions = {cache_key(p): m for p, m in zip(measured, predict_all(measured))}
    for point in points:
        key = cache_key(point)
        if key in failed:
            print(f"{point['family']:12s} {point['mode']:10s} failed: {failed[key][-300:]}", flush=True)
            continue
        predicted, real = predictions[key], cache[key]
        error = predicted["peak_per_rank"] / real["peak"] - 1
        worst = max(worst, abs(error))
        reserved = f" {real['reserved'] / 2**30:>9.3f}G" if "reserved" in real else ""
        print(f"{point['family']:12s} {point['mode']:10s} {point['batch']:>5d} {point['seq']:>5d} "
              f"{predicted['peak_per_rank'] / 2**30:>9.3f}G {real['peak'] / 2**30:>9.3f}G {error:>+7.1%}{reserved}  "
              f"{predicted['peak_moment']}", flush=True)
    print(f"largest error: {worst:.1%} ({time.perf_counter() - t0:.0f} s)")
    return 0


def _measure_or_error(point: dict) -> dict | str:
    try:
        return measure(point)
    except RuntimeError as e:
        return str(e)


if __name__ == "__main__":
    sys.exit(main())
