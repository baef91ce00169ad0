"""Checks of experts that run the Mega MoE kernel (`implementation: deepgemm_megamoe`): gate layout, top-k,
ranks, activation, kernel block alignment, FP4 weights."""

from __future__ import annotations

from planc.compiler.compiled import CompileWarning
from planc.compiler.context import key_where, Resolution
from planc.compiler.walk import ModuleInfo, generic_path
from planc.spec.choices import MEGAMOE_BACKENDS
from planc.spec.megamoe import MEGAMOE_KERNEL_BLOCK
from planc.spec.model import MegaMoe
from planc.compiler import rule_examples as ex
from planc.lint.diagnostic import WARNING
from planc.lint.registry import compile_rule


MEGAMOE_NO_GATE = compile_rule(
    "PLC608", "megamoe-needs-gated-experts", "Mega MoE on experts with no gate, or with transposed weights",
    "The Mega MoE kernel computes SwiGLU over [gate | up] rows of gate_up_proj [E, 2I, H]; gpt_oss stores its "
    "experts transposed, so it runs `implementation: grouped_mm`.",
    "version: 1\nmodel: {type: gpt_oss}\nparallel: {tp_size: 2, ep_size: 2}\n"
    + ex.EP.replace("{gate_up_proj,down_proj}", "{gate_up_proj,down_proj,gate_up_proj_bias,down_proj_bias}")
    + "experts:\n  implementation: deepgemm_megamoe\n  megamoe: {backend: reference, quantize: fp4}\n",
    ex.V4 + ex.V4_EP,
)
MEGAMOE_TOP_K = compile_rule(
    "PLC609", "megamoe-top-k", "Mega MoE with top-k above 32",
    "The kernel routes each token to at most 32 experts.",
    ex.V4 + ex.V4_EP, ex.V4 + ex.V4_EP.replace("deepgemm_megamoe", "grouped_mm").replace(
        "  megamoe: {backend: reference, quantize: fp4}\n", ""),
    config={"num_experts_per_tok": 33, "n_routed_experts": 64},
)
MEGAMOE_EP_SIZE = compile_rule(
    "PLC610", "megamoe-ep-size", "Mega MoE with `ep_size` above 72",
    "Mega MoE reaches its peers over one NVLink domain (at most 72 GPUs).",
    ex.V4.replace("tp_size: 2, ep_size: 2", "tp_size: 80, ep_size: 80") + ex.V4_EP,
    ex.V4.replace("tp_size: 2, ep_size: 2", "tp_size: 40, ep_size: 40") + ex.V4_EP,
    config={"n_routed_experts": 80},
)
MEGAMOE_SIZES = compile_rule(
    "PLC611", "megamoe-deep-gemm-sizes", "`backend: deep_gemm` with hidden or intermediate sizes not multiples of 128",
    "The deep_gemm kernel's host checks need both sizes divisible by 128; the PyTorch reference backend runs "
    "any size.",
    ex.V4 + ex.V4_EP.replace("backend: reference", "backend: deep_gemm"), ex.V4 + ex.V4_EP,
)
MEGAMOE_NOT_FP4 = compile_rule(
    "PLC612", "megamoe-needs-fp4", "Mega MoE experts that are not FP4 while `megamoe.quantize` is none",
    "Mega MoE runs FP8 x FP4 experts: load an FP4 checkpoint, or write `megamoe: {quantize: fp4}` to quantize "
    "bf16 experts when the plan is applied.",
    ex.V4 + ex.V4_EP.replace("quantize: fp4", "quantize: none"), ex.V4 + ex.V4_EP,
)
MEGAMOE_ACTIVATION = compile_rule(
    "PLC621", "megamoe-activation", "Mega MoE on a model whose activation is not the kernel's SiLU SwiGLU",
    "Every Mega MoE backend computes SiLU SwiGLU (clamped by `swiglu_limit`) and nothing else. A config with "
    "another `hidden_act`, or with `swiglu_alpha`, `mlp_gate_softcap`/`mlp_up_softcap` (`gate_softcap`/"
    "`up_softcap`) set, would get a different function without an error; such models run "
    "`implementation: grouped_mm`.",
    ex.V4 + ex.V4_EP, ex.V4 + ex.V4_EP.replace("deepgemm_megamoe", "grouped_mm").replace(
        "  megamoe: {backend: reference, quantize: fp4}\n", ""),
    config={"hidden_act": "gelu"},
)
MEGAMOE_KERNEL_BLOCKS = compile_rule(
    "PLC622", "megamoe-kernel-blocks",
    "`backend: deep_gemm` with sizes that pass the kernel's host checks but not its block alignment",
    "Sizes that are multiples of 128 pass deep_gemm's host checks, but the kernel also needs hidden / 128 "
    "even and, at decode-sized batches (BLOCK_K 256), intermediate % 256 == 0. `backend: triton` (FP4 kept "
    "packed) or `backend: reference` run any size; with `backend: auto` the same sizes give warning PLC653.",
    ex.V4 + ex.V4_EP.replace("backend: reference", "backend: deep_gemm"), ex.V4 + ex.V4_EP,
    config={"hidden_size": 384, "moe_intermediate_size": 128},
)
MEGAMOE_ALIGNMENT = compile_rule(
    "PLC653", "megamoe-alignment", "Mega MoE sizes the kernel's block alignment may not fit",
    "`backend: auto` falls back to the reference below 128-multiples; sizes that pass the host checks but not "
    "the block alignment (hidden % 256, % 512 above 4096; intermediate % 256) are worth verifying on the GPU.",
    ex.V4 + ex.V4_EP.replace("backend: reference", "backend: auto"), ex.V4 + ex.V4_EP, severity=WARNING,
)


MEGAMOE_MAX_TOP_K = 32
MEGAMOE_MAX_RANKS = 72
# Config fields of gated activations other than the kernel's SiLU SwiGLU (the clamp is `swiglu_limit`).
MEGAMOE_OTHER_ACTIVATION_FIELDS = ("swiglu_alpha", "mlp_gate_softcap", "mlp_up_softcap", "gate_softcap", "up_softcap")


def check_megamoe(c: Resolution, m: ModuleInfo) -> None:
    info, settings = m.experts, c.plan.experts.megamoe
    assert info is not None  # called for experts modules
    impl_where = key_where(c.loaded, ("experts", "implementation"))
    if not info.has_gate or info.is_transposed:
        why = "have no gate (up_proj only)" if not info.has_gate else "store their weights transposed ([E, H, 2I])"
        c.problems.add(
            MEGAMOE_NO_GATE,
            f"Mega MoE computes SwiGLU over [gate | up] rows of gate_up_proj [E, 2I, H]; these experts "
            f"({m.class_name}) {why}",
            impl_where,
            "use `implementation: grouped_mm` for this model; deepgemm_megamoe needs gated, untransposed experts",
            m.fqn,
        )
    if info.top_k is not None and info.top_k > MEGAMOE_MAX_TOP_K:
        c.problems.add(
            MEGAMOE_TOP_K,
            f"Mega MoE supports top-k <= {MEGAMOE_MAX_TOP_K}, this model routes each token to {info.top_k} experts",
            impl_where,
            "use `implementation: grouped_mm` for this model",
            m.fqn,
        )
    if c.ep > MEGAMOE_MAX_RANKS:
        c.problems.add(
            MEGAMOE_EP_SIZE,
            f"Mega MoE reaches peers over one NVLink domain of at most {MEGAMOE_MAX_RANKS} ranks, "
            f"ep_size is {c.ep}",
            key_where(c.loaded, ("parallel", "ep_size")),
            f"set ep_size <= {MEGAMOE_MAX_RANKS}",
        )
    check_megamoe_activation(c, m, impl_where)
    backend = (settings or MegaMoe()).backend_row
    may_pass_over = backend.per_device and any(r.kernel_blocks for r in MEGAMOE_BACKENDS.values())
    h, i = info.hidden_size, info.intermediate_size
    backend_where = key_where(c.loaded, ("experts", "megamoe", "backend"))
    if h is not None and i is not None and (backend.kernel_blocks or may_pass_over):
        bad = [f"{n} {v}" for n, v in (("hidden", h), ("intermediate", i)) if v % 128]
        blocks = [f"{n} {v}" for n, v in (("hidden", h), ("intermediate", i)) if v % MEGAMOE_KERNEL_BLOCK]
        if bad and backend.kernel_blocks:
            c.problems.add(
                MEGAMOE_SIZES,
                f"the deep_gemm Mega MoE kernel needs hidden and intermediate sizes divisible by 128, "
                f"got {', '.join(bad)}",
                backend_where,
                "write `megamoe: {backend: triton}` (FP4 kept packed) or `{backend: reference}` (PyTorch), "
                "or use `implementation: grouped_mm`",
                m.fqn,
            )
        elif blocks and backend.kernel_blocks:
            c.problems.add(
                MEGAMOE_KERNEL_BLOCKS,
                f"the deep_gemm Mega MoE kernel passes its host checks (% 128) but not its block alignment: "
                f"hidden / 128 must be even and, at decode-sized batches (BLOCK_K {MEGAMOE_KERNEL_BLOCK}), "
                f"intermediate % {MEGAMOE_KERNEL_BLOCK} == 0; got {', '.join(blocks)}",
                backend_where,
                "write `megamoe: {backend: triton}` (FP4 kept packed) or `{backend: reference}`",
                m.fqn,
            )
        elif blocks:
            c.warnings.append(
                CompileWarning(
                    MEGAMOE_ALIGNMENT,
                    f"{generic_path(m.fqn)}: hidden {h} / intermediate {i} are not multiples of "
                    f"{MEGAMOE_KERNEL_BLOCK}, which the deep_gemm kernel needs: backend `auto` runs the Triton "
                    "backend (or the reference) even on SM100",
                    "write `megamoe: {backend: triton}` to say so",
                    backend_where,
                )
            )
    quantize = settings.quantize if settings else "none"
    if not info.is_fp4 and quantize == "none":
        c.problems.add(
            MEGAMOE_NOT_FP4,
            f"Mega MoE runs FP8 x FP4 experts, but gate_up_proj of these experts is "
            f"{c.walk.params[m.params[0]].dtype}, not FP4 (int8-packed), and megamoe.quantize is none",
            key_where(c.loaded, ("experts", "megamoe")),
            "write `megamoe: {quantize: fp4}` to quantize the experts when the plan is applied, or load an "
            "FP4 checkpoint",
            m.fqn,
        )


def check_megamoe_activation(c: Resolution, m: ModuleInfo, where: str) -> None:
    """Every Mega MoE backend computes the kernel's SiLU SwiGLU (with the `swiglu_limit` clamp) and nothing else."""
    config = c.walk.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None)
    reasons = []
    if act is not None and str(act).lower() not in ("silu", "swish"):
        reasons.append(f"hidden_act is {act!r}")
    for name in MEGAMOE_OTHER_ACTIVATION_FIELDS:
        if getattr(text, name, None) is not None:
            reasons.append(f"{name} is {getattr(text, name)!r}")
    if reasons:
        c.problems.add(
            MEGAMOE_ACTIVATION,
            f"Mega MoE computes SiLU SwiGLU (clamped by swiglu_limit) and nothing else, but this model's config "
            f"sets {', '.join(reasons)}: the experts would compute a different function",
            where,
            "use `implementation: grouped_mm` for this model",
            m.fqn,
        )
