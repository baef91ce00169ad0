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
   step between sharding and forwards (fill.py) hands the model to transformers' loader
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

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from planc.checkpoint.atomic import agree
from planc.checkpoint.dcp_reader import CheckedReader
from planc.checkpoint.files import CheckpointFiles
from planc.checkpoint.fill import SafetensorsFill
from planc.checkpoint.keys import checkpoint_problems, last_line
from planc.checkpoint.quantized import prepare_meta_model, quantizer_for
from planc.errors import ApplyError, CheckpointError, PlancError
from planc.runtime.mesh import rank_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from planc.compiler.compiled import CompiledPlan
    from planc.runtime.install import InstallState
    from planc.spec.loaded_plan import LoadedPlan


def load(
    source: str | os.PathLike[str],
    loaded: LoadedPlan,
    *,
    dtype: Optional[torch.dtype | str] = None,
    device: Optional[torch.device | str] = None,
    mesh: Any = None,
    dequantize: Optional[bool] = None,
    trust_checkpoint_code: bool = False,
) -> nn.Module:
    """Load the checkpoint directory `source` sharded by `loaded`; every rank reads only its own shards.

    `loaded`: the plan at the sizes it runs at, loaded on every rank by the public face
    (`planc.runtime.install.load_plan_on_every_rank`). `dtype`: the
    parameters' dtype (default: the checkpoint's `dtype` in config.json, else float32). `device`:
    where this rank's shards live (default: `cuda:LOCAL_RANK` under NCCL, the CPU under gloo).
    `mesh`: an optional DeviceMesh, as for `apply`. `dequantize`: for an FP8 block-scaled
    checkpoint, keep the weights FP8 (False; transformers' FP8 modules, CUDA kernels) or dequantize each shard to
    `dtype` as it is read (True); default: as transformers decides (FP8 on a CUDA GPU of compute capability
    >= 8.9, else dequantized). `trust_checkpoint_code`: read a planc.save checkpoint with torch's own unpickler
    instead of planc's allow-list (dcp_reader.py; it warns). Returns the applied model; its CompiledPlan is
    `model._planc_plan`, as after `planc.apply`.
    """
    from planc.runtime import install
    from planc.runtime.mesh import build_groups

    device = rank_device(device)
    checked = check_checkpoint(source, loaded, dtype=dtype, device=device, mesh=mesh, dequantize=dequantize,
                               trust_checkpoint_code=trust_checkpoint_code)
    try:
        agree(checked.refused, "planc.load")  # a refused .metadata: the same CheckpointError on every rank
        install.agree_across_ranks(checked.compiled, checked.problems, what="planc.load", decisions=checked.decisions)
    except (ApplyError, CheckpointError):
        checked.close()
        raise

    model, compiled = checked.model, checked.compiled
    assert model is not None and compiled is not None  # the ranks agreed on no problems: both were built
    groups = build_groups(compiled.parallel, mesh)
    state = install.InstallState(model=model, compiled=compiled, groups=groups)
    fill: SafetensorsFill | _DcpFill
    if checked.dcp_dir is None:
        assert checked.files is not None  # not a planc.save checkpoint: the safetensors files are open
        fill = SafetensorsFill(checked.files, device)
    else:
        fill = _DcpFill(checked.dcp_dir, device, checked.reader)
    try:
        install.install_atomically(state, after_sharding=fill, what="planc.load")
    finally:
        checked.close()
    return model


@dataclass
class Checked:
    """What `check_checkpoint` found: the meta model and its CompiledPlan (None when compiling failed), the open
    safetensors files or the DCP directory (and the reader its metadata was read with; `refused`: why that
    metadata was refused, before anything else was checked), every problem (each a message naming file/key and the fix), and the
    decisions the ranks must agree on before their collectives diverge (install.agree_across_ranks)."""

    model: Optional[PreTrainedModel] = None
    compiled: Optional[CompiledPlan] = None
    files: Optional[CheckpointFiles] = None
    dcp_dir: Optional[str] = None
    reader: Optional[CheckedReader] = None
    refused: Optional[CheckpointError] = None
    problems: list[str] = field(default_factory=list)
    decisions: dict[str, str] = field(default_factory=dict)

    def close(self) -> None:
        if self.files is not None:
            self.files.close()


def check_checkpoint(
    source: str | os.PathLike[str], loaded: LoadedPlan, *, dtype: Optional[torch.dtype | str] = None,
    device: Optional[torch.device | str] = None, mesh: Any = None, dequantize: Optional[bool] = None,
    launched: bool = True, trust_checkpoint_code: bool = False
) -> Checked:
    """Every check planc.load runs before a byte of a tensor is read, on this rank alone (no communication).

    `planc.load` calls it on every rank and agrees on the outcome; `planc explain --checkpoint` calls it with
    `launched=False` (no world: the world size and the kernels' device are not checked) and prints the problems.
    One function, so explain refuses exactly what load refuses. A planc.save checkpoint's `.metadata` is read here,
    through planc's allow-list (dcp_reader.py), and every file it points into checked.
    """
    from planc.runtime import install

    device = torch.device(device) if device is not None else torch.device("cpu")
    out = Checked()
    try:
        out.dcp_dir = _dcp_checkpoint(source)
        route = "planc.save (torch.distributed.checkpoint)" if out.dcp_dir else "safetensors"
        out.decisions["checkpoint route"] = route
        if out.dcp_dir is None:
            out.files = CheckpointFiles.open(source)
            out.decisions["checkpoint"] = f"{len(out.files.tensors)} tensors, headers {out.files.digest()}"
            config = _config(out.files.config_path.parent, dtype)
            config_path = out.files.config_path
        else:
            try:
                out.reader = _dcp_reader(Path(out.dcp_dir), trust_checkpoint_code)
            except CheckpointError as e:  # its metadata refused: nothing more of it is read or built
                out.refused = e
                out.problems.append(str(e))
                return out
            config = _config(out.dcp_dir, dtype)
            config_path = Path(out.dcp_dir) / "config.json"
        _check_model_type(loaded, config, config_path)
        megamoe = loaded.plan.experts.implementation_row.megamoe
        quantizer = _quantizer(config, config_path, device, dequantize, dcp=out.dcp_dir is not None, megamoe=megamoe)
        out.decisions["quantization"] = (
            "none" if quantizer is None
            else "dequantized" if getattr(quantizer.quantization_config, "dequantize", False) else "kept"
        )
        model = out.model = _meta_model(config, dtype)
        if quantizer is not None:
            _check_fp8_kept_plan(quantizer, loaded, config_path)
            prepare_meta_model(model, quantizer)
        out.compiled, problems = install.compile_and_check(model, loaded, mesh, device=device, launched=launched)
        out.problems += problems
        if out.compiled is not None and out.files is not None:
            out.problems += checkpoint_problems(model, out.files)
        if out.compiled is not None and device.type == "cuda":
            out.problems += _memory_problems(out.compiled, device, source)
    except PlancError as e:
        out.problems.append(str(e))
    except Exception as e:  # noqa: BLE001 - reported on every rank by the agreement instead of hanging them
        out.problems.append(f"{type(e).__name__}: {last_line(str(e)) or e}")
    return out


def _memory_problems(compiled: CompiledPlan, device: torch.device, source: str | os.PathLike[str]) -> list[str]:
    """PLC660 before any read when this rank's shard alone cannot fit its GPU."""
    from planc.compiler.memory import budget_problems

    total = torch.cuda.get_device_properties(device).total_memory
    return [f"{p.code} {p.message} ({device}). Hint: {p.hint}" for p in budget_problems(compiled, total, str(source))]


# ---- 1-2. checkpoint, config, plan, meta model -------------------------------------------------------------


def _dcp_reader(directory: Path, trust_code: bool) -> CheckedReader:
    """The reader of a planc.save checkpoint, its `.metadata` read (planc's allow-list unless the user trusts the
    checkpoint's code) and every `.distcp` range it names present; CheckpointError otherwise."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from planc.checkpoint.dcp import open_checked
    from planc.checkpoint.dcp_reader import metadata_protocol, warn_trusted
    from planc.checkpoint.marker import read_marker

    if trust_code:
        warn_trusted(directory, "planc.load")
    reader = open_checked(directory, protocol=metadata_protocol(read_marker(directory)), trust_code=trust_code,
                          what="the checkpoint")
    metadata = reader.read_metadata()
    items = sorted(k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata))
    if items:  # fill_from_dcp would refuse them too: refused here, so explain --checkpoint does as well
        raise CheckpointError(
            f"{directory / '.metadata'}: {len(items)} non-tensor item(s) (`{items[0]}`"
            + (f" and {len(items) - 1} more" if len(items) > 1 else "") + "): planc.save writes a model's state as "
            "tensors only, so the checkpoint was changed since or written by another tool; none of them was read."
        )
    return reader



def _dcp_checkpoint(source: str | os.PathLike[str]) -> Optional[str]:
    """`source` if it holds a planc DCP checkpoint (written by `planc.save`), None for a safetensors directory.

    A `planc.json` that cannot be read means a damaged planc checkpoint, said as such (not "no model.safetensors"):
    planc.save writes it last, so it is damaged only when something changed the directory afterwards.
    """
    import json

    from planc.checkpoint.files import missing_directory
    from planc.checkpoint.marker import FORMAT, MARKER, read_marker

    root = Path(source)
    if not root.is_dir():
        raise CheckpointError(missing_directory(root))
    marker = root / MARKER
    if not (marker.exists() or marker.is_symlink()):
        return None
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{marker}: unreadable ({type(e).__name__}: {e}), so {root} is a damaged planc.save checkpoint (planc.json "
            "names its format and plan; nothing was read). Save it again, or restore planc.json from a copy."
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None  # someone else's planc.json beside a safetensors checkpoint
    read_marker(root)  # its format_version, with the fix when this planc cannot read it
    return str(source)


def _resolve_dtype(dtype: Optional[torch.dtype | str], config: Any) -> torch.dtype:
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


def _config(root: str | os.PathLike[str], dtype: Optional[torch.dtype | str]) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad config
        raise CheckpointError(f"{Path(root) / 'config.json'}: transformers cannot build a config from it: {e}") from None
    config.dtype = _resolve_dtype(dtype, config)
    return config


def _quantizer(config: Any, config_path: Path, device: torch.device, dequantize: Optional[bool], *, dcp: bool,
               megamoe: bool) -> Any:
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


def _check_fp8_kept_plan(quantizer: Any, loaded: LoadedPlan, config_path: Path) -> None:
    """Mega MoE takes bf16 experts (quantized to FP4 at load) or FP4 ones, not transformers' FP8Experts."""
    qc = quantizer.quantization_config
    if qc.dequantize or qc.expert_dtype == "fp4" or not loaded.plan.experts.implementation_row.megamoe:
        return
    raise CheckpointError(
        f"{config_path}: an FP8 checkpoint kept in FP8 cannot feed a `deepgemm_megamoe` plan (its kernel takes FP4 "
        "experts, or bf16 ones it quantizes with `megamoe.quantize: fp4`). Load with `dequantize=True`: each rank's "
        "experts are dequantized as they arrive, then quantized to FP4 layer by layer."
    )


def _check_model_type(loaded: LoadedPlan, config: Any, config_path: Path) -> None:
    """CheckpointError unless the plan is for this checkpoint's model type (or names none)."""
    plan_type = loaded.plan.model.type if loaded.plan.model is not None else None
    model_type = getattr(config, "model_type", None)
    if plan_type is not None and model_type is not None and plan_type != model_type:
        raise CheckpointError(
            f"{config_path}: the checkpoint is a `{model_type}` model, but the plan is for `model.type: {plan_type}`. "
            f"Load it with a {model_type} plan (`planc init --from-transformers {model_type}` writes one)."
        )


def _model_class(config: Any) -> Any:
    """The class named by the config's `architectures` (as `from_pretrained` picks it), else the one users load for
    the config (`model_class_for`: the family's top model, e.g. a multimodal MoE, else its *ForCausalLM)."""
    import transformers

    from planc.models.build import model_class_for

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return model_class_for(config)


def _meta_model(config: Any, dtype: Optional[torch.dtype | str]) -> PreTrainedModel:
    from planc.models.build import meta_model

    model: PreTrainedModel = meta_model(config, model_class=_model_class(config), dtype=config.dtype).eval()
    return model


# ---- 3. the fill step ------------------------------------------------------------------------------------


class _DcpFill:
    """Between sharding and forwards: `torch.distributed.checkpoint` reshards a planc checkpoint into this plan."""

    def __init__(self, path: str, device: torch.device, reader: Optional[CheckedReader]) -> None:
        self.path = path
        self.device = device
        self.reader = reader

    def __call__(self, state: InstallState) -> None:
        from planc.checkpoint.dcp import fill_from_dcp

        fill_from_dcp(state.model, self.path, device=self.device, compiled=state.compiled, groups=state.groups,
                      reader=self.reader)
        quantizer = getattr(state.model, "hf_quantizer", None)
        if quantizer is not None:  # FP8 kept: as after a safetensors load (the config keeps its quantization_config)
            quantizer.postprocess_model(state.model)


__all__ = ["load"]
