"""Cold-process wall time of `planc lint plans/` vs `check-jsonschema` on the same plan files.

Each run is a fresh process (what pre-commit and CI pay). The two tools run alternately so that
machine noise hits both alike; one warm-up run each fills the OS file cache. Prints the median and
minimum of each and the ratio planc / check-jsonschema (below 1: planc is faster), from one run of
this script. check-jsonschema checks only the schema; planc also checks duplicate keys, `extends`,
styles, patterns, EP strategies and sizes.

    .venv/bin/python bench/lint_cold.py [--runs 15] [--plans plans]
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from machine import wall  # noqa: E402  (same directory)


def tool(name: str) -> list[str] | None:
    local = os.path.join(os.path.dirname(sys.executable), name)
    found = local if os.path.exists(local) else shutil.which(name)
    return [found] if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--plans", default="plans")
    args = parser.parse_args()

    files = sorted(glob.glob(os.path.join(REPO, args.plans, "*.yaml")))
    rel = [os.path.relpath(f, REPO) for f in files]
    planc = (tool("planc") or [sys.executable, "-m", "planc"]) + ["lint", args.plans + "/"]
    cjs_exe = tool("check-jsonschema")
    if cjs_exe is None:
        raise SystemExit("check-jsonschema is not installed (pip install check-jsonschema)")
    cjs = cjs_exe + ["--schemafile", "schemas/plan.schema.json", *rel]

    times: dict[str, list[float]] = {"planc": [], "check-jsonschema": []}
    wall(planc, REPO), wall(cjs, REPO)  # warm-up: OS file cache, .pyc files
    for _ in range(args.runs):
        times["planc"].append(wall(planc, REPO))
        times["check-jsonschema"].append(wall(cjs, REPO))

    print(f"{len(files)} plan files, {args.runs} cold runs each (python {sys.version.split()[0]}, {os.cpu_count()} cpus)")
    print(f"  planc:            {' '.join(planc[-2:])}")
    print(f"  check-jsonschema: --schemafile schemas/plan.schema.json {args.plans}/*.yaml")
    for name, ts in times.items():
        print(f"{name:>18}: median {statistics.median(ts) * 1000:6.0f} ms   min {min(ts) * 1000:6.0f} ms")
    ratio = statistics.median(times["planc"]) / statistics.median(times["check-jsonschema"])
    print(f"ratio planc / check-jsonschema (median): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
