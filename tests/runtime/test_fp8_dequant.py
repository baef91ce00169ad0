"""planc's CPU FP8 block dequantization (planc/checkpoint/fp8.py) against transformers' `Fp8Dequantize`.

planc.load hands transformers' loader its own dequantize op because torch's float8 -> float32 cast is slow on the CPU;
the results must be the same bits as transformers' op (the reference of every FP8 load test): on every one of the
256 codes (NaN, -0.0, subnormals, the largest values) times scales that overflow, underflow, are zero, negative, NaN or
infinite, and on real weights quantized by the tests' writer, in every output dtype, batched (experts), with
per-element scales (planc's off-grid `BlockScaleSlice`) and split into many chunks over several threads.
"""

import copy

import pytest
import torch

from planc.checkpoint import fp8
from planc.checkpoint.fp8 import dequantize_fp8_blocks, fast_path, fp8_e4m3_table, with_fast_dequantize
from tests.runtime.load_fp8_workers import quantize_blocks

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _reference(q, s, dtype=None):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = _INT[got.element_size()]
    assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits))


def _all_codes(rows=256, cols=256) -> torch.Tensor:
    """Every code 0..255 in every row and at every column position mod 256."""
    codes = (torch.arange(rows)[:, None] + torch.arange(cols)[None, :]) % 256
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


SCALES = [1.0, 0.5, 3.0e-3, -2.0, 0.0, -0.0, 1.0e-38, 1.0e-45, 3.0e38, 7.5e35, float("inf"), float("-inf"),
          float("nan")]


def test_table_is_torchs_cast_of_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    table = torch.from_numpy(fp8_e4m3_table())
    _assert_same_bits(table, codes.to(torch.float32))
    assert torch.isnan(table[0x7F]) and torch.isnan(table[0xFF])
    assert table[0x80].item() == 0.0 and str(table[0x80].item()) == "-0.0"


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scale", SCALES)
def test_every_code_times_special_scales(scale, dtype):
    q = _all_codes(256, 256)
    s = torch.full((2, 2), scale, dtype=torch.float32)
    s[0, 1] = 1.0  # a second factor in the same grid
    _assert_same_bits(dequantize_fp8_blocks(q, s, dtype), _reference(q, s, dtype))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_dtypes_and_transformers_default_output(scale_dtype):
    q = _all_codes(256, 384)
    s = (torch.rand(2, 3) * 4 - 2).to(scale_dtype)
    got, want = dequantize_fp8_blocks(q, s), _reference(q, s)
    assert got.dtype == want.dtype  # transformers' default: the scale's dtype when it is >= 2 bytes
    _assert_same_bits(got, want)


@pytest.mark.parametrize("shape", [(384, 256), (256, 640), (4, 256, 384), (2, 3, 128, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_quantized_blocks(shape, dtype):
    torch.manual_seed(sum(shape))
    w = torch.randn(shape) * torch.logspace(-3, 2, shape[-1])  # columns of very different magnitudes
    pairs = [quantize_blocks(m) for m in w.reshape(-1, *shape[-2:])]
    q = torch.stack([p[0] for p in pairs]).reshape(shape)
    s = torch.stack([p[1] for p in pairs]).reshape(*shape[:-2], *pairs[0][1].shape)
    _assert_same_bits(dequantize_fp8_blocks(q, s, dtype), _reference(q, s, dtype))


def test_per_element_scales_of_an_off_grid_shard():
    """BlockScaleSlice expands the scale to one factor per element when a shard edge falls inside a block."""
    torch.manual_seed(1)
    q, s = quantize_blocks(torch.randn(576, 256))
    rows = slice(100, 388)
    expanded = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[rows]
    _assert_same_bits(dequantize_fp8_blocks(q[rows], expanded, torch.bfloat16),
                      _reference(q[rows], expanded, torch.bfloat16))


def test_many_chunks_on_many_threads(monkeypatch):
    """Chunk edges and threads change nothing: small chunks, several threads, an uneven last chunk."""
    monkeypatch.setattr(fp8, "_CHUNK", 3000)
    monkeypatch.setattr(fp8, "_threads", lambda chunks: min(chunks, 4))
    torch.manual_seed(2)
    u8 = torch.randint(0, 256, (5, 384, 256), dtype=torch.uint8)
    q = u8.view(torch.float8_e4m3fn)
    s = torch.rand(5, 3, 2) * 10
    _assert_same_bits(dequantize_fp8_blocks(q, s, torch.bfloat16), _reference(q, s, torch.bfloat16))
    q = q[:, :, :128]  # non-contiguous input
    s = s[:, :, :1]
    _assert_same_bits(dequantize_fp8_blocks(q, s, torch.bfloat16), _reference(q, s, torch.bfloat16))


def test_wrong_grid_is_refused_like_transformers():
    q = _all_codes(256, 256)
    with pytest.raises(ValueError, match="not divisible by scale grid"):
        dequantize_fp8_blocks(q, torch.ones(3, 2))


def test_fast_path_covers_only_cpu_e4m3_with_float_scales():
    q = _all_codes(256, 256)
    assert fast_path(q, torch.ones(2, 2))
    assert not fast_path(q.view(torch.uint8).view(torch.int8), torch.ones(2, 2))  # FP4 pairs
    assert not fast_path(q, torch.ones(2, 2, dtype=torch.uint8))  # E8M0 exponents as bytes
    assert not fast_path(q[:0], torch.ones(0, 2))
    assert not fast_path(torch.stack([q, q]), torch.ones(2, 2))  # one grid for several matrices: transformers broadcasts


def test_mapping_swaps_only_the_dequantize_op_and_keeps_its_reverse():
    from transformers.core_model_loading import MergeModulelist, WeightConverter
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    quantizer = object()
    converter = WeightConverter(["experts.*.w1.weight", "experts.*.w1.weight_scale_inv"], "experts.gate_proj",
                                operations=[Fp8Dequantize(quantizer), MergeModulelist(dim=0)])
    (swapped,) = with_fast_dequantize([converter])
    fast, merge = swapped.operations
    assert isinstance(fast, Fp8Dequantize) and type(fast) is not Fp8Dequantize and isinstance(merge, MergeModulelist)
    assert isinstance(fast.reverse_op, Fp8Quantize)  # export re-quantizes as before
    copied = copy.deepcopy(swapped)  # transformers' loader copies the converter once per checkpoint key
    assert copied.operations[0].hf_quantizer is quantizer and type(copied.operations[0]) is type(fast)

    torch.manual_seed(3)
    pairs = [quantize_blocks(torch.randn(256, 128)) for _ in range(3)]
    inputs = {"w1.weight": [p[0] for p in pairs], "w1.weight_scale_inv": [p[1] for p in pairs]}
    got = fast.convert(dict(inputs))  # the per-expert list path of a merging converter
    want = Fp8Dequantize(quantizer).convert(dict(inputs))
    assert len(got["w1.weight"]) == 3
    for g, w in zip(got["w1.weight"], want["w1.weight"]):
        _assert_same_bits(g, w)
    packed = torch.randint(-128, 127, (256, 64), dtype=torch.int8)  # FP4 pairs: transformers' own path
    _assert_same_bits(fast._dequantize_one(packed, torch.ones(256, 2)),
                      Fp8Dequantize(quantizer)._dequantize_one(packed, torch.ones(256, 2)))
