"""The reference backend against an independent float64 emulation of the kernel, and accuracy bounds."""

import pytest
import torch

from planc.kernels.megamoe.quant import calc_diff, quantize_experts_fp4
from planc.kernels.megamoe.reference import DequantizedExperts, reference_mega_moe
from tests.kernels.megamoe.common import E, full_weights, routing
from tests.kernels.megamoe.emulation import decode_fp4, emulate, moe_float64


@pytest.fixture(scope="module")
def experts():
    w1, w2 = full_weights(0)
    q = quantize_experts_fp4(w1, w2)
    deq = DequantizedExperts.from_fp4(q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj, q.down_proj_scale_inv)
    # the emulation decodes the FP4 bytes itself
    d1 = torch.stack([decode_fp4(q.gate_up_proj[e], q.gate_up_proj_scale_inv[e]) for e in range(E)])
    d2 = torch.stack([decode_fp4(q.down_proj[e], q.down_proj_scale_inv[e]) for e in range(E)])
    return dict(w1=w1, w2=w2, deq=deq, d1=d1, d2=d2)


def run(experts, x, idx, w, clamp=None):
    return reference_mega_moe(x, idx, w, experts["deq"], num_experts=E, activation_clamp=clamp)


def assert_equal_within_bf16_rounding(y, expected):
    """Same value, or one BF16 ulp apart where FP32 vs float64 accumulation flips a rounding."""
    y = y.double()
    ulp = torch.ldexp(torch.ones_like(expected), torch.frexp(expected)[1] - 8)
    assert ((y - expected).abs() <= ulp).all(), (y - expected).abs().max()
    assert (y == expected).double().mean() > 0.99


@pytest.mark.parametrize("clamp", [None, 10.0, 0.5])
def test_reference_matches_float64_emulation(experts, clamp):
    x, idx, w = routing(32, seed=1, masked=0.2)
    y = run(experts, x, idx, w, clamp)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert_equal_within_bf16_rounding(y, emulate(x, idx, w, experts["d1"], experts["d2"], clamp=clamp))


def test_clamp_is_bf16_asymmetric_gate_and_symmetric_up(experts):
    x, idx, w = routing(16, seed=2)
    x = x * 8  # push the L1 outputs well past the clamp
    c = 0.3
    y = run(experts, x, idx, w, clamp=c)
    assert_equal_within_bf16_rounding(y, emulate(x, idx, w, experts["d1"], experts["d2"], clamp=c))
    # both the unclamped and a symmetric gate clamp give other numbers
    assert not torch.equal(y, run(experts, x, idx, w, clamp=None))
    inter = experts["d2"].shape[2]

    def symmetric_gate(e):  # what a wrong (symmetric) gate clamp would compute for slot 0
        h = experts["d1"][e] @ x[0].double()
        gate, up = h[:inter].clamp(-c, c), h[inter:].clamp(-c, c)
        return experts["d2"][e] @ (gate * torch.sigmoid(gate) * up)

    one = idx[:1].clone()
    one[0, 1:] = -1
    y_one = run(experts, x[:1], one, w[:1], clamp=c).double()[0]
    wrong = symmetric_gate(int(one[0, 0])) * float(w[0, 0])
    assert calc_diff(y_one, wrong) > 1e-3


def test_topk_weight_is_applied_before_requantization(experts):
    x, idx, w = routing(24, seed=3)
    w = w * 0.37  # not a power of two: before/after requant give different roundings
    y = run(experts, x, idx, w).double()
    before = emulate(x, idx, w, experts["d1"], experts["d2"])
    after = emulate(x, idx, w, experts["d1"], experts["d2"], weight_after_requant=True)
    assert_equal_within_bf16_rounding(y, before)
    assert (y != after).double().mean() > 0.2


def test_skipped_slots_and_tokens_without_slots(experts):
    x, idx, w = routing(8, seed=4)
    idx[2, 1] = -1
    idx[5] = -1  # no valid slot at all
    garbage = w.clone()
    garbage[idx < 0] = 123.0  # weights of skipped slots are ignored
    zeroed = w.masked_fill(idx < 0, 0.0)
    y = run(experts, x, idx, garbage)
    assert torch.equal(y, run(experts, x, idx, zeroed))
    assert torch.equal(y[5], torch.zeros_like(y[5]))
    assert_equal_within_bf16_rounding(y, emulate(x, idx, garbage, experts["d1"], experts["d2"]))


def test_empty_batch(experts):
    x, idx, w = routing(0, seed=5)
    y = run(experts, x, idx, w)
    assert y.shape == (0, x.shape[1]) and y.dtype == torch.bfloat16


def test_accuracy_against_float64_moes(experts):
    """calc_diff bounds: vs a float64 MoE on the FP4-dequantized weights < 0.01; vs the unquantized weights
    < 0.05 (two chained FP4 GEMMs: ~0.02-0.035 expected, more would be a bug)."""
    x, idx, w = routing(64, seed=6)
    w = torch.softmax(w, dim=-1)
    y = run(experts, x, idx, w, clamp=10.0)
    on_dequantized = calc_diff(y, moe_float64(x, idx, w, experts["d1"], experts["d2"], clamp=10.0))
    on_unquantized = calc_diff(y, moe_float64(x, idx, w, experts["w1"], experts["w2"], clamp=10.0))
    print(f"calc_diff MoE vs float64 on dequantized FP4 weights: {on_dequantized:.5f}")
    print(f"calc_diff MoE vs float64 on unquantized weights:     {on_unquantized:.5f}")
    assert on_dequantized < 0.01
    assert on_unquantized < 0.05


def test_wrong_expert_count_is_refused(experts):
    x, idx, w = routing(4, seed=7)
    with pytest.raises(ValueError, match="global experts"):
        reference_mega_moe(x, idx, w, experts["deq"], num_experts=2 * E)


def test_the_local_forward_gets_the_layers_expert_count(experts):
    """A kernel backend sizes its tiles by the rows its local experts receive, which needs the layer's global expert
    count (under EP the gathered rows are ep_size times that share): the layer hands it to `local_forward`."""
    from planc.kernels.megamoe.reference import local_experts_forward

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("num_experts"))
        return local_experts_forward(*args, **kwargs)

    x, idx, w = routing(5, 1)
    y = reference_mega_moe(x, idx, w, experts["deq"], num_experts=E, local_forward=recording)
    assert seen == [E] and torch.equal(y, run(experts, x, idx, w))
