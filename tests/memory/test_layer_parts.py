"""Parts of a decoder layer the peak model reads from the module tree and the config, on the families grid's own
points (bench/memory_grid_families.json): LongCat-Flash's dual sublayers, the indexers that get no gradient, the
hyper-connection streams around a common layer."""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from memory_grid import plan_of  # noqa: E402

from planc.commands.explain import explain_one, parse_overrides  # noqa: E402
from planc.compiler import peak_memory  # noqa: E402
from planc.compiler.family_memory import family_memory  # noqa: E402
from planc.compiler.hyper_connection_memory import GATED_RESIDUAL, INDEPENDENT  # noqa: E402
from planc.compiler.train_memory import train_memory  # noqa: E402


def compiled_point(family: str):
    """The compiled plan and model walk of the family's training point in the committed grid."""
    cache = json.loads((REPO / "bench" / "memory_grid_families.json").read_text())
    point = next(v["point"] for v in cache.values() if v["point"]["family"] == family and v["point"]["mode"] != "serve")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        path.write_text(yaml.safe_dump(plan_of(point), sort_keys=False))
        overrides = parse_overrides([f"{k}={v}" for k, v in point["overrides"].items()])
        rc, compiled, walk = explain_one(str(path), {}, overrides, "config")
    assert rc == 0
    return compiled, walk


def shapes_of(compiled, walk):
    config = peak_memory.text_config(walk.config.to_dict())
    return peak_memory.layer_shapes(compiled, walk, config, 2)


def test_longcat_layers_run_two_mla_sublayers_beside_their_moe():
    compiled, walk = compiled_point("longcat_flash")
    shapes = shapes_of(compiled, walk)
    ffn = int(walk.config.ffn_hidden_size) // compiled.parallel.tp_size
    assert [(s.attention, s.mlp, s.attentions, s.mlps_beside) for s in shapes] == [("mla", "moe", 2, (ffn, ffn))] * 2
    one = replace(shapes[0], attentions=1, mlps_beside=())
    fam = family_memory(walk.model_type)
    two, single = (peak_memory.layer_saved(s, 6144, 2, 1024, 1536, 8, fam, 1) for s in (shapes[0], one))
    assert two > 1.5 * single


def test_indexers_hold_their_parameters_without_gradients_or_adamw_state():
    compiled, walk = compiled_point("mistral_large4_text")
    train = train_memory(compiled, walk)
    indexers = [f for f in walk.params if ".indexer." in f]
    assert indexers and train.index_only > 0
    trained = train.parameter_bytes - train.index_only - train.text_unreached - train.frozen
    assert train.gradients == trained
    assert train.optimizer == 2 * trained + 4 * train.tensors
    assert "sparse attention indexers" in train.render()


@pytest.mark.parametrize("family, kind", [("qwen4_exp_text", GATED_RESIDUAL), ("hy_v4_vl_text", INDEPENDENT)])
def test_hyper_connection_streams_wrap_the_common_layer(family, kind):
    compiled, walk = compiled_point(family)
    mixers = {s.stream_mixer for s in shapes_of(compiled, walk)}
    assert len(mixers) == 1 and next(iter(mixers)).kind == kind and next(iter(mixers)).streams == 4
