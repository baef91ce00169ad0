"""A project's own TP style and EP strategy, registered through the public API: refused where they would be wrong,
then linted, compiled, explained, applied on 2 gloo ranks and equal to the unsharded model, like planc's own."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planc.errors import PlancError
from planc.spec.choices import EPStrategyRow
from planc.spec.styles import Style
from tests.checkout_env import checkout_env
from tests.distributed import run_distributed
from tests.runtime.custom_rows import COUNTED_ALL_TO_ALL, TRACED_COLWISE

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "plans" / "mixtral.yaml"


def plan_text(tp: int = 8, *, style: str = TRACED_COLWISE.name, ep: str = COUNTED_ALL_TO_ALL.name) -> str:
    """The shipped Mixtral plan with q/k/v under the registered style and experts under the registered strategy."""
    text = PLAN.read_text().replace("self_attn.{q,k,v}_proj: colwise", f"self_attn.{{q,k,v}}_proj: {style}")
    text = text.replace("ep_implementation: auto", f"ep_implementation: {ep}")
    return text.replace("tp_size: 8", f"tp_size: {tp}").replace("ep_size: 8", f"ep_size: {tp}")


@contextlib.contextmanager
def registered(how: str = "objects"):
    """The two extensions registered (runtime objects, or import paths as the torch-free rows module does)."""
    from planc.spec.extensions import unregister
    from tests.runtime import custom_extensions, custom_rows

    (custom_extensions if how == "objects" else custom_rows).register()
    try:
        yield
    finally:
        unregister(TRACED_COLWISE.name)
        unregister(COUNTED_ALL_TO_ALL.name)


def refusal(fn, *args) -> str:
    with pytest.raises(PlancError) as e:
        fn(*args)
    return str(e.value)


def test_registration_refuses_what_would_be_wrong():
    import planc
    from tests.runtime.custom_extensions import CountedAllToAll, TracedColwise

    own = refusal(planc.register_tp_style, Style("colwise", "tp", "module", "mine", runtime=True), TracedColwise())
    assert "`colwise` is one of planc's own styles" in own and "name of its own" in own
    assert "`all_to_all` is one of planc's own EP strategies" in refusal(
        planc.register_ep_strategy, EPStrategyRow("all_to_all", "Mine", "mine"), CountedAllToAll)
    # a row planc cannot install, a runtime object that is not the row's
    assert "write runtime=True" in refusal(planc.register_tp_style, Style("mine", "tp", "module", "x"), TracedColwise())
    named = refusal(planc.register_tp_style, TRACED_COLWISE.__class__(**{**TRACED_COLWISE.__dict__, "name": "other"}),
                    TracedColwise())
    assert "the runtime object's name is `colwise_traced`, the row's is `other`" in named
    assert "not a subclass of planc.runtime.ep.EPRuntime" in refusal(
        planc.register_ep_strategy, COUNTED_ALL_TO_ALL, TracedColwise)
    assert "per_call=True" in refusal(planc.register_ep_strategy, EPStrategyRow("mine", "Mine", "x", per_call=True),
                                      CountedAllToAll)
    with registered():
        planc.register_tp_style(TRACED_COLWISE, TracedColwise())  # the same again: a module imported twice
        twice = refusal(planc.register_tp_style, Style("colwise_traced", "tp", "module", "other", dims=(-1, None),
                                                       runtime=True), TracedColwise())
        assert "already registered by tests.runtime.custom_extensions" in twice and "under another name" in twice
    from planc.spec.styles import STYLE

    assert "colwise_traced" not in STYLE and "mine" not in STYLE  # nothing refused was kept


def test_registered_extensions_lint_schema_compile_and_explain():
    import planc
    from planc.commands.schema import schema_text
    from planc.compiler.render import render_text
    from planc.lint.runner import check_text
    from planc.models.build import build_meta_model

    text = plan_text()
    before = check_text(text).diagnostics
    assert "planc.register_tp_style" in next(d.hint for d in check_text(plan_text(style="my_attention_split")).diagnostics
                                             if d.code == "PLC310")
    assert "planc.register_ep_strategy" in next(d.hint for d in check_text(plan_text(ep="my_dispatch")).diagnostics
                                                if d.code == "PLC103")
    assert {d.code for d in before} == {"PLC310", "PLC103"}  # unknown style, unknown ep_implementation
    with registered("paths"):  # the torch-free rows module: lint never imports the runtime halves
        assert check_text(text).diagnostics == []
        schema = json.loads(schema_text())
        assert COUNTED_ALL_TO_ALL.name in schema["$defs"]["Experts"]["properties"]["ep_implementation"]["enum"]
        assert TRACED_COLWISE.name in schema["properties"]["tp_plan"]["additionalProperties"]["enum"]
        compiled = planc.compile(build_meta_model("mixtral", {"num_hidden_layers": 2}), text)
        styles = {a.fqn: a.style for a in compiled.assignments}
        assert styles["model.layers.1.self_attn.k_proj"] == TRACED_COLWISE.name
        assert {e.strategy.describe() for e in compiled.experts} == {
            f"CountedAllToAllEP: ep_implementation: {COUNTED_ALL_TO_ALL.name}"}
        shown = render_text(compiled)
        assert TRACED_COLWISE.name in shown and "CountedAllToAllEP" in shown
    assert check_text(text).diagnostics == before


def test_lint_imports_the_modules_the_project_config_names(tmp_path):
    """`planc lint` in a project whose pyproject.toml names its rows module: clean, and torch never imported;
    a module that fails to import is PLC313 at the config's line."""
    (tmp_path / "plan.yaml").write_text(plan_text())
    (tmp_path / "myproject_planc.py").write_text("from tests.runtime.custom_rows import register\nregister()\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.planc]\nextensions = ["myproject_planc"]\n')
    code = ("import sys\nfrom planc.cli import main\nrc = main(['lint', 'plan.yaml'])\n"
            "print('torch imported' if 'torch' in sys.modules else 'torch-free')\nsys.exit(rc)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=checkout_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "torch-free" in run.stdout, run.stdout + run.stderr
    (tmp_path / "myproject_planc.py").write_text("raise ImportError('no module named torch_extras')\n")
    run = subprocess.run([sys.executable, "-m", "planc", "lint", "plan.yaml"], cwd=tmp_path, env=checkout_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "pyproject.toml:5:1: PLC313" in run.stdout.replace(str(tmp_path) + os.sep, "")
    assert "module `myproject_planc` failed to import: ImportError: no module named torch_extras" in run.stdout


def _extensions_world(rank, world_size):
    """On every rank: a registration on rank 0 only, a row its runtime contradicts, then the two extensions used
    by the plan, forward and one training step against the unsharded model."""
    import planc
    from planc.errors import ApplyError
    from planc.spec.extensions import unregister
    from tests.runtime import custom_extensions
    from tests.runtime.workers import batch, fresh, logits_diff, train_step_diff

    out = {}
    text = plan_text(world_size)
    if rank == 0:
        custom_extensions.register()
    try:
        planc.apply(fresh("mixtral")[0], text)
    except ApplyError as e:
        out["one_rank"] = str(e)
    unregister(TRACED_COLWISE.name)
    unregister(COUNTED_ALL_TO_ALL.name)
    # a row that says rowwise for an object that shards colwise: found on the TP mesh before the model is touched
    planc.register_ep_strategy(COUNTED_ALL_TO_ALL, custom_extensions.CountedAllToAll)
    planc.register_tp_style(Style(TRACED_COLWISE.name, "tp", "module", "says rowwise", dims=(-1, None),
                                  input="replicated", output="sharded", runtime=True, local_forward=True),
                            custom_extensions.TracedColwise())
    model, ref = fresh("mixtral")
    try:
        planc.apply(model, text)
    except ApplyError as e:
        out["contradicted"] = str(e)
    out["untouched"] = logits_diff(model, ref, batch(0))
    unregister(TRACED_COLWISE.name)
    # a runtime import path that names nothing: refused on every rank when the plan is applied
    planc.register_tp_style(TRACED_COLWISE, "tests.runtime.custom_extensions:NoSuchStyle")
    try:
        planc.apply(model, text)
    except ApplyError as e:
        out["unimportable"] = str(e)
    unregister(TRACED_COLWISE.name)
    unregister(COUNTED_ALL_TO_ALL.name)

    custom_extensions.register()
    model, ref = fresh("mixtral")
    planc.apply(model, text)
    out["logits"] = logits_diff(model, ref, batch(0))
    out["loss"], out["grads"] = train_step_diff(model, ref, batch(1))
    out["style_calls"] = custom_extensions.TracedColwise.calls
    out["ep_calls"] = custom_extensions.CountedAllToAll.calls
    return out


@pytest.mark.distributed
def test_registered_extensions_apply_on_two_ranks_equal_to_unsharded():
    results = run_distributed(_extensions_world, 2)
    for rank, res in enumerate(results):
        one = res["one_rank"]
        assert "the ranks registered different styles or strategies" in one, one
        assert "`colwise_traced`:" in one and "rank 1: not registered" in one and "rank 0: TP style" in one, one
        assert "[tool.planc] extensions" in one
        bad = res["contradicted"]
        assert "its runtime object contradicts its row (dims=(-1, None), input=replicated, output=sharded)" in bad, bad
        assert "its forward failed on a probe nn.Linear" in bad, bad
        assert "the model was restored exactly as it was" in bad, bad
        assert res["untouched"] == 0.0
        gone = res["unimportable"]
        assert "runtime `tests.runtime.custom_extensions:NoSuchStyle` cannot be imported" in gone, gone
        assert "importable on every rank" in gone and "ranks 0, 1" in gone, gone
        assert res["logits"] < 1e-5 and res["loss"] < 1e-5 and res["grads"] < 1e-5, (rank, res)
        # q, k, v of the tiny mixtral's layers, two forwards (the eval forward and the training step)
        assert res["style_calls"] > 0 and res["ep_calls"] > 0, res
    assert results[0]["one_rank"] == results[1]["one_rank"]
