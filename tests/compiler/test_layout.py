"""The layout pass and the size hints: each plan that lint once passed and apply then crashed on
is refused by the compiler, before anything is installed, with the module, the plan line and a fix."""

from __future__ import annotations

import textwrap

import pytest

import planc
from planc.compiler.experts_assignments import EXPERTS_NOT_DIVISIBLE, EXPERTS_UNCOVERED
from planc.compiler.layout import (
    LAYOUT_MODULE_PARAM_CONFLICT, LAYOUT_NORM_OVER_SHARDED, LAYOUT_OUTPUT_LEFT_SHARDED, LAYOUT_PARTIAL_GRADIENT,
    LAYOUT_PER_HEAD_SPLIT_HEADS_WHOLE, LAYOUT_PRODUCERS_DISAGREE, LAYOUT_ROWWISE_WITHOUT_SHARDED,
    LAYOUT_SHARDED_INTO_REPLICATED,
)
from planc.errors import CompileError
from planc.models.build import build_meta_model, build_tiny_model
from planc.spec.sizes import Sizes, check_sizes, solve_sizes

HEAD = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2, ep_size: 2}\n"
EP = (
    "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
)
ATTN = "  model.layers.*.self_attn.{q,k,v}_proj: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n"


@pytest.fixture(scope="module")
def mixtral():
    return build_tiny_model("mixtral")


def refused(tmp_path, text, model, code):
    path = tmp_path / "plan.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(CompileError) as info:
        planc.compile(model, str(path))
    found = [p for p in info.value.problems if p.code == code]
    assert found, [str(p) for p in info.value.problems]
    return str(path), found


def test_lm_head_colwise_leaves_the_logits_sharded(tmp_path, mixtral):
    path, (p,) = refused(tmp_path, HEAD + "tp_plan:\n" + ATTN + "  lm_head: colwise\n" + EP, mixtral, LAYOUT_OUTPUT_LEFT_SHARDED)
    assert p.module == "lm_head" and p.where == f"{path}:7:3"
    assert "`lm_head: colwise_gather_output`" in p.hint and "1/2 of the logits" in p.message


def test_module_rule_that_contradicts_a_parameter_rule(tmp_path, mixtral):
    text = HEAD + "tp_plan:\n  lm_head: colwise_gather_output\n  lm_head.weight: rowwise\n" + EP
    path, (p,) = refused(tmp_path, text, mixtral, LAYOUT_MODULE_PARAM_CONFLICT)
    assert p.module == "lm_head.weight" and p.where == f"{path}:6:3"
    assert "colwise_gather_output" in p.message and "rowwise" in p.message and "delete `lm_head.weight`" in p.hint


def test_rowwise_o_proj_with_replicated_qkv(tmp_path, mixtral):
    text = HEAD + "tp_plan:\n  model.layers.*.self_attn.o_proj: rowwise\n" + EP
    path, (p,) = refused(tmp_path, text, mixtral, LAYOUT_ROWWISE_WITHOUT_SHARDED)
    assert p.module.startswith("model.layers.*.self_attn.o_proj (2 targets") and p.where == f"{path}:5:3"
    assert "rowwise_split_input" in p.hint and "colwise" in p.hint
    assert "MixtralConfig.base_model_tp_plan" in p.message  # what the pass assumed about the data flow


def test_colwise_qkv_without_an_o_proj_rule(tmp_path, mixtral):
    text = HEAD + "tp_plan:\n  model.layers.*.self_attn.{q,k,v}_proj: colwise\n" + EP
    _, (p,) = refused(tmp_path, text, mixtral, LAYOUT_SHARDED_INTO_REPLICATED)
    assert "o_proj" in p.module and "`model.layers.*.self_attn.o_proj: rowwise`" in p.hint


def test_qkv_that_disagree(tmp_path, mixtral):
    text = HEAD + "tp_plan:\n  model.layers.*.self_attn.q_proj: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n" + EP
    _, (p,) = refused(tmp_path, text, mixtral, LAYOUT_PRODUCERS_DISAGREE)
    assert "k_proj, v_proj" in p.message and "q_proj" in p.message


def test_colwise_o_proj_feeds_the_residual_sharded(tmp_path, mixtral):
    text = HEAD + "tp_plan:\n  model.layers.*.self_attn.{q,k,v}_proj: colwise\n  model.layers.*.self_attn.o_proj: colwise\n" + EP
    _, found = refused(tmp_path, text, mixtral, LAYOUT_SHARDED_INTO_REPLICATED)
    assert any("residual stream" in p.message for p in found)


def test_colwise_router_gate_is_consumed_whole(tmp_path, mixtral):
    text = HEAD + "tp_plan:\n" + ATTN + "  model.layers.*.mlp.gate: colwise\n" + EP
    _, (p,) = refused(tmp_path, text, mixtral, LAYOUT_SHARDED_INTO_REPLICATED)
    assert p.module.startswith("model.layers.*.mlp.gate ") and "colwise_gather_output" in p.hint


def test_norm_over_the_sharded_heads(tmp_path):
    # OLMoE normalizes q and k over all heads at once, so transformers' own plan gathers q/k/v first.
    olmoe = build_meta_model("olmoe", {"num_hidden_layers": 2})
    text = (
        "version: 1\nmodel: {type: olmoe}\nparallel: {tp_size: 2, ep_size: 2}\ntp_plan:\n" + ATTN
        + "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
        "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    )
    _, found = refused(tmp_path, text, olmoe, LAYOUT_NORM_OVER_SHARDED)
    assert {p.module.split(" ")[0] for p in found} == {"model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"}
    assert "colwise_gather_output" in found[0].hint and "rowwise_split_input" in found[0].hint
    # transformers' own OLMoE attention plan (gathered q/k/v, split-input o_proj) passes
    ok = text.replace(ATTN, "  model.layers.*.self_attn.{q,k,v}_proj: colwise_gather_output\n"
                            "  model.layers.*.self_attn.o_proj: rowwise_split_input\n")
    (tmp_path / "ok.yaml").write_text(ok)
    planc.compile(olmoe, str(tmp_path / "ok.yaml"))


def test_mla_low_rank_projection_feeds_a_norm(tmp_path):
    ds = build_tiny_model("deepseek_v3")
    text = (
        "version: 1\nmodel: {type: deepseek_v3}\nparallel: {tp_size: 2, ep_size: 2}\ntp_plan:\n"
        "  model.layers.*.self_attn.q_a_proj: colwise\n"
        "ep_plan:\n  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
        "  model.layers.*.mlp.experts: ep_dispatch_experts\n"
    )
    _, (p,) = refused(tmp_path, text, ds, LAYOUT_NORM_OVER_SHARDED)
    assert "q_a_layernorm" in p.message and "module names" in p.message


def test_qwen3_per_head_norms_are_fine():
    # q_norm/k_norm of Qwen3 normalize each head_dim slice, so colwise q/k/v may feed them
    from planc.lint.plan_loader import load_plan

    model = build_meta_model("qwen3_moe", {"num_hidden_layers": 2})
    compiled = planc.compile(model, load_plan("plans/qwen3_moe.yaml"))
    styles = {a.fqn: a.style for a in compiled.assignments}
    attn = "model.layers.0.self_attn"
    assert styles[f"{attn}.q_proj"] == styles[f"{attn}.k_proj"] == "colwise"  # sharded heads feed the norms
    assert styles[f"{attn}.q_norm"] == "replicated_with_grad_allreduce"  # the norm stays whole on every rank
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert dict(model.named_parameters())[f"{attn}.q_norm.weight"].shape == (head_dim,)  # one head wide
    assert not [w for w in compiled.warnings if w.code.startswith("PLC63")]  # no layout warning either


def test_whole_parameter_whose_gradient_is_partial(tmp_path):
    # Qwen3's per-head q_norm/k_norm under colwise q/k: the forward is right on each rank's heads, but each rank's
    # backward holds only its heads' part of the norm's gradient; `replicate` (or no rule) trains on partial grads
    model = build_meta_model("qwen3_moe", {"num_hidden_layers": 2})
    text = HEAD.replace("mixtral", "qwen3_moe") + "tp_plan:\n" + ATTN + (
        "  model.layers.*.self_attn.{q,k}_norm: replicate\n") + EP
    path, found = refused(tmp_path, text, model, LAYOUT_PARTIAL_GRADIENT)
    assert {p.module.split(" ")[0] for p in found} == {"model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"}
    assert found[0].where.startswith(f"{path}:7:3")  # the `replicate` rule's line
    assert "partial" in found[0].message and "add `model.layers.*.self_attn.q_norm: replicated_with_grad_allreduce`" in found[0].hint
    assert "in place of `model.layers.*.self_attn.{q,k}_norm: replicate`" in found[0].hint
    (tmp_path / "ok.yaml").write_text(text.replace(": replicate\n", ": replicated_with_grad_allreduce\n"))
    planc.compile(model, str(tmp_path / "ok.yaml"))
    # attention left whole: every rank computes the whole norm gradient, nothing to reduce (Qwen3-Next's plan)
    (tmp_path / "whole.yaml").write_text(HEAD.replace("mixtral", "qwen3_moe") + EP)
    planc.compile(model, str(tmp_path / "whole.yaml"))


def test_per_head_parameter_split_while_the_heads_stay_whole(tmp_path):
    # sinks split under `local_params` while no projection splits the heads (q/k/v left whole, as init leaves them
    # when the kv heads do not divide): each rank would meet every head with 1/tp of the sinks
    model = build_meta_model("granitemoe_swa", {"num_hidden_layers": 2})
    head = "version: 1\nmodel: {type: granitemoe_swa}\nparallel: {tp_size: 2}\ntp_plan:\n"
    moe = ("  model.layers.*.block_sparse_moe.experts.gate_up_proj: packed_colwise\n"
           "  model.layers.*.block_sparse_moe.experts.down_proj: rowwise\n"
           "  model.layers.*.block_sparse_moe.experts: moe_tp_experts\n")
    sinks = "  model.layers.*.self_attn.sinks: colwise\n  model.layers.*.self_attn: local_params\n"
    path, (p,) = refused(tmp_path, head + sinks + moe, model, LAYOUT_PER_HEAD_SPLIT_HEADS_WHOLE)
    assert p.where.startswith(f"{path}:5:3") and p.module.startswith("model.layers.*.self_attn.sinks")
    assert "1/2 of sinks" in p.message and "delete `model.layers.*.self_attn.sinks`" in p.hint
    # the heads split with them: the sinks go with their heads
    attn = ("  model.layers.*.self_attn.{q,k,v}_proj: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n")
    (tmp_path / "ok.yaml").write_text(head + attn + sinks + moe)
    planc.compile(model, str(tmp_path / "ok.yaml"))


def test_mla_rope_key_needs_its_own_reduction(tmp_path):
    # MLA: the heads split on q_b_proj/kv_b_proj, and every head reads the rope key kv_a_proj_with_mqa's output
    # ends with; only `mla_kv_a_proj` reduces that slice (replicated_with_grad_allreduce would double the rest)
    model = build_meta_model("deepseek_v2", {"num_hidden_layers": 2, "first_k_dense_replace": 1})
    attn = ("  model.layers.*.self_attn.{q_b_proj,kv_b_proj}: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n")
    head = "version: 1\nmodel: {type: deepseek_v2}\nparallel: {tp_size: 2, ep_size: 2}\ntp_plan:\n"
    for wrong in ("", "  model.layers.*.self_attn.kv_a_proj_with_mqa: replicated_with_grad_allreduce\n"):
        _, (p,) = refused(tmp_path, head + attn + wrong + EP, model, LAYOUT_PARTIAL_GRADIENT)
        assert p.module.startswith("model.layers.*.self_attn.kv_a_proj_with_mqa") and "rope key" in p.message
        assert "`model.layers.*.self_attn.kv_a_proj_with_mqa: mla_kv_a_proj`" in p.hint
    # its q_a_layernorm/kv_a_layernorm normalize the low-rank input of the colwise projections: not per head
    (tmp_path / "ok.yaml").write_text(head + attn + "  model.layers.*.self_attn.kv_a_proj_with_mqa: mla_kv_a_proj\n" + EP)
    planc.compile(model, str(tmp_path / "ok.yaml"))


def test_coverage_is_never_full_without_experts(capsys):
    # a model with no experts module at all: a plan that shards only lm_head is not "full" coverage
    plan = {"version": 1, "model": {"type": "llama"}, "parallel": {"tp_size": 8},
            "tp_plan": {"lm_head": "colwise_gather_output"}}
    compiled = planc.compile(build_meta_model("llama", {"num_hidden_layers": 2}), plan)
    assert not compiled.experts and not compiled.full_coverage
    assert "coverage: INCOMPLETE" in str(compiled) and "no experts module found" in str(compiled)


def test_llama4_experts_are_found_and_must_be_sharded():
    # what `planc init --from-transformers llama4_text` used to write: only lm_head. Llama 4's experts take
    # every token pre-scaled (forward(hidden_states)); planc finds them and refuses to leave them whole.
    plan = {"version": 1, "model": {"type": "llama4_text"}, "parallel": {"tp_size": 8},
            "experts": {"implementation": "eager"}, "tp_plan": {"lm_head": "colwise_gather_output"}}
    with pytest.raises(CompileError) as info:
        planc.compile(build_meta_model("llama4_text", {"num_hidden_layers": 2}), plan)
    (problem,) = info.value.problems
    assert problem.code == EXPERTS_UNCOVERED and "Llama4TextExperts" in problem.message


def test_sizes_problem_is_reported_alone(tmp_path, mixtral):
    from planc.errors import PlanError
    from planc.spec.loaded_plan import LoadedPlan
    from planc.spec.model import Plan

    data = {
        "version": 1, "model": {"type": "qwen3_moe"}, "parallel": {"tp_size": 4, "ep_size": 6, "dp_size": 3},
        "tp_plan": {"model.layers.*.self_attn.q_proj": "colwise", "nothing.here": "colwise"},
    }
    with pytest.raises(PlanError) as info:  # a Plan object is linted: the sizes rule stops it
        planc.compile(mixtral, Plan.model_validate(data))
    assert "PLC500" in {d.code for d in info.value.diagnostics}
    # a LoadedPlan built in code skips lint: the compiler reports the sizes alone, not PLC601/607
    with pytest.raises(CompileError) as info:
        planc.compile(mixtral, LoadedPlan(Plan.model_validate(data), None))
    assert {p.code for p in info.value.problems} == {"PLC500"}


def _apply_hint(plan: dict, hint: str) -> list[dict]:
    import re

    out = []
    for tp, ep, dp in re.findall(r"tp_size: (\d+), ep_size: (\d+), dp_size: (\d+)", hint):
        p = dict(plan, parallel={"tp_size": int(tp), "ep_size": int(ep), "dp_size": int(dp)})
        out.append(p)
    return out


def test_every_suggested_size_compiles_60_experts_at_tp8():
    # PLC606 once suggested ep 4 at tp 8, which PLC500 then refused. The hint now solves jointly.
    model = build_meta_model("mixtral", {"num_hidden_layers": 2, "num_local_experts": 60})
    plan = {
        "version": 1, "model": {"type": "mixtral"}, "parallel": {"tp_size": 8, "ep_size": 8},
        "tp_plan": {"model.layers.*.self_attn.{q,k,v}_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"},
        "ep_plan": {"model.layers.*.mlp.experts.{gate_up_proj,down_proj}": "grouped_gemm",
                    "model.layers.*.mlp.experts": "ep_dispatch_experts"},
    }
    with pytest.raises(CompileError) as info:
        planc.compile(model, plan)
    (p,) = [p for p in info.value.problems if p.code == EXPERTS_NOT_DIVISIBLE]
    suggested = _apply_hint(plan, p.hint)
    assert suggested, p.hint
    for s in suggested:
        assert s["parallel"]["tp_size"] * s["parallel"]["dp_size"] == 8
        planc.compile(model, s)  # each suggestion passes every other check


def test_three_experts_on_two_ranks_suggests_what_fits(tmp_path):
    model = build_tiny_model("mixtral", num_local_experts=3)
    plan = {
        "version": 1, "model": {"type": "mixtral"}, "parallel": {"tp_size": 2, "ep_size": 2},
        "tp_plan": {"model.layers.*.self_attn.{q,k,v}_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"},
        "ep_plan": {"model.layers.*.mlp.experts.{gate_up_proj,down_proj}": "grouped_gemm",
                    "model.layers.*.mlp.experts": "ep_dispatch_experts"},
    }
    with pytest.raises(CompileError) as info:
        planc.compile(model, plan)
    (p,) = [p for p in info.value.problems if p.code == EXPERTS_NOT_DIVISIBLE]
    assert "divides 3 (3)" not in p.hint and "launch 3 ranks" in p.hint
    for s in _apply_hint(plan, p.hint):
        planc.compile(model, s)


def test_solver_respects_every_size_rule():
    for world in range(1, 17):
        for s in solve_sizes(world, num_experts=60, tp_divides=[8], limit=100):
            assert s.world == world and not check_sizes(s.tp, s.ep, s.dp) and 8 % s.tp == 0
            assert s.ep == 1 or 60 % s.ep == 0
    assert solve_sizes(8, num_experts=60, prefer=Sizes(8, 8, 1), need_ep=True)[0] == Sizes(4, 4, 2)


def test_lint_size_hints_pass_lint():
    from planc.lint.runner import lint_text

    text = HEAD.replace("tp_size: 2, ep_size: 2", "tp_size: 8, ep_size: 4") + EP
    (d,) = [d for d in lint_text(text) if d.code == "PLC500"]
    for s in _apply_hint({}, d.hint):
        p = s["parallel"]
        fixed = text.replace("tp_size: 8, ep_size: 4", f"tp_size: {p['tp_size']}, ep_size: {p['ep_size']}, dp_size: {p['dp_size']}")
        assert [x for x in lint_text(fixed) if x.severity == "error"] == []


def _glm5_next():
    import torch

    from planc.models.families import family
    from planc.models.build import tiny_config

    fam = family("glm5_next_text")
    config = tiny_config(fam)
    with torch.device("meta"):
        return fam.model_class(config)._from_config(config, dtype=torch.float32)


GLM5 = """\
version: 1
model: {type: glm5_next}
parallel: {tp_size: 2, ep_size: 2}
tp_plan:
  model.language_model.layers.%s.self_attn.{q_b_proj,kv_b_proj}: colwise
  model.language_model.layers.%s.self_attn.o_proj: rowwise
  model.language_model.layers.*.self_attn.kv_a_proj_with_mqa: mla_kv_a_proj
ep_plan:
  model.language_model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm
  model.language_model.layers.*.mlp.experts: ep_dispatch_experts
"""


def test_one_rule_over_blocks_of_two_classes_names_the_class_it_breaks(tmp_path):
    """glm5_next's `layers.*.self_attn` is linear attention in some layers, MLA in others: transformers' chain
    q_b_proj/kv_b_proj -> o_proj holds in the MLA blocks only, and `o_proj: rowwise` breaks the linear ones."""
    model = _glm5_next()
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if n.endswith("self_attn")}
    assert len(set(kinds.values())) == 2, kinds
    _, problems = refused(tmp_path, GLM5 % ("*", "*"), model, LAYOUT_ROWWISE_WITHOUT_SHARDED)
    (p,) = problems
    assert "in the Glm5NextTextLinearAttention blocks" in p.message and "q_proj/k_proj/v_proj" in p.message
    mla = sorted(n.split(".")[3] for n, k in kinds.items() if k == "Glm5NextTextAttention")
    assert f"layers.{mla[0] if len(mla) == 1 else '{' + ','.join(mla) + '}'}.self_attn.o_proj" in p.hint
    # the MLA producers are not blamed for the linear blocks (no empty producer list)
    assert "but  leave" not in p.message and "{}" not in p.hint
    assert not [q for q in problems if q.code in (LAYOUT_PRODUCERS_DISAGREE,)]
    # narrowed to the MLA layers as the hint says, the plan compiles
    layers = mla[0] if len(mla) == 1 else "{" + ",".join(mla) + "}"
    planc.compile(model, GLM5 % (layers, layers))
