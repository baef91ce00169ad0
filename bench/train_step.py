"""Training step time and peak memory per rank: planc `fsdp` against plain FSDP2 and DDP, same model, same run.

CPU mode (default, 4 gloo ranks): a Mixtral-shaped model (8 experts) trained for a few AdamW steps
three ways, each in its own spawned world so that each process's memory high-water mark is its own:

- planc: `planc.apply` with `parallel: {tp_size: 1, ep_size: 4, dp_size: 4}`, `training:
  {data_parallel: fsdp}` (experts expert-parallel, 2 per rank; dense parameters FSDP2 over 4 ranks);
- FSDP2: `fully_shard` on every decoder layer and the root over the 4 ranks (no TP/EP);
- DDP: `DistributedDataParallel` over the 4 ranks.

Every rank feeds its micro-batch of the same global batch. Step time: median over the timed steps of
the slowest rank's. Peak memory per rank: the process's resident-set high-water mark
(`getrusage`) minus its resident set right before the model is built (imports and the process group
excluded), the largest over ranks. Ratios planc / FSDP2 and planc / DDP are printed; the goal is planc
peak memory <= FSDP2's.

GPU mode (`--gpu`, a world of one GPU): one training step (forward, backward, AdamW) of a full-width
2-layer Qwen3-MoE (bf16, grouped_mm experts) through planc against the same model without planc,
alternating in one process; the ratio is planc / plain. At a world of one no rule shards anything
(ep_size 1, so no EP dispatch runs either) and neither data-parallel mode wraps anything (one replica, no
mixed precision), so this measures what planc leaves on the step: `planc.clip_grad_norm_` against
torch's, and whatever apply installed. Both `training.data_parallel` values are timed.

    python bench/train_step.py                      # CPU, 4 ranks
    python bench/train_step.py --gpu                # one CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from machine import describe  # noqa: E402

CPU_CONFIG = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, head_dim=32, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
)
PLAN = {
    "version": 1, "model": {"type": "mixtral"},
    "parallel": {"tp_size": 1, "ep_size": 4, "dp_size": 4},
    "experts": {"implementation": "grouped_mm", "ep_implementation": "all_to_all"},
    "training": {"data_parallel": "fsdp"},
    "ep_plan": {"model.layers.*.mlp.experts.{gate_up_proj,down_proj}": "grouped_gemm",
                "model.layers.*.mlp.experts": "ep_dispatch_experts"},
}
MODES = ("planc", "fsdp2", "ddp")


def _rss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _current_rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def cpu_rank(rank: int, world: int, mode: str, steps: int, warmup: int, micro: int, cols: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    base = _current_rss_kib()
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**CPU_CONFIG))
    model.set_experts_implementation("grouped_mm")
    if mode == "planc":
        import planc

        plan = dict(PLAN, parallel={"tp_size": 1, "ep_size": world, "dp_size": world})
        planc.apply(model, plan)

        def clip():
            return planc.clip_grad_norm_(model, 1.0)
    elif mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for i, layer in enumerate(model.model.layers):
            fully_shard(layer, reshard_after_forward=i < len(model.model.layers) - 1).set_force_sum_reduction_for_comms(True)
        fully_shard(model, reshard_after_forward=False).set_force_sum_reduction_for_comms(True)

        def clip():
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)

        def clip():
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses = [], []
    for step in range(warmup + steps):
        ids = torch.randint(0, CPU_CONFIG["vocab_size"], (world * micro, cols),
                            generator=torch.Generator().manual_seed(step))[rank * micro:(rank + 1) * micro]
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(elapsed.item())
        losses.append(loss.item())
    peak = torch.tensor([float(_rss_kib() - base)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"mode": mode, "step_ms": 1e3 * statistics.median(times), "peak_mib": peak.item() / 1024,
            "first_loss": losses[0]}


def cpu_main(args) -> dict:
    from planc.runtime.local_world import run_local_world

    rows = {}
    for mode in MODES:
        rows[mode] = run_local_world(cpu_rank, args.world, mode, args.steps, args.warmup, args.micro, args.cols)[0]
    p, f, d = rows["planc"], rows["fsdp2"], rows["ddp"]
    out = {
        "machine": describe("cpu", load=True) + f", {args.world} gloo ranks",
        "config": CPU_CONFIG, "world": args.world, "micro_batch": [args.micro, args.cols], "rows": rows,
        "time_ratio_vs_fsdp2": p["step_ms"] / f["step_ms"], "time_ratio_vs_ddp": p["step_ms"] / d["step_ms"],
        "memory_ratio_vs_fsdp2": p["peak_mib"] / f["peak_mib"], "memory_ratio_vs_ddp": p["peak_mib"] / d["peak_mib"],
    }
    print(out["machine"])
    print(f"tiny-ish Mixtral {CPU_CONFIG['num_hidden_layers']} layers, hidden {CPU_CONFIG['hidden_size']}, "
          f"{CPU_CONFIG['num_local_experts']} experts; micro-batch {args.micro}x{args.cols} per rank")
    print("| setup | step ms (median, slowest rank) | peak MiB per rank (max over ranks) |")
    print("| --- | ---: | ---: |")
    names = {"planc": f"planc fsdp (tp 1, ep {args.world}, dp {args.world})", "fsdp2": "FSDP2 whole model",
             "ddp": "DDP"}
    for mode in MODES:
        print(f"| {names[mode]} | {rows[mode]['step_ms']:.1f} | {rows[mode]['peak_mib']:.0f} |")
    print(f"planc / FSDP2: time {out['time_ratio_vs_fsdp2']:.2f}x, memory {out['memory_ratio_vs_fsdp2']:.2f}x; "
          f"planc / DDP: time {out['time_ratio_vs_ddp']:.2f}x, memory {out['memory_ratio_vs_ddp']:.2f}x")
    return out


def gpu_main(args) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import planc

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    config = Qwen3MoeConfig(num_hidden_layers=2, mlp_only_layers=[])  # full width: hidden 2048, 128 experts x 768
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    base.set_experts_implementation("grouped_mm")
    models = {"plain": base}
    for mode in ("replicate", "fsdp"):
        m = copy.deepcopy(base)
        plan = {
            "version": 1, "model": {"type": "qwen3_moe"}, "parallel": {"tp_size": 1, "ep_size": 1, "dp_size": 1},
            "experts": {"implementation": "grouped_mm", "ep_implementation": "all_to_all"},
            "training": {"data_parallel": mode},
        }
        planc.apply(m, plan)
        models[f"planc_{mode}"] = m
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5) for k, m in models.items()}
    ids = torch.randint(0, config.vocab_size, (args.gpu_batch, args.gpu_seq), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))

    def step(name):
        m, opt = models[name], opts[name]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = m(ids, labels=ids).loss
        loss.backward()
        (planc.clip_grad_norm_(m, 1.0) if name != "plain" else torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    times = {k: [] for k in models}
    for rep in range(args.warmup + args.steps):
        for name in models:  # interleaved: the same clocks and thermals for each
            t = step(name)
            if rep >= args.warmup:
                times[name].append(t)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    out = {
        "machine": describe("cuda", world=1), "tokens": args.gpu_batch * args.gpu_seq,
        "step_ms": med,
        "ratio_replicate": med["planc_replicate"] / med["plain"], "ratio_fsdp": med["planc_fsdp"] / med["plain"],
    }
    print(out["machine"])
    print(f"full-width 2-layer Qwen3-MoE bf16, grouped_mm, {args.gpu_batch}x{args.gpu_seq} tokens, AdamW + clip")
    for k, v in med.items():
        print(f"  {k:<16} {v:8.1f} ms")
    print(f"planc replicate / plain: {out['ratio_replicate']:.3f}x; planc fsdp / plain: {out['ratio_fsdp']:.3f}x")
    dist.destroy_process_group()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="one CUDA GPU: planc vs plain on a full-width 2-layer Qwen3-MoE")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro", type=int, default=2, help="rows per rank (CPU)")
    p.add_argument("--cols", type=int, default=128, help="tokens per row (CPU)")
    p.add_argument("--gpu-batch", type=int, default=4)
    p.add_argument("--gpu-seq", type=int, default=2048)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    out = gpu_main(args) if args.gpu else cpu_main(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
