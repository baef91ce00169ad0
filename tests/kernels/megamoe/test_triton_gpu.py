"""The Triton backend compiled on a real GPU, at real tile sizes, against the reference backend on the same GPU.

Run on a CUDA machine: ``python -m pytest -m gpu tests/kernels/megamoe/test_triton_gpu.py``.
"""

import dataclasses
import types

import pytest
import torch

from planc.kernels.megamoe.quant import calc_diff, float_to_ue8m0_bytes, quantize_experts_fp4, quantize_fp8
from planc.kernels.megamoe.reference import DequantizedExperts, local_experts_forward
from planc.kernels.megamoe.triton import decode, hopper_decode, hopper_fp8, hopper_fp8_ws, hopper_prefill, target
from planc.kernels.megamoe.triton.config import KernelConfig
from planc.kernels.megamoe.triton.decode import arrival_counters
from planc.kernels.megamoe.triton.forward import combine, device_config, triton_local_experts_forward
from planc.kernels.megamoe.triton.hopper_prefill import gluon_unavailable_reason
from planc.kernels.megamoe.triton.layout import PackedExperts, e4m3_tables
from planc.kernels.megamoe.triton.routing import FUSED_ROUTE_MAX_SLOTS, route, route_torch
from planc.runtime.ep.megamoe import MegaMoeEPRuntime
from planc.runtime.megamoe import install_megamoe_forward, megamoe_state
from planc.spec.ep import MegaMoeEP
from tests.kernels.megamoe.emulation import emulate_fp8
from tests.kernels.megamoe.common import CP_ASYNC, CP_ASYNC_80_ROWS, GLUON, GLUON_80_ROWS, mixtral_experts, routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NE, NH, NI, NK = 32, 2048, 1024, 6  # 32 experts, hidden 2048, intermediate 1024, top-6


def decode_ws_unavailable() -> str | None:
    """Why `hopper_decode` cannot run on this GPU, or None."""
    return gluon_unavailable_reason(torch.device("cuda")) or hopper_decode.unavailable_reason


def gpu_weights(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1 = torch.randn(NE, 2 * NI, NH, generator=g, device="cuda").bfloat16() * NH**-0.5
    w2 = torch.randn(NE, NH, NI, generator=g, device="cuda").bfloat16() * NI**-0.5
    return w1, w2


@pytest.fixture(scope="module")
def experts():
    q = quantize_experts_fp4(*gpu_weights())
    params = (q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj, q.down_proj_scale_inv)
    return PackedExperts.from_params(*params), DequantizedExperts.from_fp4(*params)


def staged(num_tokens, seed, **kw):
    x, idx, w = (t.cuda() for t in routing(num_tokens, seed, num_experts=NE, topk=NK, hidden=NH, **kw))
    q, sf = quantize_fp8(x)
    return q, float_to_ue8m0_bytes(sf), idx, w


def check(out, ref, fp8=False):
    """The BF16 path: the reference's numerics up to the FP32 sum order; the FP8 path (`fp8`): DeepGEMM's FP8 bound."""
    assert out.shape == ref.shape
    assert calc_diff(out.float(), ref.float()) < (1e-2 if fp8 else 1e-4)


def picks_fp8(num_rows):
    """Whether a forward without a config runs the FP8 path on these shapes (its row of `config.FP8_CONFIGS`)."""
    return bool(device_config(num_rows, NE, NH, NI, torch.device("cuda")).fp8)


# The decode config as `pick_config` widens it for V4-sized batches (L2 N tiles of 128); these shapes pick 64.
WIDE_L2 = KernelConfig(block_t=16, l1_n=64, l1_k=64, l2_n=128, l2_k=64, num_warps=4, num_stages=4)


@pytest.mark.parametrize("num_tokens", [1, 3, 7, 129, 600])
@pytest.mark.parametrize("clamp", [None, 0.05])  # 0.05: active on most gate/up values here
@pytest.mark.parametrize("config", [None, WIDE_L2], ids=["picked", "l2n128"])
def test_ragged_batches_match_the_reference(experts, num_tokens, clamp, config):
    packed, deq = experts
    q, sf, idx, w = staged(num_tokens, num_tokens, masked=0.1)  # -1 padding slots included
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=clamp)
    check(triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=clamp, config=config),
          ref, fp8=config is None and picks_fp8(idx.numel()))


# The split-K decode kernels (`decode.py`), each way they stream the weights, both GEMMs split.
DECODE_VARIANTS = [
    KernelConfig(16, 64, 64, 64, 64, 4, 6, l1_split=4, prefetch=0, decode=1, l2_split=2),
    KernelConfig(16, 64, 64, 64, 64, 4, 1, l1_split=2, prefetch=1, decode=2, l2_split=2),
    KernelConfig(16, 64, 64, 64, 64, 4, 1, l1_split=2, prefetch=1, decode=4, l2_split=2),
    KernelConfig(16, 64, 64, 64, 64, 4, 6, l1_split=4, prefetch=0, decode=1, l2_split=2, persistent=1),
    KernelConfig(16, 64, 64, 64, 64, 4, 1, l1_split=2, prefetch=1, decode=2, l2_split=2, persistent=1),
    KernelConfig(16, 64, 64, 64, 64, 4, 6, l1_split=4, prefetch=0, decode=1, l2_split=2, prologue=0),
    KernelConfig(16, 64, 64, 64, 64, 4, 6, l1_split=4, prefetch=0, decode=1, l2_split=2, persistent=1, l2_stages=8,
                 pdl=1),
    KernelConfig(16, 64, 64, 64, 64, 4, 6, l1_split=4, prefetch=0, decode=1, l2_split=2, pdl=1),
    KernelConfig(16, 64, 64, 128, 64, 4, 6, l1_split=4, prefetch=0, decode=1, l2_split=4, persistent=1, maxnreg=128),
    KernelConfig(16, 128, 64, 128, 64, 4, 6, l1_split=8, prefetch=0, decode=1, l2_split=4),
    KernelConfig(16, 64, 64, 64, 64, 4, 6, prefetch=0, decode=1, stream_k=5),
    KernelConfig(16, 64, 64, 64, 64, 4, 6, prefetch=0, decode=1, stream_k=4, l2_stream_k=6, pdl=1),
    KernelConfig(16, 64, 64, 64, 64, 4, 6, l1_split=4, prefetch=0, decode=1, l2_split=2, stream_k=4),
]


@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize("config", [None, *DECODE_VARIANTS], ids=["picked", "pipeline", "prefetch2", "prefetch4",
                                                                  "persistent", "persistent_prefetch2", "three_launches",
                                                                  "persistent_pdl", "pdl", "persistent_l2n128",
                                                                  "n128", "stream_k5", "stream_k_pdl",
                                                                  "stream_k_slices"])
def test_split_k_decode_matches_the_reference_and_repeats_its_bits(experts, config, num_tokens):
    """Each tile's last program reduces the split partials in split order: two runs give the same bits (a race on
    the arrival counters or a stale partial would not), the counters are left at zero, and the result is the
    reference's up to the FP32 sum order."""
    packed, deq = experts
    q, sf, idx, w = staged(num_tokens, 40 + num_tokens, masked=0.1)
    picked = device_config(idx.numel(), NE, NH, NI, torch.device("cuda"))
    assert picked.decode  # up to 24 rows
    if config is not None and config.prefetch and not target.REGISTER_PREFETCH:
        pytest.skip("this Triton streams by the cp.async pipeline only")
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=0.05)
    runs = [triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.05, config=config)
            for _ in range(3)]
    check(runs[0], ref)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    torch.cuda.synchronize()
    assert not arrival_counters(torch.device("cuda"), 1).any() and not decode.stalls(torch.device("cuda")).any()


def test_split_k_decode_on_deepseek_v4_shapes():
    """The decode kernels at DeepSeek-V4's hidden and intermediate sizes (8 of its experts), 1 and 4 tokens, with
    the splits `pick_config` gives this GPU and under the stream-K schedule at 4 and 6 programs per SM, against the
    reference."""
    e, h, i = 8, 7168, 3072
    g = torch.Generator(device="cuda").manual_seed(7)
    w1 = torch.randn(e, 2 * i, h, generator=g, device="cuda").bfloat16() * h**-0.5
    w2 = torch.randn(e, h, i, generator=g, device="cuda").bfloat16() * i**-0.5
    qw = quantize_experts_fp4(w1, w2)
    del w1, w2
    params = (qw.gate_up_proj, qw.gate_up_proj_scale_inv, qw.down_proj, qw.down_proj_scale_inv)
    packed, deq = PackedExperts.from_params(*params), DequantizedExperts.from_fp4(*params)
    for t in (1, 4):
        x, idx, w = (a.cuda() for a in routing(t, t, num_experts=e, topk=NK, hidden=h))
        q, sf = quantize_fp8(x)
        sf = float_to_ue8m0_bytes(sf)
        cfg = device_config(idx.numel(), e, h, i, torch.device("cuda"))
        assert cfg.decode
        ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=10.0)
        out = triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=10.0)
        check(out, ref)
        split = dataclasses.replace(cfg, stream_k=0, l2_stream_k=0)  # the split-K grid, whatever the row picks
        base = out if split == cfg else triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0,
                                                                     activation_clamp=10.0, config=split)
        ws = [] if decode_ws_unavailable() else [dict(decode_ws=1, maxnreg=64, num_stages=4)]
        for variant in (dict(persistent=1 - split.persistent), dict(prologue=1 - split.prologue),
                        dict(persistent=1, pdl=1, l2_stages=8), *ws):
            other = dataclasses.replace(split, **variant)  # the same partial sums in the same order: the same bits
            assert torch.equal(base, triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0,
                                                                  activation_clamp=10.0, config=other)), variant
        if ws:  # the warp-specialized kernels on mma.sync: the reference's numerics, the same bits on every run
            other = dataclasses.replace(split, decode_ws=2, maxnreg=48, num_stages=4)
            runs = [triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=10.0,
                                                 config=other) for _ in range(2)]
            check(runs[0], ref)
            assert torch.equal(runs[0], runs[1])
        for per_sm in (4, 6):  # stream-K in the row's K slices: its own FP32 sum order, the same bits on every run
            other = dataclasses.replace(split, stream_k=per_sm, persistent=0)
            runs = [triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=10.0,
                                                 config=other) for _ in range(3)]
            check(runs[0], ref)
            assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2]), per_sm
    torch.cuda.synchronize()
    assert not arrival_counters(torch.device("cuda"), 1).any() and not decode.stalls(torch.device("cuda")).any()


def test_all_routes_to_one_expert(experts):
    packed, deq = experts
    q, sf, idx, w = staged(300, 1)
    idx = torch.full_like(idx, 5)
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=10.0)
    check(triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=10.0), ref,
          fp8=picks_fp8(idx.numel()))


@pytest.mark.parametrize("tokens,num_local,first", [(4096, 384, 0), (8 * 4096, 48, 96), (2049, 16, 0)])
def test_chunked_route_on_the_gpu_equals_the_torch_route(tokens, num_local, first):
    """Every batch above `FUSED_ROUTE_MAX_SLOTS` routes in chunks on a GPU (`routing.route_chunked`): one V4 rank at
    4096 tokens (24576 pairs, 12 chunks), an EP 8 rank's share of 8 x 4096 gathered (96 chunks), a batch one pair
    past a chunk."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    idx = torch.randint(-1, 384, (tokens, 6), generator=g, device="cuda")
    kw = dict(first_expert=first, num_local_experts=num_local, block_t=80)
    assert idx.numel() > FUSED_ROUTE_MAX_SLOTS
    got, ref = route(idx, **kw), route_torch(idx, **kw)
    valid = ref[1] < num_local
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(got[2][valid], ref[2][valid]) and torch.equal(got[3][valid], ref[3][valid])


def test_rank_slice_and_no_local_expert(experts):
    packed, deq = experts
    lo = NE // 2
    half = PackedExperts(*(t[lo:] for t in (packed.w1, packed.s1, packed.w2, packed.s2)))
    half_deq = DequantizedExperts(deq.gate_up[lo:], deq.down[lo:])
    q, sf, idx, w = staged(64, 2)
    ref = local_experts_forward(q, sf, idx, w, half_deq, first_expert=lo, activation_clamp=None)
    check(triton_local_experts_forward(q, sf, idx, w, half, first_expert=lo, activation_clamp=None), ref,
          fp8=picks_fp8(idx.numel()))
    out = triton_local_experts_forward(q, sf, idx % lo, w, half, first_expert=lo, activation_clamp=None)
    assert not out.any()


# The Hopper Gluon kernels (`hopper_prefill`) against the Triton kernels' 64-row blocks: the same bits.
TRITON_64 = KernelConfig(block_t=64, l1_n=128, l1_k=64, l2_n=128, l2_k=64, num_warps=8, num_stages=4, maxnreg=128)
needs_gluon = pytest.mark.skipif(
    torch.cuda.is_available() and gluon_unavailable_reason(torch.device("cuda")) is not None,
    reason="the Gluon kernels run on Hopper only")


def test_a_gathered_prefill_gives_the_same_bits_every_call(experts):
    """The structure of `planc verify`'s prefill: 8 ranks' tokens gathered (8 x 2048), routed over 8 x NE experts, this
    rank owning NE of them (~380 rows each, several row blocks): the picked config equals the reference, bit for bit
    the same on every call. Blocks of 128 rows through Triton's cp.async pipeline (the former pick) gave a few garbage
    slots (up to 1.9e38) on some calls at these shapes; they are refused now."""
    packed, deq = experts
    x, idx, w = (t.cuda() for t in routing(8 * 2048, 3, num_experts=8 * NE, topk=NK, hidden=NH))
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=NE, activation_clamp=10.0)
    outs = [triton_local_experts_forward(q, sf, idx, w, packed, first_expert=NE, activation_clamp=10.0)
            for _ in range(4)]
    for out in outs:
        check(out, ref, fp8=picks_fp8(idx.numel()))
        assert torch.equal(out, outs[0])
    racing = dataclasses.replace(TRITON_64, block_t=128, maxnreg=0, prefetch=0)
    with pytest.raises(ValueError, match="races on blocks of 128"):
        triton_local_experts_forward(q, sf, idx, w, packed, first_expert=NE, activation_clamp=10.0, config=racing)


@needs_gluon
@pytest.mark.parametrize("config", [GLUON, GLUON_80_ROWS, CP_ASYNC, CP_ASYNC_80_ROWS,
                                    dataclasses.replace(CP_ASYNC, l1_n=128, l2_n=128, num_warps=8, num_stages=6,
                                                        maxnreg=0),
                                    dataclasses.replace(GLUON, l2_maxnreg=96)],  # the async wgmma of 96-row blocks
                         ids=["shipped", "80rows", "cpasync", "cpasync80", "8warps", "ws96async"])
@pytest.mark.parametrize("num_tokens", [1, 3, 7, 129, 300, 400, 600])  # up to 112 rows per expert: 0-2 tail MMAs
@pytest.mark.parametrize("clamp", [None, 0.05])
def test_gluon_kernels_give_the_triton_kernels_bits(experts, config, num_tokens, clamp):
    packed, deq = experts
    q, sf, idx, w = staged(num_tokens, num_tokens, masked=0.1)
    out = triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=clamp, config=config)
    assert torch.equal(out, triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0,
                                                         activation_clamp=clamp, config=TRITON_64))
    check(out, local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=clamp))


# The split-K decode grid as warp-specialized Gluon kernels (`hopper_decode`), on wgmma and on mma.sync.
WS_DECODE = dict(decode_ws=1, maxnreg=64, num_stages=4)


@pytest.mark.skipif(torch.cuda.is_available() and decode_ws_unavailable() is not None,
                    reason="the warp-specialized decode kernels run on Hopper with a Triton that builds them")
@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize("fields", [WS_DECODE, dict(WS_DECODE, maxnreg=48, num_stages=6),
                                    dict(WS_DECODE, l1_split=1, l2_split=1), dict(WS_DECODE, decode_ws=2),
                                    dict(WS_DECODE, decode_ws=2, maxnreg=40, num_stages=6),
                                    dict(WS_DECODE, decode_ws=2, l1_split=1, l2_split=1),
                                    dict(WS_DECODE, decode_ws=2, block_t=8),
                                    dict(WS_DECODE, decode_ws=2, decode=1, l2_split=16)],  # 1 L2 K tile a slice
                         ids=["ws4", "ws6_r48", "unsplit", "sync", "sync_r40_s6", "sync_unsplit", "sync_bt8",
                              "sync_l2odd"])
def test_warp_specialized_decode_gives_the_triton_decode_bits(experts, num_tokens, fields):
    """The same slices, K order and epilogues as the Triton decode kernels: with wgmma (`decode_ws=1`) the same
    bits; with mma.sync (2) the reference's numerics (the tensor cores' FP32 sums may round in another order) and the
    same bits on every run; the arrival counters left at zero."""
    packed, deq = experts
    q, sf, idx, w = staged(num_tokens, 60 + num_tokens, masked=0.1)
    picked = device_config(idx.numel(), NE, NH, NI, torch.device("cuda"))
    assert picked.decode and not picked.decode_ws
    triton_decode = dataclasses.replace(picked, **{k: v for k, v in fields.items() if k.endswith("split")
                                                   or k == "block_t"})
    base = triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.05,
                                        config=triton_decode)
    ws = dataclasses.replace(triton_decode, **fields)
    runs = [triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.05, config=ws)
            for _ in range(3)]
    check(runs[0], local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=0.05))
    for run in runs:
        assert torch.equal(run, base if ws.decode_ws == 1 else runs[0])
    torch.cuda.synchronize()
    assert not arrival_counters(torch.device("cuda"), 1).any()
    print(f"decode_ws={ws.decode_ws}: the Triton decode bits {torch.equal(runs[0], base)}, calc_diff "
          f"{calc_diff(runs[0].float(), base.float()):.1e}")


@needs_gluon
@pytest.mark.parametrize("config", [GLUON, CP_ASYNC], ids=["shipped", "cpasync"])
def test_gluon_kernels_on_one_expert_a_rank_slice_and_large_scales(experts, config):
    packed, deq = experts
    q, sf, idx, w = staged(300, 1)
    one = torch.full_like(idx, 5)  # 1800 rows of one expert: 18 full blocks and a tail
    ref = local_experts_forward(q, sf, one, w, deq, first_expert=0, activation_clamp=10.0)
    check(triton_local_experts_forward(q, sf, one, w, packed, first_expert=0, activation_clamp=10.0,
                                       config=config), ref)
    lo = NE // 2
    half = PackedExperts(*(t[lo:] for t in (packed.w1, packed.s1, packed.w2, packed.s2)))
    out = triton_local_experts_forward(q, sf, idx, w, half, first_expert=lo, activation_clamp=None, config=config)
    ref = local_experts_forward(q, sf, idx, w, DequantizedExperts(deq.gate_up[lo:], deq.down[lo:]), first_expert=lo,
                                activation_clamp=None)
    check(out, ref)
    assert not triton_local_experts_forward(q, sf, idx % lo, w, half, first_expert=lo, activation_clamp=None,
                                            config=config).any()
    w1, w2 = gpu_weights(2)
    big = quantize_experts_fp4(w1 * 2.0**10, w2 * 2.0**10)  # UE8M0 bytes above 128: the two-multiply expansion
    params = (big.gate_up_proj, big.gate_up_proj_scale_inv, big.down_proj, big.down_proj_scale_inv)
    large = PackedExperts.from_params(*params)
    assert large.large_scales
    out = triton_local_experts_forward(q, sf, idx, w, large, first_expert=0, activation_clamp=None, config=config)
    assert torch.equal(out, triton_local_experts_forward(q, sf, idx, w, large, first_expert=0,
                                                         activation_clamp=None, config=TRITON_64))
    check(out, local_experts_forward(q, sf, idx, w, DequantizedExperts.from_fp4(*params), first_expert=0,
                                     activation_clamp=None))


@needs_gluon
def test_bf16_math_runs_the_bf16_path_and_keeps_one_layout(world1):
    """`experts.megamoe.math: bf16`: a batch the table gives the FP8 path on Hopper (~34 rows per expert) runs the
    BF16 path instead, bit for bit the layer with the FP8 rows removed, and the experts keep their one layout
    (`fp8_layout_nbytes` 0); with `auto` the same batch makes the FP8 layout."""
    w1, w2 = gpu_weights(1)
    auto_m, bf16_m = mixtral_experts(w1, w2), mixtral_experts(w1, w2)
    install_megamoe_forward(auto_m, backend="triton", quantize="fp4", activation_clamp=10.0)
    install_megamoe_forward(bf16_m, backend="triton", quantize="fp4", activation_clamp=10.0, math="bf16")
    groups = types.SimpleNamespace(ep_group=world1, ep_rank=0, ep_size=1, tp_group=world1, tp_size=1, shares_batch=True)
    strategy = MegaMoeEP(reason="the experts implementation")
    auto, bf16 = MegaMoeEPRuntime(auto_m, strategy, groups), MegaMoeEPRuntime(bf16_m, strategy, groups)
    device = torch.device("cuda")
    t = 200  # 200 x 6 / 32 experts: ~34 rows per expert, 90% routed
    assert device_config(t * NK, NE, NH, NI, device).fp8 and not device_config(t * NK, NE, NH, NI, device, fp8=False).fp8
    x, idx, w = (a.cuda() for a in routing(t, t, num_experts=NE, topk=NK, hidden=NH, masked=0.1))
    with torch.no_grad():
        y_auto, y_bf16 = auto(x, idx, w), bf16(x, idx, w)
    assert megamoe_state(auto_m).runner.weights(device).fp8_layout_nbytes > 0
    assert megamoe_state(bf16_m).runner.weights(device).fp8_layout_nbytes == 0
    q, sf = quantize_fp8(x)
    packed = megamoe_state(bf16_m).runner.weights(device)
    want = combine(triton_local_experts_forward(q, float_to_ue8m0_bytes(sf), idx, w, packed, first_expert=0,
                                                activation_clamp=10.0, fp8_path=False))
    assert torch.equal(y_bf16, want)
    check(y_auto, y_bf16, fp8=True)


def test_installed_layer_graph_capture_without_host_sync(world1):
    w1, w2 = gpu_weights(1)
    ref_m, tri_m = mixtral_experts(w1, w2), mixtral_experts(w1, w2)
    install_megamoe_forward(ref_m, backend="reference", quantize="fp4", activation_clamp=10.0)
    install_megamoe_forward(tri_m, backend="auto" if torch.cuda.get_device_capability()[0] == 9 else "triton",
                            quantize="fp4", activation_clamp=10.0)
    assert megamoe_state(tri_m).backend == "triton"
    groups = types.SimpleNamespace(ep_group=world1, ep_rank=0, ep_size=1, tp_group=world1, tp_size=1, shares_batch=True)
    strategy = MegaMoeEP(reason="the experts implementation")
    layer, ref_layer = MegaMoeEPRuntime(tri_m, strategy, groups), MegaMoeEPRuntime(ref_m, strategy, groups)
    with torch.no_grad():
        for t in (1, 16, 129, 400):  # 400 tokens: 75 rows per expert, the Gluon kernels on Hopper
            x, idx, w = (a.cuda() for a in routing(t, t, num_experts=NE, topk=NK, hidden=NH, masked=0.1))
            layer(x, idx, w)  # compile outside the capture
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # a host sync in the forward raises
            try:
                y = layer(x, idx, w)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            graph = torch.cuda.CUDAGraph()  # a capture fails on any sync too
            with torch.cuda.graph(graph):
                y_graph = layer(x, idx, w)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_graph, y)
            check(y, ref_layer(x, idx, w), fp8=picks_fp8(t * NK))
            # the decode kernels' arrival counters were zeroed before the capture: no fill kernel in the graph
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            fills = [e.name for e in prof.events() if "FillFunctor<int>" in e.name]
            assert not fills, (t, fills)


# The FP8-math path (`triton/fp8.py`) at real tile sizes against its float64 emulation (only the FP32 sum order
# differs) and the BF16-path reference (DeepGEMM's FP8 bound).
FP8_NE, FP8_NH, FP8_NI = 8, 1024, 512
needs_fp8 = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                               reason="FP8 MMAs need sm_89 or newer")


needs_gluon = pytest.mark.skipif(gluon_unavailable_reason(torch.device("cuda")) is not None if torch.cuda.is_available()
                                 else True, reason="the FP8 Gluon kernels need Hopper and Gluon")
needs_fp8_ws = pytest.mark.skipif(hopper_fp8_ws.unavailable(torch.device("cuda")) is not None
                                  if torch.cuda.is_available() else True,
                                  reason="the warp-specialized FP8 kernels need Hopper and a Triton that builds them")


# The row-scaled kernels (fp8=6) against their float64 emulation, which sums each GEMM exactly: they accumulate every K
# block in the FP8 wgmma's accumulator, whose adds on Hopper keep fewer bits than FP32 (nothing promotes a block's sum
# in FP32, which is what makes them fast). On an H100 (2026-12-07) cuBLAS's FP8 GEMM in that mode (`use_fast_accum`)
# left exact sums by 1.0e-4 / 1.7e-4 / 3.8e-4 of the row's largest (rms; K 512 / 1024 / 7168) where its promoting mode
# left them by 3.9e-5; the row-scaled kernels' L1 outputs at 90 tokens differed from the emulation's in 11.5% of
# elements, and the layer gave calc_diff 7.1e-6 / 1.9e-5 / 7.6e-6 at 5 / 90 / 150 tokens (fp8=3, promoted per 128:
# 1.3e-6 / 4.6e-6 / 3.4e-6). A wrong scale, row or slot costs 1e-3 and more.
ROW_SCALED_EMULATION_BOUND = 5e-5


@needs_fp8
@pytest.mark.parametrize("config", [
    KernelConfig(128, 128, 128, 128, 128, 8, 3, fp8=1),
    KernelConfig(64, 128, 128, 128, 128, 8, 3, fp8=2),
    pytest.param(KernelConfig(64, 128, 128, 64, 128, 8, 4, fp8=3), marks=needs_gluon),  # L1 casts in its epilogue
    pytest.param(KernelConfig(32, 128, 128, 128, 128, 4, 3, fp8=3), marks=needs_gluon),  # L1 in FP32, then the cast
    # warp-specialized: L1 in two passes of 64 channels, cast in the kernel; 64 channels, cast apart; 8 warps
    pytest.param(KernelConfig(64, 128, 128, 64, 128, 4, 4, fp8=4), marks=needs_fp8_ws),
    pytest.param(KernelConfig(64, 64, 128, 64, 128, 4, 3, fp8=4), marks=needs_fp8_ws),
    pytest.param(KernelConfig(32, 128, 128, 128, 128, 8, 3, fp8=4), marks=needs_fp8_ws),
    # the converter warps expand into shared memory: two passes, cast in the kernel; 32-row blocks on 8 warps
    pytest.param(KernelConfig(64, 128, 128, 64, 128, 4, 3, fp8=5), marks=needs_fp8_ws),
    pytest.param(KernelConfig(32, 128, 128, 128, 128, 8, 3, maxnreg=96, fp8=5), marks=needs_fp8_ws),
    # one scale per row, no promotion: 64- and 128-row blocks on 4 warps, 32-row blocks on 8; 80-row blocks (a 16-row
    # tail MMA) at the cap that fits three programs an SM
    pytest.param(KernelConfig(64, 128, 128, 64, 128, 4, 4, fp8=6), marks=needs_gluon),
    pytest.param(KernelConfig(128, 128, 128, 64, 128, 4, 4, fp8=6), marks=needs_gluon),
    pytest.param(KernelConfig(32, 128, 128, 128, 128, 8, 3, fp8=6), marks=needs_gluon),
    pytest.param(KernelConfig(80, 128, 128, 64, 128, 4, 4, maxnreg=168, fp8=6), marks=needs_gluon),
    # and with L2 on 8 warps at 128 registers (its tail tile in the 8-warp copy layout)
    pytest.param(KernelConfig(80, 128, 128, 128, 128, 4, 4, maxnreg=168, l2_maxnreg=128, fp8=6), marks=needs_gluon),
], ids=["swap_ab", "rows_m", "gluon_64", "gluon_32", "ws_64", "ws_64_cast_apart", "ws_32", "cv_64", "cv_32",
        "row_scaled_64", "row_scaled_128", "row_scaled_32", "row_scaled_80", "row_scaled_80_l2_8warps"])
# ~4, ~61 and ~101 rows per expert (90% of the slots routed): blocks of a few rows; some experts of 65-79 rows (80-row
# blocks: a tail cut by the expert's end); experts over 80 rows (full tails, then a second block)
@pytest.mark.parametrize("num_tokens,clamp", [(5, None), (90, None), (150, 0.05)])
def test_fp8_path_matches_its_emulation(config, num_tokens, clamp):
    g = torch.Generator(device="cuda").manual_seed(7)
    w1 = torch.randn(FP8_NE, 2 * FP8_NI, FP8_NH, generator=g, device="cuda").bfloat16() * FP8_NH**-0.5
    w2 = torch.randn(FP8_NE, FP8_NH, FP8_NI, generator=g, device="cuda").bfloat16() * FP8_NI**-0.5
    w1[:, ::3, 32:64] *= 2.0**-12  # 32-groups far below their 128-block's largest: off the e4m3 grid
    fp4 = quantize_experts_fp4(w1, w2)
    params = (fp4.gate_up_proj, fp4.gate_up_proj_scale_inv, fp4.down_proj, fp4.down_proj_scale_inv)
    packed, deq = PackedExperts.from_params(*params), DequantizedExperts.from_fp4(*params)
    x, idx, w = (t.cuda() for t in routing(num_tokens, num_tokens, num_experts=FP8_NE, topk=NK, hidden=FP8_NH,
                                            masked=0.1))
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    out = triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=clamp, config=config)
    y = combine(out)
    cpu = types.SimpleNamespace(**{k: v.cpu() for k, v in vars(fp4).items()})
    emulated = emulate_fp8(q.cpu(), sf.cpu(), idx.cpu(), w.cpu(), cpu, clamp=clamp, rows=config.fp8 == 6)
    assert calc_diff(y.double().cpu(), emulated) < (ROW_SCALED_EMULATION_BOUND if config.fp8 == 6 else 1e-5)
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=clamp)
    check(out, ref, fp8=True)


if hopper_prefill.gluon is not None:
    @hopper_fp8.gluon.jit
    def _table_words_kernel(t_ptr, out_ptr):
        L: hopper_fp8.gl.constexpr = hopper_fp8.gl.BlockedLayout([1], [32], [4], [0])
        offs = hopper_fp8.gl.program_id(0) * 128 + hopper_fp8.gl.arange(0, 128, layout=L)
        lo, hi = hopper_fp8.table_words(hopper_fp8.gl.load(t_ptr + offs))
        hopper_fp8.gl.store(out_ptr + 2 * offs, lo)
        hopper_fp8.gl.store(out_ptr + 2 * offs + 1, hi)


@needs_gluon
def test_e4m3_table_words_are_the_tables():
    """`hopper_fp8.table_words` (rows 0-6 by two multiply-adds, the subnormal rows by `cvt` behind a warp vote) gives
    `layout.e4m3_tables`' words for every row: warps whose lanes need none of the `cvt` rows, some, all, and random."""
    g = torch.Generator().manual_seed(0)
    t = torch.cat([torch.arange(128) % 7, torch.arange(128) % 17, 7 + torch.arange(128) % 10,
                   torch.randint(0, 17, (128,), generator=g)]).int().cuda()
    tab = e4m3_tables(t.device)
    out = torch.empty(t.numel(), 2, dtype=torch.int32, device="cuda")
    _table_words_kernel[(t.numel() // 128,)](t, out, num_warps=4)
    want = tab[t.long()]
    assert torch.equal(out[:, 0], (want & 0xFFFFFFFF).to(torch.int32)), (t, out[:, 0], want)
    assert torch.equal(out[:, 1], (want >> 32).to(torch.int32)), (t, out[:, 1], want)


@needs_fp8_ws
@pytest.mark.parametrize("fields,ws_fields", [
    (dict(block_t=64, num_warps=4, l2_n=64, num_stages=4), dict(l1_n=64)),  # L1 64 channels, cast apart
    (dict(block_t=64, num_warps=4, l2_n=64, num_stages=4), {}),  # two passes, cast in the kernel
    (dict(block_t=64, num_warps=8, l2_n=128, num_stages=6, maxnreg=168), {}),
    (dict(block_t=32, num_warps=4, l2_n=64, num_stages=3, l2_maxnreg=168), {})],
    ids=["64rows", "2passes", "8warps", "32rows"])
@pytest.mark.parametrize("num_tokens", [5, 150, 700])  # up to ~525 rows per expert: several blocks, half-width tails
@pytest.mark.parametrize("fp8", [4, 5])
def test_warp_specialized_fp8_kernels_give_the_fp8_gluon_bits(fields, ws_fields, num_tokens, fp8):
    """`hopper_fp8_ws` (fp8=4; fp8=5 with the converter warps, the same e4m3 operand from shared memory) runs
    `hopper_fp8`'s (fp8=3) expansions, MMAs, promotions and casts in the same order: the same bits, on every call (L1
    in two passes casts in the kernel what fp8=3 on 4 warps casts apart)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    w1 = torch.randn(FP8_NE, 2 * FP8_NI, FP8_NH, generator=g, device="cuda").bfloat16() * FP8_NH**-0.5
    w2 = torch.randn(FP8_NE, FP8_NH, FP8_NI, generator=g, device="cuda").bfloat16() * FP8_NI**-0.5
    fp4 = quantize_experts_fp4(w1, w2)
    packed = PackedExperts.from_params(fp4.gate_up_proj, fp4.gate_up_proj_scale_inv, fp4.down_proj,
                                       fp4.down_proj_scale_inv)
    x, idx, w = (t.cuda() for t in routing(num_tokens, num_tokens, num_experts=FP8_NE, topk=NK, hidden=FP8_NH,
                                            masked=0.1))
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    gluon = KernelConfig(**{**dict(l1_n=128, l1_k=128, l2_k=128, fp8=3), **fields})
    base = triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.05, config=gluon)
    ws = dataclasses.replace(gluon, fp8=fp8, **ws_fields)
    if fp8 == 5:  # the converter's tiles take shared memory and its warps registers: 3 stages, the default caps (8 MMA
        # and 8 converter warps: 96, one program per SM)
        ws = dataclasses.replace(ws, num_stages=3, maxnreg=96 if ws.num_warps == 8 else 0, l2_maxnreg=0)
    for _ in range(3):
        assert torch.equal(triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.05,
                                                        config=ws), base)
