"""planc.export -> plain from_pretrained; save_pretrained / deepcopy refused; interrupted saves keep the old
checkpoint; planc never replaces a directory it did not write.

The exported model runs unsharded (transformers' own forward over the hub-layout weights), so its logits
match the applied model's up to the order of the sharded sums: <= 1e-5 (fp32).
"""

import json

import pytest

from tests.checkpoint.workers import (
    CASES,
    REFUSAL,
    REFUSED,
    export_world,
    guards_world,
    logits,
)
from tests.distributed import run_distributed

TOL = 1e-5


@pytest.mark.distributed
def test_export_loads_with_plain_from_pretrained(tmp_path):
    from transformers import AutoConfig

    from planc.models.build import model_class_for

    results = run_distributed(export_world, 2, str(tmp_path))
    failures = []
    for rank, res in enumerate(results):  # a plan that quantizes at apply: refused, on every rank, with the reason
        assert set(res["refused"]) == REFUSED and all(REFUSAL in m for m in res["refused"].values()), (rank, res["refused"])
    for name, kind in CASES:
        key = f"{name}-{kind}"
        for rank, res in enumerate(results):
            assert not isinstance(res[key], str), f"{key} rank {rank} raised:\n{res[key]}"
        directory = tmp_path / "export" / key
        # plain transformers: AutoModelForCausalLM's class, or the multimodal top model (Qwen3-VL-MoE), which
        # AutoModelForCausalLM does not build
        model, info = model_class_for(AutoConfig.from_pretrained(directory)).from_pretrained(
            directory, attn_implementation="eager", output_loading_info=True
        )
        problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
        if problems:
            failures.append(f"{key}: from_pretrained reported {problems}")
        diff = (logits(model.eval()) - results[0][key]).abs().max().item()
        if diff > TOL:
            failures.append(f"{key}: exported logits differ by {diff}")
        if kind == "tied":  # written once, under the name transformers ties the other to
            from safetensors import safe_open

            with safe_open(str(directory / "model.safetensors"), "pt") as f:
                assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
            assert model.lm_head.weight is model.model.embed_tokens.weight
        assert not any(p.name.startswith(".") for p in (tmp_path / "export").iterdir())
    index = json.loads((tmp_path / "export" / "mixtral-ep" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / "export" / "mixtral-ep" / f).is_file() for f in files)
    assert not (tmp_path / "export" / "mixtral-ep" / "model.safetensors").exists()  # the one-file export was replaced
    # the hub layout: Mixtral's per-expert w1/w2/w3, not the fused in-memory gate_up_proj
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in index["weight_map"]
    assert not any("gate_up_proj" in k for k in index["weight_map"])
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_guards_and_interrupted_saves(tmp_path):
    results = run_distributed(guards_world, 2, str(tmp_path))
    for res in results:
        assert res["save_unapplied"].startswith("CheckpointError") and "no plan installed" in res["save_unapplied"]
        assert res["save_pretrained"].startswith("CheckpointError") and "planc.export(model, dir)" in res["save_pretrained"]
        assert res["save_pretrained_wrote"] is False
        for key in ("deepcopy_model", "deepcopy_layer"):
            assert res[key].startswith("CheckpointError: copy.deepcopy of a module planc installed"), res[key]
        assert "model.layers.0.self_attn" in res["deepcopy_layer"]
        assert res["copy_before_apply_is_plain"] == "Parameter"
        for name in ("after_metadata", "after_shards_rank1"):
            msg = res[f"interrupted/{name}"]
            assert msg.startswith("CheckpointError") and "injected" in msg and "intact" in msg, msg
            assert res[f"interrupted/{name}/unchanged"] is True
            assert res[f"interrupted/{name}/leftovers"] == []
        assert "rank 1: Injected" in res["interrupted/after_shards_rank1"]
        assert res["interrupted/reload"] == 0.0
        assert res["recover/failed_save"].startswith("CheckpointError")
        assert res["recover/restored"] is True
        assert res["replaced/reload"] == 0.0
        assert res["replaced/leftovers"] == []
        for key in ("foreign/save", "foreign/export", "foreign/export_over_checkpoint"):
            assert "is not a checkpoint this call writes" in res[key], res[key]
        assert res["foreign/kept"] == ["notes.txt"]

