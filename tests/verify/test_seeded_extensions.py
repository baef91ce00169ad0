"""Seeded bugs in a project's own style and strategy, registered through the public API: `planc.verify` catches
each at its first module (a combine that drops the routing weights on one rank; a gradient reduced twice), and
certifies the same models under the right extensions. 2 gloo ranks (tp_size 2, ep_size 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

import planc
from tests.runtime.custom_rows import COUNTED_ALL_TO_ALL, TRACED_COLWISE
from tests.verify.seeded_extensions import DROPS_WEIGHTS, REDUCED, REDUCED_TWICE

PLANS = Path(__file__).parent / "plans"
MODELS = "tests.verify.seeded_models"


@pytest.fixture(scope="module", autouse=True)
def registered():
    from planc.spec.extensions import unregister
    from tests.verify import seeded_extensions

    seeded_extensions.register()
    yield
    for row in (TRACED_COLWISE, COUNTED_ALL_TO_ALL, DROPS_WEIGHTS, REDUCED_TWICE, REDUCED):
        unregister(row.name)


def plan(tmp_path: Path, *, qkv: str, ep: str, gain: str | None = None) -> str:
    """The custom-attention Mixtral plan with q/k/v under `qkv`, the experts under `ep`, the q gain under `gain`."""
    text = (PLANS / "mixtral_attention_tp.yaml").read_text()
    text = text.replace("self_attn.{q,k,v}_proj: colwise", f"self_attn.{{q,k,v}}_proj: {qkv}")
    text = text.replace("implementation: grouped_mm", f"implementation: grouped_mm\n  ep_implementation: {ep}")
    if gain:
        text = text.replace("  model.layers.*.self_attn.o_proj", f"  model.layers.*.self_attn.q_scale: {gain}\n"
                            "  model.layers.*.self_attn.o_proj")
    path = tmp_path / f"{qkv}-{ep}-{gain}.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.distributed
def test_a_combine_that_drops_the_routing_weights_on_one_rank(tmp_path):
    report = planc.verify(f"{MODELS}:mixtral_model", plan(tmp_path, qkv=TRACED_COLWISE.name, ep=DROPS_WEIGHTS.name))
    assert report.error is None, report.error
    assert not report.ok and report.exit_code == 1, report.render_text()
    d = report.first_divergence
    assert d is not None and d.stage == "logits" and d.direction == "forward", report.render_text()
    assert d.module == "model.layers.0.mlp.experts", d.describe()
    assert "ep_dispatch_experts" in {r.style for r in d.rules}, d.describe()
    assert DROPS_WEIGHTS.title in d.describe(), d.describe()  # the strategy that ran there


@pytest.mark.distributed
def test_a_gradient_reduced_twice(tmp_path):
    path = plan(tmp_path, qkv="colwise", ep=COUNTED_ALL_TO_ALL.name, gain=REDUCED_TWICE.name)
    report = planc.verify(f"{MODELS}:gain_q_model", path)
    assert report.error is None, report.error
    assert not report.ok and report.exit_code == 1, report.render_text()
    d = report.first_divergence
    assert d is not None and d.stage == "grads" and d.direction == "backward", report.render_text()
    assert d.parameter == "model.layers.1.self_attn.q_scale.weight", d.describe()  # last layer: first in backward
    assert d.rule is not None and d.rule.style == REDUCED_TWICE.name, d.describe()
    assert d.where.startswith(path) and d.where.count(":") == 2
    assert report.stage("logits").ok  # forward exact: only the gradient is wrong


@pytest.mark.distributed
def test_the_right_extensions_are_certified(tmp_path):
    path = plan(tmp_path, qkv=TRACED_COLWISE.name, ep=COUNTED_ALL_TO_ALL.name, gain=REDUCED.name)
    report = planc.verify(f"{MODELS}:gain_q_model", path)
    assert report.ok and report.exit_code == 0, report.render_text()
    assert report.first_divergence is None
