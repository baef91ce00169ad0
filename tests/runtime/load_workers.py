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

from tests.runtime.workers import batch, shipped_plan

# (case name, model type, plan file or None for the family's shipped plan, extra experts settings)
CASES = [
    ("mixtral", "mixtral", None, {}),
    ("qwen3_moe", "qwen3_moe", None, {}),
    ("gpt_oss", "gpt_oss", None, {}),
    ("deepseek_v3", "deepseek_v3", None, {}),
    ("deepseek_v4", "deepseek_v4", None, {}),
    ("deepseek_v4_megamoe", "deepseek_v4", "deepseek_v4_megamoe.yaml", {"backend": "reference"}),
]
LAYOUTS = ("hub", "model")


def write_checkpoints(root: Path, model_types, *, seed: int = 0) -> None:
    """Tiny random checkpoints of every family in both layouts: root/<type>/<layout>/ (config + safetensors).

    `hub`: what `save_pretrained` writes (transformers' reverse conversion, e.g. Mixtral's per-expert
    w1/w2/w3), sharded over several files with an index. `model`: the model's in-memory layout (fused
    gate_up_proj), one file.
    """
    from planc.runtime.models import build_tiny_model

    for model_type in model_types:
        model = build_tiny_model(model_type, seed=seed)
        model.save_pretrained(root / model_type / "hub", max_shard_size="40KB")
        model.save_pretrained(root / model_type / "model", save_original_format=False)


def _plan(case, world):
    name, model_type, file, extra = case
    return shipped_plan(model_type, tp=world, file=file, **dict(extra))


def _full_load_then_apply(path, plan):
    from transformers import AutoModelForCausalLM

    from planc import apply

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    apply(ref, plan)
    return ref


def load_world(rank, world, root, case_names, layouts):
    """{case/layout: True if bit-identical to full-load-then-apply, else the difference or a traceback}."""
    from planc import load

    out = {}
    for case in CASES:
        if case[0] not in case_names:
            continue
        for layout in layouts:
            key = f"{case[0]}/{layout}"
            try:
                path = os.path.join(root, case[1], layout)
                plan = _plan(case, world)
                model = load(path, plan, dtype=torch.float32)
                ref = _full_load_then_apply(path, plan)
                ids = batch(3)
                with torch.no_grad():
                    a, b = model(ids).logits, ref(ids).logits
                out[key] = True if torch.equal(a, b) else (a - b).abs().max().item()
                out[key + "/compiled"] = model._planc_plan.fingerprint == ref._planc_plan.fingerprint
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
    ref = _full_load_then_apply(path, plan)
    with torch.no_grad():
        same = torch.equal(model(batch(1)).logits, ref(batch(1)).logits)
    return {"tied": model.lm_head.weight is model.model.embed_tokens.weight, "logits": same}


def error_world(rank, world, cases):
    """{case: the error message each rank got (or 'loaded')} for broken checkpoints and mismatched plans."""
    from planc import load

    out = {}
    for name, path, model_type in cases:
        try:
            load(path, shipped_plan(model_type, tp=world), dtype=torch.float32)
            out[name] = "loaded"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


def everything_world(rank, world, root, case_names, layouts, tied_path, error_cases):
    """One world for all of a world size's checks (starting ranks costs more than the checks)."""
    out = {"load": load_world(rank, world, root, case_names, layouts)}
    if tied_path is not None:
        out["tied"] = tied_world(rank, world, tied_path)
    if error_cases:
        out["errors"] = error_world(rank, world, error_cases)
    return out
