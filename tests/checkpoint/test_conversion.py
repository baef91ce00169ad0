"""planc's replacements for transformers' conversion ops (planc/checkpoint/conversion.py) compute what
transformers' own ops compute, bit for bit, and keep their reverse ops (save and export use them)."""

from __future__ import annotations

import pytest
import torch

from planc.checkpoint.conversion import shard_aware

pytest.importorskip("transformers")
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    MergeModulelist,
    SplitModulelist,
    WeightConverter,
)

SOURCES = [".experts.*.w1.weight", ".experts.*.w3.weight"]


def _converter(dim: int = 1) -> WeightConverter:
    return WeightConverter(SOURCES, ".experts.gate_up_proj", operations=[MergeModulelist(dim=0), Concatenate(dim=dim)])


def _run(ops, inputs):
    data = {k: list(v) if isinstance(v, list) else v for k, v in inputs.items()}
    for op in ops:
        data = op.convert(data, source_patterns=SOURCES, target_patterns=[".experts.gate_up_proj"])
    return data


def _experts(n=4, rows=(6, 6), cols=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {p: [torch.randn(r, cols, generator=g).to(dtype) for _ in range(n)] for p, r in zip(SOURCES, rows)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [(6, 6), (3, 7)])  # gate and up of equal or different widths (a TP shard of each)
def test_single_copy_merge_equals_transformers_pair(dtype, rows):
    inputs = _experts(rows=rows, dtype=dtype)
    ours = shard_aware([_converter()])[0]
    expected = _run(_converter().operations, inputs)[".experts.gate_up_proj"]
    got = _run(ours.operations, inputs)[".experts.gate_up_proj"]
    assert got.dtype == expected.dtype and got.shape == expected.shape == (4, sum(rows), 5)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_pre_stacked_and_non_contiguous_inputs():
    inputs = _experts()
    inputs[SOURCES[0]] = torch.stack(inputs[SOURCES[0]])  # a dequantizer that already stacks (CompressedTensors)
    inputs[SOURCES[1]] = [t.t().contiguous().t() for t in inputs[SOURCES[1]]]  # column-major views
    expected = _run(_converter().operations, inputs)[".experts.gate_up_proj"]
    got = _run(shard_aware([_converter()])[0].operations, inputs)[".experts.gate_up_proj"]
    assert torch.equal(got, expected)


def test_mismatched_inputs_fail_as_transformers_does():
    inputs = _experts()
    inputs[SOURCES[1]] = inputs[SOURCES[1]][:3]  # one expert fewer: no fused shape exists
    with pytest.raises(RuntimeError):
        _run(_converter().operations, inputs)
    with pytest.raises(RuntimeError):
        _run(shard_aware([_converter()])[0].operations, inputs)


def test_reverse_ops_are_transformers_own():
    reverse = shard_aware([_converter()])[0].reverse_transform()
    assert [type(op) for op in reverse.operations] == [Chunk, SplitModulelist]


def test_mixtral_mapping_gets_the_single_copy_pair():
    mapping = shard_aware(get_checkpoint_conversion_mapping("mixtral"))
    ops = [op for t in mapping for op in getattr(t, "operations", [])]
    names = [type(op).__name__ for op in ops]
    assert "StackedConcatenate" in names and "Concatenate" not in names
    assert all(isinstance(op, (MergeModulelist, Concatenate)) for op in ops)  # subclasses: reverse ops inherited


def test_empty_list_fails_as_transformers_does():
    inputs = _experts()
    inputs[SOURCES[1]] = []
    with pytest.raises(RuntimeError):
        _run(_converter().operations, inputs)
    with pytest.raises(RuntimeError):
        _run(shard_aware([_converter()])[0].operations, inputs)
