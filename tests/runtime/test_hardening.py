"""Rollback restores the very objects hook handles point at."""

from __future__ import annotations

import pytest
import torch

from planc.runtime.snapshot import Snapshot
from planc.models.build import build_tiny_model
from tests.distributed import run_distributed
from tests.lint.helpers import plan_text
from tests.runtime.workers import _failing_after, batch, shipped_plan


def _containers(model):
    """(owner, attribute, container) for every dict/list/set attribute Snapshot saves."""
    from planc.runtime.snapshot import _configs

    owners = [*model.modules(), *_configs(model)]
    return [(o, k, v) for o in owners for k, v in vars(o).items() if isinstance(v, (dict, list, set))]


def test_restore_puts_back_the_original_containers_so_handles_still_remove_hooks():
    model = build_tiny_model("qwen3_moe")
    ids = batch(0)
    calls = []
    layer = model.model.layers[0]
    handles = [
        layer.register_forward_hook(lambda m, i, o: calls.append("forward")),
        layer.register_forward_pre_hook(lambda m, i: calls.append("pre")),
        layer.mlp.register_forward_hook(lambda m, a, kw, o: calls.append("kwargs"), with_kwargs=True, always_call=True),
    ]
    before = [(o, k, v, type(v)(v)) for o, k, v in _containers(model)]
    snap = Snapshot(model)
    # what a failed install does: new hooks, replaced containers, edited contents
    layer.register_forward_hook(lambda m, i, o: calls.append("installed"))
    layer.mlp._forward_hooks = {}
    model.config.num_hidden_layers = 99
    snap.restore()
    for owner, key, original, contents in before:
        assert getattr(owner, key) is original, (type(owner).__name__, key)
        assert getattr(owner, key) == contents, (type(owner).__name__, key)
    with torch.no_grad():
        model(ids)
    assert sorted(set(calls)) == ["forward", "kwargs", "pre"] and model.config.num_hidden_layers == 2
    calls.clear()
    for h in handles:
        h.remove()
    with torch.no_grad():
        model(ids)
    assert calls == [], calls


def hook_after_failed_apply_world(rank, world_size):
    """A handle taken before a failed apply still removes its hook afterwards (real gloo, real rollback)."""
    from planc import apply
    from planc.errors import ApplyError
    from planc.runtime import install

    model = build_tiny_model("qwen3_moe")
    calls = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: calls.append(1))
    steps = list(install.INSTALL_STEPS)
    install.INSTALL_STEPS[-1] = _failing_after(steps[-1], True)
    try:
        apply(model, shipped_plan("qwen3_moe", tp=world_size))
        return "apply did not raise"
    except ApplyError:
        pass
    finally:
        install.INSTALL_STEPS[:] = steps
    handle.remove()
    with torch.no_grad():
        model(batch(1))
    return calls


@pytest.mark.distributed
def test_hook_handle_taken_before_a_failed_apply_still_removes_its_hook():
    assert run_distributed(hook_after_failed_apply_world, 2) == [[], []]


def apply_at_other_sizes_world(rank, world_size):
    """planc.apply(model, shipped tp8 plan file, parallel=...) on a 2-rank world: runs and matches unsharded."""
    from planc import apply
    from planc.errors import ApplyError
    from tests.runtime.workers import PLANS, fresh, logits_diff

    model, ref = fresh("mixtral", "grouped_mm")
    path = str(PLANS / "mixtral.yaml")
    try:
        apply(model, path)
        refused = "apply at the plan's own sizes did not raise"
    except ApplyError as e:
        refused = str(e)
    compiled = apply(model, path, parallel={"tp_size": world_size, "ep_size": world_size})
    return refused, compiled.parallel.tp_size, logits_diff(model, ref, batch(2))


@pytest.mark.distributed
def test_apply_runs_a_shipped_plan_at_other_sizes():
    for refused, tp, diff in run_distributed(apply_at_other_sizes_world, 2):
        assert "parallel=" in refused and tp == 2 and diff < 1e-5, (refused, tp, diff)


# ---- 11. planc demo for a family without a hand-tuned tiny config ------------------------------------------

QWEN2_MOE_PLAN = plan_text("qwen2_moe", 8, 8)


def test_tiny_config_is_derived_from_the_familys_own_config_class():
    from planc.models.build import TINY_CONFIGS, tiny_config

    assert "qwen2_moe" not in TINY_CONFIGS
    config = tiny_config("qwen2_moe")
    assert (config.num_hidden_layers, config.hidden_size, config.num_experts, config.num_attention_heads) == (2, 64, 8, 4)
    model = build_tiny_model("qwen2_moe")
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    with torch.no_grad():
        assert model(batch(0)).logits.shape == (2, 9, 128)


@pytest.mark.distributed
def test_demo_runs_a_family_without_a_built_in_tiny_config(tmp_path, capsys):
    import re

    from planc.cli import main

    plan = tmp_path / "qwen2.yaml"
    plan.write_text(QWEN2_MOE_PLAN)
    assert main(["demo", str(plan)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    match = re.search(r"max \|logits - unsharded logits\| on 2 ranks: (\S+)", out)
    assert match and float(match.group(1)) <= 1e-5, out


def test_demo_checks_the_family_and_the_plan_before_spawning(tmp_path, capsys):
    from planc.cli import main

    plan = tmp_path / "dbrx.yaml"
    plan.write_text(QWEN2_MOE_PLAN.replace("qwen2_moe", "dbrx"))
    assert main(["demo", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`dbrx`" in err and "a rank failed" not in err, err
    plan.write_text(QWEN2_MOE_PLAN.replace("o_proj: rowwise", "out_proj: rowwise"))
    assert main(["demo", str(plan)]) == 1
    err = capsys.readouterr().err
    assert "does not resolve against a tiny Qwen2MoeForCausalLM" in err and "out_proj" in err and "a rank failed" not in err


# ---- one answer for "this rank's device" (planc.runtime.mesh.rank_device) ----------------------------------


def test_rank_device_is_the_callers_else_the_cpu_without_nccl():
    from planc.runtime.mesh import rank_device

    assert rank_device() == torch.device("cpu")  # no process group (and gloo alike): the CPU
    assert rank_device("meta") == torch.device("meta")
    assert rank_device(torch.device("cpu")) == torch.device("cpu")
