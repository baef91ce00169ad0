"""The safetensors fill step of `planc.load`: transformers' loader reads each rank's byte ranges into the model.

`planc.load` (load.py) builds the model on `meta`, compiles and agrees, shards the parameters on `meta`,
then hands this step to `install_atomically` as `after_sharding`. It runs transformers'
`convert_and_load_state_dict_in_model` once per decoder layer over lazy `mmap` slices (files.py), so each rank
reads only the byte ranges its DTensor placements ask for; after each layer the views of the mapping are copied
and the files unmapped; transformers' own finalisation then recomputes non-persistent buffers and ties weights.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any, Iterable, Iterator, cast

import torch
from torch import nn

from planc.checkpoint.files import CheckpointFiles
from planc.checkpoint.keys import loading_problems
from planc.checkpoint.quantized import (
    block_size,
    conversion_mapping,
    dequantizing,
    wrap_scales,
)
from planc.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils.loading_report import LoadStateDictInfo

    from planc.runtime.install import InstallState


class SafetensorsFill:
    """Between sharding and forwards: transformers' loader reads this rank's byte ranges into the meta-sharded model.

    It runs once per decoder layer (the keys without a layer index first): after each layer, what the model holds
    as a view of the mapped files is copied and the files are unmapped (files.py says why mmap), and for a Mega MoE
    plan with `quantize: fp4` the layer's local experts are quantized as soon as they arrive, so no rank ever holds
    more than one layer of unquantized experts.
    """

    def __init__(self, files: CheckpointFiles, device: torch.device) -> None:
        self.files = files
        self.device = device

    def __call__(self, state: InstallState) -> None:
        from transformers.modeling_utils import LoadStateDictConfig

        model = cast("PreTrainedModel", state.model)  # planc.load builds a transformers model
        mapping = conversion_mapping(model)
        quantizer = getattr(model, "hf_quantizer", None)
        config = LoadStateDictConfig(
            pretrained_model_name_or_path=str(self.files.root),
            dtype=cast(torch.dtype, model.config.dtype),  # resolved to a torch dtype by planc.load's _config
            device_map={"": self.device},
            weight_mapping=mapping,
            hf_quantizer=quantizer,
        )
        quantize = _experts_to_quantize(state)
        infos: list[LoadStateDictInfo] = []
        used: dict[int, Any] = {}  # id -> a conversion some layer used
        # One loader call per decoder layer: the mapped pages of a layer leave the RSS (`unmap`) before the next
        # layer is read, and Mega MoE experts are quantized as soon as their layer is complete.
        with _no_progress_bars(), _shard_offsets_once():  # no progress bar per layer per rank
            for keys in _by_layer(self.files.tensors):
                infos.append(self._fill_layer(model, keys, config))
                used.update((id(c), c) for c in getattr(model, "_weight_conversions", None) or [])
                for fqn in [f for f in quantize if _filled(state.module(f))]:
                    _quantize_experts(state.module(fqn))
                    quantize.remove(fqn)
        # What save/export reverse later: every conversion any layer used (transformers keeps the last call's).
        model._weight_conversions = [c for c in mapping if id(c) in used]  # type: ignore[assignment]  # a plain list
        info = _merged(infos)
        model._adjust_missing_and_unexpected_keys(info)
        problems = loading_problems(model, info, self.files)
        if problems:
            raise CheckpointError("\n".join(problems))
        # transformers' own finalisation: non-persistent buffers off meta and recomputed (rotary inv_freq), ties.
        type(model)._finalize_model_loading(model, config, info)
        if quantizer is not None:  # as from_pretrained ends: FP8 scale views, or the quantization config dropped
            quantizer.postprocess_model(model)
        _move_buffers(model, self.device)
        left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if left:
            raise CheckpointError(
                f"{self.files.root}: after loading, {len(left)} tensor(s) were never read (first: `{left[0]}`): the "
                "checkpoint lacks them. Use a checkpoint saved from this model type and config."
            )

    def _fill_layer(self, model: PreTrainedModel, keys: list[str], config: LoadStateDictConfig) -> LoadStateDictInfo:
        """One loader call over `keys` (one decoder layer's), then the mapped views copied or dropped and unmapped."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        slices = self.files.slices(keys)
        block = block_size(model)
        if dequantizing(model) and block is not None:  # each rank reads only its rows/columns' scale blocks
            slices = wrap_scales(slices, self.files.tensors, block)
        info: LoadStateDictInfo
        info, _ = convert_and_load_state_dict_in_model(model, slices, config)
        _own_copies(model, self.files.mapped_storages)
        self.files.unmap()
        return info


def _quantize_experts(experts: nn.Module) -> None:
    from planc.runtime.megamoe.experts import quantize_to_fp4

    quantize_to_fp4(experts)
    for p in experts.parameters(recurse=False):
        p._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' flag: loaded, not to be re-initialised by transformers' finalisation


def _own_copies(model: nn.Module, mapped: set[int]) -> None:
    """Copy any parameter or buffer still holding a view of the mmap'd checkpoint into memory of its own.

    A converter that stacks, concatenates or dequantizes makes new tensors, but a tensor passed through (an
    attention shard) or a view a converter returns (a split of a fused tensor) would keep the whole mapped tensor,
    and the file, alive in the model. Checked by storage identity after each layer, for every family."""
    if not mapped:
        return
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, t in list(table.items()):
                if t is None or t.is_meta:
                    continue
                local = t._local_tensor if isinstance(t, DTensor) else t
                if local.untyped_storage().data_ptr() not in mapped:
                    continue
                copy = local.detach().clone()
                if isinstance(t, DTensor):
                    copy = DTensor.from_local(copy, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                              stride=tuple(t.stride()))
                if table is module._parameters:
                    copy = nn.Parameter(copy, requires_grad=t.requires_grad)
                # `_is_hf_initialized` and the like: without it transformers' finalisation would re-initialise the
                # tensor (a loaded buffer such as DeepSeek's e_score_correction_bias came back as zeros)
                copy.__dict__.update(t.__dict__)
                table[name] = copy


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it untyped
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it untyped


@contextlib.contextmanager
def _shard_offsets_once() -> Iterator[None]:
    """Each parameter's local shape and offsets computed once per loader call, not once per checkpoint key.

    transformers' loader builds a `DtensorShardOperation` for every checkpoint key it reads into a DTensor (one per
    expert of a per-expert hub checkpoint), and each asks torch's `compute_local_shape_and_global_offset`, which builds
    an index tensor per sharded dim (~1 ms a call; 0.43 s of a 2-rank FP8 DeepSeek-V3 load, 314 calls). The answer
    depends only on (global shape, mesh, placements), so torch's own function is memoized for the call: torch stays
    the one source of truth for shard shapes, it is just not asked the same question twice."""
    from transformers.distributed import sharding_utils

    original = getattr(sharding_utils, "compute_local_shape_and_global_offset", None)
    if original is None:  # another transformers layout: nothing to memoize
        yield
        return
    answers: dict[tuple[Any, ...], Any] = {}

    def memoized(global_shape: Iterable[int], mesh: Any, placements: Iterable[Any], *args: Any,
                 **kwargs: Any) -> Any:
        key = (tuple(global_shape), mesh, tuple(placements), args, tuple(sorted(kwargs.items())))
        if key not in answers:
            answers[key] = original(global_shape, mesh, placements, *args, **kwargs)
        return answers[key]

    sharding_utils.compute_local_shape_and_global_offset = memoized
    try:
        yield
    finally:
        sharding_utils.compute_local_shape_and_global_offset = original


def _by_layer(keys: Iterable[str]) -> list[list[str]]:
    """Checkpoint keys grouped by decoder layer index (keys of no layer first): one loader call per group.

    A converter's inputs (e.g. one layer's per-expert w1/w3) always share a layer index, so every
    group is complete for the conversions it feeds.
    """
    groups: dict[int, list[str]] = {}
    for key in keys:
        m = _LAYER.search(key)
        groups.setdefault(int(m.group(1)) if m else -1, []).append(key)
    return [groups[i] for i in sorted(groups)]


def _merged(infos: list[LoadStateDictInfo]) -> LoadStateDictInfo:
    """One LoadStateDictInfo for all the per-layer loader calls (a key is missing only if no call filled it)."""
    from transformers.utils.loading_report import LoadStateDictInfo

    missing = set.intersection(*(set(i.missing_keys) for i in infos)) if infos else set()
    return LoadStateDictInfo(
        missing_keys=missing,
        unexpected_keys=set().union(*(i.unexpected_keys for i in infos)),
        mismatched_keys=set().union(*(i.mismatched_keys for i in infos)),
        error_msgs=[m for i in infos for m in i.error_msgs],
        conversion_errors={k: v for i in infos for k, v in i.conversion_errors.items()},
        skipped_pp_keys=set(),
    )


def _experts_to_quantize(state: InstallState) -> list[str]:
    """The experts modules a Mega MoE plan quantizes to FP4 (`megamoe.quantize: fp4`) that hold floats."""
    settings = state.compiled.experts_settings
    if not settings.implementation_row.megamoe or settings.megamoe is None or settings.megamoe.quantize != "fp4":
        return []
    out = []
    for e in state.compiled.experts:
        p = state.module(e.fqn)._parameters.get("gate_up_proj")
        if p is not None and p.is_floating_point():
            out.append(e.fqn)
    return out


def _filled(experts: nn.Module) -> bool:
    return all(
        (p := experts._parameters.get(n)) is not None and not p.is_meta for n in ("gate_up_proj", "down_proj")
    )


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers built on the CPU by the model's constructor (none are sharded) follow the shards' device."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                module._buffers[name] = b.to(device)


__all__ = ["SafetensorsFill"]
