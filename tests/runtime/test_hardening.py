"""Issue 12, runtime side: rollback restores the very objects hook handles point at."""

from __future__ import annotations

import pytest
import torch

from planc.runtime.install import Snapshot
from planc.runtime.models import build_tiny_model
from tests.distributed import run_distributed
from tests.runtime.workers import _failing_after, batch, shipped_plan


def _containers(model):
    """(owner, attribute, container) for every dict/list/set attribute Snapshot saves."""
    from planc.runtime.install import _configs

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
