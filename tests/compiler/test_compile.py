"""What a successful compile produces: order, strategies, bytes, fingerprint, and what it never does."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

import planc
from planc.spec.ep import AllReduceEP, AllToAllEP, AutoEP, MegaMoeEP
from planc.spec.model import Plan
from tests.compiler.fakes import fake_moe, fake_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def mixtral():
    from planc.models.build import build_tiny_model

    return build_tiny_model("mixtral")


def test_parameters_come_before_their_module_whatever_the_file_order(tmp_path, mixtral):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "version: 1\nmodel: {type: mixtral}\nparallel: {tp_size: 2, ep_size: 2}\n"
        "ep_plan:\n  model.layers.*.mlp.experts: ep_dispatch_experts\n"
        "  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm\n"
    )
    compiled = planc.compile(mixtral, str(path))
    order = [a.fqn for a in compiled.assignments]
    for layer in (0, 1):
        e = f"model.layers.{layer}.mlp.experts"
        assert order.index(f"{e}.gate_up_proj") < order.index(e)
        assert order.index(f"{e}.down_proj") < order.index(e)
    assert [a.target for a in compiled.assignments[:3]] == ["parameter", "parameter", "module"]


def test_module_rule_covers_its_parameters_like_transformers(mixtral):
    compiled = planc.compile(mixtral, Plan.model_validate(fake_plan(model_type="mixtral")))
    a = compiled.assignment_for("model.layers.0.self_attn.q_proj.weight")
    assert a.style == "colwise" and a.inherited and a.table == "tp"
    m = compiled.assignment_for("model.layers.0.self_attn.q_proj")
    assert m.target == "module" and not m.inherited
    # experts module styles are never inherited: the parameters have grouped_gemm rules of their own
    assert compiled.assignment_for("model.layers.0.mlp.experts.down_proj").style == "grouped_gemm"


@pytest.mark.parametrize(
    "parallel,experts,cls,shares",
    [
        ({"tp_size": 2, "ep_size": 2}, {}, AutoEP, True),
        ({"tp_size": 1, "ep_size": 2, "dp_size": 2}, {}, AutoEP, False),
        ({"tp_size": 2, "ep_size": 2}, {"ep_implementation": "all_to_all"}, AllToAllEP, None),
        ({"tp_size": 2, "ep_size": 2}, {"ep_implementation": "all_reduce"}, AllReduceEP, None),
        ({"tp_size": 2, "ep_size": 2}, {"implementation": "deepgemm_megamoe", "megamoe": {"quantize": "fp4"}}, MegaMoeEP, None),
    ],
)
def test_ep_strategy_object_and_its_reason(parallel, experts, cls, shares):
    plan = fake_plan(**experts)
    plan["parallel"] = parallel
    if parallel["tp_size"] == 1:
        plan["tp_plan"] = {}
    compiled = planc.compile(fake_moe(), Plan.model_validate(plan))
    strategies = {e.strategy for e in compiled.experts}
    (strategy,) = strategies
    assert type(strategy) is cls and strategy.reason
    if shares is not None:
        assert strategy.shares_batch is shares
    assert all(e.num_local_experts == 4 and e.mode == "ep" for e in compiled.experts)
    from planc.runtime.ep import EP_RUNTIMES

    assert EP_RUNTIMES[strategy.name].__module__.startswith("planc.runtime.ep.")


def test_megamoe_experts_carry_megamoe_ep_at_ep_size_1():
    # the kernel takes its process group from MegaMoeEP, so the strategy is there without EP too
    plan = fake_plan(ep_size=1, tp_size=1, implementation="deepgemm_megamoe", megamoe={"quantize": "fp4"})
    plan["tp_plan"] = {}
    compiled = planc.compile(fake_moe(), Plan.model_validate(plan))
    assert all(type(e.strategy) is MegaMoeEP and e.mode is None for e in compiled.experts)


def test_moe_tp_experts_have_no_strategy(mixtral):
    plan = {
        "version": 1, "model": {"type": "mixtral"}, "parallel": {"tp_size": 2},
        "tp_plan": {
            "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
            "model.layers.*.mlp.experts.down_proj": "rowwise",
            "model.layers.*.mlp.experts": "moe_tp_experts",
        },
    }
    compiled = planc.compile(mixtral, plan)
    assert all(e.mode == "tp" and e.strategy is None and e.num_local_experts == 8 for e in compiled.experts)
    assert compiled.full_coverage


def test_bytes_sharded_and_replicated():
    # fake_moe, 2 layers, bf16: q/o 256x256 (TP 2), experts 8x512x256 + 8x256x256 (EP 2), rest replicated
    compiled = planc.compile(fake_moe(), Plan.model_validate(fake_plan()))
    attn = 2 * 2 * 256 * 256 * 2
    experts = 2 * (8 * 512 * 256 + 8 * 256 * 256) * 2
    replicated = (512 * 256 * 2) * 2 + 2 * (8 * 256 * 2 + 256 * 2)  # embed + lm_head, router + norm per layer
    assert compiled.bytes_sharded_per_rank == (attn + experts) // 2
    assert compiled.bytes_replicated_per_rank == replicated
    assert compiled.bytes_total == attn + experts + replicated
    by_path = {g.path: g for g in compiled.replicated}
    assert by_path["lm_head"].bytes_per_rank == 512 * 256 * 2
    warned = [w for w in compiled.warnings if w.code == "PLC651"]
    assert any("lm_head" in w.message and "256.0 KiB per rank" in w.message for w in warned)


def test_inactive_table_is_checked_but_not_applied():
    plan = fake_plan(ep_size=1, tp_size=2)
    plan["tp_plan"].update(
        {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise", "model.layers.*.mlp.experts.down_proj": "rowwise",
         "model.layers.*.mlp.experts": "moe_tp_experts"}
    )
    compiled = planc.compile(fake_moe(), Plan.model_validate(plan))
    assert not any(a.table == "ep" for a in compiled.assignments)
    assert any(w.code == "PLC652" and "ep_plan" in w.message for w in compiled.warnings)
    assert [c.active for c in compiled.coverage if c.rule.table == "ep_plan"] == [False, False]


def _state(model):
    import torch

    params = {n: (p.detach().clone(), p.requires_grad, type(p)) for n, p in model.named_parameters()}
    modules = {n: (dict(m.__dict__.get("_forward_hooks", {})), "forward" in m.__dict__, m.training) for n, m in model.named_modules()}
    return params, modules, torch.get_default_dtype()


def test_compile_never_changes_the_model(mixtral):
    before = _state(mixtral)
    planc.compile(mixtral, Plan.model_validate(fake_plan(model_type="mixtral")))
    after = _state(mixtral)
    assert before[1] == after[1] and before[2] == after[2]
    assert before[0].keys() == after[0].keys()
    for name, (t, rg, cls) in before[0].items():
        t2, rg2, cls2 = after[0][name]
        assert (t == t2).all() and rg == rg2 and cls is cls2, name


FINGERPRINT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    import planc
    from planc.models.build import build_meta_model
    c = planc.compile(build_meta_model("mixtral", {{"num_hidden_layers": 2}}), {plan!r})
    print(c.fingerprint)
    """
)


def test_fingerprint_is_stable_across_processes():
    code = FINGERPRINT.format(root=ROOT, plan=os.path.join(ROOT, "plans", "mixtral.yaml"))
    runs = []
    for seed in ("0", "12345"):  # different hash seeds: no set or dict-of-id ordering may leak in
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.split()[-1])
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_fingerprint_changes_with_the_plan():
    a = planc.compile(fake_moe(), Plan.model_validate(fake_plan()))
    b = planc.compile(fake_moe(), Plan.model_validate(fake_plan(ep_implementation="all_to_all")))
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == planc.compile(fake_moe(), Plan.model_validate(fake_plan())).fingerprint


NO_TORCH = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    import planc
    from tests.compiler.fakes import fake_moe, fake_plan
    c = planc.compile(fake_moe(), fake_plan())
    print(json.dumps({{"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules,
                      "covered": c.experts_covered}}))
    """
)


def test_compile_path_imports_no_torch():
    code = NO_TORCH.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"torch": False, "transformers": False, "covered": 2}


def test_compiled_plan_is_immutable_and_printable():
    compiled = planc.compile(fake_moe(), Plan.model_validate(fake_plan()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        compiled.fingerprint = "x"
    text = str(compiled)
    assert "AutoEP" in text and "coverage: full" in text and "per rank:" in text


def test_planc_compile_stays_callable_after_the_compiler_is_imported():
    """`planc.compile` is the public function; importing the compiler package must not shadow it."""
    import planc
    import planc.compiler.resolve  # the import that used to replace planc.compile

    assert callable(planc.compile)
    assert planc.compile.__module__ == "planc"


def test_the_plan_is_loaded_at_the_public_face_only():
    """planc.compile loads any plan source (and takes the old (plan, model) order, with a warning); the compiler
    below it takes the LoadedPlan and says where to go with anything else."""
    from planc.compiler.resolve import compile_plan
    from planc.lint.plan_loader import load_plan

    data = fake_plan()
    loaded = load_plan(data)
    expected = compile_plan(fake_moe(), loaded).fingerprint
    assert planc.compile(fake_moe(), data).fingerprint == expected
    with pytest.warns(DeprecationWarning, match=r"planc.compile\(plan, model\) is deprecated"):
        assert planc.compile(data, fake_moe()).fingerprint == expected
    with pytest.raises(TypeError, match="takes a LoadedPlan.*planc.compile"):
        compile_plan(fake_moe(), data)
