"""How each Mega MoE backend runs one experts module: which kernels it calls and how it binds the module's FP4
parameters to them (the reference dequantizes a copy once, Triton and deep_gemm put the parameters into their
kernels' layout in place on the first forward), and whether it can run here (`check_runs_here` for a backend the plan
names, `why_not_here` for `auto`'s choice). `experts.install_megamoe_forward` picks one and installs it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from planc.kernels.megamoe import deep_gemm
from planc.kernels.megamoe.quant import SCALE_DTYPE
from planc.kernels.megamoe import reference
from planc.kernels.megamoe.reference import DequantizedExperts, compute_dtype_for, reference_mega_moe
from planc.kernels.megamoe.triton import forward, layout, target
from planc.runtime.collectives import to_local
from planc.spec.choices import MEGAMOE_BACKENDS, MEGAMOE_MATH, MegaMoeBackend

Sizes = tuple[int, int]  # (hidden, intermediate) of the experts, when known

FP4_PARAMS = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")


def describe_experts(experts: nn.Module) -> str:
    """The experts module for error messages: its path in the model (set by `planc.apply`) and its class."""
    fqn = getattr(experts, "_planc_fqn", None)
    return f"{fqn} ({type(experts).__name__})" if fqn else type(experts).__name__


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` are one device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


@dataclass
class _StagedRunner:
    """One module's Mega MoE call through the reference staging, dispatch and combine; the backends differ
    only in the weights they hand it (`weights`) and the local experts computation (`_local_forward`)."""

    module: nn.Module
    num_experts: int
    activation_clamp: float | None
    max_tokens_per_rank: int | None
    math: str = "auto"  # `experts.megamoe.math` (planc.spec.choices.MEGAMOE_MATH)

    def weights(self, device: torch.device) -> DequantizedExperts | layout.PackedExperts:
        raise NotImplementedError

    def _local_forward(self) -> dict[str, Any]:
        return {}

    def staged_kernels(self) -> tuple[Any, Any, Any]:
        """(stage, local experts forward, combine): the three steps this backend runs around the dispatch, with
        `reference`'s signatures (`planc verify`'s kernel stages run them on one rank's share of a layer)."""
        kw = self._local_forward()
        return (kw.get("stage_fn") or reference.stage, kw.get("local_forward", reference.local_experts_forward),
                kw.get("combine_fn") or reference.combine)

    # What `auto` says of this backend (experts.choose_backend): its name in "no <LABEL> (why)", and why it runs.
    LABEL = ""
    CHOSEN = ""

    @classmethod
    def check_runs_here(cls, device: torch.device | None, sizes: Sizes | None) -> None:
        """Raise why the plan's backend cannot run on `device` (for these sizes); the base runs anywhere."""

    @classmethod
    def why_not_here(cls, row: MegaMoeBackend, device: torch.device | None, sizes: Sizes | None) -> str | None:
        """Why `auto` cannot pick this backend (its `row` of MEGAMOE_BACKENDS) here, or None."""
        return None

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 process_group: Any) -> torch.Tensor:
        return reference_mega_moe(
            hidden_states, top_k_index, top_k_weights, self.weights(hidden_states.device),
            num_experts=self.num_experts,
            group=process_group,
            activation_clamp=self.activation_clamp,
            max_tokens_per_rank=self.max_tokens_per_rank,
            **self._local_forward(),
        )


@dataclass
class ReferenceRunner(_StagedRunner):
    """The reference backend for one module: dequantizes its FP4 weights once (per device) and runs."""

    _cache: DequantizedExperts | None = field(default=None, repr=False)

    LABEL = "reference"
    CHOSEN = "the pure-PyTorch reference runs instead, about 5-100x slower, holding a BF16 copy of the experts"

    def weights(self, device: torch.device) -> DequantizedExperts:
        if self._cache is None or self._cache.gate_up.device != device:
            self._cache = None  # free the old copy first
            m = self.module
            p = {name: to_local(getattr(m, name)).detach().to(device) for name in FP4_PARAMS}
            self._cache = DequantizedExperts.from_fp4(
                p["gate_up_proj"], p["gate_up_proj_scale_inv"], p["down_proj"], p["down_proj_scale_inv"],
                compute_dtype_for(device),
            )
        return self._cache


# Marks on an experts module, kept in its __dict__: `nn.Module.__setattr__` is typed for tensors and modules only.
WEIGHT_LAYOUT = "_planc_megamoe_weight_layout"  # which kernels' layout its FP4 parameters hold, once transformed
LARGE_SCALES = "_planc_megamoe_large_scales"  # Triton layout: whether a scale byte is above 128
TRITON_LAYOUT = "triton"  # `module.<WEIGHT_LAYOUT>` once its FP4 parameters hold the Triton layout


@dataclass
class TritonRunner(_StagedRunner):
    """The Triton backend for one module: on its first forward, the module's FP4 parameters are put into the kernels'
    layout (`layout.shuffle_fp4`: the same e2m1 and UE8M0 bytes in MMA-fragment order, same dtypes and
    shapes, so no copy stays); the kernels then read them where they are."""

    _cache: tuple[tuple[int, ...], layout.PackedExperts] | None = field(default=None, repr=False)

    LABEL = "Triton backend"
    CHOSEN = "Triton on sm_90+ keeps the FP4 weights packed"

    def _local_forward(self) -> dict[str, Any]:
        local = forward.triton_local_experts_forward
        if not MEGAMOE_MATH[self.math].fp8_layout:  # the tables without the FP8 path's rows: its layout is never made
            local = functools.partial(local, fp8_path=False)
        return dict(local_forward=local, backend="triton", combine_fn=forward.combine, stage_fn=forward.stage)

    @staticmethod
    def _problem(device: torch.device | None, sizes: Sizes | None) -> str | None:
        """Why the Triton kernels cannot run these experts here (no Triton or GPU for it, or sizes it does not tile)."""
        reason = target.triton_unavailable_reason(device)
        if reason is None and sizes is not None:
            reason = layout.size_problem(*sizes)
        return reason

    @classmethod
    def check_runs_here(cls, device: torch.device | None, sizes: Sizes | None) -> None:
        reason = cls._problem(device, sizes)
        if reason is not None:
            raise RuntimeError(
                f"the Triton Mega MoE backend cannot run here: {reason}. Use `experts.megamoe.backend: reference` "
                "(pure PyTorch) on this machine."
            )

    @classmethod
    def why_not_here(cls, row: MegaMoeBackend, device: torch.device | None, sizes: Sizes | None) -> str | None:
        """As `check_runs_here`, and `auto` takes it only on a CUDA GPU of the row's compute capability."""
        reason = cls._problem(device, sizes)
        if reason is not None:
            return reason
        need = row.min_capability or (0, 0)
        if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
            return "no CUDA device"
        have = torch.cuda.get_device_capability(device)
        return None if have >= need else "sm_{}{} is older than sm_{}{}".format(*have, *need)

    def _shuffle_module(self) -> bool:
        """Replace the module's FP4 parameters by the same bytes in the kernels' layout; returns `large_scales`.
        One host read (any scale byte above 128?): the first forward is not capturable, like Triton's compile."""
        m = self.module
        p = {name: to_local(getattr(m, name)).detach() for name in FP4_PARAMS}
        w1, s1 = layout.shuffle_fp4(p["gate_up_proj"].contiguous().view(torch.uint8),
                                    layout.exponent_bytes(p["gate_up_proj_scale_inv"]))
        w2, s2 = layout.shuffle_fp4(p["down_proj"].contiguous().view(torch.uint8),
                                    layout.exponent_bytes(p["down_proj_scale_inv"]))
        large = layout.has_large_scales(s1, s2)
        scale_dtype = SCALE_DTYPE if SCALE_DTYPE != torch.float32 else torch.uint8
        for name, tensor in (("gate_up_proj", w1.view(torch.int8)), ("gate_up_proj_scale_inv", s1.view(scale_dtype)),
                             ("down_proj", w2.view(torch.int8)), ("down_proj_scale_inv", s2.view(scale_dtype))):
            setattr(m, name, nn.Parameter(tensor, requires_grad=False))
        m.__dict__[WEIGHT_LAYOUT] = TRITON_LAYOUT
        m.__dict__[LARGE_SCALES] = large
        return large

    def weights(self, device: torch.device) -> layout.PackedExperts:
        m = self.module
        self._check_device(device)
        if getattr(m, WEIGHT_LAYOUT, None) != TRITON_LAYOUT:
            self._shuffle_module()
        p = [to_local(getattr(m, name)).detach() for name in FP4_PARAMS]
        key = tuple(t.data_ptr() for t in p)
        if self._cache is None or self._cache[0] != key:  # views of the parameters, rebuilt if they move
            w1, s1, w2, s2 = p
            self._cache = (key, layout.PackedExperts(
                w1.view(torch.int32), s1.view(torch.uint8), w2.view(torch.int32), s2.view(torch.uint8),
                bool(getattr(m, LARGE_SCALES, True)),
            ))
        return self._cache[1]

    def _check_device(self, device: torch.device) -> None:
        w = to_local(self.module.gate_up_proj)
        if not _same_device(w.device, torch.device(device)):
            raise ValueError(
                f"the FP4 experts of {describe_experts(self.module)} are on {w.device} but the tokens on {device}: the "
                "Triton backend reads the weights where they are (no copy); move the model to the tokens' device"
            )


class DeepGemmRunner:
    """The deep_gemm backend for one module: on its first forward the module's FP4 parameters are replaced by the
    kernel-layout tensors (`deep_gemm.transform_weights`), as transformers does, so the weights are not held twice."""

    LABEL = "deep_gemm"
    CHOSEN = "deep_gemm imports with the pinned API and the GPU is SM100"

    @classmethod
    def check_runs_here(cls, device: torch.device | None, sizes: Sizes | None) -> None:
        """An SM100 GPU and the pinned deep_gemm API (the sizes are checked when a module is bound)."""
        deep_gemm.check_device(device)
        deep_gemm.load_deep_gemm()

    @classmethod
    def why_not_here(cls, row: MegaMoeBackend, device: torch.device | None, sizes: Sizes | None) -> str | None:
        reason = deep_gemm.deep_gemm_unavailable_reason(device)
        if reason is None and sizes is not None:
            reason = deep_gemm.kernel_size_problem(*sizes)
        return reason

    def __init__(self, module: nn.Module, num_experts: int, activation_clamp: float | None,
                 max_tokens_per_rank: int | None, math: str = "auto") -> None:
        # `math`: the kernel multiplies in FP8 whatever it says (`choose_backend` refuses `bf16` for this row)
        self.module = module
        self.num_experts = num_experts
        self.activation_clamp = activation_clamp
        self.max_tokens_per_rank = max_tokens_per_rank
        self.dg = deep_gemm.load_deep_gemm()
        two_i, half_h = to_local(module.gate_up_proj).shape[1:]
        self.intermediate, self.hidden = two_i // 2, 2 * half_h
        problem = deep_gemm.kernel_size_problem(self.hidden, self.intermediate)
        if problem is not None:
            raise ValueError(f"{problem}; use `experts.megamoe.backend: triton` (or `reference`)")
        # The kernel-layout (weights, scales) pairs of L1 and L2, once `transform_weights` ran.
        self.l1: tuple[torch.Tensor, torch.Tensor] | None = None
        self.l2: tuple[torch.Tensor, torch.Tensor] | None = None

    def transform_weights(self) -> None:
        """FP4 weights -> the kernel's layout, once; the module's parameters then hold that layout."""
        m = self.module
        self.l1, self.l2 = deep_gemm.transform_weights(
            self.dg, *(to_local(getattr(m, name)) for name in FP4_PARAMS))
        for name, tensor in zip(FP4_PARAMS, (*self.l1, *self.l2)):
            setattr(m, name, nn.Parameter(tensor, requires_grad=False))
        m.__dict__[WEIGHT_LAYOUT] = "deep_gemm"

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 process_group: Any) -> torch.Tensor:
        if self.l1 is None:
            self.transform_weights()
        return deep_gemm.mega_moe(
            self.dg, self.l1, self.l2, hidden_states, top_k_index, top_k_weights, process_group,
            num_experts=self.num_experts, intermediate=self.intermediate, activation_clamp=self.activation_clamp,
            max_tokens_per_rank=self.max_tokens_per_rank,
        )


# One runner per backend row of planc.spec.choices.MEGAMOE_BACKENDS (the `per_device` row, `auto`, picks one of them).
RUNNERS: dict[str, type[ReferenceRunner] | type[TritonRunner] | type[DeepGemmRunner]] = {
    "deep_gemm": DeepGemmRunner,
    "triton": TritonRunner,
    "reference": ReferenceRunner,
}


def _check_registry() -> None:
    """Fail at import if the runners and the backend rows drift apart (a backend with no runner, or the reverse)."""
    want = {b.name for b in MEGAMOE_BACKENDS.values() if not b.per_device}
    if set(RUNNERS) != want:
        raise ImportError(
            f"planc.runtime.megamoe.runners: runners {sorted(set(RUNNERS) ^ want)} differ from "
            "planc.spec.choices.MEGAMOE_BACKENDS; add the runner or the row"
        )


_check_registry()
