"""What the installed Triton and the device offer the kernels: whether they run here (and why not), whether they
run under Triton's CPU interpreter, version-dependent lowering, the SM count the tuned table assumes."""

from __future__ import annotations

import torch

try:  # Triton ships with torch's CUDA builds; CPU CI installs it for the interpreter (TRITON_INTERPRET=1).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _probe():
        """A kernel defined with the others: its type says whether `triton.jit` made interpreted functions."""


def interpreting() -> bool:
    """Whether the kernels were defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import time:
    `triton.jit` decides when it decorates)."""
    return triton is not None and type(_probe).__name__ == "InterpretedFunction"


def triton_unavailable_reason(device: torch.device | None) -> str | None:
    """None when the Triton backend can run on `device`, else why not."""
    if triton is None:
        return "the `triton` package is not installed (it ships with torch's CUDA builds: `pip install triton`)"
    if interpreting():
        return None  # Triton's CPU interpreter (TRITON_INTERPRET=1 when planc was imported): runs anywhere, slowly
    if torch.version.hip is not None:  # ROCm reports `cuda` devices and capabilities such as (9, 4) on MI300
        return (f"a ROCm build of torch (HIP {torch.version.hip}): the Triton kernels are written against NVIDIA's "
                "PTX (inline conversions, wgmma)")
    if device is not None and device.type != "cuda":
        return f"the weights are on {device.type} (Triton kernels need a CUDA GPU; TRITON_INTERPRET=1 runs them on CPU)"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"compute capability sm_{major}x has no BF16 MMA (the Triton backend needs sm_80 or newer)"
    return None


def _triton_at_least(major: int, minor: int) -> bool:
    """Whether the installed Triton is `major.minor` or newer (how it lowers a loop is version-specific)."""
    try:
        found = tuple(int(v) for v in triton.__version__.split(".")[:2])
    except ValueError:  # pragma: no cover - an unparsable (source build) version: assume the newer lowering
        return True
    return found >= (major, minor)


# How the two GEMM loops stream the weights (the kernels' `PREFETCH`, per config `KernelConfig.prefetch`). Each
# program loads the next K tile's words, scale words and activations into registers while it expands and multiplies
# this one: the weights never pass through shared memory, and the loop has none of the cp.async pipeline's stage
# bookkeeping (sm_90 SASS, L1 / L2 loop per thread: 181 / 104 instructions against 245 / 150 under Triton 3.7.1;
# decode batches are issue-bound, and the V4 experts computation runs 3-13% faster; the same bits). It needs Triton
# to keep the loop-carried words in the layout they were loaded in, the MMA operand's (`jit`'s `_fp4_offsets`): 3.5
# and later do; 3.3 and 3.4 still move part of each tile through shared memory, so they keep Triton's software
# pipeline (`num_stages` cp.async buffers; `num_stages` means nothing to the prefetch loop).
REGISTER_PREFETCH = triton is not None and _triton_at_least(3, 5)

# Programmatic dependent launch (`KernelConfig.pdl`): a kernel launched with it may start while the kernel before it
# on the stream still runs, and waits (`griddepcontrol.wait`) before it touches memory that kernel wrote. Hopper
# (sm_90) and later; Triton exposes it from 3.4 (`gdc_wait`, `launch_pdl`).
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton (or none): no kernel asks for it there
    gdc_launch_dependents = gdc_wait = None


def pdl_available(device: torch.device) -> bool:
    """Whether a kernel can be launched with programmatic dependent launch on `device`: compiled (not interpreted),
    a Triton that has it, sm_90 or later."""
    return (gdc_wait is not None and not interpreting() and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (9, 0))


TUNED_SMS = 132  # the H200 the table was tuned on (`config`): the SM count assumed off the GPU (the interpreter)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (a cached host property: no sync); `TUNED_SMS` off the GPU (the interpreter)."""
    if device.type != "cuda":
        return TUNED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def has_fp8_mma(device: torch.device) -> bool:
    """Whether `device` multiplies e4m3 operands on its tensor cores (sm_89 and newer; not the interpreter, where a
    config asks for the FP8 path explicitly)."""
    if device.type != "cuda" or interpreting() or triton_unavailable_reason(device) is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)
