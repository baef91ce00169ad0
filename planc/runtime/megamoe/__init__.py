"""Mega MoE kernel layer: FP8/FP4 quantization, the pure-PyTorch reference backend, the deep_gemm binding,
and the buffer cache they share. See docs/megamoe.md.

`install_megamoe_forward` is the entry point the apply layer uses; `destroy_megamoe_buffers` is re-exported
as `planc.destroy_megamoe_buffers`.
"""

from planc.runtime.megamoe.buffers import BufferStats, buffer_stats, destroy_megamoe_buffers
from planc.runtime.megamoe.experts import BACKENDS, install_megamoe_forward, megamoe_state, resolve_backend
from planc.runtime.megamoe.quant import (
    FP4Experts,
    calc_diff,
    dequantize_experts_fp4,
    dequantize_fp4,
    dequantize_fp8,
    quantize_experts_fp4,
    quantize_fp4,
    quantize_fp8,
)
from planc.runtime.megamoe.reference import DequantizedExperts, reference_mega_moe

__all__ = [
    "BACKENDS",
    "BufferStats",
    "DequantizedExperts",
    "FP4Experts",
    "buffer_stats",
    "calc_diff",
    "dequantize_experts_fp4",
    "dequantize_fp4",
    "dequantize_fp8",
    "destroy_megamoe_buffers",
    "install_megamoe_forward",
    "megamoe_state",
    "quantize_experts_fp4",
    "quantize_fp4",
    "quantize_fp8",
    "reference_mega_moe",
    "resolve_backend",
]
