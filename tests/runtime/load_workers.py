"""Rank code for the planc.load tests (module level: spawn pickles functions by name).

The checkpoints are written by the test process before the world starts (`write_checkpoints`); each
world loads them with `planc.load` and compares with today's route, `from_pretrained` of the whole
model on every rank followed by `planc.apply` of the same plan: the logits must be bit-identical.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch

from tests.runtime.workers import FOUR_RANK_HEADS, SHIPPED, batch, shipped_case_plan, shipped_plan

CASES = [(name, *case) for name, case in SHIPPED.items()]  # (name, model type, plan file, extra)
LAYOUTS = ("hub", "model")


def write_checkpoints(root: Path, model_types, *, seed: int = 0) -> None:
    """Tiny random checkpoints of every family in both layouts: root/<type>/<layout>/ (config + safetensors).

    `hub`: what `save_pretrained` writes (transformers' reverse conversion, e.g. Mixtral's per-expert
    w1/w2/w3), sharded over several files with an index. `model`: the model's in-memory layout (fused
    gate_up_proj), one file.
    """
    from planc.models.build import build_tiny_model

    for model_type in model_types:
        model = build_tiny_model(model_type, seed=seed, **FOUR_RANK_HEADS.get(model_type, {}))
        model.save_pretrained(root / model_type / "hub", max_shard_size="40KB")
        model.save_pretrained(root / model_type / "model", save_original_format=False)


def _plan(case, world):
    return shipped_case_plan(case[0], tp=world)


def full_load_then_apply(path, plan, cls):
    """Today's route: `cls.from_pretrained` of the whole model on every rank (`cls`: the class planc.load built,
    e.g. Qwen3-VL-MoE's ForConditionalGeneration, which AutoModelForCausalLM does not build), then apply."""
    from planc import apply

    ref = cls.from_pretrained(path, dtype=torch.float32)
    # from_pretrained's tensors are views of the mapped file at whatever offset the file gives them; CPU kernels
    # round differently on unaligned memory (measured: 1e-7 in qwen3_next's logits from its linear-attention
    # parameters at offsets 8-56 mod 64). planc.load reads into fresh allocations; give the reference the same.
    for p in ref.parameters():
        p.data = p.data.clone()
    apply(ref, plan)
    return ref


def logits_match(model, ref) -> bool | float:
    """True if the two models' logits on the test batch are bit-identical, else their largest difference."""
    with torch.no_grad():
        a, b = model(batch(3)).logits, ref(batch(3)).logits
    return True if torch.equal(a, b) else (a - b).abs().max().item()


def load_and_compare(path, plan):
    """(planc.load's model, full-load-then-apply's, {"": logits_match, "/compiled": same fingerprint})."""
    from planc import load

    model = load(path, plan, dtype=torch.float32)
    ref = full_load_then_apply(path, plan, type(model))
    return model, ref, {"": logits_match(model, ref), "/compiled": model._planc_plan.fingerprint == ref._planc_plan.fingerprint}


def load_world(rank, world, root, case_names, layouts):
    """{case/layout: True if bit-identical to full-load-then-apply, else the difference or a traceback}."""
    out = {}
    for case in CASES:
        if case[0] not in case_names:
            continue
        for layout in layouts:
            key = f"{case[0]}/{layout}"
            try:
                model, ref, compared = load_and_compare(os.path.join(root, case[1], layout), _plan(case, world))
                out.update({key + k: v for k, v in compared.items()})
                buffers = dict(ref.named_buffers())
                out[key + "/buffers"] = all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
            except Exception:  # noqa: BLE001 - report every case
                out[key] = traceback.format_exc()
    return out


def tied_world(rank, world, path):
    """A tied-embeddings checkpoint (no lm_head tensor on disk): tied after load, logits as full load."""
    from planc import load

    plan = shipped_plan("mixtral", tp=world)
    del plan["tp_plan"]["model.embed_tokens"], plan["tp_plan"]["lm_head"]  # tied weights stay replicated
    model = load(path, plan, dtype=torch.float32)
    ref = full_load_then_apply(path, plan, type(model))
    with torch.no_grad():
        same = torch.equal(model(batch(1)).logits, ref(batch(1)).logits)
    return {"tied": model.lm_head.weight is model.model.embed_tokens.weight, "logits": same}


def write_transposed_experts_checkpoint(path: Path, *, seed: int = 0) -> None:
    """A tiny Qwen3-VL-MoE checkpoint as the hub stores the real ones: experts `gate_up_proj [E, H, 2I]` and
    `down_proj [E, I, H]`, the transpose of the model's (transformers' `Transpose(1, 2, check_dims=True)` converts
    them at load). H 64, I 16: no dim pair is square, so the transpose is visible in every shape."""
    from safetensors.torch import load_file, save_file

    from planc.models.build import build_tiny_model

    model = build_tiny_model("qwen3_vl_moe", seed=seed, moe_intermediate_size=16)
    model.save_pretrained(path, save_original_format=False)
    tensors = load_file(path / "model.safetensors")
    experts = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts and all(tensors[k].shape[1] != tensors[k].shape[2] for k in experts)
    tensors.update({k: tensors[k].transpose(1, 2).contiguous() for k in experts})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def transposed_world(rank, world, path):
    """A checkpoint whose experts are stored transposed: planc.load's shards equal full-load-then-apply's."""
    plan = shipped_case_plan("qwen3_vl_moe", tp=world)
    model, _, compared = load_and_compare(path, plan)
    experts = model.model.language_model.layers[0].mlp.experts
    return {"logits": compared[""] is True, "down_proj": list(experts.down_proj.to_local().shape)}


def error_world(rank, world, cases):
    """{case: the error message each rank got (or 'loaded')} for broken checkpoints and mismatched plans."""
    from planc import load

    out = {}
    for name, path, model_type in cases:
        try:
            load(path, shipped_plan(model_type, tp=world), dtype=torch.float32)
            out[name] = "loaded"
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out[name] = f"{type(e).__name__}: {e}"
    return out


def everything_world(rank, world, root, case_names, layouts, tied_path, error_cases, transposed_path=None):
    """One world for all of a world size's checks (starting ranks costs more than the checks)."""
    out = {"load": load_world(rank, world, root, case_names, layouts)}
    if tied_path is not None:
        out["tied"] = tied_world(rank, world, tied_path)
    if transposed_path is not None:
        try:
            out["transposed"] = transposed_world(rank, world, transposed_path)
        except Exception:  # noqa: BLE001 - report every case
            out["transposed"] = traceback.format_exc()
    if error_cases:
        out["errors"] = error_world(rank, world, error_cases)
    return out
