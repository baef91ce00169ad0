"""Rank code for the FP8 planc.load tests (module level: spawn pickles functions by name).

`write_fp8_checkpoint` writes a tiny random model as a DeepSeek-V3-style FP8 checkpoint: every linear weight of the
decoder layers (attention, dense MLP, shared and routed experts; not the routers, norms, embeddings or lm_head) as
float8_e4m3fn with a `weight_scale_inv` of one fp32 factor per 128 x 128 block, in the hub layout
(`save_pretrained`'s per-expert tensors, several files and an index), and
`quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}` in config.json. The tiny configs
are as small as the 128 grid allows at 2 ranks: every TP-sharded dim is a multiple of 2 x 128.
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
from pathlib import Path

import torch

from tests.runtime.load_workers import full_load_then_apply, load_and_compare, logits_match
from tests.runtime.workers import shipped_plan

BLOCK = 128
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
# case -> (model type, tiny config overrides). On the grid: every dim a TP style splits at 2 ranks is a multiple of
# 256, the rest multiples of 128: no partial blocks, which transformers' own Fp8Dequantize (the reference) gets wrong
# (it derives the block from the two shapes: a [512, 192] weight with [4, 2] scales gets 96-wide blocks). Off the grid: Mixtral with 384-wide attention, whose colwise and
# rowwise shards at 2 ranks are 192 = 1.5 blocks: refused with FP8 kept (PLC625), exact when dequantized.
FP8_CASES = {
    "deepseek_v3": ("deepseek_v3", dict(
        hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=128, qk_nope_head_dim=64,
        v_head_dim=64, head_dim=128, qk_head_dim=192,  # DeepseekV3Config's own: head_dim = rope, qk = nope + rope
    )),
    "mixtral": ("mixtral", dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                                head_dim=64)),
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                                    num_attention_heads=4, num_key_value_heads=4, head_dim=64)),
    "mixtral_off_grid": ("mixtral", dict(hidden_size=384, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=4, head_dim=96)),
}
OFF_GRID = ("mixtral_off_grid",)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 weight_scale_inv per 128 x 128 block): w ~= q * scale_inv, blockwise."""
    rows, cols = w.shape
    r, c = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(r * BLOCK, c * BLOCK)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(r, BLOCK, c, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(r * BLOCK, c * BLOCK)
    return q[:rows, :cols].contiguous(), scale.float()


def _quantized(key: str, t: torch.Tensor) -> bool:
    return key.startswith("model.layers.") and key.endswith(".weight") and t.ndim == 2 and not key.endswith("gate.weight")


def write_fp8_checkpoint(case: str, path: Path, *, seed: int = 0) -> None:
    from planc.models.build import build_tiny_model

    model_type, overrides = FP8_CASES[case]
    bf = Path(str(path) + ".unquantized")
    build_tiny_model(model_type, seed=seed, **overrides).save_pretrained(bf, max_shard_size="300KB")
    quantize_checkpoint(bf, path)
    shutil.rmtree(bf)


def quantize_checkpoint(src: Path, dst: Path) -> None:
    """Write the unquantized sharded checkpoint `src` (config + index + shards) to `dst` in the DeepSeek FP8 format:
    every 2-D decoder weight but the routers as float8_e4m3fn + fp32 `weight_scale_inv` per 128 x 128 block, one
    output file per input file (the tests' writer; bench/load_sharded.py uses it too)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for name in sorted(set(index["weight_map"].values())):
        out = {}
        for key, t in load_file(src / name).items():
            if _quantized(key, t):
                out[key], out[key[: -len("weight")] + "weight_scale_inv"] = quantize_blocks(t)
            else:
                out[key] = t
        save_file(out, dst / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in out})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=1))


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def fp8_world(rank, world, root, cases):
    """Per case: the dequantized load against full-load-then-apply (logits, fingerprint, every local shard), and
    the FP8-kept load (dequantize=False): its FP8 shards and scale shards, dequantized by transformers' own
    Fp8Dequantize, against the dequantized load's shards, bit for bit (off the grid: the error it raises)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, FP8Experts, FP8Linear

    from planc import load

    out = {}
    for case in cases:
        model_type = FP8_CASES[case][0]
        path = os.path.join(root, case)
        plan = shipped_plan(model_type, tp=world)
        key = case
        try:
            model, ref, compared = load_and_compare(path, plan)
            out.update({key + k: v for k, v in compared.items()})
            ref_params = dict(ref.named_parameters())
            out[key + "/shards"] = [n for n, p in model.named_parameters() if not torch.equal(_local(p), _local(ref_params[n]))]
            out[key + "/no_quantization_left"] = getattr(model.config, "quantization_config", None) is None
        except Exception:  # noqa: BLE001 - report every case
            out[key] = traceback.format_exc()
            continue
        key = f"{case}/kept"
        try:
            kept = load(path, plan, dtype=torch.float32, dequantize=False)
            deq = Fp8Dequantize(None)
            dense = dict(model.named_parameters())
            fp8_linears = fp8_experts = 0
            bad = []
            for name, module in kept.named_modules():
                if isinstance(module, FP8Linear):
                    fp8_linears += 1
                    pairs = [("weight", "weight")]
                elif isinstance(module, FP8Experts):
                    fp8_experts += 1
                    pairs = [("gate_up_proj", "gate_up_proj"), ("down_proj", "down_proj")]
                else:
                    continue
                for weight_name, dense_name in pairs:
                    w = _local(getattr(module, weight_name))
                    s = _local(getattr(module, weight_name + "_scale_inv"))
                    if w.dtype != torch.float8_e4m3fn or s.dtype != torch.float32:
                        bad.append(f"{name}.{weight_name}: {w.dtype}/{s.dtype}")
                        continue
                    expected = _local(dense[f"{name}.{dense_name}"])
                    got = deq._dequantize_one(w, s, output_dtype=torch.float32)
                    if got.shape != expected.shape or not torch.equal(got, expected):
                        bad.append(f"{name}.{weight_name}: local {tuple(got.shape)} vs {tuple(expected.shape)}")
            from torch.distributed.tensor import DTensor

            out[key] = {"fp8_linears": fp8_linears, "fp8_experts": fp8_experts, "bad": bad,
                        "sharded_scales": sum(isinstance(p, DTensor) for n, p in kept.named_parameters()
                                              if n.endswith("_scale_inv"))}
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out[key] = f"{type(e).__name__}: {e}" if case in OFF_GRID else traceback.format_exc()
    if "deepseek_v3" in cases:
        out.update(_megamoe(os.path.join(root, "deepseek_v3"), world))
    return out


def megamoe_plan(world: int) -> dict:
    """The shipped DeepSeek-V3 plan with Mega MoE experts (reference backend) quantized to FP4 at load."""
    plan = shipped_plan("deepseek_v3", tp=world)
    plan["experts"] = {"implementation": "deepgemm_megamoe", "ep_implementation": "auto",
                       "megamoe": {"backend": "reference", "quantize": "fp4"}}
    return plan


def _megamoe(path, world):
    """FP8 checkpoint -> Mega MoE FP4 experts: dequantized per shard, quantized per layer, equal to full + apply;
    with FP8 kept, refused before reading (the kernel takes FP4 or bf16 experts, not FP8Experts)."""
    from planc import load

    out = {}
    plan = megamoe_plan(world)
    try:
        model, _, compared = load_and_compare(path, plan)
        experts = model.model.layers[1].mlp.experts
        out["megamoe"] = compared[""]
        out["megamoe/fp4"] = str(_local(experts.gate_up_proj).dtype)
    except Exception:  # noqa: BLE001 - report every case
        out["megamoe"] = traceback.format_exc()
    try:
        load(path, plan, dtype=torch.float32, dequantize=False)
        out["megamoe/kept"] = "loaded"
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        out["megamoe/kept"] = f"{type(e).__name__}: {e}"
    return out


# ---- DeepSeek-V4's format: FP4 experts straight into Mega MoE -------------------------------------------------------

V4_QUANTIZATION_CONFIG = {**QUANTIZATION_CONFIG, "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def write_fp4_experts_checkpoint(path: Path, *, seed: int = 0) -> None:
    """A tiny random DeepSeek-V4 whose routed experts are stored as DeepSeek-V4 ships them (`save_fp4_experts`).
    The FP4 values are planc's (= DeepGEMM's) cast of the random bf16 experts. The other weights stay fp32 (the tiny
    dims are not on the 128 grid). `experts_fp4.pt` beside it holds every layer's stacked FP4 tensors, for the byte
    comparison."""
    from planc.models.build import build_tiny_model

    model = build_tiny_model("deepseek_v4", seed=seed)
    stacked = save_fp4_experts(model, path, max_shard_size="40KB")
    torch.save(stacked, path / "experts_fp4.pt")


def save_fp4_experts(model, path: Path, *, max_shard_size) -> dict:
    """Quantize `model`'s routed experts to FP4 (planc's cast, in place) and save it in DeepSeek-V4's hub format:
    per expert `ffn.experts.N.w{1,2,3}.weight` e2m1 packed two per int8 byte (low nibble = even element) and `.scale`
    UE8M0 (float8_e8m0fnu) per 32 along the input dim, with `quantization_config: {quant_method: fp8, scale_fmt:
    ue8m0, expert_dtype: fp4, ...}`. Returns every layer's stacked FP4 tensors (on the CPU). Also bench/load_gpu.py's
    writer, at full width."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from planc.runtime.megamoe.experts import quantize_to_fp4

    stacked = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            quantize_to_fp4(module)
            stacked.update({f"{name}.{n}": p.detach().cpu() for n, p in module.named_parameters()})
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if (path / "model.safetensors.index.json").is_file():
        index = json.loads((path / "model.safetensors.index.json").read_text())
    else:  # one file: indexed below like a sharded save (its keys from the header; the loop reads the tensors)
        with safe_open(path / "model.safetensors", framework="pt") as f:
            keys = list(f.keys())
        index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "model.safetensors")}
    weight_map = index["weight_map"]
    for file in sorted(set(weight_map.values())):
        tensors = load_file(path / file)
        out = {}
        for key, t in tensors.items():
            if key.endswith("experts.gate_up_proj_scale_inv"):
                half = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[key.replace("gate_up_proj_scale_inv", f"{e}.w1.scale")] = t[e, :half].contiguous()
                    out[key.replace("gate_up_proj_scale_inv", f"{e}.w3.scale")] = t[e, half:].contiguous()
            elif key.endswith("experts.down_proj_scale_inv"):
                for e in range(t.shape[0]):
                    out[key.replace("down_proj_scale_inv", f"{e}.w2.scale")] = t[e].contiguous()
            else:
                out[key] = t
        save_file(out, path / file, metadata={"format": "pt"})
        weight_map = {k: v for k, v in weight_map.items() if v != file or k in out}
        weight_map.update({k: file for k in out})
    index["weight_map"] = weight_map
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = V4_QUANTIZATION_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return stacked


def fp4_world(rank, world, path):
    """FP4 experts read straight into the Mega MoE layout (bytes = the checkpoint's, this rank's experts only), and
    logits against transformers' unsharded from_pretrained (which dequantizes the FP4 experts) + planc.apply of the
    same plan (which quantizes them back to FP4)."""
    from planc import load

    out = {}
    plan = shipped_plan("deepseek_v4", tp=world, file="deepseek_v4_megamoe.yaml", backend="reference")
    try:
        model = load(path, plan, dtype=torch.float32)
        stacked = torch.load(os.path.join(path, "experts_fp4.pt"))
        bad = []
        for key, full in stacked.items():
            module, _, name = key.rpartition(".")
            local = _local(getattr(model.get_submodule(module), name)).detach()
            n = full.shape[0] // world
            expected = full[rank * n:(rank + 1) * n]
            if local.dtype != expected.dtype or not torch.equal(local.view(torch.uint8), expected.view(torch.uint8)):
                bad.append(f"{key}: {local.dtype} {tuple(local.shape)}")
        out["fp4/bytes"] = bad
        out["fp4/checked"] = len(stacked)
        out["fp4/logits"] = logits_match(model, full_load_then_apply(path, plan, type(model)))
    except Exception:  # noqa: BLE001 - report every case
        out["fp4/error"] = traceback.format_exc()
    try:
        load(path, shipped_plan("deepseek_v4", tp=world), dtype=torch.float32)
        out["fp4/not_megamoe"] = "loaded"
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        out["fp4/not_megamoe"] = f"{type(e).__name__}: {e}"
    return out
