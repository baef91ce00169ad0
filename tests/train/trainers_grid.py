"""The full trainer-integration grid (too slow for CI; tests/train/test_trainers.py runs a subset).

python -m tests.train.trainers_grid [--world 2|4] [--sft]

Tiny Mixtral, Qwen3-MoE and DeepSeek-V3 at every (tp, ep, dp) of (1,2,2), (2,2,1), (2,2,2), (1,4,4) that fits
the world, fsdp and replicate, through Trainer (tp 1: on CPU accelerate refuses Trainer's tp > 1, see
test_trainers.py) and the Accelerate loop; --sft adds TRL's SFTTrainer. Every case against one process on the
global batch.
One spawned world per world size; prints each case's worst differences and the failures.
"""

from __future__ import annotations

import argparse
import time

from tests.distributed import run_distributed
from tests.train.test_trainers import failures
from tests.train.trainers_workers import trainers_world

MODELS = ("mixtral", "qwen3_moe", "deepseek_v3")
LAYOUTS = ((1, 2, 2), (2, 2, 1), (2, 2, 2), (1, 4, 4))


def grid(world: int, sft: bool) -> list[tuple]:
    clients = ("trainer", "accelerate") + (("sft",) if sft else ())
    return [(m, tp, ep, dp, mode, client) for tp, ep, dp in LAYOUTS if tp * dp == world
            for client in clients if not (client != "accelerate" and tp > 1)
            for mode in ("fsdp", "replicate") for m in MODELS]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, choices=(2, 4), action="append")
    ap.add_argument("--sft", action="store_true")
    args = ap.parse_args()
    for world in args.world or (2, 4):
        cases = grid(world, args.sft)
        start = time.monotonic()
        results = run_distributed(trainers_world, world, cases, False)
        for case in cases:
            r = results[0][case]
            print(case, {k: r.get(k) for k in ("loss", "norm_rel", "params", "worst", "wrapped_by", "error")})
        bad = failures(cases, results)
        print(f"world {world}: {len(cases)} cases, {len(bad)} failures, {time.monotonic() - start:.0f} s wall")
        print("\n".join(bad))


if __name__ == "__main__":
    main()
