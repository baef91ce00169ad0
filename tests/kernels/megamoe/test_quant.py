"""FP8 / FP4 casts: layouts, rounding rules, exactness, and DeepGEMM's single-GEMM accuracy bound."""

import pytest
import torch

from planc.kernels.megamoe.quant import (
    SCALE_DTYPE,
    calc_diff,
    dequantize_experts_fp4,
    dequantize_fp4,
    dequantize_fp8,
    pack_ue8m0,
    quantize_experts_fp4,
    quantize_fp4,
    quantize_fp8,
    requantize_fp8_like_kernel,
    unpack_ue8m0,
)
from tests.kernels.megamoe.emulation import decode_fp4, round_bf16


def test_fp4_packing_puts_even_index_in_low_nibble():
    # amax 6 -> scale 1: codes are the e2m1 table indices (+8 for negatives)
    row = torch.zeros(1, 32)
    row[0, :4] = torch.tensor([0.5, -1.0, 6.0, -0.0])
    packed, sf = quantize_fp4(row)
    assert packed.dtype == torch.int8 and packed.shape == (1, 16) and sf.shape == (1, 1)
    assert float(sf) == 1.0
    b = packed.view(torch.uint8)[0].tolist()
    assert b[0] == 0x1 | (0x8 | 0x2) << 4  # 0.5 -> code 1 (low), -1.0 -> code 0xA (high)
    assert b[1] == 0x7  # 6.0 -> code 7, -0.0 -> code 0 (no negative zero)


@pytest.mark.parametrize(
    "value,expected",
    [(0.25, 0.0), (0.26, 0.5), (0.75, 0.5), (1.25, 1.0), (1.75, 1.5), (2.5, 2.0), (3.5, 3.0), (5.0, 4.0), (5.1, 6.0)],
)
def test_fp4_rounds_to_nearest_with_ties_toward_zero(value, expected):
    row = torch.zeros(1, 32)
    row[0, 0], row[0, 1] = value, 6.0  # pin the scale to 1
    packed, sf = quantize_fp4(row)
    assert float(dequantize_fp4(packed, sf)[0, 0]) == expected
    assert float(dequantize_fp4(*quantize_fp4(-row))[0, 0]) == -expected


def test_fp4_scales_are_ue8m0_and_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(1)
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    signs = torch.where(torch.rand(16, 64, generator=g) < 0.5, -1, 1)
    codes = table[torch.randint(0, 8, (16, 64), generator=g)] * signs
    codes[:, ::32] = 6.0  # amax 6 in every group
    x = codes * 2.0 ** torch.randint(-8, 8, (16, 2), generator=g).repeat_interleave(32, dim=1)
    packed, sf = quantize_fp4(x)
    assert torch.equal(torch.log2(sf), torch.round(torch.log2(sf)))  # powers of two
    assert torch.equal(dequantize_fp4(packed, sf), x)
    assert torch.equal(decode_fp4(packed, sf).float(), x)  # the test's own decoder agrees


def test_quantize_experts_layout_and_dequantize():
    g = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(3, 64, 96, generator=g), torch.randn(3, 96, 32, generator=g)
    q = quantize_experts_fp4(w1, w2)
    assert q.gate_up_proj.shape == (3, 64, 48) and q.gate_up_proj.dtype == torch.int8
    assert q.gate_up_proj_scale_inv.shape == (3, 64, 3) and q.gate_up_proj_scale_inv.dtype == SCALE_DTYPE
    assert q.down_proj.shape == (3, 96, 16) and q.down_proj_scale_inv.shape == (3, 96, 1)
    d1, d2 = dequantize_experts_fp4(q)
    assert calc_diff(d1, w1) < 0.01 and calc_diff(d2, w2) < 0.01
    with pytest.raises(ValueError, match="down_proj must be"):
        quantize_experts_fp4(w1, w2.transpose(1, 2))


def test_fp8_activation_cast_scales_and_packing():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 128, generator=g) * 10
    q, sf = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and sf.shape == (4, 4)
    assert (sf * 448 >= x.view(4, 4, 32).abs().amax(-1)).all()  # never overflows
    assert (sf * 224 < x.view(4, 4, 32).abs().amax(-1)).all()  # smallest such power of two
    packed = pack_ue8m0(sf)
    assert packed.dtype == torch.int32 and packed.shape == (4, 1)
    assert torch.equal(unpack_ue8m0(packed), sf)
    assert calc_diff(dequantize_fp8(q, sf), x) < 1e-3
    # the 1e-4 floor: an all-zero group keeps a finite scale
    assert float(quantize_fp8(torch.zeros(1, 32))[1]) > 0


def test_kernel_requant_has_no_floor_and_saturates():
    a = torch.zeros(2, 64)
    a[1, :32] = 448.0 * 0.25  # amax exactly 448 * 2^-2 -> sf 2^-2, values hit 448
    a[1, 32] = 1e-30  # tiny but nonzero group: exponent from the bits, no floor
    q, sf = requantize_fp8_like_kernel(a)
    assert sf[0].tolist() == [0.0, 0.0]  # all-zero group: SF byte 0
    assert float(sf[1, 0]) == 0.25 and float(q[1, 0].float()) == 448.0
    # a floor of 1e-4 (the activation cast's) would give sf >= 2^-22 and flush 1e-30 to zero
    assert float(sf[1, 1]) == 2.0 ** -108  # ceil(log2(1e-30 / 448)) = -108
    back = dequantize_fp8(q, sf)
    assert torch.equal(back[1, :32], a[1, :32])
    assert abs(float(back[1, 32]) - 1e-30) <= 1e-30 * 2**-4


def test_calc_diff_is_deepgemms_metric():
    x = torch.randn(100)
    assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-12)
    assert calc_diff(x, -x) == pytest.approx(2.0)
    assert calc_diff(x, 2 * x) == pytest.approx(1 - 4 / 5)


def test_one_fp8_x_fp4_gemm_is_within_deepgemms_bound():
    """DeepGEMM's own bound for one FP8 x FP4 GEMM: calc_diff < 0.01 against the unquantized BF16 GEMM."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 512, generator=g).bfloat16()
    w = torch.randn(384, 512, generator=g).bfloat16()
    xq, xs = quantize_fp8(x)
    wq, ws = quantize_fp4(w)
    out = round_bf16(dequantize_fp8(xq, xs).double() @ dequantize_fp4(wq, ws).double().T)
    diff = calc_diff(out, x.double() @ w.double().T)
    print(f"calc_diff one L1 GEMM (FP8 x FP4 vs unquantized): {diff:.5f}")
    assert diff < 0.01
