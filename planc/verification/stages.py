"""One rank of `planc verify`: the sharded model and its unsharded twin, stage by stage.

Every rank builds the model from the same source and seed, keeps an unsharded copy (the twin), applies the plan to
the other, and runs the stages on both: forward logits, greedy `generate()` tokens (serving plans), the loss, every
parameter's gradient gathered to full, `clip_grad_norm_` and gradient accumulation with the plan's data parallelism
(training), one AdamW step and the forward after it. Each rank feeds its dp replica its own rows of the global batch;
the twin runs the whole batch. Every decision that changes which collectives run (localise a divergence or not) is
taken on the maximum over the ranks, so all ranks take it together.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from planc.verification.tolerance import tolerance

SEQ = 12  # tokens per row
ROWS = 2  # rows per dp replica (two micro-batches when training accumulates)
LR = 1e-3


@dataclass(frozen=True)
class Job:
    """What every rank runs (picklable)."""

    source: Any  # planc.verification.source.ModelSource
    config: Any  # the shrunk config (type and dir sources), None for a build source
    plan: Any  # LoadedPlan at the sizes that run
    dtype: str
    seed: int
    train: bool
    serve: bool
    save_dir: Optional[str] = None  # where to save the stepped model and its twin for the reshard stage
    progress: bool = False  # rank 0 prints a line per stage to stderr (a terminal)
    inference_only: bool = False  # the experts have no backward (Mega MoE): forward stages only


def quiet() -> None:
    """No warning spam from torch or transformers in the ranks: the report says what matters."""
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _stage(name: str, got: Any, want: Any, dtype: str, detail: str = "") -> dict:
    from planc.verification.compare import abs_error, rel_error

    return {"name": name, "abs": abs_error(got, want), "rel": rel_error(got, want), "detail": detail}


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _logits(out: Any) -> Any:
    return _full(out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out)


def _vocab(model: Any) -> int:
    config: Any = getattr(model, "config", None)
    text: Any = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(model, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError("the model has no `config.vocab_size`: verify feeds it token ids")
    return vocab


def training_labels(model: Any, ids: Any) -> Any:
    """The training step's labels: the tokens, folded into the classes the model's head scores. A language model's
    head may be narrower than its embedding (Inkling 2's `lm_head` spans `unpadded_vocab_size`), and a token classifier
    (OpenAI's privacy filter: no output embeddings, `config.num_labels` classes) scores a few classes: a label past
    the head's width is out of the loss's bounds (an IndexError on CPU, a device-side assert or a cuBLAS error on
    CUDA)."""
    head = model.get_output_embeddings()
    width = int(head.weight.shape[0]) if head is not None else int(model.config.num_labels)
    return ids % width


def _loss(model: Any, ids: Any) -> Any:
    out = model(ids, labels=training_labels(model, ids))
    loss = getattr(out, "loss", None)
    if loss is None:
        import torch.nn.functional as F

        logits = _logits(out)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    return loss


def run_rank(rank: int, world: int, job: Job) -> dict:
    """Run every stage on this rank; returns {"stages": [...], "divergence": ..., "notes": [...]}."""
    import torch
    import torch.distributed as dist

    from planc.models.build import clone_model
    from planc.runtime import install
    from planc.runtime.clip import clip_grad_norm_
    from planc.runtime.data_parallel import no_sync
    from planc.spec.choices import EXPERTS_IMPLEMENTATIONS
    from planc.verification.divergence import Recorder, agree_max, backward_culprit, backward_order, forward_culprit
    from planc.verification.source import build_model

    quiet()
    dtype = getattr(torch, job.dtype)
    model = build_model(job.source, job.config, job.seed)
    if dtype != torch.float32:
        model = model.to(dtype)
    twin = clone_model(model)
    impl = job.plan.plan.experts.implementation
    if EXPERTS_IMPLEMENTATIONS[impl].megamoe:
        _megamoe_twin(twin, job.plan.plan.experts.megamoe, rank, world)
    elif hasattr(twin, "set_experts_implementation"):
        with contextlib.suppress(Exception):  # a custom model without the experts contract runs its own code
            twin.set_experts_implementation(impl)
    install.apply(model, install.load_plan_on_every_rank(job.plan, what="planc verify", world_model=model))
    groups = model._planc_groups
    coords = [(groups.tp_rank, groups.tp_size), (groups.ep_rank, groups.ep_size)]
    dp_mesh = groups.dp_mesh
    dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    out: dict = {"stages": _Stages(rank == 0 and job.progress), "divergence": None, "notes": []}

    gen = torch.Generator().manual_seed(job.seed + 100)
    vocab = _vocab(model)
    rows = ROWS * dp_size
    ids = torch.randint(0, vocab, (rows, SEQ), generator=gen)
    mine = ids[dp_rank * ROWS:(dp_rank + 1) * ROWS]
    order = Recorder(twin)  # forward completion order of the twin, for the backward order

    def agreed(stage: dict) -> float:
        return agree_max([stage["rel"]])[0]

    # forward logits
    with torch.no_grad():
        want = _logits(twin(ids))
        got = _logits(model(ids))
    order.remove()
    s = _stage("logits", got, want, job.dtype)
    out["stages"].append(s)
    tol_fwd = tolerance("logits", job.dtype).rel
    if agreed(s) > tol_fwd:
        out["divergence"] = _localise_forward(model, twin, ids, coords, tol_fwd, Recorder, forward_culprit, "logits")
    # greedy generate (serving plans)
    if job.serve and hasattr(model, "generate") and out["divergence"] is None:
        prompt = ids[:1, : SEQ // 2]
        with torch.no_grad():
            kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
            want_tokens = twin.generate(prompt, **kw)
            got_tokens = model.generate(prompt, **kw)
        out["stages"].append(_stage("generate", got_tokens, want_tokens, job.dtype,
                                    f"{want_tokens.shape[-1] - prompt.shape[-1]} greedy tokens"))
    if job.inference_only:
        out["notes"].append(f"experts.implementation `{impl}` is inference-only: no loss, gradient or step stages")
        if job.save_dir is not None:
            _save_for_reshard(model, twin, job.save_dir, rank)
        dist.barrier()
        return out
    # loss and gradients
    model.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    ref_loss = _loss(twin, ids)
    ref_loss.backward()
    accumulate = 2 if job.train else 1
    total = torch.zeros((), dtype=torch.float64)
    for i in range(accumulate):
        part = mine[i * (ROWS // accumulate):(i + 1) * (ROWS // accumulate)]
        ctx = no_sync(model) if i < accumulate - 1 else contextlib.nullcontext()
        with ctx:
            loss = _loss(model, part) / accumulate
            loss.backward()
        total += loss.detach().double()
    if dp_size > 1:
        dist.all_reduce(total, group=dp_mesh.get_group())
        total /= dp_size
    note = f"{accumulate} micro-batches accumulated (no_sync)" if accumulate > 1 else ""
    out["stages"].append(_stage("loss", total.to(ref_loss.dtype), ref_loss.detach(), job.dtype, note))
    grads = _grad_errors(model, twin)
    worst = max(grads, key=lambda n: grads[n]["rel"]) if grads else ""
    out["stages"].append({"name": "grads", "abs": max((g["abs"] for g in grads.values()), default=0.0),
                          "rel": max((g["rel"] for g in grads.values()), default=0.0),
                          "detail": f"{len(grads)} parameters; worst {worst}" if worst else ""})
    tol_grad = tolerance("grads", job.dtype).rel
    names = list(grads)
    agreed_grads = dict(zip(names, agree_max([grads[n]["rel"] for n in names])))
    if out["divergence"] is None and max(agreed_grads.values(), default=0.0) > tol_grad:
        found = backward_culprit(agreed_grads, backward_order(order.order), tol_grad)
        if found is not None:
            out["divergence"] = {"stage": "grads", "direction": "backward", "module": found[0].rpartition(".")[0],
                                 "parameter": found[0], "rel": found[1]}
    # clip_grad_norm_ (training)
    if job.train:
        ref_norm = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), float("inf"))
        max_norm = float(ref_norm) / 2  # so that clipping happens
        torch.nn.utils.clip_grad_norm_(list(twin.parameters()), max_norm)
        norm = clip_grad_norm_(model, max_norm, 2.0, False)
        clipped = _grad_errors(model, twin)
        s = _stage("clip", _full(norm).double().reshape(1), ref_norm.double().reshape(1), job.dtype,
                   "total norm, then gradients clipped to half of it")
        s["rel"] = max([s["rel"], *(g["rel"] for g in clipped.values())])
        s["abs"] = max([s["abs"], *(g["abs"] for g in clipped.values())])
        out["stages"].append(s)
    # one AdamW step, then the next forward
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(twin.parameters(), lr=LR)
    opt.step()
    ref_opt.step()
    with torch.no_grad():
        want = _logits(twin(ids))
        got = _logits(model(ids))
    out["stages"].append(_stage("step", got, want, job.dtype, f"logits after one AdamW step (lr {LR:g})"))
    if job.save_dir is not None:
        _save_for_reshard(model, twin, job.save_dir, rank)
    dist.barrier()
    return out


def _megamoe_twin(twin: Any, settings: Any, rank: int, world: int) -> None:
    """The twin's experts run the Mega MoE reference backend unsharded (all experts, a one-rank group), FP4 quantized
    as the plan quantizes them: the sharded run is compared with the same arithmetic, not with bf16 experts."""
    import torch.distributed as dist

    from planc.runtime.megamoe import install_megamoe_forward

    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in the same order
    for name, experts in twin.named_modules():
        if name.endswith("mlp.experts") and hasattr(experts, "gate_up_proj"):
            num = experts.gate_up_proj.shape[0]
            quantize = None if settings is None or settings.quantize == "none" else settings.quantize
            install_megamoe_forward(experts, backend="reference", quantize=quantize, num_global_experts=num, ep_size=1)
            unsharded = experts.forward
            experts.forward = lambda h, i, w, _f=unsharded, _g=singles[rank]: _f(h, i, w, process_group=_g)


def _save_for_reshard(model: Any, twin: Any, directory: str, rank: int) -> None:
    """The stepped sharded model as a planc DCP checkpoint, and its stepped twin (safetensors, rank 0)."""
    import os

    from safetensors.torch import save_model

    from planc.checkpoint.save import save

    save(model, os.path.join(directory, "sharded"))
    if rank == 0:
        twin.config.save_pretrained(directory)
        save_model(twin, os.path.join(directory, "twin.safetensors"))


@dataclass(frozen=True)
class ReshardJob:
    """The reshard stage's world: the checkpoint of the first, read back at other sizes."""

    source: Any
    config: Any
    plan: Any  # LoadedPlan at the reshard sizes
    dtype: str
    seed: int
    save_dir: str


def run_reshard_rank(rank: int, world: int, job: ReshardJob) -> dict:
    """planc.load of the saved checkpoint at the reshard sizes against the stepped twin: logits."""
    import os

    import torch
    from safetensors.torch import load_model

    from planc.checkpoint.load import load
    from planc.runtime import install
    from planc.verification.source import build_model

    quiet()
    dtype = getattr(torch, job.dtype)
    loaded = install.load_plan_on_every_rank(job.plan, what="planc verify (reshard)")
    model = load(os.path.join(job.save_dir, "sharded"), loaded, dtype=dtype)
    twin = build_model(job.source, job.config, job.seed).to(dtype)
    load_model(twin, os.path.join(job.save_dir, "twin.safetensors"))
    ids = torch.randint(0, _vocab(twin), (ROWS, SEQ), generator=torch.Generator().manual_seed(job.seed + 200))
    with torch.no_grad():
        want = _logits(twin(ids))
        got = _logits(model(ids))
    p = job.plan.plan.parallel
    return {"stages": [_stage("reshard", got, want, job.dtype, f"saved at the plan's sizes, loaded at tp_size="
                              f"{p.tp_size} ep_size={p.ep_size} dp_size={p.dp_size}, after the step")]}


class _Stages(list):
    """The stage results of a rank; with `progress`, each is announced on stderr as it completes."""

    def __init__(self, progress: bool) -> None:
        super().__init__()
        self.progress = progress

    def append(self, stage: dict) -> None:
        super().append(stage)
        if self.progress:
            import sys

            print(f"planc verify: stage {stage['name']} done (rel {stage['rel']:.2e})", file=sys.stderr, flush=True)

    def __reduce__(self):  # pickled back to the parent as a plain list
        return (list, (list(self),))


def _grad_errors(model: Any, twin: Any) -> dict[str, dict]:
    """{parameter: {"abs", "rel"}} of every gradient gathered to full against the twin's (same order on every rank)."""
    import torch

    from planc.verification.compare import abs_error, rel_error

    ref = dict(twin.named_parameters())
    # a gradient is measured against its share of the whole gradient at least: a parameter whose reference gradient
    # is near zero (a hash-routed gate) would otherwise turn summation noise into relative errors of order one
    grads = [r.grad for r in ref.values() if r.grad is not None]
    total = sum(g.numel() for g in grads) or 1
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))) \
        if grads else 0.0
    out = {}
    for name, p in model.named_parameters():
        r = ref.get(name)
        if r is None:
            continue
        g = _full(p.grad) if p.grad is not None else None
        if g is None and r.grad is None:
            continue
        if g is None or r.grad is None:
            out[name] = {"abs": float("inf"), "rel": float("inf")}
            continue
        want = r.grad
        if g.shape != want.shape and g.ndim and g.shape[1:] == want.shape[1:] and g.shape[0] < want.shape[0]:
            want = want[: g.shape[0]]  # rows the forward never reads, dropped by the sharding
        with torch.no_grad():
            floor = norm * (want.numel() / total) ** 0.5
            out[name] = {"abs": abs_error(g, want), "rel": rel_error(g, want, floor)}
    return out


def _localise_forward(model, twin, ids, coords, tol, Recorder, forward_culprit, stage) -> Optional[dict]:
    import torch

    got, want = Recorder(model), Recorder(twin)
    try:
        with torch.no_grad():
            twin(ids)
            model(ids)
    finally:
        got.remove()
        want.remove()
    found = forward_culprit(got, want, coords, tol)
    if found is None:
        return None
    return {"stage": stage, "direction": "forward", "module": found[0], "parameter": None, "rel": found[1]}
