"""Workers for test_mla.py and test_dense_ep.py (module-level: spawned): MLA attention tensor-parallel with and
without `mla_kv_a_proj`; Llama 4's pre-scaled experts expert-parallel."""

from __future__ import annotations

import copy

from tests.runtime.workers import batch, train_step_diff

PLAN = """\
version: 1
model: {type: deepseek_v2}
parallel: {tp_size: 2, ep_size: 2}
experts: {implementation: grouped_mm, ep_implementation: all_to_all}
tp_plan:
  model.embed_tokens: embedding_rowwise
  model.layers.*.self_attn.q_b_proj: colwise
  model.layers.*.self_attn.kv_a_proj_with_mqa: KV_A_STYLE
  model.layers.*.self_attn.kv_b_proj: colwise
  model.layers.*.self_attn.o_proj: rowwise
  model.layers.*.mlp.shared_experts.{gate,up}_proj: colwise
  model.layers.*.mlp.shared_experts.down_proj: rowwise
  lm_head: colwise_gather_output
ep_plan:
  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm
  model.layers.*.mlp.experts: ep_dispatch_experts
"""


def mla_world(rank, world_size):
    """{"refused": apply's error for `replicate` on kv_a_proj_with_mqa, "mla_kv_a_proj" / "unwrapped":
    (|loss diff|, max |grad diff| of kv_a_proj_with_mqa, max |grad diff| of every parameter)}: "unwrapped" is the
    installed plan with the style's forward taken off kv_a_proj_with_mqa (the partial gradient it exists for)."""
    from planc import apply
    from planc.errors import ApplyError, CompileError
    from planc.models.build import build_tiny_model

    out = {}
    base = build_tiny_model("deepseek_v2", seed=3)
    try:
        apply(copy.deepcopy(base), PLAN.replace("KV_A_STYLE", "replicate"))
        out["refused"] = ""
    except (CompileError, ApplyError) as e:  # every rank's compile, in one error
        out["refused"] = str(e)
    for variant in ("mla_kv_a_proj", "unwrapped"):
        model, ref = copy.deepcopy(base), copy.deepcopy(base)
        apply(model, PLAN.replace("KV_A_STYLE", "mla_kv_a_proj"))
        for layer in model.model.layers:
            proj = layer.self_attn.kv_a_proj_with_mqa
            if variant == "mla_kv_a_proj":
                out["installed"] = getattr(proj.forward, "planc_style", None)
            else:
                del proj.forward  # the instance attribute the style set: back to nn.Linear's forward
        loss, _ = train_step_diff(model, ref, batch(4))
        _, kv_a = _kv_a_grads(model, ref)
        model.zero_grad(), ref.zero_grad()
        _, every = train_step_diff(model, ref, batch(4))
        out[variant] = (loss, kv_a, every)
    return out


def _kv_a_grads(model, ref):
    from tests.runtime.workers import full

    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        if "kv_a_proj_with_mqa" in name:
            worst = max(worst, (full(p.grad) - ref_params[name].grad).abs().max().item())
    return None, worst


def _init_plan(model_type: str, world_size: int) -> dict:
    """The plan `planc init --from-transformers MODEL_TYPE` writes for the family's tiny config at this world size."""
    import yaml

    from planc.models.synthesis import init_plan
    from planc.models.families import family
    from planc.models.build import tiny_config

    fam = family(model_type)
    return yaml.safe_load(init_plan(fam.model_type, tiny_config(fam).to_dict(), sizes=(world_size,)))


def _each_strategy(base, plan: dict, strategies, local_experts) -> dict:
    """`plan` applied to a copy of `base` with each EP strategy, against an unsharded copy: {strategy: (logits, loss,
    grads) diffs, "experts per rank": experts in `local_experts(model)`'s local shard}."""
    import torch

    from planc import apply
    from tests.runtime.workers import logits_diff

    out = {}
    for strategy in strategies:
        plan["experts"]["ep_implementation"] = strategy
        model, ref = copy.deepcopy(base), copy.deepcopy(base)
        apply(model, plan)
        out["experts per rank"] = int(local_experts(model).to_local().shape[0])
        logits = logits_diff(model, ref, batch(3))
        loss, grads = train_step_diff(model, ref, batch(4))
        out[strategy] = (logits, loss, grads)
        torch.distributed.barrier()
    return out


def dense_ep_world(rank, world_size):
    """Llama 4 (experts take every token pre-scaled) under the plan `planc init` writes, EP over the TP group:
    {strategy: (max |logits diff|, |loss diff|, max |grad diff|), "experts per rank": int}."""
    from planc.models.build import build_tiny_model

    plan = _init_plan("llama4_text", world_size)
    base = build_tiny_model("llama4_text", seed=5)
    out = {"ep_size": plan["parallel"].get("ep_size", 1)}
    out.update(_each_strategy(base, plan, ("all_to_all", "all_reduce"),
                              lambda m: m.model.layers[0].feed_forward.experts.gate_up_proj))
    return out


def own_forward_ep_world(rank, world_size):
    """longcat_flash (its own experts forward: the model cannot switch its experts implementation; parameter-free
    "zero" experts past the routed ones) under the plan `planc init` writes: {strategy: (logits, loss, grads)
    diffs}, "experts per rank", "zero experts hit" (routes to the parameter-free experts in the batch)."""
    import torch

    from planc.models.build import build_tiny_model

    plan = _init_plan("longcat_flash", world_size)
    base = build_tiny_model("longcat_flash", seed=5)
    routed = base.config.n_routed_experts
    hits = []
    router = base.model.layers[0].mlp.router
    hook = router.register_forward_hook(lambda m, a, o: hits.append(int((o[2] >= routed).sum())))
    with torch.no_grad():
        base(input_ids=batch(3))
    hook.remove()
    out = {"ep_size": plan["parallel"].get("ep_size", 1), "zero experts hit": sum(hits)}
    out.update(_each_strategy(base, plan, ("all_to_all", "all_reduce", "auto"),
                              lambda m: m.model.layers[0].mlp.experts.down_proj))
    return out
