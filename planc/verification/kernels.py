"""The kernel stages of `planc verify`: a Mega MoE plan's experts at their real per-rank shapes, the Triton backend
against the reference backend on the same inputs, on one GPU.

The CPU ranks run a Mega MoE plan with the reference backend (engine._on_cpu), so the Triton kernels a Hopper GPU
runs are not reached there. These stages run them: for each Mega MoE layer of the plan (the real config, not the
shrunk one), one EP rank's share of the layer (rank `layer index % ep_size`, so the layers cycle through every rank's
expert range): its `E / ep_size` experts at the real hidden and intermediate sizes, random weights at the config's
`initializer_range`, quantized to FP4 by `install_megamoe_forward` as `planc.apply` quantizes them. Every rank's
tokens are staged and gathered as the dispatch gathers them, for batches of 1 token, a decode batch and a prefill
batch per rank (up to the plan's `max_tokens_per_rank`). Each backend runs its own staging, local experts
computation and combine (its runner's kernels, `staged_kernels`); the outputs are compared with DeepGEMM's calc_diff
against the bound of the backend contract (tolerance.kernel_tolerance). A failing layer names the expert whose slots
differ most.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from planc.errors import VerifyError
from planc.verification.report import Divergence, StageResult
from planc.verification.tolerance import kernel_tolerance

DECODE_TOKENS = 24  # tokens per rank of the decode batch: not a power of two, so the dispatch pads it (-1 slots)
PREFILL_TOKENS = 4096  # tokens per rank of the prefill batch when the plan sets no `max_tokens_per_rank`
STAGE = "kernels"


@dataclass(frozen=True)
class KernelLayer:
    """One Mega MoE experts module of the plan at its real per-rank shapes."""

    fqn: str
    hidden: int
    intermediate: int
    num_experts: int
    ep_size: int
    top_k: int
    config: Any  # the experts module's config: the SwiGLU clamp is read from it as `install_megamoe_forward` does
    init_std: float
    routed_scaling: float

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size


@dataclass
class KernelOutcome:
    """What the kernel stages give the report: one stage per token batch, the first divergence (layer order, then
    batch order), and the lines that say what ran."""

    stages: list[StageResult] = field(default_factory=list)
    divergence: Optional[Divergence] = None
    notes: list[str] = field(default_factory=list)
    skipped: str = ""  # why they could not run at these shapes (nothing ran)


def kernel_device(asked: Optional[bool]) -> tuple[Optional[torch.device], str]:
    """Where the kernel stages run, or None and why not. `asked`: None runs them on a CUDA GPU when there is one;
    True also under Triton's CPU interpreter (TRITON_INTERPRET=1 when planc was imported; slow at real widths);
    False never."""
    from planc.kernels.megamoe.triton import target

    if asked is False:
        return None, "not asked for (--no-kernels)"
    if target.interpreting():
        if asked:
            return torch.device("cpu"), ""
        return None, ("Triton's CPU interpreter is on (TRITON_INTERPRET=1): no CUDA GPU runs the kernels; --kernels "
                      "runs them interpreted, slowly at the real widths")
    if not torch.cuda.is_available():
        return None, ("no CUDA GPU here: the Triton kernels run only on one; run `planc verify PLAN` on a GPU "
                      "machine (sm_90 or newer)")
    device = torch.device("cuda")
    reason = target.triton_unavailable_reason(device)
    if reason is not None:
        return None, reason
    return device, ""


def token_batches(settings: Any) -> tuple[int, ...]:
    """Tokens per rank of the batches: 1, a decode batch and a prefill batch (the plan's `max_tokens_per_rank`, else
    PREFILL_TOKENS), each at most the prefill batch."""
    prefill = getattr(settings, "max_tokens_per_rank", None) or PREFILL_TOKENS
    return tuple(sorted({1, min(DECODE_TOKENS, prefill), prefill}))


def kernel_layers(loaded: Any, real_config: Any) -> list[KernelLayer]:
    """The plan's Mega MoE experts modules, from the plan compiled against the real config on the meta device."""
    from planc.compiler.resolve import compile_plan
    from planc.models.build import meta_model

    model = meta_model(real_config)
    compiled = compile_plan(model, loaded)
    text = real_config.get_text_config() if hasattr(real_config, "get_text_config") else real_config
    ep = loaded.plan.parallel.ep_size
    layers = []
    for e in compiled.experts:
        module = model.get_submodule(e.fqn)
        gate_up = module.gate_up_proj
        hidden = e.hidden_size or gate_up.shape[2]
        inter = e.intermediate_size or gate_up.shape[1] // 2
        layers.append(KernelLayer(
            e.fqn, hidden, inter, e.num_experts, ep, e.top_k or text.num_experts_per_tok,
            getattr(module, "config", None) or text, float(getattr(text, "initializer_range", 0.02)),
            float(getattr(text, "routed_scaling_factor", 1.0) or 1.0)))
    return layers


class _RankExperts(nn.Module):
    """One rank's experts as `planc.apply` leaves them before the Mega MoE install: `gate_up_proj [E_loc, 2I, H]`,
    `down_proj [E_loc, H, I]` (bf16, or FP4 with their scales), and the model's config."""

    def __init__(self, tensors: dict[str, torch.Tensor], config: Any, fqn: str) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t, requires_grad=False))
        self.config = config
        self._planc_fqn = fqn


@dataclass
class _Side:
    """One backend bound to one rank's experts: its weights and its three staged kernels."""

    weights: Any
    stage: Callable
    local: Callable
    combine: Callable


def _bind(layer: KernelLayer, rank: int, settings: Any, device: torch.device, seed: int) -> tuple[_Side, _Side, Any]:
    """(triton, reference, clamp) for `rank`'s experts of `layer`: random bf16 weights quantized to FP4 once by the
    Triton install (as the plan quantizes them); the reference install takes the same FP4 tensors."""
    from planc.runtime.megamoe import install_megamoe_forward, megamoe_state
    from planc.runtime.megamoe.runners import FP4_PARAMS

    g = torch.Generator(device=device).manual_seed(seed)
    e_loc, h, i = layer.local_experts, layer.hidden, layer.intermediate
    w1 = torch.randn(e_loc, 2 * i, h, generator=g, device=device, dtype=torch.bfloat16) * layer.init_std
    w2 = torch.randn(e_loc, h, i, generator=g, device=device, dtype=torch.bfloat16) * layer.init_std
    kw: dict[str, Any] = dict(
        max_tokens_per_rank=getattr(settings, "max_tokens_per_rank", None),
        activation_clamp=getattr(settings, "activation_clamp", None), num_global_experts=layer.num_experts,
        ep_rank=rank, ep_size=layer.ep_size, device=device)
    triton = _RankExperts({"gate_up_proj": w1, "down_proj": w2}, layer.config, layer.fqn)
    install_megamoe_forward(triton, backend="triton", quantize="fp4", **kw)
    del w1, w2  # the install dropped them (its undo is not kept)
    fp4 = {name: getattr(triton, name).detach() for name in FP4_PARAMS}  # before the Triton layout replaces them
    reference = _RankExperts(fp4, layer.config, layer.fqn)
    install_megamoe_forward(reference, backend="reference", **kw)
    sides = []
    for module in (triton, reference):
        runner: Any = megamoe_state(module).runner  # type: ignore[union-attr]
        sides.append(_Side(runner.weights(device), *runner.staged_kernels()))
    return sides[0], sides[1], megamoe_state(triton).activation_clamp  # type: ignore[union-attr]


def _batch(layer: KernelLayer, tokens: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """Every rank's tokens: hidden states [ep, T, H] (bf16, unit scale like normed activations) and top-k routing
    [ep, T, K] over the global experts, with sqrt-softplus scores normalised and scaled as DeepSeek-V4's router does."""
    g = torch.Generator(device=device).manual_seed(seed)
    ep, k = layer.ep_size, layer.top_k
    x = torch.randn(ep, tokens, layer.hidden, generator=g, device=device).bfloat16()
    scores = F.softplus(torch.randn(ep, tokens, layer.num_experts, generator=g, device=device)).sqrt()
    weights, idx = scores.topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True) * layer.routed_scaling
    return x, idx, weights.float()


def _run_side(side: _Side, layer: KernelLayer, rank: int, x, idx, weights, settings: Any, clamp):
    """One backend on `rank`: every rank stages its tokens (padded as the dispatch pads them), the rows are gathered,
    this rank's experts compute their slots, and the combine sums each token's slots. Returns (slots [M, K, H],
    combined [ep, T, H]) where M is the gathered rows."""
    from planc.kernels.megamoe.buffers import capacity_for, next_power_of_two
    from planc.kernels.megamoe.reference import ReferenceBuffer

    ep, tokens = layer.ep_size, x.shape[1]
    limit = getattr(settings, "max_tokens_per_rank", None)
    rows = tokens if ep == 1 else min(next_power_of_two(tokens), capacity_for(tokens, limit))
    parts = []
    for r in range(ep):
        buf = ReferenceBuffer(rows, layer.hidden, layer.top_k, x.device)
        side.stage(buf, x[r], idx[r], weights[r], rows)
        parts.append((buf.x.view(torch.uint8), buf.x_sf, buf.topk_idx, buf.topk_weights))
    gx, gsf, gidx, gw = (torch.cat(t) for t in zip(*parts))
    slots = side.local(gx.view(torch.float8_e4m3fn), gsf, gidx, gw, side.weights,
                       first_expert=rank * layer.local_experts, activation_clamp=clamp, num_experts=layer.num_experts)
    # after the exchange each token's rank sums the slots it receives in FP32 (one owner each: exact), then combines
    combined = side.combine(slots.float() if ep > 1 else slots)
    return slots, gidx, combined.view(ep, rows, layer.hidden)[:, :tokens]


def _worst_expert(slots_t, slots_r, gidx, first: int, count: int) -> tuple[Optional[int], float]:
    """The local expert (global id) whose slots differ most between the backends, and its calc_diff."""
    from planc.kernels.megamoe.quant import calc_diff

    worst, worst_diff = None, -1.0
    for e in range(first, first + count):
        mask = gidx == e
        if not bool(mask.any()):
            continue
        d = calc_diff(slots_t[mask].float(), slots_r[mask].float())
        if d > worst_diff:
            worst, worst_diff = e, d
    return worst, worst_diff


def run_kernel_stages(loaded: Any, real_config: Any, device: torch.device, *, seed: int = 0,
                      layers: Optional[int] = None, say: Callable[[str], None] = lambda _text: None) -> KernelOutcome:
    """The kernel stages of `loaded` (a Mega MoE plan) against `real_config` on `device`; `layers`: only the first
    so many Mega MoE layers."""
    from planc.kernels.megamoe.triton import layout

    settings = loaded.plan.experts.megamoe
    found = kernel_layers(loaded, real_config)[:layers]
    out = KernelOutcome()
    if not found:
        out.notes.append("kernel stages: the plan compiles to no Mega MoE experts module")
        return out
    for layer in found:
        problem = layout.size_problem(layer.hidden, layer.intermediate)
        if problem is not None:
            out.skipped = f"{layer.fqn}: {problem}"
            return out
    batches = token_batches(settings)
    started = time.monotonic()
    per_batch: dict[int, list[dict]] = {t: [] for t in batches}
    with torch.no_grad():
        for n, layer in enumerate(found):
            rank = n % layer.ep_size
            say(f"kernel stages: {layer.fqn} ({n + 1}/{len(found)}), rank {rank}'s experts")
            try:
                _run_layer(layer, rank, n, batches, settings, device, seed, per_batch, out)
            except (RuntimeError, ValueError) as e:  # a kernel that raises (a launch, a CUDA error): where, and why
                raise VerifyError(f"kernel stages: {layer.fqn}, rank {rank}'s experts: {type(e).__name__}: {e}") \
                    from None
    seconds = time.monotonic() - started
    first, last = found[0], found[-1]
    out.notes.append(
        f"kernel stages on {_device_name(device)}: {len(found)} Mega MoE layers ({first.fqn} .. {last.fqn}), "
        f"{first.local_experts} experts per rank (of {first.num_experts}, ep_size {first.ep_size}), hidden "
        f"{first.hidden}, intermediate {first.intermediate}, top-{first.top_k}; the Triton backend against the "
        f"reference backend on the same FP4 weights and tokens, {seconds:.0f} s")
    for t in batches:
        rows = per_batch[t]
        worst = max(rows, key=lambda r: r["calc_diff"])
        tol = worst["tol"]
        cfg = worst["config"]
        path = "FP8 path" if cfg.fp8 else f"BF16 path, {'Gluon ' if cfg.gluon else ''}blocks of {cfg.block_t} rows"
        detail = (f"calc_diff; {t} token{'s' if t > 1 else ''} per rank x {first.ep_size} ranks gathered, "
                  f"{len(rows)} layers, {min(r['slots'] for r in rows)}-{max(r['slots'] for r in rows)} slots on the "
                  f"rank's experts; worst {worst['layer']} (rank {worst['rank']}, rel {worst['rel']:.2e}); Triton {path}")
        out.stages.append(StageResult(f"{STAGE}[{t}]", max(r["abs"] for r in rows), worst["calc_diff"], tol.rel,
                                      tol.rule, all(r["calc_diff"] <= r["tol"].rel for r in rows), detail,
                                      measure="calc_diff"))
    return out


def _run_layer(layer: KernelLayer, rank: int, n: int, batches: tuple[int, ...], settings: Any, device: torch.device,
               seed: int, per_batch: dict[int, list[dict]], out: KernelOutcome) -> None:
    """Layer `n` on `rank`: both backends on each batch, one row per batch; the first failing row is the divergence."""
    from planc.kernels.megamoe.quant import calc_diff
    from planc.kernels.megamoe.triton.forward import device_config
    from planc.verification.compare import abs_error, rel_error

    triton, reference, clamp = _bind(layer, rank, settings, device, seed * 100_003 + n)
    for t in batches:
        x, idx, w = _batch(layer, t, device, seed * 100_003 + n * 1009 + t)
        slots_t, gidx, y_t = _run_side(triton, layer, rank, x, idx, w, settings, clamp)
        slots_r, _, y_r = _run_side(reference, layer, rank, x, idx, w, settings, clamp)
        cfg = device_config(gidx.numel(), layer.local_experts, layer.hidden, layer.intermediate, device,
                            num_experts=layer.num_experts)
        tol = kernel_tolerance(bool(cfg.fp8))
        d = calc_diff(y_t.float(), y_r.float())
        first = rank * layer.local_experts
        mine = int(((gidx >= first) & (gidx < first + layer.local_experts)).sum())  # slots this rank computes
        row = {"layer": layer.fqn, "rank": rank, "tokens": t, "calc_diff": d, "tol": tol, "slots": mine,
               "abs": abs_error(y_t, y_r), "rel": rel_error(y_t, y_r), "config": cfg}
        if not d <= tol.rel:
            row["expert"] = _worst_expert(slots_t, slots_r, gidx, first, layer.local_experts)
            if out.divergence is None:
                out.divergence = _divergence(layer, rank, row)
        per_batch[t].append(row)
        del slots_t, slots_r, y_t, y_r


def _divergence(layer: KernelLayer, rank: int, row: dict) -> Divergence:
    expert, expert_diff = row["expert"]
    where = f", worst expert {expert} (calc_diff {expert_diff:.3g} on its slots)" if expert is not None else ""
    tokens = f"{row['tokens']} token{'s' if row['tokens'] > 1 else ''}"
    note = (f"the Triton backend's output differs from the reference backend's on the same inputs: {tokens} "
            f"per rank, rank {rank}'s experts {rank * layer.local_experts}-{(rank + 1) * layer.local_experts - 1}"
            f"{where}")
    return Divergence(f"{STAGE}[{row['tokens']}]", "kernel", layer.fqn, row["calc_diff"], note=note,
                      tokens=row["tokens"], expert=expert)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return "CPU (Triton's interpreter)"
