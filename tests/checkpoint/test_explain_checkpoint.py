"""`planc explain --checkpoint` refuses what planc.load refuses (one check function), exits 1 listing every
problem; `--parallel` explains a plan at other sizes without copying it; an unreadable config.json is named."""

import json
import subprocess
import sys

import pytest
import torch

from tests.checkpoint.bad_workers import EXPERT, _rewrite, write_good

PLAN = "plans/mixtral.yaml"  # tp 8 / ep 8; the tiny Mixtral has 8 experts and 4 KV heads... run at 2/2
SIZES = "tp_size=2,ep_size=2"


def _explain(*args):
    return subprocess.run([sys.executable, "-m", "planc", "explain", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("explain")
    write_good(root / "good")
    w1 = EXPERT.format(i=0, w="w1")
    for name, fn in (
        ("expert_i32", lambda t: {**t, w1: t[w1].view(torch.int32)}),
        ("expert_missing", lambda t: {k: v for k, v in t.items() if k != w1}),
    ):
        shutil.copytree(root / "good", root / name)
        _rewrite(root / name, fn)
    shutil.copytree(root / "good", root / "norm_missing")
    index = json.loads((root / "norm_missing" / "model.safetensors.index.json").read_text())
    file = index["weight_map"]["model.norm.weight"]
    from safetensors.torch import load_file, save_file

    tensors = load_file(root / "norm_missing" / file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()  # a shape config.json disagrees with
    save_file(tensors, root / "norm_missing" / file, metadata={"format": "pt"})
    shutil.copytree(root / "good", root / "bad_config")
    (root / "bad_config" / "config.json").write_text('{"model_type": "mixtral",')
    return root


def test_explain_at_other_sizes_without_copying_the_plan():
    r = _explain(PLAN, "--parallel", SIZES)
    assert r.returncode == 0, r.stderr
    assert "parallel: tp_size=2 ep_size=2 dp_size=1 (world 4)" in r.stdout or "tp_size=2 ep_size=2" in r.stdout


def test_bad_parallel_is_a_usage_error():
    r = _explain(PLAN, "--parallel", "tp=2")
    assert r.returncode == 2 and "tp_size=2,ep_size=2" in r.stderr, r.stderr


def test_good_checkpoint_explains_clean(checkpoints):
    r = _explain(PLAN, "--parallel", SIZES, "--checkpoint", str(checkpoints / "good"))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""


@pytest.mark.parametrize("name,needles", [
    ("expert_i32", [EXPERT.format(i=0, w="w1"), "I32", "model.layers.0.mlp.experts.gate_up_proj"]),
    ("expert_missing", [EXPERT.format(i=0, w="w1"), "is missing", "merges 8 experts"]),
    ("norm_missing", ["model.norm.weight", "shape [63]", "[64]"]),
])
def test_explain_refuses_what_load_refuses(checkpoints, name, needles):
    from planc.checkpoint.load import check_checkpoint
    from planc.lint.plan_loader import load_plan

    r = _explain(PLAN, "--parallel", SIZES, "--checkpoint", str(checkpoints / name))
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "planc.load would refuse" in r.stderr and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)
    # the very problems planc.load's pre-read check finds (the same function, here without a world)
    loaded = load_plan(PLAN, parallel={"tp_size": 2, "ep_size": 2})
    checked = check_checkpoint(str(checkpoints / name), loaded, launched=False)
    checked.close()
    assert checked.problems and all(p in r.stderr for p in checked.problems)


def test_unreadable_config_json_is_named(checkpoints):
    r = _explain(PLAN, "--checkpoint", str(checkpoints / "bad_config"))
    assert r.returncode == 2, r.stderr
    assert str(checkpoints / "bad_config" / "config.json") in r.stderr and "not valid JSON" in r.stderr, r.stderr
