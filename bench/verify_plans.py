"""How long `planc verify` takes per shipped plan at its own world size, against the floor of starting that world.

Why: the promise is "certified on CPU in minutes, before the GPU": each shipped plan, train stages included, fp32,
under 3 minutes on a 2-core box. Every plan runs `planc.verify(plan=..., train=True)` (logits, loss, every gradient,
clip_grad_norm_ with accumulation, one AdamW step, save -> load at half the sizes), then `--train` off (logits,
generate) when --serve is given; an inference-only plan (Mega MoE) runs the serving stages only. The peer in the same run: an empty gloo world of the same size (every rank imports
torch, transformers and planc and meets at a barrier), the part of a verify no stage can make faster; the ratio says
how much the stages cost on top. The box's load average is printed: CPU timings on a shared box move with it.

    python bench/verify_plans.py [--plans mixtral qwen3_moe] [--serve] [--json verify_plans.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from machine import describe  # noqa: E402  (same directory)

PLANS = sorted(p.stem for p in (REPO / "plans").glob("*.yaml"))


def _empty_rank(rank: int, world: int) -> None:
    import transformers  # noqa: F401 - what a verify rank imports before its first stage

    import planc.runtime.install  # noqa: F401


def world_floor(world: int) -> float:
    from planc.runtime.local_world import run_local_world

    start = time.monotonic()
    run_local_world(_empty_rank, world)
    return time.monotonic() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", nargs="+", choices=PLANS, default=PLANS)
    parser.add_argument("--serve", action="store_true", help="also the serving stages (a second verify per plan)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)

    import planc

    rows = []
    floors: dict[int, float] = {}
    print(f"{'plan':<24} {'ranks':>5} {'mode':<6} {'verify s':>8} {'empty world s':>13} {'ratio':>6}  verdict")
    from planc.spec.choices import EXPERTS_IMPLEMENTATIONS

    for name in args.plans:
        inference_only = EXPERTS_IMPLEMENTATIONS[
            planc.load_plan(str(REPO / "plans" / f"{name}.yaml")).plan.experts.implementation].inference_only
        modes = (False,) if inference_only else (True, False) if args.serve else (True,)
        for train in modes:
            report = planc.verify(plan=str(REPO / "plans" / f"{name}.yaml"), train=train, dtype=args.dtype)
            world = report.world_size
            if world and world not in floors:
                floors[world] = world_floor(world)
            floor = floors.get(world, float("nan"))
            verdict = "certified" if report.ok else (f"could not run: {report.error.splitlines()[0]}" if report.error
                                                     else "MISMATCH " + ",".join(s.name for s in report.stages if not s.ok))
            mode = "train" if train else "serve"
            print(f"{name:<24} {world:>5} {mode:<6} {report.seconds:8.1f} {floor:13.1f} {report.seconds / floor:6.1f}  "
                  f"{verdict}", flush=True)
            rows.append({"plan": name, "world": world, "mode": mode, "seconds": report.seconds,
                         "empty_world_seconds": floor, "ok": report.ok, "error": report.error,
                         "stages": [[s.name, s.max_rel_error, s.tolerance, s.ok] for s in report.stages]})
    machine = describe("cpu", load=True) + ", 1 torch thread per rank"
    print(f"\n{machine}; {args.dtype}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "dtype": args.dtype, "rows": rows}, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
