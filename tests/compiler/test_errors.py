"""Each model-aware error of the compiler: its code, the module it names, the plan line, the hint."""

from __future__ import annotations

import textwrap

import pytest

import planc
from planc.compiler.checks.experts import EXPERTS_PARTIAL
from planc.compiler.checks.megamoe import MEGAMOE_ACTIVATION, MEGAMOE_ALIGNMENT, MEGAMOE_EP_SIZE, MEGAMOE_KERNEL_BLOCKS, MEGAMOE_NOT_FP4, MEGAMOE_NO_GATE, MEGAMOE_SIZES, MEGAMOE_TOP_K
from planc.compiler.checks.shards import HEAD_SPLIT, UNEVEN_SHARD
from planc.compiler.checks.targets import CONFLICTING_RULES, MODEL_TYPE_MISMATCH, STYLE_NOT_INSTALLABLE, WRONG_TARGET
from planc.compiler.experts_assignments import EXPERTS_NOT_DIVISIBLE, EXPERTS_UNCOVERED
from planc.compiler.match import UNMATCHED_RULE
from planc.errors import CompileError, PlanError
from tests.compiler.fakes import fake_moe, fake_plan

HEAD = """\
version: 1
model:
  type: mixtral
parallel:
  tp_size: 2
  ep_size: 2
"""
EP = """\
ep_plan:
  model.layers.*.mlp.experts.gate_up_proj: grouped_gemm
  model.layers.*.mlp.experts.down_proj: grouped_gemm
  model.layers.*.mlp.experts: ep_dispatch_experts
"""


@pytest.fixture(scope="module")
def mixtral():
    from planc.models.build import build_tiny_model

    return build_tiny_model("mixtral")


def write(tmp_path, text, name="plan.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def problems(plan, model):
    """Every diagnostic that stops `plan` from compiling against `model`. Mappings are passed as Plan
    objects: those are linted too, so a problem lint finds is reported with lint's code, not again."""
    if isinstance(plan, dict):
        from planc.spec.model import Plan

        plan = Plan.model_validate(plan)
    with pytest.raises((CompileError, PlanError)) as info:
        planc.compile(model, plan)
    return getattr(info.value, "problems", None) or info.value.diagnostics


def only(probs, code):
    found = [p for p in probs if p.code == code]
    assert found, f"no {code} in {[str(p) for p in probs]}"
    return found


def test_unmatched_rule_names_closest_paths_and_plan_line(tmp_path, mixtral):
    path = write(tmp_path, HEAD + "tp_plan:\n  layers.*.self_attn.q_proj: colwise\n" + EP)
    (p,) = only(problems(path, mixtral), UNMATCHED_RULE)
    assert p.where == f"{path}:8:3"
    assert "`model.layers.*.self_attn.q_proj`" in p.hint  # the missing `model.` prefix
    assert "MixtralForCausalLM" in p.message


def test_unmatched_alternative_of_a_brace_rule(tmp_path, mixtral):
    path = write(tmp_path, HEAD + "tp_plan:\n  model.layers.*.self_attn.{q,x}_proj: colwise\n" + EP)
    (p,) = only(problems(path, mixtral), UNMATCHED_RULE)
    assert "alternative `model.layers.*.self_attn.x_proj`" in p.message
    assert "model.layers.*.self_attn." in p.hint


def test_layer_index_past_the_last_layer_is_unmatched(tmp_path, mixtral):
    path = write(tmp_path, HEAD + "tp_plan:\n  model.layers.7.self_attn.q_proj: colwise\n" + EP)
    (p,) = only(problems(path, mixtral), UNMATCHED_RULE)
    assert "model.layers.*.self_attn.q_proj" in p.hint


def test_experts_without_ep_or_tp_rule(tmp_path, mixtral):
    text = "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2}\ntp_plan:\n  model.layers.*.self_attn.q_proj: colwise\n"
    (p,) = only(problems(write(tmp_path, text), mixtral), EXPERTS_UNCOVERED)
    assert p.module.startswith("model.layers.*.mlp.experts (2 targets")
    assert "ep_dispatch_experts" in p.hint and p.where.endswith(":4:1")


def test_two_styles_on_one_target(tmp_path, mixtral):
    text = HEAD + "tp_plan:\n  model.layers.*.self_attn.q_proj: colwise\n  model.layers.1.self_attn.q_proj: rowwise\n" + EP
    (p,) = only(problems(write(tmp_path, text), mixtral), CONFLICTING_RULES)
    assert p.module == "model.layers.1.self_attn.q_proj" and p.where.endswith(":9:3")
    assert "colwise" in p.message and "rowwise" in p.message


def test_tied_weights_with_two_rules():
    from planc.models.build import build_tiny_model

    tied = build_tiny_model("mixtral", tie_word_embeddings=True)
    plan = fake_plan(model_type="mixtral")
    plan["tp_plan"] = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    (p,) = only(problems(plan, tied), CONFLICTING_RULES)
    assert "tied" in p.message and "tie_word_embeddings" in p.hint


def test_tied_weights_with_one_rule():
    # lm_head would read the vocab shard of the embedding as its whole weight
    from planc.models.build import build_tiny_model

    plan = fake_plan(model_type="mixtral")
    plan["tp_plan"] = {"model.embed_tokens": "embedding_rowwise"}
    (p,) = only(problems(plan, build_tiny_model("mixtral", tie_word_embeddings=True)), CONFLICTING_RULES)
    assert "lm_head.weight (no rule)" in p.message and "delete `model.embed_tokens`" in p.hint


def test_tp_rule_on_experts_that_ep_shards(mixtral):
    # A Plan object is linted like a file: lint's PLC406 refuses it (the compiler's PLC604 copy is retired).
    plan = fake_plan(model_type="mixtral")
    plan["tp_plan"] = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise"}
    (p,) = only(problems(plan, mixtral), "PLC406")
    assert "model.layers.*.mlp.experts.gate_up_proj" in p.message
    assert "ep_size: 1" in p.hint


def test_style_the_runtime_does_not_install(tmp_path, mixtral):
    text = HEAD + "tp_plan:\n  model.layers.*.self_attn.q_proj: sequence_parallel\n" + EP
    (p,) = only(problems(write(tmp_path, text), mixtral), STYLE_NOT_INSTALLABLE)
    assert "does not install style `sequence_parallel`" in p.message and "replicate" in p.hint


def test_removed_style_points_to_migrate(mixtral):
    plan = fake_plan(model_type="mixtral")
    plan["ep_plan"]["model.layers.*.mlp.gate"] = "ep_router"
    (p,) = only(problems(plan, mixtral), "PLC320")  # lint's removed-style rule; `planc migrate` rewrites it
    assert "removed" in p.message and "router" in p.hint


def test_num_experts_not_divisible_by_ep_size(tmp_path, mixtral):
    text = HEAD.replace("tp_size: 2\n  ep_size: 2", "tp_size: 1\n  ep_size: 3\n  dp_size: 3") + EP
    (p,) = only(problems(write(tmp_path, text), mixtral), EXPERTS_NOT_DIVISIBLE)
    assert "8 experts" in p.message and p.where.endswith(":6:3")
    # sizes that compile, from the joint solver: other worlds with EP, or this world without
    assert "launch 2 ranks" in p.hint and "ep_size: 1, dp_size: 3" in p.hint


def test_model_type_differs_from_config(tmp_path, mixtral):
    text = HEAD.replace("type: mixtral", "type: qwen3_moe") + EP
    (p,) = only(problems(write(tmp_path, text), mixtral), MODEL_TYPE_MISMATCH)
    assert "`mixtral`" in p.message and p.where.endswith(":3:3")


def megamoe_plan(**megamoe):
    return fake_plan(ep_size=2, tp_size=2, implementation="deepgemm_megamoe", megamoe={"quantize": "fp4", **megamoe})


def test_megamoe_experts_without_gate():
    (p,) = only(problems(megamoe_plan(), fake_moe(has_gate=False)), MEGAMOE_NO_GATE)
    assert "no gate" in p.message and "grouped_mm" in p.hint


def test_megamoe_top_k_above_32():
    (p,) = only(problems(megamoe_plan(), fake_moe(num_experts=64, top_k=33)), MEGAMOE_TOP_K)
    assert "33" in p.message


def test_megamoe_ep_size_above_72():
    plan = megamoe_plan()
    plan["parallel"] = {"tp_size": 73, "ep_size": 73}
    plan["tp_plan"] = {}
    (p,) = only(problems(plan, fake_moe(num_experts=146)), MEGAMOE_EP_SIZE)
    assert "72" in p.message and p.module is None


def test_megamoe_deep_gemm_sizes():
    probs = problems(megamoe_plan(backend="deep_gemm"), fake_moe(hidden=192, inter=96))
    (p,) = only(probs, MEGAMOE_SIZES)
    assert "hidden 192" in p.message and "intermediate 96" in p.message and "reference" in p.hint
    planc.compile(fake_moe(hidden=192, inter=96), megamoe_plan(backend="reference"))  # the reference takes any size


def test_megamoe_deep_gemm_block_alignment():
    """The contract test's own shape (hidden 256 passes, intermediate 128 at decode does not) and H/128 odd."""
    (p,) = only(problems(megamoe_plan(backend="deep_gemm"), fake_moe(hidden=384, inter=128)), MEGAMOE_KERNEL_BLOCKS)
    assert "hidden 384" in p.message and "intermediate 128" in p.message and "backend: triton" in p.hint
    planc.compile(fake_moe(hidden=512, inter=256), megamoe_plan(backend="deep_gemm"))
    for backend in ("triton", "reference"):
        planc.compile(fake_moe(hidden=384, inter=128), megamoe_plan(backend=backend))


def test_megamoe_auto_warns_when_the_kernel_rejects_the_sizes():
    compiled = planc.compile(fake_moe(hidden=384, inter=128), megamoe_plan(backend="auto"))
    warned = [w for w in compiled.warnings if w.code == MEGAMOE_ALIGNMENT]
    assert warned and all("Triton" in w.message and "384" in w.message for w in warned)
    assert not [w for w in planc.compile(fake_moe(), megamoe_plan()).warnings if w.code == MEGAMOE_ALIGNMENT]


@pytest.mark.parametrize("field,value", [("hidden_act", "gelu"), ("swiglu_alpha", 1.702), ("mlp_gate_softcap", 4.0),
                                         ("mlp_up_softcap", 25.0)])
def test_megamoe_refuses_other_activations(field, value):
    model = fake_moe()
    setattr(model.config, field, value)
    (p,) = only(problems(megamoe_plan(backend="reference"), model), MEGAMOE_ACTIVATION)
    assert field in p.message and repr(value) in p.message and "grouped_mm" in p.hint
    model.config.hidden_act = "silu"
    if field == "hidden_act":
        planc.compile(model, megamoe_plan(backend="reference"))


def test_megamoe_bf16_experts_without_quantize():
    (p,) = only(problems(megamoe_plan(quantize="none"), fake_moe()), MEGAMOE_NOT_FP4)
    assert "bfloat16" in p.message and "quantize: fp4" in p.hint
    planc.compile(fake_moe(dtype="int8"), megamoe_plan(quantize="none"))  # an FP4 checkpoint needs no quantize


def test_parameter_style_on_a_module(mixtral):
    plan = fake_plan(model_type="mixtral")
    plan["parallel"] = {"tp_size": 1, "ep_size": 1}  # the tables are checked against the model at size 1 too
    plan["tp_plan"] = {}
    plan["ep_plan"] = {"model.layers.*.mlp.experts": "grouped_gemm"}
    probs = problems(plan, mixtral)
    (p,) = only(probs, WRONG_TARGET)
    assert "parameter style" in p.message and "gate_up_proj, down_proj" in p.hint


def test_ep_dispatch_on_a_module_that_is_not_experts(mixtral):
    plan = fake_plan(model_type="mixtral")
    plan["ep_plan"]["model.layers.*.mlp"] = "ep_dispatch_experts"
    (p,) = only(problems(plan, mixtral), WRONG_TARGET)
    assert "MixtralSparseMoeBlock" in p.message and "experts" in p.hint


def test_ep_strategy_that_cannot_run(tmp_path, mixtral):
    plan = fake_plan(model_type="mixtral", ep_implementation="all_reduce")
    plan["parallel"] = {"tp_size": 1, "ep_size": 2, "dp_size": 2}
    plan["tp_plan"] = {}
    (p,) = only(problems(plan, mixtral), "PLC402")  # lint and compile share resolve_ep; lint reports it
    assert "same batch" in p.message and "all_to_all" in p.hint


def test_experts_parameter_left_whole_under_ep(mixtral):
    plan = fake_plan(model_type="mixtral")
    plan["ep_plan"] = {"model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "model.layers.*.mlp.experts": "ep_dispatch_experts"}
    (p,) = only(problems(plan, mixtral), EXPERTS_PARTIAL)
    assert "down_proj" in p.message and "model.layers.*.mlp.experts.down_proj: grouped_gemm" in p.hint


def test_uneven_shard(tmp_path, mixtral):
    text = HEAD.replace("tp_size: 2\n  ep_size: 2", "tp_size: 3\n  ep_size: 1") + "tp_plan:\n  lm_head: colwise_gather_output\n" + (
        "  model.layers.*.mlp.experts.gate_up_proj: packed_colwise\n  model.layers.*.mlp.experts.down_proj: rowwise\n"
        "  model.layers.*.mlp.experts: moe_tp_experts\n"
    )
    probs = only(problems(write(tmp_path, text), mixtral), UNEVEN_SHARD)
    assert any("size 128" in p.message and p.module == "lm_head.weight" for p in probs)


def test_attention_head_split_across_ranks(tmp_path, mixtral):
    # 4 KV heads of 16 features: 8 ranks would get 8 features each, half a head
    text = HEAD.replace("tp_size: 2\n  ep_size: 2", "tp_size: 8\n  ep_size: 8") + (
        "tp_plan:\n  model.layers.*.self_attn.{q,k,v}_proj: colwise\n"
    ) + EP
    probs = only(problems(write(tmp_path, text), mixtral), HEAD_SPLIT)
    assert any("k_proj" in p.module for p in probs) and "head_dim 16" in probs[0].message


def test_style_in_the_wrong_table(mixtral):
    plan = fake_plan(model_type="mixtral")
    plan["tp_plan"] = {"model.layers.*.self_attn.q_proj": "grouped_gemm"}
    probs = problems(plan, mixtral)
    assert any(p.code == "PLC311" and "move" in p.hint for p in probs)


def test_sizes_checked_for_unlinted_mappings(mixtral):
    plan = fake_plan(model_type="mixtral")
    plan["parallel"] = {"tp_size": 2, "ep_size": 3, "dp_size": 3}
    (p,) = only(problems(plan, mixtral), "PLC500")  # planc.spec.sizes.check_sizes, through lint
    assert "multiple of tp_size 2" in p.message


def test_every_problem_is_reported_at_once(tmp_path, mixtral):
    text = HEAD.replace("type: mixtral", "type: gpt_oss") + (
        "tp_plan:\n  model.layers.*.self_attn.q_prj: colwise\n  model.layers.*.self_attn.o_proj: sequence_parallel\n"
    ) + EP
    codes = {p.code for p in problems(write(tmp_path, text), mixtral)}
    assert {MODEL_TYPE_MISMATCH, UNMATCHED_RULE, STYLE_NOT_INSTALLABLE} <= codes
    with pytest.raises(CompileError) as info:
        planc.compile(mixtral, write(tmp_path, text))
    assert "3 problem(s)" in str(info.value) and "hint:" in str(info.value)


def test_same_problem_on_many_layers_is_one_line():
    plan = fake_plan()
    plan["ep_plan"] = {"model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "model.layers.*.mlp.experts": "ep_dispatch_experts"}
    probs = only(problems(plan, fake_moe(layers=6)), EXPERTS_PARTIAL)
    assert len(probs) == 1 and "(6 targets" in probs[0].module
