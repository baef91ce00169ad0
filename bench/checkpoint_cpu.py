"""planc.save / fill_from_dcp / planc.export on gloo ranks: wall time and how much memory each adds.

Why: save and export must not need the whole model on any rank (export gathers one decoder layer at a
time; save writes local shards), and reading a planc.save checkpoint back must cost about the local
shards. A mid-size random Mixtral (fp32; `--hidden`, `--layers`) is applied with the shipped plan at
tp = ep = world, saved, exported, then read back (new processes) into a model sharded on `meta`.
Memory is sampled from /proc/self/statm every 2 ms in a thread: "added" is the peak during the call
minus the RSS just before it (the process already holds the unsharded model planc.apply needed, which
is why the added RSS, not ru_maxrss, is the measure here); the read runs in fresh processes, so no
memory freed by an earlier model is reused unseen. A call's time is its slowest rank's.

    python bench/checkpoint_cpu.py --world 2 --json checkpoint_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _Peak:
    """Peak RSS while the block runs, sampled every 2 ms, minus the RSS at its start."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self.done = False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self.done:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.done = True
        self.thread.join()
        self.peak = max(self.peak, _rss())
        self.added = self.peak - self.start


def _world(rank, world_size, root, hidden, layers):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import planc
    from planc.models.build import build_tiny_model
    from tests.checkpoint.workers import plan_for

    model = build_tiny_model(
        "mixtral", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, head_dim=hidden // 4,
        vocab_size=1024,
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    plan = plan_for("ep", "mixtral", world_size)
    planc.apply(model, plan)
    local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
    )
    out = {"model_bytes": total, "layer_bytes": largest_layer, "local_bytes": local}
    for name, fn in (
        ("save", lambda: planc.save(model, Path(root) / "ckpt")),
        ("export", lambda: planc.export(model, Path(root) / "hub")),
    ):
        dist.barrier()
        with _Peak() as p:
            fn()
        out[f"{name}_s"], out[f"{name}_added_bytes"] = p.seconds, p.added
    return out


def _load_world(rank, world_size, root):
    """A fresh process per rank (nothing freed by an earlier model to reuse): what reading the checkpoint adds."""
    import torch

    import torch.distributed.checkpoint  # imports are not what is measured
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.checkpoint.workers import load_on_meta, plan_for

    with torch.device("meta"):  # import the model's modules before measuring
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(Path(root) / "ckpt"))
    gc.collect()
    with _Peak() as p:
        loaded = load_on_meta(Path(root) / "ckpt", plan_for("ep", "mixtral", world_size))
    with torch.no_grad():
        loaded(torch.zeros(1, 4, dtype=torch.long))
    return {"load_s": p.seconds, "load_added_bytes": p.added}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from planc.runtime.local_world import run_local_world

    with tempfile.TemporaryDirectory() as root:
        results = run_local_world(_world, args.world, root, args.hidden, args.layers)
        for r, loaded in zip(results, run_local_world(_load_world, args.world, root)):
            r.update(loaded)
    mib = 1 << 20
    r0 = results[0]
    summary = {
        "world": args.world,
        "model_MiB": r0["model_bytes"] / mib,
        "largest_layer_MiB": r0["layer_bytes"] / mib,
        "local_shards_MiB_per_rank": [r["local_bytes"] / mib for r in results],
        **{f"{k}_s": max(r[f"{k}_s"] for r in results) for k in ("save", "export", "load")},
        **{f"{k}_added_MiB_per_rank": [r[f"{k}_added_bytes"] / mib for r in results] for k in ("save", "export", "load")},
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
