"""FP8 block dequantization on the CPU: the same bits as transformers' `Fp8Dequantize`, without its slow cast.

Why planc has its own copy of this one step: `planc.load` of a DeepSeek-V3-style FP8 checkpoint without a GPU
dequantizes every shard as it is read, and transformers' `Fp8Dequantize._dequantize_one` spends most of that time
(measured: 2.6 of a 4.9 s load on 2 ranks) in torch's float8_e4m3fn -> float32 cast, which on the CPU converts one
element at a time, and in page-faulting three fresh full-size temporaries (the fp32 copy, the scaled product, the
output). `dequantize_fp8_blocks` computes exactly what that op computes, `(float32(q) * float32(scale)).to(out)`
block by block, with two changes that leave every bit the same:

- `float32(q)` is a 256-entry table indexed by the weight's uint8 view (numpy's `take`, which accepts uint8
  indices and copies the table's bits). The table is torch's own cast of the 256 codes, so every code maps to the
  value (and the NaN bits, and -0.0) that torch's cast gives it.
- the work goes one chunk of block rows at a time through a cache-sized fp32 buffer (the multiply is the same fp32
  multiply of the same two numbers, rounded once; the conversion to the output dtype is torch's same cast), so
  the only full-size allocation is the output; the chunks run on a few threads (numpy's take and torch's ops
  release the GIL).

Anything else (FP4/int8 weights, uint8 E8M0 scales, a CUDA tensor, an empty one) goes to transformers' own op.
`tests/runtime/test_fp8_dequant.py` checks the bits against `Fp8Dequantize` on all 256 codes and on real blocks.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import torch

_CHUNK = 1 << 16  # elements per chunk: a 256 KiB fp32 buffer
_TABLE: Optional[np.ndarray] = None


def fp8_e4m3_table() -> np.ndarray:
    """float32 value of each float8_e4m3fn code 0..255, from torch's own cast (so identical to it, NaNs included)."""
    global _TABLE
    if _TABLE is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        _TABLE = codes.to(torch.float32).numpy().copy()
    return _TABLE


def fast_path(quantized: torch.Tensor, scales: torch.Tensor) -> bool:
    """True when `dequantize_fp8_blocks` handles this pair (else use transformers' op)."""
    return (
        quantized.dtype == torch.float8_e4m3fn
        and quantized.device.type == "cpu"
        and quantized.ndim >= 2
        and quantized.numel() > 0
        and isinstance(scales, torch.Tensor)
        and scales.device.type == "cpu"
        and scales.ndim >= 2
        and scales.dtype.is_floating_point
        and math.prod(scales.shape[:-2]) == math.prod(quantized.shape[:-2])  # one scale grid per matrix
    )


def _threads(chunks: int) -> int:
    return max(1, min(chunks, torch.get_num_threads(), os.cpu_count() or 1))


def dequantize_fp8_blocks(quantized: torch.Tensor, scales: torch.Tensor,
                          output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`Fp8Dequantize._dequantize_one(quantized, scales, output_dtype)` for a CPU float8_e4m3fn weight, bit for bit.

    `quantized [..., rows, cols]`, `scales [..., rows / bm, cols / bn]` (the block is derived from the two shapes,
    as transformers does; a 1 x 1 block is a per-element scale)."""
    rows, cols = quantized.shape[-2:]
    scale_rows, scale_cols = scales.shape[-2:]
    if rows % scale_rows or cols % scale_cols:
        raise ValueError(f"Weight shape ({rows}, {cols}) not divisible by scale grid ({scale_rows}, {scale_cols}).")
    block_m, block_n = rows // scale_rows, cols // scale_cols
    if output_dtype is None:  # transformers' default
        output_dtype = scales.dtype if scales.dtype.is_floating_point and scales.element_size() >= 2 else torch.bfloat16
    table = fp8_e4m3_table()
    codes = quantized.contiguous().view(torch.uint8).reshape(-1, block_m, scale_cols, block_n)
    factors = scales.to(torch.float32).reshape(-1, 1, scale_cols, 1)
    if factors.shape[0] != codes.shape[0]:
        raise ValueError(f"FP8 weight {tuple(quantized.shape)} and its scales {tuple(scales.shape)} disagree.")
    out = torch.empty(codes.shape, dtype=output_dtype)
    n = codes.shape[0]
    step = max(1, _CHUNK // codes[0].numel())

    def chunk(start: int) -> None:
        stop = min(start + step, n)
        values = torch.from_numpy(np.take(table, codes[start:stop].numpy()))
        values.mul_(factors[start:stop])
        out[start:stop].copy_(values)

    starts = range(0, n, step)
    threads = _threads(len(starts))
    if threads == 1:
        for s in starts:
            chunk(s)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(chunk, starts))
    return out.reshape(quantized.shape)


def _fast_dequantize_class() -> type[Any]:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    class CpuFp8Dequantize(Fp8Dequantize):
        """transformers' `Fp8Dequantize` with `dequantize_fp8_blocks` for CPU float8_e4m3fn weights (same bits).

        Also shares its quantizer when transformers' loader deep-copies the converter holding it (once per
        checkpoint key): the op keeps no state of its own, and copying the quantizer each time cost ~0.3 s per load."""

        def _dequantize_one(self, quantized: torch.Tensor, scales: torch.Tensor,
                            output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
            if fast_path(quantized, scales):
                return dequantize_fp8_blocks(quantized, scales, output_dtype)
            return super()._dequantize_one(quantized, scales, output_dtype)

        def __deepcopy__(self, memo: Any) -> Any:
            return type(self)(self.hf_quantizer)

    return CpuFp8Dequantize


_FAST_CLASS: Optional[type[Any]] = None


def with_fast_dequantize(mapping: list[Any]) -> list[Any]:
    """The conversion mapping with every transformers `Fp8Dequantize` op replaced by the CPU fast one (in place)."""
    from transformers.core_model_loading import WeightConverter
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    global _FAST_CLASS
    if _FAST_CLASS is None:
        _FAST_CLASS = _fast_dequantize_class()
    for converter in mapping:
        if not isinstance(converter, WeightConverter):
            continue
        converter.operations = [
            _FAST_CLASS(op.hf_quantizer) if type(op) is Fp8Dequantize else op for op in converter.operations
        ]
    return mapping


__all__ = ["dequantize_fp8_blocks", "fast_path", "fp8_e4m3_table", "with_fast_dequantize"]
