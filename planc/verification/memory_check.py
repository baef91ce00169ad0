"""`planc verify --memory`: rank 0 measured at full width beside `planc explain`'s predicted peak.

The model is the user's config at its real widths with the fewest layers that hold one of each kind (the
`--no-shrink` rule); the plan runs at its own sizes. The prediction is `planc.compiler.peak_memory` on that config,
the number `planc explain --train/--serve --batch --seq` prints; the measurement is rank 0 under torch's fake
process group with MemTracker (planc.verification.memory), in its own process (the fake group is that process's
default group). Both in bf16, the dtype a real run holds. The check fails when the prediction is under the
measured peak by more than `UNDER_PREDICTION` of it: a plan sized on explain's number would not fit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from planc.errors import VerifyError

UNDER_PREDICTION = 0.05  # the prediction may be this far under the measured peak (relative to the measured peak)
BATCH, SEQ = 1, 512  # the workload measured (explain's defaults are a user's choice; this is one cheap point)
TIMEOUT_S = 1200.0


def predicted_peak(loaded: Any, config: Any, *, train: bool, batch: int, seq: int) -> int:
    """`planc explain`'s peak per rank for `config` (bf16) under `loaded` at batch x seq."""
    import torch

    from planc.compiler.peak_memory import peak_memory
    from planc.compiler.resolve import compile_plan
    from planc.compiler.train_memory import train_memory
    from planc.compiler.walk import walk_model
    from planc.models.build import meta_model

    model = meta_model(config, dtype=torch.bfloat16)
    compiled = compile_plan(model, loaded)
    held = train_memory(compiled, model) if train else None
    # the measured rank runs on the CPU: torch's for-loop AdamW step, no cuBLAS workspaces
    peak = peak_memory(compiled, walk_model(model), config.to_dict(), held, workload="train" if train else "serve",
                       batch=batch, seq=seq, device_type="cpu")
    return int(peak.peak)


def measured_peak(loaded: Any, config: Any, *, train: bool, batch: int, seq: int) -> int:
    """Rank 0's peak (bytes) under the fake process group, measured in a process of its own."""
    data = loaded.plan.model_dump(exclude_none=True)
    data.pop("extends", None)
    training = data.get("training") or {}
    mode = "serve" if not train else "fsdp" if training.get("data_parallel") == "fsdp" else "replicate"
    if train and not training:
        data["training"] = {"data_parallel": "replicate"}
    from planc.spec.extensions import snapshot_data

    with tempfile.TemporaryDirectory(prefix="planc-verify-memory-") as tmp:
        config.save_pretrained(tmp)
        point = {"family": config.model_type, "mode": mode, "batch": batch, "seq": seq, "overrides": {},
                 "plan": data, "config_dir": tmp, "extensions": snapshot_data()}
        # the planc this process runs, first on the child's path (a checkout that is not installed too)
        here = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)}
        try:
            run = subprocess.run([sys.executable, "-m", "planc.verification.memory", json.dumps(point)], env=env,
                                 capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise VerifyError(f"--memory: rank 0 at full width did not finish in {TIMEOUT_S:.0f} s") from None
    if run.returncode != 0:
        last = [line for line in run.stderr.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        raise VerifyError(f"--memory: rank 0 at full width could not run: {last[0]}")
    return int(json.loads(run.stdout.strip().splitlines()[-1])["peak"])


def memory_stage(loaded: Any, config: Any, *, train: bool, batch: int = BATCH, seq: int = SEQ) -> dict:
    """The memory check as a stage of the report: `rel` is how far the prediction is under the measured peak
    (0 when it is at or above it), against UNDER_PREDICTION."""
    predicted = predicted_peak(loaded, config, train=train, batch=batch, seq=seq)
    measured = measured_peak(loaded, config, train=train, batch=batch, seq=seq)
    under = max(0.0, (measured - predicted) / measured) if measured else 0.0
    workload = "a training step (AdamW)" if train else "a prefill"
    gib = 2 ** 30
    detail = (f"rank 0 measured {measured / gib:.3f} GiB, explain predicts {predicted / gib:.3f} GiB "
              f"({(predicted - measured) / measured:+.1%}); {workload} at batch {batch} x seq {seq}, bf16, full width")
    return {"name": "memory", "abs": float(abs(measured - predicted)), "rel": under, "detail": detail,
            "measured": measured, "predicted": predicted}


__all__ = ["memory_stage", "predicted_peak", "measured_peak", "UNDER_PREDICTION"]
