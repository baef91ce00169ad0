"""Pre-quantized checkpoints in `planc.load`: DeepSeek-V3-style FP8 block-scaled weights, through transformers' own
FineGrainedFP8 quantizer.

A checkpoint whose config.json has `quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}` stores
each quantized weight as `float8_e4m3fn` plus `weight_scale_inv`: one fp32 factor per 128 x 128 block (what the
weight is multiplied by to dequantize). planc builds the quantizer transformers itself would build
(`AutoHfQuantizer.from_config`), lets it prepare the `meta` model and extend the family's conversion mapping
(`update_weight_conversions`), and hands it to transformers' loader, so planc loads exactly what
`from_pretrained` loads. Two modes, chosen as transformers chooses them:

- **FP8 kept** (a CUDA GPU of compute capability >= 8.9, or `dequantize=False`): the quantizer swaps nn.Linear for
  `FP8Linear` and the experts for `FP8Experts` on the meta model before the plan is compiled. Their scale parameters
  (`weight_scale_inv`, `gate_up_proj_scale_inv`, ...) take their weight's style (the compiler's companion rule) and
  are read with their weight: a colwise shard of rows [r0, r1) reads scale rows [r0/128, r1/128). The compiler
  refuses a plan whose shards do not fall on the block grid (PLC625). The weights stay FP8 in memory; the forwards
  are transformers' FP8 kernels (CUDA only).
- **dequantized at load** (no such GPU, or `dequantize=True`): transformers' own choice without a GPU. The model
  stays unquantized and transformers' `Fp8Dequantize` runs on each rank's shard as it arrives. transformers'
  shard-on-read splits every source of a parameter by that source's own shape, so the scale grid is split into
  as many chunks as the weight: right only when every shard edge falls on the block grid. Off the grid (a 384-row
  weight at tp 2: 192 rows but 2 of the 3 scale rows) it dequantizes with the wrong factors, silently (measured:
  logits off by 0.13 on a tiny Mixtral). `BlockScaleSlice` presents the scale in its weight's coordinates, so a
  rank reads exactly the scale blocks its own rows and columns touch (expanded per element where a shard starts
  or ends inside a block) and the dequantized load is exact for any plan.

DeepSeek-V4's format (`expert_dtype: fp4`, `scale_fmt: ue8m0`) under a `deepgemm_megamoe` plan: the experts modules
get the Mega MoE FP4 storage on `meta` (int8 e2m1 pairs + UE8M0 scales per 32, the names and shapes of transformers'
`FP8Experts(expert_dtype="fp4")`), so the quantizer's scale converters read each rank's experts' FP4 bytes and scales
straight into it: no bf16 copy of an expert ever exists. The other FP8 weights are dequantized as they are read.

Anything else (other methods, per-tensor FP8, UE8M0 scales without FP4 experts, static activation scales, FP4
experts without Mega MoE, FP4 experts with the other weights kept FP8) is refused before a byte is read, naming
what was found.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, cast

import torch
from torch import nn

from planc.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SCALE_SUFFIX = "_scale_inv"
SUPPORTED = ("`quant_method: fp8` with `weight_block_size: [n, k]`, fp32 scales (`scale_fmt: float`) and dynamic "
             "activations (DeepSeek-V3), and DeepSeek-V4's FP4 experts (`expert_dtype: fp4`, `scale_fmt: ue8m0`) under "
             "a `deepgemm_megamoe` plan")


def _get(q: Any, name: str, default: Any = None) -> Any:
    return q.get(name, default) if isinstance(q, dict) else getattr(q, name, default)


def quantizer_for(config: Any, config_path: Path, device: torch.device, dequantize: Optional[bool], *,
                  megamoe: bool = False) -> Any:
    """transformers' quantizer for this checkpoint (None when it is not quantized); refuses what planc cannot load.

    `megamoe`: the plan runs Mega MoE experts, which take DeepSeek-V4's FP4 experts (`expert_dtype: fp4`, UE8M0
    scales) as they are stored."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    method = _get(q, "quant_method", type(q).__name__)
    method = getattr(method, "value", method)
    problem = None
    block = _get(q, "weight_block_size")
    if method != "fp8":
        problem = f"`quant_method: {method}`"
    elif not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        problem = f"`weight_block_size: {block}` (per-tensor FP8)"
    elif _get(q, "activation_scheme", "dynamic") != "dynamic":
        problem = f"`activation_scheme: {_get(q, 'activation_scheme')}`"
    elif fp4_experts(q) and not megamoe:
        problem = f"`expert_dtype: {_get(q, 'expert_dtype')}` (FP4 experts) for a plan without Mega MoE experts"
    elif fp4_experts(q) and _get(q, "scale_fmt") != "ue8m0":
        problem = f"`expert_dtype: fp4` with `scale_fmt: {_get(q, 'scale_fmt', 'float')}`"
    elif _get(q, "expert_dtype", "fp8") not in (None, "fp8", "fp4"):
        problem = f"`expert_dtype: {_get(q, 'expert_dtype')}`"
    elif not fp4_experts(q) and _get(q, "scale_fmt", "float") not in (None, "float"):
        problem = f"`scale_fmt: {_get(q, 'scale_fmt')}`"
    elif _get(q, "fmt", "e4m3") not in (None, "e4m3"):
        problem = f"`fmt: {_get(q, 'fmt')}`"
    if problem is not None:
        raise CheckpointError(
            f"{config_path}: the checkpoint is pre-quantized with {problem} in `quantization_config`, which planc.load "
            f"does not support: it loads {SUPPORTED}. Nothing was read. Load a bf16/fp32 "
            "checkpoint instead; for FP4 Mega MoE experts use a plan with `experts.megamoe.quantize: fp4`, which "
            "quantizes each rank's experts as they are read."
        )
    from transformers.quantizers.auto import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(q, pre_quantized=True)
    quantizer.quantization_config.dequantize = _dequantize(quantizer.quantization_config, device, dequantize)
    if fp4_experts(q) and not quantizer.quantization_config.dequantize:
        raise CheckpointError(
            f"{config_path}: FP4 experts (`expert_dtype: fp4`) load into Mega MoE with the other FP8 weights "
            "dequantized as they are read; keeping those in FP8 at the same time is not supported yet. Nothing was "
            "read. Pass `planc.load(..., dequantize=True)` (the experts stay FP4 either way)."
        )
    return quantizer


def fp4_experts(q: Any) -> bool:
    """DeepSeek-V4's format: FP4 experts (e2m1 packed, UE8M0 scale per 32) beside FP8 block-scaled linears."""
    return bool(_get(q, "expert_dtype", "fp8") == "fp4")


def _fp4_experts_on_meta(model: nn.Module) -> list[str]:
    """Give every experts module planc's (and transformers' `FP8Experts(expert_dtype="fp4")`) FP4 storage on `meta`:
    int8 `gate_up_proj [E, 2I, H/2]`, `down_proj [E, H, I/2]`, UE8M0 `*_scale_inv` per 32. The loader then reads the
    checkpoint's FP4 bytes and scales into them as they are (the quantizer's scale converters), never in bf16."""
    from planc.kernels.megamoe.quant import GRAN, SCALE_DTYPE
    from planc.runtime.megamoe.experts import set_fp4_parameters

    names = []
    for name, module in model.named_modules():
        gate_up, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
        if gate_up is None or down is None or gate_up.ndim != 3 or not gate_up.is_floating_point():
            continue
        (e, two_i, h), i = gate_up.shape, down.shape[2]

        def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device="meta")

        set_fp4_parameters(module, {
            "gate_up_proj": meta(e, two_i, h // 2, dtype=torch.int8),
            "gate_up_proj_scale_inv": meta(e, two_i, h // GRAN, dtype=SCALE_DTYPE),
            "down_proj": meta(e, h, i // 2, dtype=torch.int8),
            "down_proj_scale_inv": meta(e, h, i // GRAN, dtype=SCALE_DTYPE),
        })
        names.append(name)
    return names


def _dequantize(qconfig: Any, device: torch.device, requested: Optional[bool]) -> bool:
    """transformers' own rule (`FineGrainedFP8HfQuantizer.validate_environment`): FP8 kernels need a CUDA GPU of
    compute capability >= 8.9; anywhere else the weights are dequantized as they load. An explicit choice wins."""
    if requested is not None:
        return bool(requested)
    if getattr(qconfig, "dequantize", False):
        return True
    if device.type != "cuda" or not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)


def prepare_meta_model(model: Any, quantizer: Any) -> None:
    """What `from_pretrained` does before reading: the quantizer swaps in its FP8 modules (kept mode; a no-op when
    dequantizing). The quantizer rides on the model so the key checks and the loader see its conversions."""
    if fp4_experts(quantizer.quantization_config):
        experts = _fp4_experts_on_meta(model)
        qc = quantizer.quantization_config
        qc.modules_to_not_convert = list(qc.modules_to_not_convert or []) + experts
    quantizer.preprocess_model(model=model, dtype=model.config.dtype, device_map=None, checkpoint_files=None,
                               use_kernels=False)
    model.hf_quantizer = quantizer


def conversion_mapping(model: PreTrainedModel) -> list[Any]:
    """The family's conversion mapping, extended by the model's quantizer (scale keys) when it has one, with its
    shape-checking ops comparing against this rank's shard (`conversion.shard_aware`) and, when it dequantizes, its
    `Fp8Dequantize` ops computing on the CPU through planc's table (fp8.py: the same bits, faster)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    from planc.checkpoint.conversion import shard_aware

    mapping = shard_aware(get_model_conversion_mapping(model, None, getattr(model, "hf_quantizer", None)))
    if dequantizing(model):
        from planc.checkpoint.fp8 import with_fast_dequantize

        mapping = with_fast_dequantize(mapping)
    return mapping


def dequantizing(model: nn.Module) -> bool:
    q = getattr(model, "hf_quantizer", None)
    return q is not None and bool(getattr(q.quantization_config, "dequantize", False))


def block_size(model: nn.Module) -> Optional[tuple[int, int]]:
    q = getattr(model, "hf_quantizer", None)
    block = getattr(q.quantization_config, "weight_block_size", None) if q is not None else None
    return cast("tuple[int, int]", tuple(block)) if block else None  # [n, k], checked by quantizer_for


def wrap_scales(slices: dict[str, Any], tensors: dict[str, Any], block: tuple[int, int]) -> dict[str, Any]:
    """Dequantize mode: every `X_scale_inv` beside an FP8 `X` becomes a `BlockScaleSlice` in X's coordinates."""
    out = dict(slices)
    for key in slices:
        info = tensors[key]
        if not key.endswith(SCALE_SUFFIX):
            continue
        weight = tensors.get(key[: -len(SCALE_SUFFIX)])
        if weight is None or len(weight.shape) < 2 or len(weight.shape) != len(info.shape):
            continue
        out[key] = BlockScaleSlice(slices[key], weight.shape, info.shape, info.dtype, block)
    return out


class BlockScaleSlice:
    """A block-scale tensor seen in its weight's coordinates, for transformers' shard-on-read.

    `DtensorShardOperation` computes a source's row/column intervals from the target parameter's placements and
    the source's shape (`get_shape`, here the weight's), then indexes the source with them. Indexed with the
    weight's `[r0:r1, c0:c1]`, this reads only
    scale blocks `[r0//bn : ceil(r1/bn), c0//bk : ceil(c1/bk)]`. When every shard edge falls on the block grid the
    result stays one factor per block (what `Fp8Dequantize` expects: it derives the block from the two shapes); when
    an edge falls inside a block, or the slice ends in a partial block (DeepSeek-V3's 576-row `kv_a_proj_with_mqa`:
    4.5 blocks, which transformers' own dequantization refuses), both dims are expanded to one factor per element
    of the slice, which `Fp8Dequantize` applies as a 1 x 1 block: the same products, element by element.
    `[...]` (a replicated parameter) reads the whole scale, expanded only if the weight ends in a partial block.
    """

    def __init__(self, source: Any, weight_shape: Sequence[int], scale_shape: Sequence[int], dtype: str,
                 block: tuple[int, int]) -> None:
        self.source = source
        self.weight_shape = tuple(weight_shape)
        self.scale_shape = tuple(scale_shape)
        self.dtype = dtype
        self.block = block

    def get_shape(self) -> list[int]:
        return list(self.weight_shape)

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is Ellipsis or index == (Ellipsis,):
            index = ()  # the whole weight (a replicated parameter)
        index = index if isinstance(index, tuple) else (index,)
        ndim = len(self.weight_shape)
        spans = []
        for d in range(ndim):
            s = index[d] if d < len(index) else slice(None)
            start, stop, step = s.indices(self.weight_shape[d])
            if step != 1:
                raise CheckpointError(f"block scales cannot be read with a strided slice ({s}) of the weight")
            spans.append((start, stop))
        lead, (rows, cols) = spans[:-2], spans[-2:]
        grid = []
        aligned = True
        for (start, stop), b in zip((rows, cols), self.block):
            grid.append((start // b, -(-stop // b)))
            aligned &= start % b == 0 and (stop - start) % b == 0
        scale: torch.Tensor = self.source[tuple(slice(a, z) for a, z in lead) + tuple(slice(a, z) for a, z in grid)]
        if aligned:
            return scale
        for axis, ((start, stop), b, (g0, _)) in enumerate(zip((rows, cols), self.block, grid)):
            dim = scale.ndim - 2 + axis
            scale = scale.repeat_interleave(b, dim=dim).narrow(dim, start - g0 * b, stop - start)
        return scale.contiguous()


__all__ = ["quantizer_for", "prepare_meta_model", "conversion_mapping", "dequantizing", "block_size", "wrap_scales",
           "BlockScaleSlice", "SCALE_SUFFIX"]
