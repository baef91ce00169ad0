"""`planc.load` on the GPU of a full-width DeepSeek-V4 layer stack straight to the GPU, FP4 experts.

The checkpoint is bf16 at transformers' default DeepSeek-V4 widths (hidden 4096, 256 experts of
intermediate 2048, top-6, vocabulary 129280) with `--layers` decoder layers, random weights, written
once in the model's own layout. It is loaded with the shipped `deepseek_v4_megamoe` plan at sizes 1
(one GPU: NCCL world of one) and `megamoe.quantize: fp4`, so each layer's experts are quantized to FP4
as they arrive. Reported: peak GPU memory during the load (`torch.cuda.max_memory_allocated`) against
the local shard bytes the model holds afterwards, the largest single layer's bf16 experts (the
transient the per-layer quantization bounds), the host's peak RSS, and the load time.

`--experts fp4` writes the routed experts as DeepSeek-V4 ships them instead (per expert w1/w2/w3 e2m1 packed
two per byte + UE8M0 scales per 32, `expert_dtype: fp4`; the rest bf16): they are read straight into the
Mega MoE FP4 layout, with no bf16 copy of any expert at any time.

    torchrun --nproc-per-node 1 bench/load_gpu.py --workdir /tmp/v4 --layers 2
    torchrun --nproc-per-node 1 bench/load_gpu.py --workdir /tmp/v4 --layers 4 --experts fp4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GIB = 1 << 30


def _config(layers: int, overrides: dict):
    import torch
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v4", num_hidden_layers=layers, **overrides)
    config.layer_types = config.layer_types[:layers]
    config.mlp_layer_types = ["moe"] * layers
    config.dtype = torch.bfloat16
    return config


def write_fp4_checkpoint(path: Path, layers: int, overrides: dict, device: str) -> None:
    """The full-width model with random weights built on the GPU, its experts cast to FP4 and saved in DeepSeek-V4's
    hub format (the tests' writer, tests/runtime/load_fp8_workers.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.runtime.load_fp8_workers import save_fp4_experts

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(_config(layers, overrides), dtype=torch.bfloat16)
    save_fp4_experts(model, path, max_shard_size="4GB")


def write_checkpoint(path: Path, layers: int, overrides: dict, device: str) -> None:
    """Random bf16 weights of the full-width model, generated on the GPU tensor by tensor, one safetensors file per layer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = _config(layers, overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(0)
    files: dict[str, dict] = {}
    for name, t in model.state_dict().items():
        layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else "other"
        if t.is_floating_point():
            value = (torch.randn(t.shape, device=device, dtype=torch.float32, generator=gen) * 0.02).to(t.dtype)
        else:
            value = torch.zeros(t.shape, dtype=t.dtype, device=device)
        files.setdefault(f"model-{layer}.safetensors", {})[name] = value.cpu()
    weight_map = {}
    for file, tensors in files.items():
        save_file(tensors, path / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(path)


def plan(max_tokens: int) -> dict:
    import planc

    data = planc.load_plan(str(REPO / "plans" / "deepseek_v4_megamoe.yaml")).plan.model_dump(mode="json", exclude_none=True)
    data.pop("extends", None)
    data["parallel"] = {"tp_size": 1, "ep_size": 1}
    data["experts"]["megamoe"].update(backend="reference", quantize="fp4", max_tokens_per_rank=max_tokens)
    return data


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    import planc

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/planc-v4")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", choices=["bf16", "fp4"], default="bf16",
                   help="the checkpoint's routed experts: bf16 (quantized at load) or FP4 as DeepSeek-V4 ships them")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=INT",
                   help="shrink the config for a CPU smoke run, e.g. --set hidden_size=256")
    args = p.parse_args(argv)
    overrides = {k: int(v) for k, v in (o.split("=") for o in args.overrides)}
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = "cuda" if gpu else "cpu"
    path = Path(args.workdir) / f"deepseek_v4-{args.layers}layers-{args.experts}"
    t0 = time.perf_counter()
    if dist.get_rank() == 0 and not (path / "model.safetensors.index.json").is_file():  # written by an earlier run
        (write_fp4_checkpoint if args.experts == "fp4" else write_checkpoint)(path, args.layers, overrides, device)
    dist.barrier()
    write_s = time.perf_counter() - t0
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if gpu else 0
    t0 = time.perf_counter()
    # FP4 experts load with the checkpoint's other FP8-format weights dequantized (here there are none: bf16)
    model = planc.load(path, plan(256), dequantize=args.experts == "fp4")
    if gpu:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if gpu else float("nan")
    held = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
               if t.device.type == device)
    cfg = model.config
    layer_experts_bf16 = cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    ckpt = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    out = {
        "layers": args.layers, "experts": args.experts, "checkpoint_gib": ckpt / GIB, "write_s": write_s,
        "load_s": load_s,
        "gpu_peak_gib": peak / GIB, "held_gib": held / GIB, "one_layer_bf16_experts_gib": layer_experts_bf16 / GIB,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
    }
    # One forward through the loaded model (reference backend) as a smoke check that it runs.
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (1, 8), device=device)
        out["logits_finite"] = bool(torch.isfinite(model(ids).logits).all())
    print(json.dumps(out, indent=1))
    print(f"\nDeepSeek-V4 x{args.layers} layers (checkpoint {out['checkpoint_gib']:.1f} GiB, {args.experts} experts) "
          f"-> GPU: peak "
          f"{out['gpu_peak_gib']:.2f} GiB for {out['held_gib']:.2f} GiB of local shards (ratio "
          f"{out['gpu_peak_gib'] / out['held_gib']:.2f}); one layer's bf16 experts {out['one_layer_bf16_experts_gib']:.2f} GiB; "
          f"load {load_s:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
