"""Checkpoint keys against model keys: what `planc.load` refuses, before any read and after it.

Both checks see the checkpoint through transformers' own key conversion for the family
(`get_model_conversion_mapping`: renames such as `block_sparse_moe` -> `mlp`, and converters such as
the per-expert `w1`/`w3` merge into `gate_up_proj`), and drop what transformers itself ignores
(`_keys_to_ignore_on_load_*`, old rotary buffers) through the model's
`_adjust_missing_and_unexpected_keys`, so planc refuses exactly what `from_pretrained` would report.

- `checkpoint_problems` (before reading, headers only): keys the model lacks, model keys the
  checkpoint lacks (tied weights excepted), shape mismatches of one-to-one keys, and integer/float8
  tensors where the model holds unquantized floats (or the reverse).
- `loading_problems` (after reading, before anything is installed): what the loader itself found:
  shape mismatches of converted tensors and conversion errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from planc.runtime.checkpoint.files import CheckpointFiles

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_MAX_LISTED = 5
_NON_FLOAT = {"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}


def _mapping(model: nn.Module):
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    from planc.runtime.checkpoint.quantized import conversion_mapping

    mapping = conversion_mapping(model)  # with a quantizer's scale keys for a pre-quantized checkpoint
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return renamings, converters


def checkpoint_problems(model: PreTrainedModel, files: CheckpointFiles) -> list[str]:
    """Every key, shape and dtype problem visible in the headers, each naming the file and the tensor."""
    from transformers.core_model_loading import rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    renamings, converters = _mapping(model)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    model_keys = model.state_dict()
    prefix = model.base_model_prefix
    quantized = getattr(model.config, "quantization_config", None) is not None

    problems: list[str] = []
    targeted: set[str] = set()
    fused_modules: set[str] = set()  # modules filled by a one-to-many converter: their keys are not checked one by one
    unexpected: dict[str, str] = {}
    for key, info in files.tensors.items():
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
        if renamed not in model_keys and key in model_keys:
            renamed, pattern = rename_source_key(key, [], [], prefix, model_keys)
        if renamed not in model_keys:
            unexpected[renamed] = key
            continue
        targeted.add(renamed)
        if pattern is not None:
            if len(by_pattern[pattern].target_patterns) > 1:
                fused_modules.add(renamed.rpartition(".")[0])
            continue  # a converted tensor's shape is checked by the loader after conversion
        expected = model_keys[renamed]
        if tuple(expected.shape) != info.shape:
            problems.append(
                f"{files.where(key)} has shape {list(info.shape)}, but the model's `{renamed}` is "
                f"{list(expected.shape)}. The checkpoint and config.json disagree: use the config saved with these weights."
            )
        elif not quantized and expected.is_floating_point() and info.dtype in _NON_FLOAT:
            problems.append(
                f"{files.where(key)} is stored as {info.dtype}, but the model's `{renamed}` is {expected.dtype} and "
                "config.json has no `quantization_config`: a quantized checkpoint needs its quantization_config "
                "(planc.load supports what transformers' quantizers load)."
            )
        elif not expected.is_floating_point() and info.dtype not in _NON_FLOAT:
            problems.append(
                f"{files.where(key)} is stored as {info.dtype}, but the model's `{renamed}` is {expected.dtype}: "
                "the checkpoint does not match this model."
            )

    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = {
        k for k in model_keys
        if k not in targeted and k not in tied and k.rpartition(".")[0] not in fused_modules
    }
    report = LoadStateDictInfo(
        missing_keys=missing, unexpected_keys=set(unexpected), mismatched_keys=set(), error_msgs=[],
        conversion_errors={}, skipped_pp_keys=set(),
    )
    model._adjust_missing_and_unexpected_keys(report)
    if report.unexpected_keys:
        keys = sorted(report.unexpected_keys)
        listed = ", ".join(f"`{unexpected[k]}`" for k in keys[:_MAX_LISTED])
        problems.append(
            f"{files.root}: {len(keys)} checkpoint tensor(s) have no place in the "
            f"{type(model).__name__} built from config.json ({listed}{' ...' if len(keys) > _MAX_LISTED else ''}, "
            f"first in {files.tensors[unexpected[keys[0]]].file}). The checkpoint is not for this model or config: "
            "check config.json (model_type, num_hidden_layers, the experts count)."
        )
    if report.missing_keys:
        keys = sorted(report.missing_keys)
        listed = ", ".join(f"`{k}`" for k in keys[:_MAX_LISTED])
        problems.append(
            f"{files.root}: {len(keys)} tensor(s) of the model are in no checkpoint file ({listed}"
            f"{' ...' if len(keys) > _MAX_LISTED else ''}). planc.load never initialises weights at random: "
            "use the complete checkpoint saved with this config."
        )
    return problems


def target_reads(model: PreTrainedModel, files: CheckpointFiles) -> list[tuple[str, str, tuple, int]]:
    """`(model parameter, checkpoint dtype, parameter shape, bytes)` for every checkpoint tensor the model takes."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _mapping(model)
    model_keys = model.state_dict()
    out = []
    for key, info in files.tensors.items():
        renamed, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, model_keys)
        if renamed not in model_keys and key in model_keys:
            renamed = key
        if renamed in model_keys:
            out.append((renamed, _DTYPE_NAMES.get(info.dtype, info.dtype), tuple(model_keys[renamed].shape), info.nbytes))
    return out


_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn",
                "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I8": "int8", "U8": "uint8", "I64": "int64",
                "I32": "int32", "F64": "float64", "BOOL": "bool"}


def loading_problems(model: nn.Module, info, files: CheckpointFiles) -> list[str]:
    """What transformers' loader reported (after `_adjust_missing_and_unexpected_keys`), as planc errors."""
    problems = []
    for key, got, want in sorted(info.mismatched_keys, key=lambda t: t[0]):
        problems.append(
            f"{files.root}: `{key}` read from the checkpoint has this rank's shape {list(got)}, but the sharded "
            f"model expects {list(want)}. The checkpoint and config.json disagree: use the config saved with these weights."
        )
    for key, error in sorted(info.conversion_errors.items()):
        problems.append(f"{files.root}: converting `{key}` from the checkpoint layout failed: {error}")
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = sorted(set(info.missing_keys) - tied)
    if missing:
        problems.append(
            f"{files.root}: {len(missing)} tensor(s) were not filled (first: `{missing[0]}`); the checkpoint lacks them."
        )
    if info.unexpected_keys:
        keys = sorted(info.unexpected_keys)
        problems.append(f"{files.root}: {len(keys)} checkpoint tensor(s) have no place in the model (first: `{keys[0]}`).")
    problems += [f"{files.root}: {m}" for m in info.error_msgs]
    return problems


__all__ = ["checkpoint_problems", "loading_problems", "target_reads"]
