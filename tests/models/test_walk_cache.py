"""`planc explain` reads its model walk from data (planc.models.walk_cache): a walk read back is the live walk.

Real transformers models on `meta` (families with quirks: MLA and an fp32 router, a multimodal config whose text
config declares the plan, attention sinks, linear attention with shared experts), in bf16 and fp32: the walk written
and read back has the same modules, parameters, ties, generic index and config reads, and the compiler, the training
bytes and the peak memory say the same of it. The shipped walks are what the live walk writes today.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from planc.cli import main
from planc.compiler.walk import config_attr, walk_model
from planc.compiler.walk_data import walk_from_data
from planc.models import walk_cache
from tests.checkout_env import REPO, checkout_env

FAMILIES = [
    ("deepseek_v3", "plans/deepseek_v3.yaml", {"num_hidden_layers": 4, "first_k_dense_replace": 1}, "config"),
    ("qwen3_vl_moe", "plans/qwen3_vl_moe.yaml", {"text_config.num_hidden_layers": 2}, "config"),
    ("gpt_oss", "plans/gpt_oss.yaml", {"num_hidden_layers": 2}, "float32"),
    ("qwen3_next", "plans/qwen3_next.yaml", {"num_hidden_layers": 4}, "config"),
]


def _read_back(key: dict, walk):
    text = walk_cache.render(key, walk)
    assert text is not None
    return walk_from_data(json.loads(text)["walk"])


def _ties(walk) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for fqn, p in walk.params.items():
        groups.setdefault(p.tensor_id, []).append(fqn)
    return sorted(groups.values())


@pytest.mark.parametrize(("model_type", "plan", "overrides", "dtype"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_walk_read_back_is_the_live_walk(model_type, plan, overrides, dtype):
    from planc.commands.explain import load_one, workload_peak
    from planc.compiler.render import json_data, render_text
    from planc.compiler.resolve import compile_plan
    from planc.compiler.train_memory import train_memory

    key = walk_cache.walk_key(model_type, overrides, dtype)
    live = walk_model(walk_cache.meta_model_at(model_type, overrides, dtype))
    back = _read_back(key, live)

    assert (back.model_class, back.model_type, back.can_switch_experts) == (
        live.model_class, live.model_type, live.can_switch_experts)
    assert list(back.modules.items()) == list(live.modules.items())
    assert [p._replace(tensor_id=0) for p in back.params.values()] == [
        p._replace(tensor_id=0) for p in live.params.values()]
    assert _ties(back) == _ties(live)
    assert back.by_generic == live.by_generic
    # the config, as the compiler reads it: the class's plans and sub-configs, every value, the text config
    for got, want in ((back.config, live.config), (back.config.get_text_config(), live.config.get_text_config())):
        assert type(got).__name__ == type(want).__name__
        assert type(got).base_model_tp_plan == type(want).base_model_tp_plan
        assert list(type(got).sub_configs or {}) == list(type(want).sub_configs or {})
        assert got.to_dict() == want.to_dict()
        for name in [*want.to_dict(), "_attn_implementation", "head_dim", "layer_types", "quantization_config"]:
            value = config_attr(want, name)
            if name == "dtype":  # a torch.dtype, not data: the snapshot has none (to_dict() has its name)
                assert config_attr(got, name) is None and str(value).startswith("torch.")
                continue
            if name in (type(want).sub_configs or {}):  # a sub-config: a snapshot of it, as the text config is
                assert config_attr(got, name).to_dict() == value.to_dict(), name
                continue
            assert config_attr(got, name) == value, name
    # what explain prints of it: the compiled plan, the training bytes, the peak of a training step and a prefill
    loaded = load_one(plan)[1]
    got_c, want_c = compile_plan(back, loaded), compile_plan(live, loaded)
    assert render_text(got_c) == render_text(want_c) and json_data(got_c) == json_data(want_c)
    got_t, want_t = train_memory(got_c, back), train_memory(want_c, live)
    assert got_t.to_json() == want_t.to_json()
    for workload, train in (("train", (got_t, want_t)), ("serve", (None, None))):
        spec = {"workload": workload, "batch": 2, "seq": 1024, "search": "batch", "capacity_factor": 1.0,
                "reserve": None}
        assert (workload_peak(got_c, back, train[0], spec, None, plan).to_json()
                == workload_peak(want_c, live, train[1], spec, None, plan).to_json())


def test_the_shipped_walks_are_what_the_live_walk_writes():
    from packaging.version import Version

    wanted = walk_cache.shipped_model_types()
    assert sorted(p.stem for p in walk_cache.SHIPPED.glob("*.json")) == wanted
    for model_type in wanted:
        text = (walk_cache.SHIPPED / f"{model_type}.json").read_text(encoding="utf-8")
        written_for = json.loads(text)["key"]["transformers"]
        installed = walk_cache._version("transformers")
        if installed is None or Version(installed) < Version(written_for):
            pytest.skip(f"the shipped walks are written from transformers {written_for}; {installed} is older")
        assert text == walk_cache.render_shipped(model_type), (
            f"planc/models/walks/{model_type}.json is stale: run `python -m planc.models.walk_cache`")


def _explain(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["explain", *argv])
    return rc, out.getvalue(), err.getvalue()


SHIPPED_PLANS = sorted(p.name for p in (REPO / "plans").glob("*.yaml"))


@pytest.mark.parametrize("plan", SHIPPED_PLANS)
def test_explain_prints_the_same_from_the_shipped_walk(monkeypatch, tmp_path, plan):
    """Every shipped plan: what explain prints (the text of a training step, the JSON of a prefill) is the same
    read from the shipped walk as built live."""
    runs = [(f"plans/{plan}", "--train", "--batch", "1", "--seq", "4096"),
            (f"plans/{plan}", "--serve", "--batch", "2", "--seq", "2048", "--format", "json")]
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    stored = [_explain(*argv) for argv in runs]
    assert stored[0][0] == 0 and "peak memory per rank, training step" in stored[0][1], stored[0]
    assert not list(tmp_path.rglob("*.json"))  # the shipped walk was read: nothing built, nothing written
    monkeypatch.setenv(walk_cache.CACHE_ENV, "off")
    assert stored == [_explain(*argv) for argv in runs]


def test_a_stored_walk_keeps_torch_and_transformers_out_of_explain(tmp_path):
    code = ("import sys; from planc.cli import main; rc = main(['explain', 'plans/deepseek_v3.yaml', '--train', "
            "'--batch', '1', '--seq', '4096']); "
            "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)")
    env = checkout_env(XDG_CACHE_HOME=str(tmp_path))
    env.pop(walk_cache.CACHE_ENV, None)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.stderr.strip().splitlines()[-1] == "0 []", r.stderr
    assert "peak memory per rank, training step" in r.stdout


def test_a_miss_builds_stores_and_the_next_run_reads_it(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ("plans/mixtral.yaml", "--set", "num_hidden_layers=2", "--serve", "--batch", "2", "--seq", "512")
    first = _explain(*argv)
    assert first[0] == 0, first
    (stored,) = (tmp_path / "planc" / "walks").glob("*.json")
    key = walk_cache.walk_key("mixtral", {"num_hidden_layers": 2}, "config")
    assert json.loads(stored.read_text())["key"] == key
    assert _explain(*argv) == first
    stored.write_text("{not json")  # a damaged file is a miss: built again, written again
    assert _explain(*argv) == first and json.loads(stored.read_text())["key"] == key
    # a file under the right key with a name planc never writes reaches no Python machinery: a miss too
    hostile = json.loads(stored.read_text())
    hostile["walk"]["config"]["class_values"]["__getattr__"] = "not a function"
    stored.write_text(json.dumps(hostile))
    assert walk_cache.cached_walk(key) is None
    assert _explain(*argv) == first and "__getattr__" not in stored.read_text()
    # a config key the config class does not have is refused every time, never stored
    bad = ("plans/mixtral.yaml", "--set", "num_hiden_layers=2")
    assert _explain(*bad)[0] == 2 and _explain(*bad)[0] == 2
    assert len(list((tmp_path / "planc" / "walks").glob("*.json"))) == 1
    # PLANC_WALK_CACHE=off reads and writes nothing
    monkeypatch.setenv(walk_cache.CACHE_ENV, "off")
    stored.unlink()
    assert _explain(*argv) == first and not stored.exists()


def test_another_transformers_version_is_a_miss(monkeypatch):
    key = walk_cache.walk_key("deepseek_v3", {}, "config")
    assert key is not None and walk_cache.cached_walk(key) is not None
    monkeypatch.setattr(walk_cache, "_version", lambda dist: "0.0.1")
    other = walk_cache.walk_key("deepseek_v3", {}, "config")
    assert other is not None and other["transformers"] == "0.0.1"
    monkeypatch.setenv("XDG_CACHE_HOME", os.devnull)  # nothing in a user cache either
    assert walk_cache.cached_walk(other) is None
