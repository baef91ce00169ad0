"""Rank code of the data-parallel training tests: one spawned world runs many cases in sequence.

Each case: a tiny fp32 model, its unsharded copy trained in this process on the global batch (the
reference), and the planc model at (tp, ep, dp) x data_parallel x EP strategy fed the micro-batch of
its dp replica; 3 AdamW steps with planc.clip_grad_norm_ on both sides.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from tests.runtime.workers import full, shipped_plan

STEPS = 3
LR = 1e-3
MAX_NORM = 0.5  # below the tiny models' gradient norms: the clip scales every step
MICRO_ROWS, COLS = 2, 8


ACCUM, VOCAB = 2, 128  # the client runs' micro-batches per optimizer step (Trainer, SFTTrainer, Accelerate, LoRA)


def rows(dp: int) -> torch.Tensor:
    """Every row a client run reads, in order: optimizer step s reads rows [s * ACCUM * dp * MICRO_ROWS, +ACCUM * dp * MICRO_ROWS)."""
    g = torch.Generator().manual_seed(2024)
    return torch.randint(3, VOCAB, (STEPS * ACCUM * dp * MICRO_ROWS, COLS), generator=g)


def step_rows(dp: int, step: int) -> torch.Tensor:
    n = ACCUM * dp * MICRO_ROWS
    return rows(dp)[step * n:(step + 1) * n]


def global_batch(step: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 128, (dp * MICRO_ROWS, COLS), generator=g)


# against the unsharded reference on the same global batches, fp32: loss, clip norm (relative), parameters
LOSS_TOL, PARAM_TOL, NORM_REL = 1e-5, 1e-4, 1e-5


def reference_failures(case: object, per_rank: list[dict]) -> list[str]:
    """What a case's ranks report against the unsharded reference (rank 0's numbers; every rank's digest of the
    full parameters): loss, clip norm, worst parameter, and replicas that drifted apart."""
    first, out = per_rank[0], []
    if first["loss"] > LOSS_TOL:
        out.append(f"{case}: loss off by {first['loss']:.3g}")
    if first["norm_rel"] > NORM_REL:
        out.append(f"{case}: clip norm off by {first['norm_rel']:.3g} (relative)")
    if first["params"] > PARAM_TOL:
        out.append(f"{case}: {first['worst']} off by {first['params']:.3g}")
    if len({r["digest"] for r in per_rank}) != 1:
        out.append(f"{case}: the full parameters differ between ranks (replicas drifted)")
    return out


def error_of(fn) -> str:
    """What calling `fn` raised, as "Type: message" (or "no error"): refusals compared on every rank."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


_REFERENCE: dict = {}


def unsharded_run(model_type: str, seed: int, batches: list, weight_decay: float = 0.01) -> dict:
    """The unsharded model trained one AdamW step (clipped to MAX_NORM) per global batch: the reference every
    sharded run is compared with (losses, pre-clip norms, parameters after the last step)."""
    from planc.models.build import build_tiny_model

    ref = build_tiny_model(model_type, seed=seed)
    ref.set_experts_implementation(shipped_plan(model_type, tp=1)["experts"]["implementation"])
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=weight_decay)
    losses, norms = [], []
    for ids in batches:
        loss = ref(ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in ref.named_parameters()}}


def compare_params(model, ref_params: dict) -> tuple[float, str, str]:
    """The largest elementwise difference of the model's full parameters from the reference's, the parameter it is
    in, and a digest of the full parameters (equal on every rank when the replicas agree)."""
    worst, worst_name, digest = 0.0, "", hashlib.sha256()
    for name, p in model.named_parameters():
        f = full(p.detach())
        diff = (f - ref_params[name]).abs().max().item()
        if diff > worst:
            worst, worst_name = diff, name
        digest.update(name.encode() + f.contiguous().numpy().tobytes())
    return worst, worst_name, digest.hexdigest()


def reference(model_type: str, dp: int, seed: int = 0) -> dict:
    """The single-process run on the global batch of `dp` micro-batches: losses, clip norms, final parameters
    (the same for every (tp, ep, mode, strategy), so one world computes it once per model and dp)."""
    key = (model_type, dp, seed)
    if key not in _REFERENCE:
        _REFERENCE[key] = unsharded_run(model_type, seed, [global_batch(step, dp) for step in range(STEPS)])
    return _REFERENCE[key]


def train_case(model_type: str, tp: int, ep: int, dp: int, data_parallel: str, strategy: str,
               checkpointing: str = "none", seed: int = 0) -> dict:
    """Worst loss, clip-norm and parameter differences of planc training against the single-process reference,
    a digest of the full parameters (equal on every rank when the replicas are bit-identical), and how many times
    the first decoder layer's forward ran per step (2 under activation checkpointing: the recompute)."""
    import planc
    from planc.models.build import build_tiny_model
    from tests.train.engine_workers import clip

    ref = reference(model_type, dp, seed)
    model = build_tiny_model(model_type, seed=seed)
    plan = shipped_plan(model_type, tp=tp, ep=ep, dp=dp, ep_implementation=strategy)
    plan["training"] = {"data_parallel": data_parallel, "activation_checkpointing": checkpointing}
    compiled = planc.apply(model, plan)
    forwards = [0]
    # a module inside the layer: transformers checkpoints the layer's forward body, so the layer's own hooks run once
    model.model.layers[0].input_layernorm.register_forward_pre_hook(
        lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    dp_rank = planc.device_mesh(model, "dp").get_local_rank()
    assert dp_rank == dist.get_rank() // tp  # the ("dp", "tp") layout: replica of this rank
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)  # CUDA's default: one kernel over many tensors
    model.train()
    # what wraps a decoder layer: torch's replicate (FSDP2-based DDP) or fully_shard, bucketed per unit
    wrappers = {c.__name__ for c in type(model.model.layers[0]).__mro__} & {"ReplicateModule", "FSDPModule"}
    out = {"loss": 0.0, "norm_rel": 0.0, "mode": compiled.data_parallel, "wrapped": sorted(wrappers)}
    for step in range(STEPS):
        ids = global_batch(step, dp)
        micro = ids[dp_rank * MICRO_ROWS:(dp_rank + 1) * MICRO_ROWS]
        loss = model(micro, labels=micro).loss
        loss.backward()
        norm = clip(model, MAX_NORM)  # planc.clip_grad_norm_, its torch warnings counted
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()  # every rank of a replica holds its loss: the mean over ranks is over replicas
        out["loss"] = max(out["loss"], abs(mean.item() - ref["losses"][step]))
        out["norm_rel"] = max(out["norm_rel"], abs(norm.item() - ref["norms"][step]) / ref["norms"][step])
    worst, worst_name, digest = compare_params(model, ref["params"])
    out["params"], out["worst"] = worst, worst_name
    out["forwards_per_step"] = forwards[0] / STEPS
    out["digest"] = digest
    return out


def run_cases(rank: int, world_size: int, cases: list) -> dict:
    return {case: train_case(*case) for case in cases}


def api_checks(rank: int, world_size: int) -> dict:
    """planc.clip_grad_norm_ (inf norm, torch's clip refused with the planc name), the root mesh and a caller's mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    import planc
    from planc.errors import ApplyError, PlancError
    from planc.models.build import build_tiny_model

    out = {}
    model = build_tiny_model("mixtral", seed=1)
    ref = build_tiny_model("mixtral", seed=1)
    plan = shipped_plan("mixtral", tp=world_size, ep=world_size, ep_implementation="all_to_all")
    compiled = planc.apply(model, plan)
    mesh = planc.device_mesh(model)
    out["mesh"] = (tuple(mesh.mesh_dim_names), tuple(mesh.shape), compiled.mesh_dims)
    ids = global_batch(0, 1)
    model(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["torch_clip"] = "no error"
    except PlancError as e:
        out["torch_clip"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - the point: no raw torch error
        out["torch_clip"] = f"raw {type(e).__name__}: {e}"
    for norm_type in (float("inf"), 1.0, 2.0):
        got = planc.clip_grad_norm_(model, 1e9, norm_type).item()
        want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type).item()
        out[f"norm_{norm_type}"] = abs(got - want) / want
    # mixed precision (fsdp): the forward computes in bf16, the sharded parameters and the step stay fp32
    mp_plan = shipped_plan("mixtral", tp=1, ep=world_size, dp=world_size, ep_implementation="all_to_all")
    mp_plan["training"] = {"data_parallel": "fsdp", "mixed_precision": {"param_dtype": "bfloat16"}}
    mp_model = build_tiny_model("mixtral", seed=0)
    planc.apply(mp_model, mp_plan)
    seen = []
    q_proj = mp_model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    ref_loss = reference("mixtral", world_size)["losses"][0]
    ids = global_batch(0, world_size)[rank * MICRO_ROWS:(rank + 1) * MICRO_ROWS]
    loss = mp_model(ids, labels=ids).loss
    loss.backward()
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    out["mp_loss"] = abs(mean.item() / world_size - ref_loss)
    out["mp_dtypes"] = (str(seen[0]), str(q_proj.weight.dtype), str(q_proj.weight.grad.dtype))
    # a caller's mesh: the root planc builds is accepted, a wrong one refused before anything changes
    right = init_device_mesh("cpu", compiled.mesh_dims[0], mesh_dim_names=compiled.mesh_dims[1])
    planc.apply(build_tiny_model("mixtral", seed=1), plan, mesh=right)
    wrong = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    try:
        planc.apply(build_tiny_model("mixtral", seed=1), shipped_plan("mixtral", tp=1, ep=world_size, dp=world_size),
                    mesh=wrong)
        out["wrong_mesh"] = "accepted"
    except ApplyError as e:
        out["wrong_mesh"] = str(e)
    return out


def train_world(rank: int, world_size: int, cases: list, hub_dirs: dict | None = None,
                bf16_hubs: dict | None = None) -> dict:
    """Every training case, the engine checks (tests/train/engine_workers.py), then (2 ranks) the API checks and
    generate(), (4 ranks) PEFT LoRA at tp 2 and dp 2 (tests/train/lora_workers.py): one world for all of them."""
    from tests.train.engine_workers import engine_world

    out = run_cases(rank, world_size, cases)
    out["engine"] = engine_world(rank, world_size, bf16_hubs or {})
    if world_size == 2:
        out["api"] = api_checks(rank, world_size)
    if world_size == 4:
        from tests.train.lora_workers import LORA_CASES_4, lora_world

        out["lora"] = lora_world(rank, world_size, LORA_CASES_4)
    if hub_dirs:
        out["generate"] = generate_checks(rank, world_size, hub_dirs)
    return out


def generate_checks(rank: int, world_size: int, hub_dirs: dict) -> dict:
    """generate() right after planc.load (default and static cache, a left-padded batch) against the unsharded
    model, for every EP strategy, TP-only, and dp replicas (each feeding its own batch): tokens identical."""
    from transformers import AutoModelForCausalLM

    import planc

    out = {}
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding
    for model_type, hub in hub_dirs.items():
        ref = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32)
        ref.set_experts_implementation("grouped_mm")
        layouts = {f"tp{world_size}/ep{world_size}/{s}": ((world_size, world_size, 1), s)
                   for s in ("all_to_all", "all_reduce", "auto")}
        layouts[f"tp{world_size}/ep1"] = ((world_size, 1, 1), "auto")
        layouts[f"tp1/ep{world_size}/dp{world_size}"] = ((1, world_size, world_size), "all_to_all")
        for name, ((tp, ep, dp), strategy) in layouts.items():
            plan = shipped_plan(model_type, tp=tp, ep=ep, dp=dp, ep_implementation=strategy)
            if ep == 1:  # TP-only: the experts tensor-parallel
                plan["ep_plan"] = {}
                plan["tp_plan"].update({"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                                        "model.layers.*.mlp.experts.down_proj": "rowwise",
                                        "model.layers.*.mlp.experts": "moe_tp_experts"})
            model = planc.load(hub, plan)
            batch_ids, batch_mask = (ids, mask) if dp == 1 else (ids[rank:rank + 1], mask[rank:rank + 1])
            for cache in (None, "static"):
                kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
                if cache:
                    kwargs["cache_implementation"] = cache
                with torch.no_grad():
                    got = model.generate(batch_ids, attention_mask=batch_mask, **kwargs)
                    want = ref.generate(batch_ids, attention_mask=batch_mask, **kwargs)
                out[f"{model_type}/{name}/{cache or 'dynamic'}"] = bool(torch.equal(got, want))
    return out
