"""Rank code of the training-engine checks that run inside the data-parallel test's worlds (no world of their own).

- bf16: DeepSeek-V3 and GLM-4.5 loaded as users load them (`dtype=torch.bfloat16`: transformers keeps the
  router weight in fp32) train under fsdp and replicate like the unsharded bf16 model on the global batch,
  the routers fp32 in the parameters, the gradients and the AdamW state.
- no-grad first: a no-grad forward, generate(), eval()/train(), then a forward with autograd on and no
  backward, before the optimizer is built, and a no-grad eval between steps; the run equals the fp32
  reference (every parameter trained), `model.parameters()` after the no-grad forwards is the set planc.apply
  left, and the optimizer holds that set after the steps.
- accumulation: two micro-batches per step, the first under `planc.no_sync`; equal to the reference, with no
  gradient reduced inside the block; dp 1 (nothing wrapped) included.
- `clip`: planc.clip_grad_norm_ as every case of the world calls it, counting the warnings torch's DTensor logs
  inside it (a redistribute over a multi-dim mesh; torch logs each once per mesh, so the whole world is counted).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from tests.runtime.workers import full, shipped_plan
from tests.train.train_workers import LR, MAX_NORM, MICRO_ROWS, STEPS, global_batch, reference

class _ClipWarnings(logging.Handler):
    """Counts the records torch's DTensor redistribute logs while planc.clip_grad_norm_ runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.inside, self.count = False, 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += self.inside


CLIP_WARNINGS = _ClipWarnings()
logging.getLogger("torch.distributed.tensor._redistribute").addHandler(CLIP_WARNINGS)


def clip(model, max_norm: float = MAX_NORM) -> torch.Tensor:
    """planc.clip_grad_norm_, with torch's redistribute warnings inside it counted."""
    import planc

    CLIP_WARNINGS.inside = True
    try:
        return planc.clip_grad_norm_(model, max_norm)
    finally:
        CLIP_WARNINGS.inside = False


BF16_MODELS = {"deepseek_v3": "deepseek_v3.yaml", "glm4_moe": "glm4_moe.yaml"}
ROUTER = "mlp.gate.weight"


def layouts(world: int) -> list[tuple[int, int, int]]:
    """(tp, ep, dp) of the acceptance that fill `world` ranks with data parallelism: (1, 2, 2) or (2, 2, 2)."""
    return [(1, 2, 2)] if world == 2 else [(2, 2, 2)] if world == 4 else []


def _plan(model_type: str, tp: int, ep: int, dp: int, mode: str | None, file: str | None = None) -> dict:
    plan = shipped_plan(model_type, tp=tp, ep=ep, dp=dp, file=file, ep_implementation="all_to_all")
    if mode is not None:
        plan["training"] = {"data_parallel": mode}
    return plan


def _mean_loss(loss: torch.Tensor) -> float:
    """The global-batch loss: every rank of a replica holds its replica's, so the mean over ranks."""
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


_BF16_REF: dict = {}


def bf16_reference(hub: str, model_type: str, dp: int) -> dict:
    """The unsharded bf16 model (from_pretrained, dtype=bfloat16) trained in this process on the global batch."""
    key = (hub, dp)
    if key not in _BF16_REF:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.bfloat16)
        ref.set_experts_implementation(_plan(model_type, 1, 1, 1, None, BF16_MODELS[model_type])["experts"]["implementation"])
        ref.train()
        start = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
        opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            ids = global_batch(step, dp)
            loss = ref(ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        _BF16_REF[key] = {"losses": losses, "start": start,
                          "params": {n: p.detach().clone() for n, p in ref.named_parameters()}}
    return _BF16_REF[key]


def bf16_case(hub: str, model_type: str, tp: int, ep: int, dp: int, mode: str) -> dict:
    """planc.load(dtype=bfloat16) at (tp, ep, dp) under `mode`, 3 steps against the bf16 reference: worst loss and
    parameter differences, how far the update (trained minus initial parameters) is from the reference's relative
    to its size (all parameters, and the routers alone), and the dtypes of every router's parameter, gradient and
    AdamW state. bf16 rounds the update of one element by up to an ulp; the relative update difference is what a
    parameter that did not train (1.0) or trained on the wrong gradient would show."""
    import planc

    ref = bf16_reference(hub, model_type, dp)
    model = planc.load(hub, _plan(model_type, tp, ep, dp, mode, BF16_MODELS[model_type]), dtype=torch.bfloat16)
    dp_rank = planc.device_mesh(model, "dp").get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    out = {"loss": 0.0, "router_dtypes": set()}
    routers = [p for n, p in model.named_parameters() if n.endswith(ROUTER)]
    for step in range(STEPS):
        micro = global_batch(step, dp)[dp_rank * MICRO_ROWS:(dp_rank + 1) * MICRO_ROWS]
        loss = model(micro, labels=micro).loss
        loss.backward()
        out["router_dtypes"] |= {f"grad {p.grad.dtype}" for p in routers}
        clip(model)
        opt.step()
        opt.zero_grad()
        out["loss"] = max(out["loss"], abs(_mean_loss(loss) - ref["losses"][step]))
    out["router_dtypes"] |= {f"param {p.dtype}" for p in routers}
    out["router_dtypes"] |= {f"state {opt.state[p]['exp_avg'].dtype}" for p in routers}
    out["routers"] = len(routers)
    out["params"], out["worst"] = 0.0, ""
    moved = {"all": [0.0, 0.0], "router": [0.0, 0.0]}  # squared norms of (update difference, reference update)
    for name, p in model.named_parameters():
        got, want, start = full(p.detach()).float(), ref["params"][name].float(), ref["start"][name]
        diff = (got - want).abs().max().item()
        if diff > out["params"]:
            out["params"], out["worst"] = diff, name
        for part in ("all", "router") if name.endswith(ROUTER) else ("all",):
            moved[part][0] += (got - want).pow(2).sum().item()
            moved[part][1] += (want - start).pow(2).sum().item()
    out["update_rel"] = (moved["all"][0] / moved["all"][1]) ** 0.5
    out["router_update_rel"] = (moved["router"][0] / moved["router"][1]) ** 0.5
    out["router_dtypes"] = sorted(out["router_dtypes"])
    return out


def _train(model, opt, dp: int, *, accumulate: bool = False, between=None) -> tuple[float, float]:
    """3 steps (each dp replica its rows; `accumulate`: in two micro-batches, the first under planc.no_sync);
    returns the worst loss and parameter differences against the fp32 reference. `between`: called after each
    step (a no-grad eval)."""
    from torch.distributed.fsdp import FSDPModule

    import planc

    ref = reference("mixtral", dp)
    dp_rank = planc.device_mesh(model, "dp").get_local_rank()
    wrapped = any(isinstance(m, FSDPModule) for m in model.modules())
    model.train()
    worst_loss, reduced_inside = 0.0, False
    for step in range(STEPS):
        micro = global_batch(step, dp)[dp_rank * MICRO_ROWS:(dp_rank + 1) * MICRO_ROWS]
        if accumulate:
            with planc.no_sync(model):
                first = model(micro[:1], labels=micro[:1]).loss / 2
                first.backward()
            reduced_inside |= wrapped and any(p.grad is not None for p in model.parameters())
            second = model(micro[1:], labels=micro[1:]).loss / 2
            second.backward()
            loss = first.detach() + second.detach()
        else:
            loss = model(micro, labels=micro).loss
            loss.backward()
        clip(model)
        opt.step()
        opt.zero_grad()
        worst_loss = max(worst_loss, abs(_mean_loss(loss) - ref["losses"][step]))
        if between is not None:
            between(model)
    worst_param = max((full(p.detach()) - ref["params"][n]).abs().max().item() for n, p in model.named_parameters())
    return worst_loss, worst_param + (1.0 if reduced_inside else 0.0)  # a reduction inside no_sync fails the case


def _no_grad_first(model) -> None:
    """What users run between planc.apply/load and building the optimizer: a baseline eval, generate(), eval/train."""
    ids = global_batch(99, 1)[:1]
    model.eval()
    with torch.no_grad():
        model(ids)
    model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    model.train()
    with torch.inference_mode():
        model(ids)
    model.eval()
    model.train()


def _eval_between(model) -> None:
    model.eval()
    with torch.no_grad():
        model(global_batch(98, 1)[:1])
    model.train()


def engine_case(kind: str, tp: int, ep: int, dp: int, mode: str) -> dict:
    """`kind` "no_grad_first" or "accumulate" on tiny fp32 Mixtral at (tp, ep, dp) under `mode`."""
    import planc
    from planc.models.build import build_tiny_model

    model = build_tiny_model("mixtral", seed=0)
    planc.apply(model, _plan("mixtral", tp, ep, dp, mode))
    applied = {id(p) for p in model.parameters()}
    if kind == "no_grad_first":
        _no_grad_first(model)
    same_set = {id(p) for p in model.parameters()} == applied
    if kind == "no_grad_first":  # then a forward with autograd on and no backward: unsharded tensors stay registered
        model(global_batch(97, 1)[:1])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loss, params = _train(model, opt, dp, accumulate=kind == "accumulate",
                          between=_eval_between if kind == "no_grad_first" else None)
    holds = {id(p) for g in opt.param_groups for p in g["params"]} == applied
    return {"loss": loss, "params": params, "same_set": same_set, "optimizer_holds_applied": holds}


def engine_world(rank: int, world_size: int, bf16_hubs: dict) -> dict:
    """Every engine check of this world size: bf16 families, no-grad first, accumulation (each mode, and dp 1)."""
    out = {}
    for tp, ep, dp in layouts(world_size):
        for model_type, hub in bf16_hubs.items():
            for mode in ("fsdp", "replicate"):
                out[("bf16", model_type, tp, ep, dp, mode)] = bf16_case(hub, model_type, tp, ep, dp, mode)
        for kind in ("no_grad_first", "accumulate"):
            for mode in ("fsdp", "replicate"):
                out[(kind, tp, ep, dp, mode)] = engine_case(kind, tp, ep, dp, mode)
            if world_size == 2:  # dp 1: nothing wrapped (no_sync has nothing to skip)
                out[(kind, 2, 2, 1, "replicate")] = engine_case(kind, 2, 2, 1, "replicate")
    out["clip_warnings"] = CLIP_WARNINGS.count  # over every case of the world (train_case clips through `clip`)
    return out
