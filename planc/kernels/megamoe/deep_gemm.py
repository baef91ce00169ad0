"""Binding to DeepGEMM's Mega MoE kernel (`fp8_fp4_mega_moe`, SM100 only), over local tensors.

The API is pinned to DeepGEMM main at `PINNED_COMMIT` (v2.6.1). `load_deep_gemm()` checks that the
installed module has every function with the parameters planc passes (by keyword) and names whatever is
missing, so an API drift fails at install time instead of deep inside a forward. The PyPI `deep-gemm`
package is a broken 2025 snapshot without Mega MoE: build from source (docs/megamoe.md).

`transform_weights` puts FP4 experts into the kernel's layout (`transform_sf_into_required_layout`, then
`transform_weights_for_mega_moe`: gate/up interleave and the UTCCP scale layout); the runtime does it once per
experts module and keeps only the result (`planc.runtime.megamoe.experts`). `mega_moe` is one call: quantize x
to FP8, stage x, x_sf, topk_idx, topk_weights into the shared symmetric buffer (`buffers.py`), call the kernel
with keywords.
"""

from __future__ import annotations

import importlib
import inspect
import re
from types import ModuleType

import torch

from planc.kernels.megamoe.buffers import BufferKey, get_buffer
from planc.kernels.megamoe.quant import pack_ue8m0, quantize_fp8, ue8m0_to_float
from planc.spec.megamoe import MEGAMOE_KERNEL_BLOCK

PINNED_COMMIT = "54e22612409371d6364144b69086735beb54e98b"
PINNED_VERSION = "2.6.1"

# name -> parameters planc passes by keyword (each must exist in the installed signature)
REQUIRED_API: dict[str, tuple[str, ...]] = {
    "get_symm_buffer_for_mega_moe": (
        "group", "num_experts", "num_max_tokens_per_rank", "num_topk", "hidden", "intermediate_hidden",
    ),
    "transform_weights_for_mega_moe": ("l1_weights", "l2_weights"),
    "transform_sf_into_required_layout": ("sf", "mn", "k", "recipe", "num_groups"),
    "fp8_fp4_mega_moe": ("y", "l1_weights", "l2_weights", "sym_buffer", "activation_clamp"),
}

_BUILD_HINT = (
    f"build DeepGEMM from source at commit {PINNED_COMMIT[:7]} (see docs/megamoe.md; the PyPI `deep-gemm` "
    "package is not it), or set `experts.megamoe.backend: reference`"
)


def parameter_names(fn) -> set[str] | None:
    """Parameter names of a Python function or a pybind11 function (from its docstring signature)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    doc = (getattr(fn, "__doc__", None) or "").strip()
    match = re.match(r"[\w.]+\((.*?)\)\s*(->|$|\n)", doc)
    if match is None:
        return None
    return set(re.findall(r"(\w+)\s*:", match.group(1)))


def check_deep_gemm_api(module) -> None:
    """Raise ImportError naming each missing function or keyword parameter of the pinned API."""
    problems = []
    for name, params in REQUIRED_API.items():
        fn = getattr(module, name, None)
        if fn is None or not callable(fn):
            problems.append(f"`deep_gemm.{name}` is missing")
            continue
        found = parameter_names(fn)
        if found is None:
            problems.append(f"the signature of `deep_gemm.{name}` cannot be read")
            continue
        missing = [p for p in params if p not in found]
        if missing:
            problems.append(f"`deep_gemm.{name}` has no parameter(s) {', '.join(missing)}")
    if problems:
        version = getattr(module, "__version__", "unknown version")
        raise ImportError(
            f"the installed deep_gemm ({version}) does not match the Mega MoE API planc is pinned to "
            f"(DeepGEMM {PINNED_VERSION}, {PINNED_COMMIT[:7]}): {'; '.join(problems)}. Fix: {_BUILD_HINT}."
        )


def load_deep_gemm() -> ModuleType:
    """Import `deep_gemm` and check its Mega MoE API."""
    try:
        module = importlib.import_module("deep_gemm")
    except (ImportError, AssertionError, NameError) as e:
        # deep_gemm asserts a CUDA toolkit at import (AssertionError) and hits a NameError when its
        # symmetric-memory import failed: both mean "cannot run here", like a missing package.
        raise ImportError(f"`deep_gemm` cannot be imported ({type(e).__name__}: {e}). Fix: {_BUILD_HINT}.") from e
    check_deep_gemm_api(module)
    return module


def device_capability_text(device: torch.device | None = None) -> str:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}, compute capability sm_{major}{minor}"


def check_device(device: torch.device | None = None) -> None:
    """The kernel runs only on SM100-class GPUs (arch major 10: B200, B300, GB200, GB300)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] != 10:
        raise RuntimeError(
            f"the deep_gemm Mega MoE kernel needs an SM100 GPU (compute capability 10.x: B200/B300/GB200/GB300); "
            f"this device is {device_capability_text(device)}. Use `experts.megamoe.backend: reference` "
            "(the pure-PyTorch implementation, much slower) on this machine."
        )


def deep_gemm_unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when the kernel can run here, else why not (for the `auto` backend's error)."""
    try:
        check_device(device)
        load_deep_gemm()
    except (ImportError, RuntimeError) as e:
        return str(e)
    return None


def kernel_size_problem(hidden: int, intermediate: int) -> str | None:
    """Why the kernel cannot run these sizes (host checks % 128, block alignment % 256), or None."""
    bad = [f"{n}={v}" for n, v in (("hidden", hidden), ("intermediate", intermediate)) if v % MEGAMOE_KERNEL_BLOCK]
    if not bad:
        return None
    return (f"the deep_gemm Mega MoE kernel needs hidden and intermediate sizes divisible by {MEGAMOE_KERNEL_BLOCK} "
            f"(host checks % 128; H/128 even; BLOCK_K {MEGAMOE_KERNEL_BLOCK} at decode), got {', '.join(bad)}")


def transform_weights(dg: ModuleType, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                      down_scale: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """FP4 experts (int8 ``[E, 2I, H/2]`` / ``[E, H, I/2]`` with UE8M0 scales per 32) -> the kernel's
    ``(l1_weights, l2_weights)``, each a (weights, scales) pair in its layout."""
    e, two_i, half_h = gate_up.shape
    h, i = 2 * half_h, two_i // 2
    sf1 = ue8m0_to_float(gate_up_scale).contiguous()  # float32 [E, 2I, H/32]
    sf2 = ue8m0_to_float(down_scale).contiguous()  # float32 [E, H, I/32]
    sf1 = dg.transform_sf_into_required_layout(sf=sf1, mn=2 * i, k=h, recipe=(1, 32), num_groups=e)
    sf2 = dg.transform_sf_into_required_layout(sf=sf2, mn=h, k=i, recipe=(1, 32), num_groups=e)
    return dg.transform_weights_for_mega_moe(
        l1_weights=(gate_up.contiguous(), sf1), l2_weights=(down.contiguous(), sf2)
    )


def mega_moe(dg, l1, l2, hidden_states, top_k_index, top_k_weights, group, *, num_experts: int, intermediate: int,
             activation_clamp, max_tokens_per_rank) -> torch.Tensor:
    """One Mega MoE call (dispatch, both GEMMs and the combine) over `group`: BF16 ``[n, H]`` for this rank."""
    n, hidden = hidden_states.shape
    num_topk = top_k_index.shape[1]
    key = BufferKey("deep_gemm", group.group_name, hidden, num_topk, num_experts, intermediate)

    def allocate(capacity):
        buf = dg.get_symm_buffer_for_mega_moe(
            group=group, num_experts=num_experts, num_max_tokens_per_rank=capacity,
            num_topk=num_topk, hidden=hidden, intermediate_hidden=intermediate,
        )
        return buf, buf.buffer.nbytes, buf.destroy

    buf = get_buffer(
        key, n, group=group, allocate=allocate, max_tokens_per_rank=max_tokens_per_rank, device=hidden_states.device,
    )
    if n == 0:
        # The kernel gets at least one row, as transformers does: a padding row with no valid slot, whose
        # output is dropped. Every rank still enters the collective kernel.
        out = mega_moe(dg, l1, l2, hidden_states.new_zeros((1, hidden)), top_k_index.new_full((1, num_topk), -1),
                       top_k_weights.new_zeros((1, num_topk)), group, num_experts=num_experts,
                       intermediate=intermediate, activation_clamp=activation_clamp,
                       max_tokens_per_rank=max_tokens_per_rank)
        return out[:0]
    x_fp8, x_sf = quantize_fp8(hidden_states)
    buf.x[:n].copy_(x_fp8)
    buf.x_sf[:n].copy_(pack_ue8m0(x_sf))
    buf.topk_idx[:n].copy_(top_k_index)
    buf.topk_weights[:n].copy_(top_k_weights)
    y = torch.empty((n, hidden), dtype=torch.bfloat16, device=hidden_states.device)
    dg.fp8_fp4_mega_moe(y=y, l1_weights=l1, l2_weights=l2, sym_buffer=buf, activation_clamp=activation_clamp)
    return y
