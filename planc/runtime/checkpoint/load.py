"""`planc.load(source, plan)`: build the model on `meta`, shard it there, and read only each rank's bytes.

Read top to bottom, `load` is the whole story:

1. Open the checkpoint directory: config.json and every safetensors header (no tensor bytes). A
   missing or truncated shard, or an index naming a missing file, fails here, naming the file.
2. Build the model from the config on the `meta` device (no memory), compile the plan against it
   with every check `planc.apply` runs, check the plan's model type against the config, and check
   the checkpoint's keys, shapes and dtypes against the model through transformers' own key
   conversion (renames, per-expert merges): a key the model lacks or a model key the checkpoint lacks
   is reported here, before a byte is read. Every rank agrees on the outcome in one all-reduce (the
   same as `apply`): a bad plan or checkpoint raises the same error on every rank.
3. Install exactly as `apply` does (`planc.runtime.install`), with one difference: the parameters are
   sharded while still on `meta` (DTensors with the plan's placements and no storage), and the fill
   step between sharding and forwards hands the model to transformers' loader
   (`convert_and_load_state_dict_in_model`), which derives each rank's byte ranges from those
   placements (`DtensorShardOperation`: a column slice, a `_StridedShard` gate|up half, or only the
   experts this rank owns in a per-expert hub checkpoint) and reads just them. Then transformers'
   own finalisation recomputes non-persistent buffers (rotary `inv_freq`) and ties tied weights.
   A planc DCP checkpoint (written by `planc.save`) is filled by `torch.distributed.checkpoint`
   instead, which reshards to this plan's sizes.

Why transformers' loader and not a planc copy: it already knows every family's checkpoint layout
(the conversion mapping) and already reads by DTensor placement; planc only has to hand it a model
whose parameters carry planc's placements.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from torch import nn

from planc.errors import ApplyError, CheckpointError, PlancError
from planc.runtime.checkpoint.files import CheckpointFiles
from planc.runtime.checkpoint.keys import checkpoint_problems, loading_problems
from planc.runtime.checkpoint.quantized import (
    block_size,
    conversion_mapping,
    dequantizing,
    prepare_meta_model,
    quantizer_for,
    wrap_scales,
)
from planc.runtime.mesh import rank_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load(
    source: str | os.PathLike,
    plan: Any,
    *,
    dtype: Optional[torch.dtype | str] = None,
    device: Optional[torch.device | str] = None,
    mesh=None,
    parallel=None,
    dequantize: Optional[bool] = None,
) -> nn.Module:
    """Load the checkpoint directory `source` sharded by `plan`; every rank reads only its own shards.

    `plan`: a path, YAML text, mapping, `LoadedPlan` or `Plan` (as for `planc.apply`). `dtype`: the
    parameters' dtype (default: the checkpoint's `dtype` in config.json, else float32). `device`:
    where this rank's shards live (default: `cuda:LOCAL_RANK` under NCCL, the CPU under gloo).
    `mesh`: an optional ("dp", "tp") DeviceMesh, as for `apply`. `parallel`: run the plan at other sizes,
    as for `apply` (`{"tp_size": 2, "ep_size": 2}`, linted again). `dequantize`: for an FP8 block-scaled
    checkpoint, keep the weights FP8 (False; transformers' FP8 modules, CUDA kernels) or dequantize each shard to
    `dtype` as it is read (True); default: as transformers decides (FP8 on a CUDA GPU of compute capability
    >= 8.9, else dequantized). Returns the applied model; its CompiledPlan is `model._planc_plan`, as after
    `planc.apply`.
    """
    from planc.runtime import install
    from planc.runtime.mesh import build_groups

    install.require_distributed("planc.load")
    device = rank_device(device)
    model = compiled = files = dcp_dir = None
    problems: list[str] = []
    try:
        dcp_dir = _dcp_checkpoint(source)
        if dcp_dir is None:
            files = CheckpointFiles.open(source)
            config_path = files.config_path
            config = _config(config_path.parent, dtype)
        else:
            config_path = Path(dcp_dir) / "config.json"
            config = _config(dcp_dir, dtype)
        loaded = _plan_for(plan, config, config_path)
        megamoe = loaded.plan.experts.implementation == "deepgemm_megamoe"
        quantizer = _quantizer(config, config_path, device, dequantize, dcp=dcp_dir is not None, megamoe=megamoe)
        model = _meta_model(config, dtype)
        if quantizer is not None:
            _check_fp8_kept_plan(quantizer, loaded, config_path)
            prepare_meta_model(model, quantizer)
        compiled, problems = install.compile_and_check(model, loaded, mesh, device=device, parallel=parallel)
        if compiled is not None and files is not None:
            problems += checkpoint_problems(model, files)
        if compiled is not None and device.type == "cuda":
            problems += _memory_problems(compiled, device, source)
    except PlancError as e:
        problems.append(str(e))
    except Exception as e:  # noqa: BLE001 - reported on every rank by the agreement instead of hanging them
        problems.append(f"{type(e).__name__}: {e}")
    try:
        install.agree_across_ranks(compiled, problems, what="planc.load")
    except ApplyError:
        if files is not None:
            files.close()
        raise

    assert model is not None and compiled is not None  # agree_across_ranks raised otherwise
    groups = build_groups(compiled.parallel, mesh)
    state = install.InstallState(model=model, compiled=compiled, groups=groups)
    fill: _SafetensorsFill | _DcpFill
    if files is not None:
        fill = _SafetensorsFill(files, device)
    else:
        assert dcp_dir is not None
        fill = _DcpFill(dcp_dir, device)
    try:
        install.install_atomically(state, after_sharding=fill, what="planc.load")
    finally:
        if files is not None:
            files.close()
    return model


def _memory_problems(compiled, device, source) -> list[str]:
    """PLC660 before any read when this rank's shard alone cannot fit its GPU."""
    from planc.compiler.memory import budget_problems

    total = torch.cuda.get_device_properties(device).total_memory
    return [f"{p.code} {p.message} ({device}). Hint: {p.hint}" for p in budget_problems(compiled, total, str(source))]


# ---- 1-2. checkpoint, config, plan, meta model -------------------------------------------------------------


def _dcp_checkpoint(source) -> Optional[str]:
    """`source` if it holds a planc DCP checkpoint (written by `planc.save`), else None."""
    try:
        from planc.runtime.checkpoint.dcp import is_planc_checkpoint
    except ImportError:  # the DCP half is not installed in this build
        return None
    return str(source) if is_planc_checkpoint(source) else None


def _resolve_dtype(dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if dtype is not None else getattr(config, "dtype", None)
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.float32
    resolved = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise CheckpointError(f"dtype {name!r} is not a torch dtype; pass e.g. torch.bfloat16 or 'bfloat16'.")
    return resolved


def _config(root, dtype):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad config
        raise CheckpointError(f"{Path(root) / 'config.json'}: transformers cannot build a config from it: {e}") from None
    config.dtype = _resolve_dtype(dtype, config)
    return config


def _quantizer(config, config_path, device, dequantize, *, dcp: bool, megamoe: bool):
    """transformers' quantizer for a pre-quantized checkpoint (quantized.py), refused before any read if planc
    cannot load it; None for an unquantized one."""
    if getattr(config, "quantization_config", None) is None:
        return None
    if dcp:
        # A planc.save checkpoint keeps its config's `quantization_config` only when its model kept FP8 (a dequantized
        # load drops it): it holds FP8 weights and their scales, read back as they are, with FP8 kept.
        if dequantize:
            raise CheckpointError(
                f"{config_path}: this planc.save checkpoint holds FP8 weights (its model was loaded with FP8 kept); "
                "it loads with FP8 kept only (nothing was read). Drop `dequantize=True`, or load the original "
                "safetensors checkpoint with `dequantize=True`."
            )
        dequantize = False
    return quantizer_for(config, config_path, device, dequantize, megamoe=megamoe)


def _check_fp8_kept_plan(quantizer, loaded, config_path) -> None:
    """Mega MoE takes bf16 experts (quantized to FP4 at load) or FP4 ones, not transformers' FP8Experts."""
    qc = quantizer.quantization_config
    if qc.dequantize or qc.expert_dtype == "fp4" or loaded.plan.experts.implementation != "deepgemm_megamoe":
        return
    raise CheckpointError(
        f"{config_path}: an FP8 checkpoint kept in FP8 cannot feed a `deepgemm_megamoe` plan (its kernel takes FP4 "
        "experts, or bf16 ones it quantizes with `megamoe.quantize: fp4`). Load with `dequantize=True`: each rank's "
        "experts are dequantized as they arrive, then quantized to FP4 layer by layer."
    )


def _plan_for(plan, config, config_path):
    """The plan, loaded and validated, after checking that it is for this checkpoint's model type."""
    from planc.lint.load import load_plan

    loaded = load_plan(plan)
    plan_type = loaded.plan.model.type if loaded.plan.model is not None else None
    model_type = getattr(config, "model_type", None)
    if plan_type is not None and model_type is not None and plan_type != model_type:
        raise CheckpointError(
            f"{config_path}: the checkpoint is a `{model_type}` model, but the plan is for `model.type: {plan_type}`. "
            f"Load it with a {model_type} plan (`planc init --from-transformers {model_type}` writes one)."
        )
    return loaded


def _model_class(config):
    """The class named by the config's `architectures` (as `from_pretrained` picks it), else the one users load for
    the config (`model_class_for`: the family's top model, e.g. a multimodal MoE, else its *ForCausalLM)."""
    import transformers

    from planc.models.build import model_class_for

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return model_class_for(config)


def _meta_model(config, dtype) -> PreTrainedModel:
    from planc.models.build import meta_model

    return meta_model(config, model_class=_model_class(config), dtype=config.dtype).eval()


# ---- 3. the fill step ------------------------------------------------------------------------------------


class _SafetensorsFill:
    """Between sharding and forwards: transformers' loader reads this rank's byte ranges into the meta-sharded model.

    It runs once per decoder layer (the keys without a layer index first): after each layer, what the model holds
    as a view of the mapped files is copied and the files are unmapped (files.py says why mmap), and for a Mega MoE
    plan with `quantize: fp4` the layer's local experts are quantized as soon as they arrive, so no rank ever holds
    more than one layer of unquantized experts.
    """

    def __init__(self, files: CheckpointFiles, device: torch.device):
        self.files = files
        self.device = device

    def __call__(self, state) -> None:
        from transformers.modeling_utils import LoadStateDictConfig

        model = state.model
        mapping = conversion_mapping(model)
        quantizer = getattr(model, "hf_quantizer", None)
        config = LoadStateDictConfig(
            pretrained_model_name_or_path=str(self.files.root),
            dtype=model.config.dtype,
            device_map={"": self.device},
            weight_mapping=mapping,
            hf_quantizer=quantizer,
        )
        quantize = _experts_to_quantize(state)
        infos: list[Any] = []
        used: dict[int, Any] = {}  # the converters transformers ran, by identity
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
        model._weight_conversions = [c for c in mapping if id(c) in used]
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

    def _fill_layer(self, model: nn.Module, keys: list[str], config):
        """One loader call over `keys` (one decoder layer's), then the mapped views copied or dropped and unmapped."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        slices = self.files.slices(keys)
        if dequantizing(model):  # each rank reads only the scale blocks of its own rows/columns (quantized.py)
            blocks = block_size(model)
            assert blocks is not None  # a dequantized model has a block size
            slices = wrap_scales(slices, self.files.tensors, blocks)
        info, _ = convert_and_load_state_dict_in_model(cast("PreTrainedModel", model), slices, config)
        _own_copies(model, self.files.mapped_storages)
        self.files.unmap()
        return info


def _quantize_experts(experts: nn.Module) -> None:
    from planc.runtime.megamoe.experts import quantize_to_fp4

    quantize_to_fp4(experts)
    for p in experts.parameters(recurse=False):
        p._is_hf_initialized = True  # type: ignore[attr-defined]  # loaded: transformers' finalisation skips it


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
def _no_progress_bars():
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


@contextlib.contextmanager
def _shard_offsets_once():
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
    answers: dict = {}

    def memoized(global_shape, mesh, placements, *args, **kwargs):
        key = (tuple(global_shape), mesh, tuple(placements), args, tuple(sorted(kwargs.items())))
        if key not in answers:
            answers[key] = original(global_shape, mesh, placements, *args, **kwargs)
        return answers[key]

    sharding_utils.compute_local_shape_and_global_offset = memoized
    try:
        yield
    finally:
        sharding_utils.compute_local_shape_and_global_offset = original


def _by_layer(keys) -> list[list[str]]:
    """Checkpoint keys grouped by decoder layer index (keys of no layer first): one loader call per group.

    A converter's inputs (e.g. one layer's per-expert w1/w3) always share a layer index, so every
    group is complete for the conversions it feeds.
    """
    groups: dict[int, list[str]] = {}
    for key in keys:
        m = _LAYER.search(key)
        groups.setdefault(int(m.group(1)) if m else -1, []).append(key)
    return [groups[i] for i in sorted(groups)]


def _merged(infos):
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


def _experts_to_quantize(state) -> list[str]:
    """The experts modules a Mega MoE plan quantizes to FP4 (`megamoe.quantize: fp4`) that hold floats."""
    settings = state.compiled.experts_settings
    if settings.implementation != "deepgemm_megamoe" or settings.megamoe is None or settings.megamoe.quantize != "fp4":
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


class _DcpFill:
    """Between sharding and forwards: `torch.distributed.checkpoint` reshards a planc checkpoint into this plan."""

    def __init__(self, path: str, device: torch.device):
        self.path = path
        self.device = device

    def __call__(self, state) -> None:
        from planc.runtime.checkpoint.dcp import fill_from_dcp

        fill_from_dcp(state.model, self.path, device=self.device, compiled=state.compiled, groups=state.groups)
        quantizer = getattr(state.model, "hf_quantizer", None)
        if quantizer is not None:  # FP8 kept: as after a safetensors load (the config keeps its quantization_config)
            quantizer.postprocess_model(state.model)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers built on the CPU by the model's constructor (none are sharded) follow the shards' device."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                module._buffers[name] = b.to(device)


__all__ = ["load"]
