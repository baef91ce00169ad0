"""Cold-process wall time of `planc explain plans/deepseek_v3.yaml --train --batch 1 --seq 4096` vs importing
torch and transformers.

Each run is a fresh process with an empty user cache (a new `XDG_CACHE_HOME` per run), as a first run from a fresh
clone: explain reads the shipped walk of the plan's model (planc/models/walks). The peer, `python -c "import torch,
transformers"`, is the floor of any run that builds the model; the live build (`PLANC_WALK_CACHE=off`, what explain
did before it read walks) runs too. The three alternate so that machine noise hits them alike; one warm-up run each
fills the OS file cache. Prints the median and minimum of each, the ratios to the import peer (below 1: faster than
importing torch and transformers) and the load average before and after.

    .venv/bin/python bench/explain_time.py [--runs 5] [--plan plans/deepseek_v3.yaml]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import machine  # noqa: E402  (same directory)


def wall(cmd: list[str], env: dict[str, str]) -> float:
    cache = tempfile.mkdtemp(prefix="planc-explain-time-")
    try:
        return machine.wall(cmd, REPO, {**env, "XDG_CACHE_HOME": cache})
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--plan", default="plans/deepseek_v3.yaml")
    args = parser.parse_args()

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    env.pop("PLANC_WALK_CACHE", None)
    explain = [sys.executable, "-m", "planc", "explain", args.plan, "--train", "--batch", "1", "--seq", "4096"]
    commands = {
        "planc explain": (explain, env),
        "import torch, transformers": ([sys.executable, "-c", "import torch, transformers"], env),
        "explain, live build": (explain, {**env, "PLANC_WALK_CACHE": "off"}),
    }
    load_before = os.getloadavg()[0]
    for cmd, e in commands.values():
        wall(cmd, e)  # warm-up: OS file cache, .pyc files
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, (cmd, e) in commands.items():
            times[name].append(wall(cmd, e))
    load_after = os.getloadavg()[0]

    from bench.machine import describe

    print(f"{' '.join(explain[2:])}: {args.runs} cold runs each, empty user cache")
    print(f"machine: {describe('cpu')}; load average {load_before:.2f} before, {load_after:.2f} after")
    for name, ts in times.items():
        print(f"{name:>27}: median {statistics.median(ts):5.2f} s   min {min(ts):5.2f} s")
    peer = statistics.median(times["import torch, transformers"])
    for name in ("planc explain", "explain, live build"):
        print(f"ratio {name} / import torch, transformers (median): {statistics.median(times[name]) / peer:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
