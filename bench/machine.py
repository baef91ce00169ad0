"""One line saying what a benchmark ran on, for its printed table and its JSON (every bench script uses it)."""

from __future__ import annotations

import os
import platform
import subprocess
import time


def describe(device: str = "cpu", *, world: int | None = None, threads: bool = False, load: bool = False) -> str:
    """`device`: "cuda" names the GPU (`world` x it), else the CPU and its cores; `threads`: torch's thread count;
    `load`: the host's load average (CPU timings on a shared box move with it)."""
    import torch
    import transformers

    if device == "cuda":
        what = torch.cuda.get_device_name()
        if world is not None:
            what = f"{world} x {what}"
    else:
        what = f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
        if threads:
            what += f", {torch.get_num_threads()} threads"
        if load and hasattr(os, "getloadavg"):
            what += f" (load {os.getloadavg()[0]:.1f} at the end)"
    return f"{what}, torch {torch.__version__}, transformers {transformers.__version__}"


def wall(cmd: list[str], cwd: str, env: dict[str, str] | None = None) -> float:
    """Seconds `cmd` takes in a fresh process (its output discarded); SystemExit with its stderr's end if it fails."""
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    elapsed = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-500:]}")
    return elapsed
