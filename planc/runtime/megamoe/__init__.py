"""Mega MoE on transformers experts modules: the forward install that binds a module's FP4 parameters to the
kernels of `planc.kernels.megamoe`. See docs/megamoe.md.

`install_megamoe_forward` is the entry point the apply layer uses; `destroy_megamoe_buffers` is re-exported
as `planc.destroy_megamoe_buffers`.
"""

from planc.kernels.megamoe.buffers import BufferStats, buffer_stats, destroy_megamoe_buffers
from planc.runtime.megamoe.experts import BACKENDS, install_megamoe_forward, megamoe_state, resolve_backend

__all__ = [
    "BACKENDS",
    "BufferStats",
    "buffer_stats",
    "destroy_megamoe_buffers",
    "install_megamoe_forward",
    "megamoe_state",
    "resolve_backend",
]
