"""Code that runs on every rank of a spawned gloo world (module level: spawn pickles functions by name).

Each world builds tiny random transformers models from configs, applies the shipped plans with
their sizes overridden to the world, and returns plain numbers / strings that the tests assert on.
One world runs many checks: spawning (importing torch + transformers per rank) is the slow part.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

TOL = 1e-5
PLANS = Path(__file__).resolve().parents[2] / "plans"
PLAN_FILES = {
    "mixtral": "mixtral.yaml",
    "qwen3_moe": "qwen3_moe.yaml",
    "gpt_oss": "gpt_oss.yaml",
    "deepseek_v3": "deepseek_v3.yaml",
    "deepseek_v4": "deepseek_v4_allreduce.yaml",
}



def _shipped_cases() -> dict[str, tuple[str, str, dict]]:
    """{plan name: (model type, plan file, extra experts settings)} for every plan in plans/, found on disk (a new
    plan is covered by the load/save/export tests without editing them). Mega MoE plans run the reference backend
    (no SM100 GPU here)."""
    from planc.lint.plan_loader import load_plan

    cases = {}
    for path in sorted(PLANS.glob("*.yaml")):
        plan = load_plan(str(path)).plan
        extra = {"backend": "reference"} if plan.experts.implementation == "deepgemm_megamoe" else {}
        cases[path.stem] = (plan.model.type, path.name, extra)
    return cases


SHIPPED = _shipped_cases()
# Tiny configs whose 2 KV heads a 4-rank tensor-parallel plan could not split (PLC617): 4 heads of their own.
FOUR_RANK_HEADS = {t: {"num_key_value_heads": 4} for t in ("glm4_moe", "llama4_text", "minimax_m2", "qwen3_next")}


def shipped_case_plan(name: str, *, tp: int, ep: int | None = None) -> dict:
    """The shipped plan `plans/<name>.yaml` at tp = ep = `tp` (with its case's experts settings)."""
    model_type, file, extra = SHIPPED[name]
    return shipped_plan(model_type, tp=tp, ep=ep, file=file, **dict(extra))


def tiny_for_case(name: str, seed: int = 0, **overrides):
    """The tiny random model a shipped plan's tests use (4 KV heads where 4-rank TP needs them)."""
    from planc.models.build import build_tiny_model

    model_type = SHIPPED[name][0]
    return build_tiny_model(model_type, seed=seed, **{**FOUR_RANK_HEADS.get(model_type, {}), **overrides})


# ---- helpers -------------------------------------------------------------------------------------------------


def shipped_plan(model_type: str, *, tp: int, ep: int | None = None, dp: int = 1, file: str | None = None, **experts):
    """A shipped plan as a mapping, sizes overridden (and `experts` settings, e.g. ep_implementation)."""
    from planc.lint.plan_loader import load_plan

    data = load_plan(str(PLANS / (file or PLAN_FILES[model_type]))).plan.model_dump()
    data["extends"] = None  # already merged
    data["parallel"] = {"tp_size": tp, "ep_size": ep if ep is not None else tp, "dp_size": dp}
    backend = experts.pop("backend", None)
    data["experts"].update(experts)
    if backend is not None:
        data["experts"]["megamoe"]["backend"] = backend
    return data


def batch(seed: int, rows: int = 2, cols: int = 9) -> torch.Tensor:
    return torch.randint(0, 128, (rows, cols), generator=torch.Generator().manual_seed(seed))


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def logits_diff(model, ref, ids) -> float:
    with torch.no_grad():
        return (model(ids).logits - ref(ids).logits).abs().max().item()


def train_step_diff(model, ref, ids, *, only=None) -> tuple[float, float]:
    """One training step on both models: |loss diff| and the max |grad diff| over every (gathered) gradient."""
    model.train()
    ref.train()
    loss, ref_loss = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        if only is not None and only not in name:
            continue
        r = ref_params[name].grad
        if r is None and p.grad is None:
            continue
        if (r is None) != (p.grad is None):
            return abs(loss.item() - ref_loss.item()), float("inf")  # a gradient went missing
        g = full(p.grad)
        if g.ndim and g.shape[1:] == r.shape[1:] and g.shape[0] < r.shape[0]:
            # rows the forward never reads were dropped by the sharding (longcat_flash's gate_up_proj rows of its
            # parameter-free experts): their reference gradient is zero
            worst = max(worst, r[g.shape[0]:].abs().max().item())
            r = r[: g.shape[0]]
        worst = max(worst, (g - r).abs().max().item())
    model.eval()
    ref.eval()
    return abs(loss.item() - ref_loss.item()), worst


def fresh(model_type: str, impl: str | None = None, **overrides):
    """A tiny model and an unsharded copy of it (running the same experts implementation)."""
    from planc.models.build import build_tiny_model

    model = build_tiny_model(model_type, **overrides)
    ref = copy.deepcopy(model)
    if impl:
        ref.set_experts_implementation(impl)
    return model, ref


def ep_runtimes(model):
    return [m.forward.runtime for m in model.modules() if hasattr(m.__dict__.get("forward"), "runtime")]


# ---- equivalence worlds --------------------------------------------------------------------------------------


def equivalence_world(rank, world_size, model_types):
    """Every model of `model_types` in one world (spawning dominates the cost): {model: checks or traceback}."""
    import traceback

    out = {}
    for model_type in model_types:
        try:
            out[model_type] = equivalence_checks(rank, world_size, model_type)
        except Exception:  # noqa: BLE001 - report every model, not only the first failure
            out[model_type] = traceback.format_exc()
    return out


def equivalence_checks(rank, world_size, model_type):
    """Logits and a training step vs an unsharded copy, for all_to_all, all_reduce and auto (+ extras)."""
    from planc import apply

    res = {}
    for strategy in ("all_to_all", "all_reduce", "auto"):
        plan = shipped_plan(model_type, tp=world_size, ep_implementation=strategy)
        model, ref = fresh(model_type, plan["experts"]["implementation"])
        apply(model, plan)
        key = f"tp{world_size}/ep{world_size}/{strategy}"
        res[f"{key}/logits"] = logits_diff(model, ref, batch(1))
        if strategy == "all_to_all":  # 3 tokens: fewer than 4 ranks, not dividing 2; some TP slices are empty
            res[f"{key}/logits_3_tokens"] = logits_diff(model, ref, batch(9, rows=1, cols=3))
            loss, grads = train_step_diff(model, ref, batch(9, rows=1, cols=3))
            res[f"{key}/loss_3_tokens"], res[f"{key}/grads_3_tokens"] = loss, grads
            model.zero_grad()
            ref.zero_grad()
        if strategy == "auto":
            chosen = {rt.last_choice for rt in ep_runtimes(model)}
            res[f"{key}/no_grad_choice"] = chosen
        res[f"{key}/loss"], res[f"{key}/grads"] = train_step_diff(model, ref, batch(2))
        if strategy == "auto":
            res[f"{key}/grad_choice"] = {rt.last_choice for rt in ep_runtimes(model)}
    if model_type == "gpt_oss":  # eager GPT-OSS experts cannot take the sentinel: all_reduce parks slots on expert 0
        plan = shipped_plan(model_type, tp=world_size, ep_implementation="all_reduce", implementation="eager")
        model, ref = fresh(model_type, "eager")
        apply(model, plan)
        res[f"tp{world_size}/ep{world_size}/all_reduce+eager/logits"] = logits_diff(model, ref, batch(3))
        loss, grads = train_step_diff(model, ref, batch(4))
        res[f"tp{world_size}/ep{world_size}/all_reduce+eager/loss"] = loss
        res[f"tp{world_size}/ep{world_size}/all_reduce+eager/grads"] = grads
    if model_type == "mixtral" and world_size == 2:
        res.update(_moe_tp_experts(world_size))
    if model_type == "mixtral" and world_size == 4:
        res.update(_ep_wider_than_tp(rank))
    if model_type in ("mixtral", "qwen3_moe") and world_size == 2:
        res.update(_transformers_peer(model_type, world_size))
    if model_type == "deepseek_v3" and world_size == 2:
        res.update(_bf16_fp32_router(world_size))
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _bf16_fp32_router(world_size):
    """The shipped DeepSeek-V3 plan as users run it: bf16 with the routers fp32 (transformers' from_pretrained with
    dtype=bfloat16 keeps `gate.weight` and `e_score_correction_bias` fp32), TP over the world, and q_a_proj split over
    its input (the shipped plan keeps it whole: one more all-reduce per layer in decode for ~1.1 GiB/rank; the split
    is the plan author's choice, so it is checked here on MLA). Against the unsharded bf16 model: q_a_proj's output (after its all-reduce) and the logits, one
    training step's loss and every gradient, relative (||sharded - unsharded|| / ||unsharded||: bf16 rounding, where
    a missing or doubled reduce gives ~1); the routers' parameter and gradient dtypes, as transformers gives them."""
    from transformers import AutoModelForCausalLM

    from planc import apply
    from planc.models.build import tiny_config

    plan = shipped_plan("deepseek_v3", tp=world_size, ep_implementation="all_to_all")
    assert "model.layers.*.self_attn.q_a_proj" not in plan["tp_plan"]
    plan["tp_plan"]["model.layers.*.self_attn.q_a_proj"] = "rowwise_split_input"
    torch.manual_seed(3)  # the same weights on every rank
    ref = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3"), dtype=torch.bfloat16)
    ref.set_experts_implementation(plan["experts"]["implementation"])
    model = copy.deepcopy(ref)
    apply(model, plan)
    key = f"tp{world_size}/ep{world_size}/bf16"
    seen: dict[str, list[torch.Tensor]] = {"model": [], "ref": []}
    for name, m in (("model", model), ("ref", ref)):
        for layer in m.model.layers:
            layer.self_attn.q_a_proj.register_forward_hook(lambda mod, args, out, name=name: seen[name].append(out))
    ids = batch(5)
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref(ids).logits
    res = {f"{key}/q_a_proj_out_rel": max(_rel(a, b) for a, b in zip(seen["model"], seen["ref"], strict=True)),
           f"{key}/logits_rel": _rel(logits, ref_logits), f"{key}/q_a_proj_calls": len(seen["ref"])}
    model.train()
    ref.train()
    loss, ref_loss = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    res[f"{key}/loss"] = abs(loss.item() - ref_loss.item())
    ref_params = dict(ref.named_parameters())
    grads = {name: _rel(full(p.grad), ref_params[name].grad) for name, p in model.named_parameters()}
    res[f"{key}/grads_rel"] = max(grads.values())
    res[f"{key}/q_a_proj_grads_rel"] = max(v for n, v in grads.items() if "q_a_proj" in n)
    res[f"{key}/q_a_proj_placements"] = sorted({str(getattr(p, "placements", "whole")) for n, p in model.named_parameters()
                                                if "q_a_proj" in n})
    def router_dtypes(m: torch.nn.Module) -> list[str]:
        routers = [p for n, p in m.named_parameters() if n.endswith("mlp.gate.weight")]
        return sorted({f"param {p.dtype}" for p in routers} | {f"grad {p.grad.dtype}" for p in routers})

    # the routers keep the dtype transformers gives them (fp32 in 5.25, bf16 in 5.23), in parameter and gradient
    res[f"{key}/router_dtypes"] = router_dtypes(model) == router_dtypes(ref) and len(router_dtypes(ref)) == 2
    return res


def _moe_tp_experts(world_size):
    """ep_size == 1: experts tensor-parallel (packed_colwise gate_up, rowwise down, moe_tp_experts)."""
    from planc import apply

    plan = shipped_plan("mixtral", tp=world_size, ep=1)
    plan["ep_plan"] = {}
    plan["tp_plan"].update(
        {
            "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
            "model.layers.*.mlp.experts.down_proj": "rowwise",
            "model.layers.*.mlp.experts": "moe_tp_experts",
        }
    )
    model, ref = fresh("mixtral", plan["experts"]["implementation"])
    apply(model, plan)
    key = f"tp{world_size}/ep1/moe_tp_experts"
    loss, grads = train_step_diff(model, ref, batch(6))
    return {f"{key}/logits": logits_diff(model, ref, batch(5)), f"{key}/loss": loss, f"{key}/grads": grads}


def _ep_wider_than_tp(rank):
    """tp=2, dp=2, ep=4: the EP group spans two batches; each replica feeds its own tokens."""
    from planc import apply

    plan = shipped_plan("mixtral", tp=2, ep=4, dp=2, ep_implementation="all_to_all")
    model, ref = fresh("mixtral", plan["experts"]["implementation"])
    apply(model, plan)
    replica = rank // 2
    key = "tp2/ep4/dp2/all_to_all"
    ids = [batch(10 + r) for r in range(2)]
    out = {f"{key}/logits": logits_diff(model, ref, ids[replica])}
    # Training (dp_size 2, `data_parallel: replicate` by default): every gradient is that of the mean of both
    # replicas' losses, the experts' too (the all_to_all summed them over both replicas' tokens: planc divides).
    model.train()
    ref.train()
    loss = model(ids[replica], labels=ids[replica]).loss
    loss.backward()
    ref_losses = [ref(i, labels=i).loss for i in ids]
    (sum(ref_losses) / 2).backward()
    out[f"{key}/loss"] = abs(loss.item() - ref_losses[replica].item())
    ref_params = dict(ref.named_parameters())
    out[f"{key}/expert_grads"] = max(
        (full(p.grad) - ref_params[n].grad).abs().max().item() for n, p in model.named_parameters() if ".experts." in n
    )
    out[f"{key}/dense_grads"] = max(
        (full(p.grad) - ref_params[n].grad).abs().max().item() for n, p in model.named_parameters()
        if ".experts." not in n
    )
    return out


def _expand(table: dict) -> dict:
    """planc patterns ({a,b} alternatives) -> transformers plan keys (one key per alternative)."""
    from planc.spec.patterns import Pattern

    return {".".join(alt): style for key, style in table.items() for alt in Pattern(key).alternatives}


def _transformers_peer(model_type, world_size):
    """The same model + plan through transformers' own EP gives the same logits as planc."""
    from transformers import DistributedConfig

    from planc import apply

    out = {}
    for strategy in ("all_to_all", "all_reduce"):
        plan = shipped_plan(model_type, tp=world_size, ep_implementation=strategy)
        ours, _ = fresh(model_type)
        theirs = copy.deepcopy(ours)
        apply(ours, plan)
        theirs.set_experts_implementation(plan["experts"]["implementation"])
        dc = DistributedConfig(
            tp_size=world_size,
            ep_size=world_size,
            tp_plan=_expand(plan["tp_plan"]),
            ep_plan=_expand(plan["ep_plan"]),
            ep_implementation=strategy,
        )
        cls = type(theirs)
        dc, _, mesh_manager = cls.prepare_distribute_model(dc)
        theirs = cls.maybe_distribute_model(theirs, dc, mesh_manager)
        with torch.no_grad():
            ids = batch(7)
            diff = (ours(ids).logits - theirs(ids).logits).abs().max().item()
        out[f"tp{world_size}/ep{world_size}/{strategy}/vs_transformers"] = diff
        # A model transformers already sharded is refused.
        try:
            apply(theirs, plan)
            out["refuses_transformers_sharded"] = "applied"
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out["refuses_transformers_sharded"] = f"{type(e).__name__}: {e}"
    return out


# ---- install: errors and rollback ------------------------------------------------------------------------------


def capture(model) -> dict:
    """Everything apply may touch, in a comparable form (identities and exact tensor values)."""

    def attrs(obj):
        out = {}
        for k, v in obj.__dict__.items():
            if isinstance(v, dict):
                out[k] = {kk: id(vv) for kk, vv in v.items()}
            elif isinstance(v, (list, set)):
                out[k] = sorted(map(id, v))
            else:
                out[k] = id(v)
        return out

    return {
        "params": [(n, id(p), type(p), p.requires_grad, sorted(p.__dict__)) for n, p in model.named_parameters()],
        "values": {n: p.detach().clone() for n, p in model.state_dict(keep_vars=True).items()},
        "modules": {n: attrs(m) for n, m in model.named_modules()},
        "config": (model.config._experts_implementation, model.config.to_dict()),
    }


def differences(before: dict, after: dict) -> list[str]:
    out = []
    for key in ("params", "modules", "config"):
        if before[key] != after[key]:
            if key == "modules":
                changed = [n for n in before[key] if before[key][n] != after[key].get(n)]
                out.append(f"module attributes changed: {changed[:5]}")
            else:
                out.append(f"{key} changed")
    if before["values"].keys() != after["values"].keys():
        out.append("state_dict keys changed")
    else:
        for n, v in before["values"].items():
            w = after["values"][n]
            if type(w) is not type(v) or v.shape != w.shape or v.dtype != w.dtype or not torch.equal(v, w):
                out.append(f"{n} changed")
    return out


class Injected(RuntimeError):
    pass


def _failing_after(step, should_fail: bool):
    def step_then_fail(state):
        step(state)
        if should_fail:
            raise Injected(f"injected failure after {step.__name__}")

    return step_then_fail


def rollback_world(rank, world_size):
    """A failure injected after each install step (on every rank, or on rank 1 only) leaves the model as it was."""
    from planc import apply
    from planc.errors import ApplyError
    from planc.runtime import install

    plans = {
        "qwen3_moe": shipped_plan("qwen3_moe", tp=world_size),
        "deepseek_v4": shipped_plan(
            "deepseek_v4", tp=world_size, file="deepseek_v4_megamoe.yaml", backend="reference"
        ),
    }
    out = {}
    steps = list(install.INSTALL_STEPS)
    for model_type, plan in plans.items():
        model, _ = fresh(model_type)
        ids = batch(1)
        with torch.no_grad():
            logits = model(ids).logits
        before = capture(model)
        for i, step in enumerate(steps):
            for who in ("all", "rank1"):
                install.INSTALL_STEPS[:] = steps
                install.INSTALL_STEPS[i] = _failing_after(step, who == "all" or rank == 1)
                try:
                    apply(model, plan)
                    problems = ["apply did not raise"]
                except ApplyError as e:
                    problems = [] if "restored exactly" in str(e) and "injected" in str(e) else [f"message: {e}"]
                finally:
                    install.INSTALL_STEPS[:] = steps
                problems += differences(before, capture(model))
                with torch.no_grad():
                    if not torch.equal(model(ids).logits, logits):
                        problems.append("logits changed")
                out[f"{model_type}/{step.__name__}/{who}"] = problems
        # after all that, the real apply still works on the same model
        apply(model, plan)
        with torch.no_grad():
            out[f"{model_type}/apply_after_rollbacks"] = (model(ids).logits - logits).abs().max().item()
    return out


def errors_world(rank, world_size):
    """Each refusal raises the same ApplyError on every rank, and leaves the model untouched."""
    from planc import apply
    from planc.errors import ApplyError

    out = {}

    def attempt(name, model, plan, **kwargs):
        before = capture(model)
        try:
            apply(model, plan, **kwargs)
            out[name] = ("no error", [])
        except ApplyError as e:
            out[name] = (str(e), differences(before, capture(model)))

    model, _ = fresh("mixtral")
    # ranks disagree: another EP implementation on rank 1 -> another fingerprint
    other = "all_reduce" if rank == 1 else "all_to_all"
    attempt("disagree", model, shipped_plan("mixtral", tp=world_size, ep_implementation=other))
    # rank 1's plan does not even load (unknown style): rank 0 must not hang
    bad = shipped_plan("mixtral", tp=world_size)
    if rank == 1:
        bad["tp_plan"]["lm_head"] = "colwise_gather_outputs"
    attempt("rank1_invalid_plan", model, bad)
    attempt("world_size", model, shipped_plan("mixtral", tp=2 * world_size))
    # sizes that fail lint on their own (PLC501: ep 2 does not divide tp * dp = 1): the world's sizes come first
    attempt("world_size_ep", model, shipped_plan("mixtral", tp=1, ep=world_size, dp=1))
    # plans that used to install and then crash at the first forward
    lm_head = shipped_plan("mixtral", tp=world_size)
    lm_head["tp_plan"]["lm_head"] = "colwise"
    attempt("lm_head_colwise", model, lm_head)
    rowwise = shipped_plan("mixtral", tp=world_size)
    del rowwise["tp_plan"]["model.layers.*.self_attn.{q,k,v}_proj"]
    attempt("rowwise_without_colwise", model, rowwise)
    attempt("deepgemm_on_cpu", model, shipped_plan("mixtral", tp=world_size, implementation="deepgemm"))
    attempt("sonicmoe_on_cpu", model, shipped_plan("mixtral", tp=world_size, implementation="sonicmoe"))
    # (Mega MoE `backend: auto` on CPU is no refusal: it runs the reference with a RuntimeWarning,
    # tests/kernels/megamoe/test_deep_gemm_binding.py::test_auto_falls_back_to_the_reference_with_a_warning_naming_why.)
    from torch.distributed.device_mesh import init_device_mesh

    wrong_mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    attempt("caller_mesh_mismatch", model, shipped_plan("mixtral", tp=world_size), mesh=wrong_mesh)
    # the caller's own (dp, tp) mesh is used as given
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    reference = copy.deepcopy(model)
    apply(model, shipped_plan("mixtral", tp=world_size), mesh=mesh)
    out["caller_mesh_logits"] = logits_diff(model, reference, batch(1))
    attempt("double_apply", model, shipped_plan("mixtral", tp=world_size))
    return out


# ---- deepgemm_megamoe ----------------------------------------------------------------------------------------


def megamoe_world(rank, world_size, batch_sizes):
    """planc's sliced Mega MoE (reference backend) vs the single-process reference of the same FP4 experts."""
    from planc import apply
    from planc.runtime.megamoe import install_megamoe_forward

    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group, in order
    single = singles[rank]
    plan = shipped_plan("deepseek_v4", tp=world_size, file="deepseek_v4_megamoe.yaml", backend="reference")
    model, ref = fresh("deepseek_v4")
    num_experts = model.config.n_routed_experts
    for name, experts in ref.named_modules():
        if name.endswith("mlp.experts"):
            install_megamoe_forward(
                experts, backend="reference", quantize="fp4", num_global_experts=num_experts, ep_size=1
            )
            unsharded = experts.forward
            experts.forward = lambda h, i, w, _f=unsharded: _f(h, i, w, process_group=single)
    apply(model, plan)
    out = {}
    layer = model.model.layers[1].mlp.experts
    ref_layer = ref.model.layers[1].mlp.experts
    gen = torch.Generator().manual_seed(3)
    for t in batch_sizes:
        x = torch.randn(t, model.config.hidden_size, generator=gen)
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(t)])
        w = torch.rand(t, 2, generator=gen)
        with torch.no_grad():
            y, expected = layer(x, idx, w), ref_layer(x, idx, w)
        out[f"experts/T={t}"] = (tuple(y.shape), (y - expected).abs().max().item() if t else 0.0)
    ids = batch(8)
    with torch.no_grad():
        out["logits"] = (model(ids).logits - ref(ids).logits).abs().max().item()
        out["logits_scale"] = ref(ids).logits.abs().max().item()
    try:
        model(ids)  # grad mode on, parameters require grad
        out["under_grad"] = "no error"
    except RuntimeError as e:
        out["under_grad"] = str(e)
    return out
