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

import re
from collections import Counter
from typing import TYPE_CHECKING, Any, Optional

from planc.checkpoint.files import CheckpointFiles

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

_MAX_LISTED = 5
_NON_FLOAT = {"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}


def _mapping(model: PreTrainedModel) -> tuple[list[Any], list[Any]]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    from planc.checkpoint.quantized import conversion_mapping

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
    sources: dict[tuple[str, int], tuple[Any, list[tuple[str, str]]]] = {}  # a converter's target -> its keys
    for key, info in files.tensors.items():
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
        if renamed not in model_keys and key in model_keys:
            renamed, pattern = rename_source_key(key, [], [], prefix, model_keys)
        if renamed not in model_keys:
            unexpected[renamed] = key
            continue
        targeted.add(renamed)
        expected = model_keys[renamed]
        if pattern is not None:
            converter = by_pattern[pattern]
            if len(converter.target_patterns) > 1:
                fused_modules.add(renamed.rpartition(".")[0])
            sources.setdefault((renamed, id(converter)), (converter, []))[1].append((key, pattern))
        elif tuple(expected.shape) != info.shape:
            problems.append(
                f"{files.where(key)} has shape {list(info.shape)}, but the model's `{renamed}` is "
                f"{list(expected.shape)}. The checkpoint and config.json disagree: use the config saved with these weights."
            )
            continue
        problems += _dtype_problems(files, key, renamed, expected, quantized)
    for (target, _), (converter, keys) in sources.items():
        problems += converter_problems(files, target, model_keys[target], converter, keys, quantized)

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
        extra = sorted(report.unexpected_keys)
        problems.append(
            f"{files.root}: {len(extra)} checkpoint tensor(s) have no place in the "
            f"{type(model).__name__} built from config.json ({_listed([unexpected[k] for k in extra])}, "
            f"first in {files.tensors[unexpected[extra[0]]].file}). The checkpoint is not for this model or config: "
            "check config.json (model_type, num_hidden_layers, the experts count)."
        )
    if report.missing_keys:
        absent = sorted(report.missing_keys)
        problems.append(
            f"{files.root}: {len(absent)} tensor(s) of the model are in no checkpoint file ({_listed(absent)}). "
            "planc.load never initialises weights at random: "
            "use the complete checkpoint saved with this config."
        )
    return problems


def _dtype_problems(files: CheckpointFiles, key: str, renamed: str, expected: torch.Tensor,
                    quantized: bool) -> list[str]:
    """An integer/float8 tensor where the model holds unquantized floats (or the reverse): same byte length or not,
    reading it would give wrong numbers, so every checkpoint key is checked, a converter's sources too."""
    info = files.tensors[key]
    if not quantized and expected.is_floating_point() and info.dtype in _NON_FLOAT:
        return [
            f"{files.where(key)} is stored as {info.dtype}, but the model's `{renamed}` is {expected.dtype} and "
            "config.json has no `quantization_config`: a quantized checkpoint needs its quantization_config "
            "(planc.load supports what transformers' quantizers load)."
        ]
    if not expected.is_floating_point() and info.dtype not in _NON_FLOAT:
        return [
            f"{files.where(key)} is stored as {info.dtype}, but the model's `{renamed}` is {expected.dtype}: "
            "the checkpoint does not match this model."
        ]
    return []


def _index_regex(pattern: str) -> Optional[re.Pattern[str]]:
    """transformers' source pattern (a regex in which `*.` stands for one module index: `.experts.*.w1.weight`,
    `\\.experts.*.w1.weight`) as a regex capturing that index; None if the pattern has no index."""
    if "*." not in pattern:
        return None
    try:
        return re.compile(pattern.replace("*.", r"(\d+)\.", 1))
    except re.error:
        return None


def converter_problems(files: CheckpointFiles, target: str, expected: torch.Tensor, converter: Any,
                       keys: list[tuple[str, str]], quantized: bool) -> list[str]:
    """What a converter would fail on (or silently get wrong), from the headers of the keys that feed `target`.

    For a per-expert merge (transformers' `MergeModulelist`, e.g. Mixtral's `experts.*.w1` + `w3` ->
    `gate_up_proj`): every source pattern present, expert indices exactly `range(num_experts)`, one shape and dtype
    for all of them, and the merged (and concatenated) shape equal to the model's. Each problem names the key and
    its file: after reading, the same mistake is a `torch.stack`/`torch.cat` size error deep in the conversion.
    """
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(converter, "operations", None) or [])
    merge = next((op for op in ops if isinstance(op, MergeModulelist)), None)
    concat = next((op for op in ops if isinstance(op, Concatenate)), None)
    fix = "The checkpoint and config.json disagree (or the checkpoint is incomplete): use the files saved together."
    infos = {k: files.tensors[k] for k, _ in keys}
    problems: list[str] = []

    for pattern in converter.source_patterns:  # one dtype per source pattern (a weight and its scales differ)
        mine = {k: infos[k] for k, p in keys if p == pattern}
        dtypes = Counter(i.dtype for i in mine.values())
        if len(dtypes) > 1:
            common = dtypes.most_common(1)[0][0]
            odd = sorted(k for k, i in mine.items() if i.dtype != common)
            reported = not quantized and expected.is_floating_point() and mine[odd[0]].dtype in _NON_FLOAT
            problems += [] if reported else [
                f"{files.where(odd[0])} is stored as {mine[odd[0]].dtype}, but the other tensors of `{pattern}` "
                f"merged into the model's `{target}` are {common}{_more(odd)}. {fix}"
            ]
    if merge is None:
        return problems

    num = expected.shape[merge.dim] if expected.dim() > merge.dim else None
    by_pattern: dict[str, dict[int, str]] = {p: {} for p in converter.source_patterns}
    for key, pattern in keys:
        regex = _index_regex(pattern)
        m = regex.search(key) if regex is not None else None
        if m is not None:
            by_pattern[pattern][int(m.group(1))] = key
    present = {p: idx for p, idx in by_pattern.items() if idx}
    example = next(iter(next(iter(present.values())).values())) if present else keys[0][0]
    for pattern, indices in by_pattern.items():
        if _index_regex(pattern) is None:
            continue
        if not indices:
            if quantized:  # a quantizer's patterns include optional ones (activation scales)
                continue
            problems.append(
                f"{files.root}: no checkpoint tensor matches `{pattern}` for the model's `{target}` (its other sources "
                f"are there, e.g. {files.where(example)}). {fix}"
            )
            continue
        wanted = range(num) if num is not None else range(max(indices) + 1)
        extra = sorted(set(indices) - set(wanted))
        missing = sorted(set(wanted) - set(indices))
        if extra:
            problems.append(
                f"{files.where(indices[extra[0]])}: expert index {extra[0]} is beyond the model's {len(wanted)} "
                f"experts of `{target}`{_more([indices[i] for i in extra])}. config.json's experts count and the "
                "checkpoint disagree: use the config saved with these weights."
            )
        if missing:
            some = indices[min(indices)]
            name = _with_index(some, pattern, missing[0])
            problems.append(
                f"{files.root}: `{name}` is missing: the model's `{target}` merges {len(wanted)} experts, and "
                f"{len(missing)} of them are in no checkpoint file (indices {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}"
                f"; its siblings are in {files.tensors[some].file}). {fix}"
            )
    per_pattern = {}
    for pattern, indices in present.items():
        pshapes = Counter(infos[k].shape for k in indices.values())
        if len(pshapes) > 1:
            usual = pshapes.most_common(1)[0][0]
            odd = sorted(k for k in indices.values() if infos[k].shape != usual)
            problems.append(
                f"{files.where(odd[0])} has shape {list(infos[odd[0]].shape)}, but the other experts' tensors of "
                f"`{pattern}` are {list(usual)}{_more(odd)}. {fix}"
            )
        per_pattern[pattern] = pshapes.most_common(1)[0][0]
    if problems or quantized or any(not isinstance(op, (MergeModulelist, Concatenate)) for op in ops):
        return problems
    if num is None or not per_pattern:
        return problems
    stacked = [list(s[: merge.dim]) + [num] + list(s[merge.dim:]) for s in per_pattern.values()]
    if len({len(s) for s in stacked}) > 1:
        keys_named = ", ".join(f"`{next(iter(i.values()))}` {list(per_pattern[p])}" for p, i in present.items())
        return [f"{files.root}: the tensors merged into the model's `{target}` have different ranks: {keys_named}. "
                f"{fix}"]
    merged = stacked[0]
    if concat is not None:
        d = concat.dim
        rest = {tuple(s[:d] + s[d + 1:]) for s in stacked}
        if len(rest) > 1 or any(d >= len(s) for s in stacked):
            keys_named = ", ".join(f"`{next(iter(i.values()))}` {list(per_pattern[p])}" for p, i in present.items())
            return [f"{files.root}: the tensors concatenated into the model's `{target}` disagree beyond dim "
                    f"{d - merge.dim - 1 if d > merge.dim else d}: {keys_named}. {fix}"]
        merged = merged[:d] + [sum(s[d] for s in stacked)] + merged[d + 1:]
    if merged != list(expected.shape):
        keys_named = ", ".join(f"`{next(iter(i.values()))}` {list(per_pattern[p])}" for p, i in present.items())
        problems.append(
            f"{files.where(example)}: the model's `{target}` is {list(expected.shape)}, but its {num} experts' "
            f"tensors ({keys_named}) merge to {merged}. {fix}"
        )
    return problems


def _with_index(key: str, pattern: str, index: int) -> str:
    regex = _index_regex(pattern)
    m = regex.search(key) if regex is not None else None
    return key[: m.start(1)] + str(index) + key[m.end(1):] if m else key


def _listed(keys: list[str]) -> str:
    """The first `_MAX_LISTED` keys, quoted, and ` ...` when there are more (every list a message prints)."""
    return ", ".join(f"`{k}`" for k in keys[:_MAX_LISTED]) + (" ..." if len(keys) > _MAX_LISTED else "")


def _more(keys: list[str]) -> str:
    return f" ({len(keys) - 1} more such key(s), e.g. `{keys[1]}`)" if len(keys) > 1 else ""


def target_reads(model: PreTrainedModel, files: CheckpointFiles) -> list[tuple[str, str, tuple[int, ...], int]]:
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


def loading_problems(model: PreTrainedModel, info: Any, files: CheckpointFiles) -> list[str]:
    """What transformers' loader reported (after `_adjust_missing_and_unexpected_keys`), as planc errors."""
    problems: list[str] = []
    for key, got, want in sorted(info.mismatched_keys, key=lambda t: t[0]):
        problems.append(
            f"{files.root}: `{key}` read from the checkpoint has this rank's shape {list(got)}, but the sharded "
            f"model expects {list(want)}. The checkpoint and config.json disagree: use the config saved with these weights."
        )
    if info.conversion_errors:
        feeders = _sources_of(model, files)
    for key, error in sorted(info.conversion_errors.items()):
        fed = feeders.get(key, [])
        listed = _listed(fed)
        where = (f" from {len(fed)} checkpoint tensor(s) ({listed}; first in {files.tensors[fed[0]].file})"
                 if fed else "")
        problems.append(
            f"{files.root}: converting the model's `{key}`{where} failed: {last_line(error)}. The checkpoint's "
            "tensors do not fit this model's layout: use the config.json saved with these weights."
        )
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


def _sources_of(model: PreTrainedModel, files: CheckpointFiles) -> dict[str, list[str]]:
    """model key -> the checkpoint keys that feed it (through the conversion mapping)."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _mapping(model)
    model_keys = model.state_dict()
    out: dict[str, list[str]] = {}
    for key in sorted(files.tensors):
        renamed, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, model_keys)
        out.setdefault(renamed, []).append(key)
    return out


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*)(?:Error|Exception|Exit|Interrupt)\b.*")


def last_line(text: str) -> str:
    """The cause of a failure without its traceback: the last `SomeError: ...` line (else the last line)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    causes = [line for line in lines if _EXCEPTION_LINE.match(line) and not line.startswith("Error")]
    return causes[-1] if causes else (lines[-1] if lines else "")


__all__ = ["checkpoint_problems", "converter_problems", "last_line", "loading_problems", "target_reads"]
