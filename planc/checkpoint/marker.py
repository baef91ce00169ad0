"""`planc.json`: the marker that makes a directory a planc checkpoint, and what it records.

A `planc.save` directory holds torch.distributed.checkpoint's files (`.metadata`, `__<rank>_0.distcp`),
the model's `config.json` (and `generation_config.json`), `plan.yaml` (the plan it was saved under,
rebuilt from the CompiledPlan, so `planc lint` and `planc.load` read it like any plan file), and
`planc.json`:

    {"format": "planc-dcp", "format_version": 1, "fingerprint": ..., "parallel": {...},
     "world_size": 2, "model_type": "mixtral", "model_class": "MixtralForCausalLM", "dtype": "float32",
     "plan": {...}, "plan_name": ..., "plan_path": ..., "non_persistent_buffers": [...],
     "planc_version": ..., "torch_version": ..., "transformers_version": ..., "pickle_protocol": 4,
     "optimizer": {"class": "torch.optim.adamw.AdamW", "path": "optimizer"}}   # only with planc.save(optimizer=)

`pickle_protocol` is the one DCP's `.metadata` pickles were written with (the saving Python's default): planc's
reader accepts that one only (dcp_reader.py). `planc.load` detects one with `is_planc_checkpoint(dir)` and reports what it was saved under with
`read_marker(dir)`.
"""

from __future__ import annotations

import json
from pathlib import Path
import os
from typing import TYPE_CHECKING, Any

from planc.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

    from planc.compiler.compiled import CompiledPlan

MARKER = "planc.json"
PLAN_FILE = "plan.yaml"
FORMAT = "planc-dcp"
FORMAT_VERSION = 1


def plan_mapping(compiled: CompiledPlan) -> dict[str, Any]:
    """The plan a CompiledPlan was compiled from, as a plan-format mapping (every rule, in plan order).

    The CompiledPlan keeps every rule (its coverage lists each one, matched or not) with its table,
    pattern and style, and the sizes and experts settings; only `description` and comments are lost.
    """
    tables: dict[str, dict[str, str]] = {"tp_plan": {}, "ep_plan": {}}
    for c in compiled.coverage:
        tables[c.rule.table][c.rule.pattern] = c.rule.style
    data: dict[str, Any] = {"version": 1}
    if compiled.plan_name:
        data["name"] = compiled.plan_name
    data["model"] = {"type": compiled.model_type}
    data["parallel"] = compiled.parallel.model_dump()
    data["experts"] = compiled.experts_settings.model_dump(exclude_none=True)
    data.update({k: v for k, v in tables.items() if v})
    return data


def marker_data(model: nn.Module, compiled: CompiledPlan, non_persistent_buffers: list[str]) -> dict[str, Any]:
    import pickle

    import torch
    import transformers

    from planc.version import __version__

    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fingerprint": compiled.fingerprint,
        "parallel": compiled.parallel.model_dump(),
        "world_size": compiled.parallel.world_size,
        "model_type": compiled.model_type,
        "model_class": compiled.model_class,
        "dtype": str(dtype).removeprefix("torch."),
        "plan": plan_mapping(compiled),
        "plan_name": compiled.plan_name,
        "plan_path": str(compiled.plan_path) if compiled.plan_path else None,
        "non_persistent_buffers": sorted(non_persistent_buffers),
        "planc_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "pickle_protocol": pickle.DEFAULT_PROTOCOL,  # what torch's FileSystemWriter pickles .metadata with
    }


def write_marker(directory: Path, data: dict[str, Any]) -> None:
    """`plan.yaml` then `planc.json` (last: a directory with the marker is a complete checkpoint)."""
    import yaml

    header = (
        f"# The plan this checkpoint was saved under (fingerprint {data['fingerprint']}), rebuilt by planc.save.\n"
    )
    (directory / PLAN_FILE).write_text(header + yaml.safe_dump(data["plan"], sort_keys=False), encoding="utf-8")
    (directory / MARKER).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def is_planc_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """True when `directory` holds a planc.save checkpoint (its `planc.json` says so)."""
    path = Path(directory) / MARKER
    if not path.is_file():
        return False
    try:
        return bool(json.loads(path.read_text(encoding="utf-8")).get("format") == FORMAT)
    except (OSError, ValueError):
        return False


def read_marker(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The `planc.json` of a planc.save checkpoint; a clear error for anything else."""
    path = Path(directory) / MARKER
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} is not a planc checkpoint: it has no {MARKER}. planc.save writes one; a hub-layout "
            "folder (config.json + safetensors) loads through planc.load's safetensors route instead."
        ) from None
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is damaged, save it again.") from None
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format is {data.get('format')!r}, expected {FORMAT!r} (written by planc.save).")
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {data.get('format_version')} is not the {FORMAT_VERSION} this planc reads; "
            "load it with the planc version that saved it and save it again."
        )
    return data


def saved_under(marker: dict[str, Any]) -> str:
    """How messages name the plan a checkpoint was saved under: its name, else its file, else "an unnamed plan"."""
    name, path = marker.get("plan_name"), marker.get("plan_path")
    plan = f"plan {name!r}" if name else f"the plan in {path}" if path else "an unnamed plan"
    return f"saved under {plan}, fingerprint {marker.get('fingerprint')}"


__all__ = ["MARKER", "PLAN_FILE", "FORMAT", "is_planc_checkpoint", "read_marker", "plan_mapping", "saved_under"]
