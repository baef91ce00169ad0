"""planc.load: every shipped family, both checkpoint layouts, 2 and 4 gloo ranks, bit-identical to
full-load-then-apply; tied weights; every kind of bad checkpoint refused on every rank before install."""

import json
import os
import shutil

import pytest
import torch

from tests.distributed import run_distributed
from tests.runtime.load_workers import (
    CASES,
    LAYOUTS,
    everything_world,
    write_checkpoints,
    write_transposed_experts_checkpoint,
)

# One xdist worker runs this module: its 2-rank world is a module fixture shared by the tests below.
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("planc_load")]
FAMILIES = sorted({c[1] for c in CASES})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    write_checkpoints(root, FAMILIES)
    from planc.models.build import build_tiny_model

    build_tiny_model("mixtral", tie_word_embeddings=True).save_pretrained(root / "tied")
    write_transposed_experts_checkpoint(root / "transposed")
    return root


def _snapshot(root):
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    """Every 2-rank check in one world: all cases x both layouts, tied weights, every broken input."""
    cases, victim = _broken(checkpoints, tmp_path_factory.mktemp("broken"))
    before = _snapshot(checkpoints)
    names = [c[0] for c in CASES]
    per_rank = run_distributed(
        everything_world, 2, str(checkpoints), names, LAYOUTS, str(checkpoints / "tied"), cases,
        str(checkpoints / "transposed"),
    )
    return per_rank, victim, before, _snapshot(checkpoints)


def _assert_all_identical(per_rank, expected_keys):
    for rank, res in enumerate(per_rank):
        res = res["load"]
        assert set(expected_keys) <= set(res), f"rank {rank}: missing {set(expected_keys) - set(res)}"
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, f"rank {rank}: " + "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_load_two_ranks_every_family_both_layouts(two_ranks):
    names = [c[0] for c in CASES]
    _assert_all_identical(two_ranks[0], [f"{n}/{layout}" for n in names for layout in LAYOUTS])


def test_load_four_ranks_every_family_both_layouts(checkpoints):
    names = [c[0] for c in CASES]
    per_rank = run_distributed(everything_world, 4, str(checkpoints), names, LAYOUTS, None, [])
    _assert_all_identical(per_rank, [f"{n}/{layout}" for n in names for layout in LAYOUTS])


def test_experts_stored_transposed_as_on_the_hub(two_ranks):
    # Qwen3-VL-MoE's hub experts are [E, H, 2I] / [E, I, H]; transformers transposes them when their shape is not
    # the parameter's. Each rank reads its 4 of 8 experts, whose shape is never the global one: planc's converter
    # compares with the rank's local shape (planc/checkpoint/conversion.py).
    for rank, res in enumerate(two_ranks[0]):
        assert res["transposed"] == {"logits": True, "down_proj": [4, 64, 16]}, (rank, res["transposed"])


def test_load_never_writes_to_the_checkpoint(two_ranks):
    _, _, before, after = two_ranks
    assert after == before


def test_tied_weights_stay_tied(checkpoints, two_ranks):
    from safetensors import safe_open

    with safe_open(str(checkpoints / "tied" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # the tied copy is not on disk
    assert all(r["tied"] == {"tied": True, "logits": True} for r in two_ranks[0]), two_ranks[0]


def _broken(checkpoints, tmp_path):
    """(name, path, model type) of every broken input, each a copy of the good hub checkpoint."""
    good = checkpoints / "mixtral" / "hub"
    cases = []

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(good, dst)
        cases.append((name, str(dst), "mixtral"))
        return dst

    index_name = "model.safetensors.index.json"
    d = copy("missing_shard")
    index = json.loads((d / index_name).read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(d / victim)

    d = copy("truncated_shard")
    data = (d / victim).read_bytes()
    (d / victim).write_bytes(data[: len(data) // 2])

    d = copy("index_names_missing_file")
    index = json.loads((d / index_name).read_text())
    index["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    (d / index_name).write_text(json.dumps(index))

    from safetensors.torch import load_file, save_file

    def rewrite(d, fn):
        index = json.loads((d / index_name).read_text())
        for file in sorted(set(index["weight_map"].values())):
            tensors = load_file(d / file)
            new = fn(tensors)
            if new is not tensors:
                save_file(new, d / file, metadata={"format": "pt"})
                index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in new or v != file}
                index["weight_map"].update({k: file for k in new})
                (d / index_name).write_text(json.dumps(index))
                return

    d = copy("key_the_model_lacks")
    rewrite(d, lambda t: {**t, "model.layers.0.self_attn.extra.weight": torch.zeros(2, 2)})

    d = copy("model_key_the_checkpoint_lacks")
    rewrite(d, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"} if "model.norm.weight" in t else t)

    d = copy("shape_mismatch")
    rewrite(d, lambda t: {k: (v[:-1] if k == "model.norm.weight" else v) for k, v in t.items()}
            if "model.norm.weight" in t else t)

    d = copy("dtype_mismatch")
    rewrite(d, lambda t: {k: (v.to(torch.int8) if k == "model.norm.weight" else v) for k, v in t.items()}
            if "model.norm.weight" in t else t)

    # Pre-quantized formats planc.load does not support: refused from config.json, before any tensor is read.
    for name, qconfig in (
        ("quantized_mxfp4", {"quant_method": "mxfp4"}),
        ("quantized_fp8_per_tensor", {"quant_method": "fp8", "weight_block_size": None}),
        ("quantized_fp8_ue8m0", {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}),
    ):
        d = copy(name)
        config = json.loads((d / "config.json").read_text())
        config["quantization_config"] = qconfig
        (d / "config.json").write_text(json.dumps(config))

    d = copy("config_of_another_model_type")
    cases[-1] = ("config_of_another_model_type", str(d), "qwen3_moe")  # a qwen3_moe plan on a mixtral checkpoint
    return cases, victim


def test_bad_checkpoints_are_refused_on_every_rank(two_ranks):
    per_rank, victim = [r["errors"] for r in two_ranks[0]], two_ranks[1]
    expected = {
        "missing_shard": [victim, "missing"],
        "truncated_shard": [victim, "truncated"],
        "index_names_missing_file": ["model-99999-of-99999.safetensors", "model.norm.weight"],
        "key_the_model_lacks": ["model.layers.0.self_attn.extra.weight", "no place"],
        "model_key_the_checkpoint_lacks": ["model.norm.weight", "in no checkpoint file"],
        "shape_mismatch": ["model.norm.weight", "shape [63]", "[64]"],
        "dtype_mismatch": ["model.norm.weight", "I8"],
        "config_of_another_model_type": ["config.json", "`mixtral`", "qwen3_moe"],
        "quantized_mxfp4": ["config.json", "`quant_method: mxfp4`", "does not support", "Nothing was read"],
        "quantized_fp8_per_tensor": ["config.json", "`weight_block_size: None` (per-tensor FP8)", "Nothing was read"],
        "quantized_fp8_ue8m0": ["config.json", "`scale_fmt: ue8m0`", "Nothing was read"],
    }
    for rank, res in enumerate(per_rank):
        for name, needles in expected.items():
            msg = res[name]
            assert msg.startswith("ApplyError: planc.load: nothing was installed"), (rank, name, msg)
            for needle in needles:
                assert needle in msg, (rank, name, needle, msg)
    assert per_rank[0] == per_rank[1]  # the same error on every rank
