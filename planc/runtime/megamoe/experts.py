"""Installs the Mega MoE forward on a transformers experts module (and takes it off again).

After `install_megamoe_forward(...)` the module's forward is
``forward(hidden_states [n, H], top_k_index [n, K] global ids (-1 = skip), top_k_weights [n, K],
process_group=EP group) -> [n, H]``: the whole MoE for this rank's tokens, dispatch and combine
included (the caller must not all-reduce). The `MegaMoeEP` runtime is the caller that `planc.apply`
installs; it passes the EP group.

The install is all or nothing and returns an `uninstall()` (`Snapshot.restore` of the module, the same
rollback path `planc.apply` uses for the whole model) that puts back the original parameters and forward.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from planc.kernels.megamoe.quant import quantize_experts_fp4
from planc.runtime.megamoe.runners import FP4_PARAMS, RUNNERS, describe_experts
from planc.runtime.collectives import to_local
from planc.runtime.snapshot import Snapshot
from planc.spec.choices import MEGAMOE_BACKENDS, MEGAMOE_MATH

BACKENDS = tuple(MEGAMOE_BACKENDS)  # the names of the table's rows: `auto` first, then the backends it picks from
_STATE = "_planc_megamoe"


def choose_backend(backend: str, device: torch.device | None = None, sizes: tuple[int, int] | None = None,
                   math: str = "auto") -> tuple[str, str]:
    """The backend that will run and why. A backend the plan names must run here (its runner raises why not) and
    multiply as `math` says (`experts.megamoe.math`). The `per_device` row (`auto`) takes the first of the other rows,
    in table order, whose runner can run here (and `sizes` = (hidden, intermediate)) and multiply so: deep_gemm on
    SM100, else Triton on a CUDA GPU of sm_90 or newer, else the `slow_fallback` reference, with a warning naming the
    slowdown."""
    row = MEGAMOE_BACKENDS.get(backend)
    if row is None:
        raise ValueError(f"unknown Mega MoE backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if math not in MEGAMOE_MATH:
        raise ValueError(f"unknown `experts.megamoe.math` {math!r}: use one of {', '.join(MEGAMOE_MATH)}")
    bf16_only = math == "bf16"
    if not row.per_device:
        if bf16_only and not row.bf16_math:
            raise ValueError(f"`experts.megamoe.backend: {backend}` multiplies in FP8, not as `math: bf16` asks: use "
                             f"`backend: triton` or `reference`, or `math: auto`")
        RUNNERS[backend].check_runs_here(device, sizes)
        return backend, f"`experts.megamoe.backend: {backend}` in the plan"
    skipped: list[str] = []
    for name, candidate in MEGAMOE_BACKENDS.items():
        if candidate.per_device:
            continue
        runner = RUNNERS[name]
        why = ("it multiplies in FP8, not as `math: bf16` asks" if bf16_only and not candidate.bf16_math
               else runner.why_not_here(candidate, device, sizes))
        if why is not None:
            skipped.append(f"no {runner.LABEL} ({why})")
            continue
        reason = f"auto: {' and '.join(skipped)}; {runner.CHOSEN}" if skipped else f"auto: {runner.CHOSEN}"
        if candidate.slow_fallback:
            warnings.warn(f"Mega MoE backend {reason}. Set `experts.megamoe.backend: {name}` to silence this.",
                          RuntimeWarning, stacklevel=3)
        return name, reason
    raise RuntimeError(f"no Mega MoE backend can run here: {'; '.join(skipped)}")


def resolve_backend(backend: str, device: torch.device | None = None, math: str = "auto") -> str:
    """The backend name `choose_backend` picks (raises where an explicitly named backend cannot run)."""
    return choose_backend(backend, device, math=math)[0]


@dataclass
class MegaMoeState:
    """What the installed forward needs; stored on the module as `_planc_megamoe`. `reason` says why this
    backend runs (the plan named it, or what `auto` found)."""

    backend: str
    num_experts: int
    ep_rank: int
    ep_size: int
    activation_clamp: float | None
    runner: Callable[..., torch.Tensor]
    reason: str = ""


def megamoe_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, process_group: Any = None) -> torch.Tensor:
    """The experts forward planc installs (bound to the experts module)."""
    state: MegaMoeState = getattr(self, _STATE)
    if process_group is None:
        raise ValueError(
            "the Mega MoE experts forward needs the EP process group as `process_group=` (its buffers and its "
            "dispatch/combine run over it). `planc.apply` supplies it through the MegaMoeEP runtime; when calling "
            "the experts directly, pass the EP group (a one-rank group for a single process)."
        )
    if process_group.size() != state.ep_size or process_group.rank() != state.ep_rank:
        raise ValueError(
            f"the experts were installed for EP rank {state.ep_rank} of {state.ep_size}, but `process_group` is "
            f"rank {process_group.rank()} of {process_group.size()}: pass the EP group they were sharded over"
        )
    if torch.is_grad_enabled() and hidden_states.requires_grad:
        raise RuntimeError(
            "Mega MoE is inference only (the kernel has no backward): run under `torch.no_grad()` or "
            "`torch.inference_mode()`, or use `experts.ep_implementation: all_to_all` for training"
        )
    y = state.runner(hidden_states, top_k_index, top_k_weights.float(), process_group)
    return y.to(hidden_states.dtype)


def install_megamoe_forward(
    experts: nn.Module,
    *,
    backend: str = "auto",
    max_tokens_per_rank: int | None = None,
    activation_clamp: float | None = None,
    quantize: str | None = None,
    math: str = "auto",
    num_global_experts: int | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    config: Any = None,
    device: torch.device | None = None,
) -> Callable[[], None]:
    """Give `experts` the Mega MoE forward; return `uninstall()`, which restores it exactly.

    - `experts` holds this rank's `E_loc = num_global_experts / ep_size` experts (global ids
      ``[ep_rank * E_loc, (ep_rank + 1) * E_loc)``), as FP4 (see `quant.py` for the layout) or as
      bf16/fp32 ``gate_up_proj [E_loc, 2I, H]``, ``down_proj [E_loc, H, I]`` with ``quantize="fp4"``,
      which quantizes them here, at install time.
    - `backend`: ``"deep_gemm"``, ``"triton"``, ``"reference"`` or ``"auto"`` (deep_gemm on SM100, Triton on
      sm_90+, else the reference with a warning); `megamoe_state(experts).reason` says which and why.
    - `activation_clamp`: the SwiGLU clamp c; None -> ``config.swiglu_limit`` if set, else unclamped.
      `config` defaults to ``experts.config``.
    - `max_tokens_per_rank`: fixed buffer size; None -> the next power of two of the tokens per rank.
    - `math`: ``"auto"`` (the backend's choice: Triton on Hopper multiplies prefill-sized batches in FP8) or
      ``"bf16"`` (BF16 MMAs at every batch; the Triton backend then holds one layout of the FP4 experts).
    - `device`: the GPU the kernel runs on, for the backend checks (default: the weights' device, else
      the current CUDA device).

    The returned `uninstall()` holds the original parameters: drop it once the install is committed so
    quantized-away bf16 weights are freed.
    """
    where = describe_experts(experts)
    if getattr(experts, _STATE, None) is not None:
        raise RuntimeError(f"{where} already has the Mega MoE forward installed")
    for attr in ("gate_up_proj", "down_proj"):
        if getattr(experts, attr, None) is None:
            raise TypeError(
                f"{where} has no `{attr}`: Mega MoE needs concatenated gate|up experts "
                "(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`)"
            )
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_gate", True) is False:
        raise NotImplementedError(
            f"{where} stores transposed or gate-less experts; the Mega MoE kernel computes "
            "SwiGLU over `gate_up_proj [E, 2I, H]` with rows [gate | up]: use another experts implementation"
        )
    for bias in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(experts, bias, None) is not None:
            raise NotImplementedError(
                f"{where} has `{bias}`; the Mega MoE kernel has no expert biases: use another "
                "experts implementation"
            )
    if quantize not in (None, "none", "fp4"):
        raise ValueError(f"unknown `experts.megamoe.quantize` {quantize!r}: use `fp4` or leave it unset")
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"invalid EP rank {ep_rank} of {ep_size}")

    gate_up = to_local(experts.gate_up_proj)
    if device is None and gate_up.device.type == "cuda":
        device = gate_up.device
    two_i, h = gate_up.shape[1], gate_up.shape[2] * (2 if gate_up.dtype == torch.int8 else 1)
    resolved, reason = choose_backend(backend, device, (h, two_i // 2), math)

    # Decide the FP4 parameters without touching the module yet.
    if gate_up.dtype == torch.int8:
        missing = [n for n in ("gate_up_proj_scale_inv", "down_proj_scale_inv") if getattr(experts, n, None) is None]
        if missing:
            raise ValueError(
                f"{where} has FP4 (int8) experts but no {', '.join(missing)}: FP4 experts need "
                "their UE8M0 scales per 32 (see docs/megamoe.md for the layout)"
            )
        new_params = {}
    elif quantize == "fp4":
        if gate_up.is_meta:
            raise ValueError("cannot quantize experts on the meta device: load the weights first")
        q = quantize_experts_fp4(gate_up, to_local(experts.down_proj))
        new_params = {name: getattr(q, name) for name in FP4_PARAMS}
    else:
        raise NotImplementedError(
            f"Mega MoE runs FP4 experts (int8 `gate_up_proj` with UE8M0 scales), but "
            f"the `gate_up_proj` of {where} is {gate_up.dtype}. Set `experts.megamoe.quantize: fp4` to "
            "quantize the experts at apply time, or load an FP4 checkpoint."
        )

    num_local = (new_params.get("gate_up_proj", gate_up)).shape[0]
    if num_global_experts is None:
        num_global_experts = num_local * ep_size
    if num_local * ep_size != num_global_experts:
        raise ValueError(
            f"{where} holds {num_local} experts, but {num_global_experts} global experts over "
            f"{ep_size} EP ranks means {num_global_experts // ep_size if num_global_experts % ep_size == 0 else '?'} "
            "per rank: shard the expert dimension (`grouped_gemm`) before installing the Mega MoE forward"
        )

    if activation_clamp is None:
        cfg = config if config is not None else getattr(experts, "config", None)
        activation_clamp = getattr(cfg, "swiglu_limit", None)
    if activation_clamp is not None:
        activation_clamp = float(activation_clamp)
        if not activation_clamp >= 0:
            raise ValueError(f"`activation_clamp` must be >= 0 (the kernel clamps to [-c, c]), got {activation_clamp}")

    # Mutate; the one rollback path (planc.runtime.snapshot) puts back everything on failure.
    snapshot = Snapshot(experts)
    try:
        set_fp4_parameters(experts, new_params)
        runner = RUNNERS[resolved](experts, num_global_experts, activation_clamp, max_tokens_per_rank, math)
        experts.__dict__[_STATE] = MegaMoeState(
            resolved, num_global_experts, ep_rank, ep_size, activation_clamp, runner, reason
        )
        experts.__dict__["forward"] = types.MethodType(megamoe_forward, experts)
    except BaseException:
        snapshot.restore()
        raise
    return snapshot.restore


def set_fp4_parameters(experts: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put FP4 experts tensors (`FP4_PARAMS` names, this rank's experts) on the module in place of its own."""
    for name, tensor in tensors.items():
        if name in experts._parameters:
            del experts._parameters[name]
        elif hasattr(experts, name):
            delattr(experts, name)
        experts.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def quantize_to_fp4(experts: nn.Module) -> None:
    """Replace bf16/fp32 `gate_up_proj`/`down_proj` (local shards) by FP4 ones; planc.load calls it per layer as
    the layer's weights arrive, so no rank ever holds more than one layer's unquantized experts."""
    q = quantize_experts_fp4(to_local(experts.gate_up_proj).detach(), to_local(experts.down_proj).detach())
    set_fp4_parameters(experts, {name: getattr(q, name) for name in FP4_PARAMS})


def megamoe_state(experts: nn.Module) -> MegaMoeState | None:
    """The installed Mega MoE state of an experts module, or None."""
    return getattr(experts, _STATE, None)
