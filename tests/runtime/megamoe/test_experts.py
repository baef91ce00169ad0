"""install_megamoe_forward on real transformers experts: errors, undo, clamp source, the buffer cache."""

import pytest
import torch

from planc.kernels.megamoe.buffers import next_power_of_two
from planc.kernels.megamoe.quant import quantize_experts_fp4
from planc.kernels.megamoe.reference import DequantizedExperts, reference_mega_moe
from planc.runtime.megamoe import buffer_stats, destroy_megamoe_buffers, install_megamoe_forward, megamoe_state
from tests.kernels.megamoe.common import E, deepseek_v4_experts, full_weights, mixtral_experts, routing


def installed(seed=0, **kw):
    m = mixtral_experts(*full_weights(seed))
    install_megamoe_forward(m, backend="reference", quantize="fp4", **kw)
    return m


def test_forward_equals_reference_on_the_quantized_weights(world1):
    w1, w2 = full_weights(0)
    m = mixtral_experts(w1, w2)
    install_megamoe_forward(m, backend="reference", quantize="fp4")
    q = quantize_experts_fp4(w1, w2)
    assert m.gate_up_proj.dtype == torch.int8 and torch.equal(m.gate_up_proj, q.gate_up_proj)
    assert torch.equal(m.down_proj_scale_inv.float(), q.down_proj_scale_inv.float())
    x, idx, w = routing(10, seed=1, masked=0.1)
    with torch.no_grad():
        y = m(x, idx, w, process_group=world1)
    deq = DequantizedExperts.from_fp4(q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj, q.down_proj_scale_inv)
    assert torch.equal(y, reference_mega_moe(x, idx, w, deq, num_experts=E))


def test_uninstall_restores_parameters_and_forward():
    m = mixtral_experts(*full_weights(0))
    before = dict(m.named_parameters())
    forward_before = m.forward
    undo = install_megamoe_forward(m, backend="reference", quantize="fp4")
    assert "gate_up_proj_scale_inv" in dict(m.named_parameters())
    undo()
    after = dict(m.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert "forward" not in m.__dict__ and m.forward == forward_before and megamoe_state(m) is None


def test_fp4_checkpoint_installs_without_quantizing(world1):
    w1, w2 = full_weights(0)
    q = quantize_experts_fp4(w1, w2)
    m = mixtral_experts(w1, w2)
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        if name in m._parameters:
            del m._parameters[name]
        m.register_parameter(name, torch.nn.Parameter(getattr(q, name), requires_grad=False))
    install_megamoe_forward(m, backend="reference")
    x, idx, w = routing(4, seed=2)
    with torch.no_grad():
        assert torch.equal(m(x, idx, w, process_group=world1), installed()(x, idx, w, process_group=world1))


def test_missing_process_group_is_a_value_error():
    m = installed()
    x, idx, w = routing(2, seed=3)
    with pytest.raises(ValueError, match="EP process group.*planc.apply"):
        with torch.no_grad():
            m(x, idx, w)


def test_bf16_experts_without_quantize_are_refused():
    m = mixtral_experts(*full_weights(0))
    with pytest.raises(NotImplementedError, match="experts.megamoe.quantize: fp4"):
        install_megamoe_forward(m, backend="reference")
    assert megamoe_state(m) is None and m.gate_up_proj.dtype == torch.bfloat16


def test_under_grad_is_refused(world1):
    m = installed()
    x, idx, w = routing(2, seed=3)
    with pytest.raises(RuntimeError, match="inference only"):
        m(x.requires_grad_(), idx, w, process_group=world1)


def test_expert_count_must_match_the_ep_layout():
    m = mixtral_experts(*full_weights(0))
    with pytest.raises(ValueError, match="grouped_gemm"):
        install_megamoe_forward(m, backend="reference", quantize="fp4", num_global_experts=E, ep_rank=0, ep_size=2)


def test_clamp_defaults_to_config_swiglu_limit(world1):
    w1, w2 = full_weights(0)
    m = deepseek_v4_experts(w1, w2, swiglu_limit=0.25)
    install_megamoe_forward(m, backend="reference", quantize="fp4")
    assert megamoe_state(m).activation_clamp == 0.25
    plain = mixtral_experts(w1, w2)
    install_megamoe_forward(plain, backend="reference", quantize="fp4")
    assert megamoe_state(plain).activation_clamp is None
    explicit = deepseek_v4_experts(w1, w2, swiglu_limit=0.25)
    install_megamoe_forward(explicit, backend="reference", quantize="fp4", activation_clamp=3.0)
    assert megamoe_state(explicit).activation_clamp == 3.0
    x, idx, w = routing(6, seed=4)
    x = x * 4
    with torch.no_grad():
        assert not torch.equal(m(x, idx, w, process_group=world1), plain(x, idx, w, process_group=world1))


def test_layers_share_one_buffer_per_power_of_two_bucket(world1):
    layers = [installed(seed) for seed in range(3)]
    stream = [3, 1, 7, 2, 16, 5, 9, 33, 4, 33, 12]
    start = buffer_stats().allocations
    peak, buckets = 0, set()
    with torch.no_grad():
        for step, n in enumerate(stream):
            x, idx, w = routing(n, seed=step)
            for layer in layers:
                x = layer(x, idx, w, process_group=world1)
            peak = max(peak, n)
            buckets.add(next_power_of_two(peak))
    stats = buffer_stats()
    assert stats.allocations - start == len(buckets) == 4  # 4, 8, 16, 64; not layers x sizes
    assert stats.live_buffers == 1
    destroy_megamoe_buffers()
    assert buffer_stats().live_buffers == 0 and buffer_stats().live_bytes == 0
    with torch.no_grad():  # the model keeps working: the next forward allocates again
        x, idx, w = routing(5, seed=99)
        y = layers[0](x, idx, w, process_group=world1)
    assert y.shape == x.shape and buffer_stats().allocations - start == 5 and buffer_stats().live_buffers == 1


def test_fixed_buffer_size_grows_instead_of_overflowing(world1):
    m = installed(max_tokens_per_rank=20)
    start = buffer_stats().allocations
    with torch.no_grad():
        for n in (1, 20, 7):
            x, idx, w = routing(n, seed=n)
            m(x, idx, w, process_group=world1)
        assert buffer_stats().allocations - start == 1
        x, idx, w = routing(21, seed=21)
        y = m(x, idx, w, process_group=world1)
    assert buffer_stats().allocations - start == 2 and y.shape == x.shape
