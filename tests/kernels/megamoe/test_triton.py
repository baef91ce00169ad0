"""The Triton backend: its kernels (under Triton's CPU interpreter here, compiled on a GPU) against the reference.

The reference's numerics are the contract (docs/megamoe.md): only the order of FP32 sums may differ, so
calc_diff < 1e-4 everywhere. On CPU both sides sum exact products in FP32 and agree to the last bit on
these shapes, which the element check below would notice if a rounding step were off.
"""

import dataclasses
import types

import pytest
import torch

from planc.kernels.megamoe.quant import calc_diff, float_to_ue8m0_bytes, quantize_experts_fp4, quantize_fp8
from planc.kernels.megamoe.reference import DequantizedExperts, ReferenceBuffer, local_experts_forward
from planc.kernels.megamoe.reference import combine as reference_combine
from planc.kernels.megamoe.reference import stage as reference_stage
from planc.kernels.megamoe.triton import config as triton_config
from planc.kernels.megamoe.triton import decode, fp8
from planc.kernels.megamoe.triton import routing as routing_module
from planc.kernels.megamoe.triton import stream_k
from planc.kernels.megamoe.triton import target
from planc.kernels.megamoe.triton.config import KernelConfig, local_rows, pick_config
from planc.kernels.megamoe.triton.decode import arrival_counters
from planc.kernels.megamoe.triton.forward import combine, dequantize_x, stage, triton_local_experts_forward
from planc.kernels.megamoe.triton.layout import PackedExperts, shuffle_fp4
from planc.kernels.megamoe.triton.routing import max_blocks, route, route_chunked, route_fused, route_torch
from planc.runtime.ep.megamoe import MegaMoeEPRuntime
from planc.runtime.megamoe import install_megamoe_forward, megamoe_state
from tests.kernels.megamoe.common import fill_ops, full_weights, mixtral_experts, routing
from planc.spec.ep import MegaMoeEP

pytestmark = pytest.mark.skipif(
    not target.interpreting(),
    reason="CPU tensors need Triton's interpreter; on a GPU, test_triton_gpu.py runs the kernels",
)

TINY = KernelConfig(block_t=16, l1_n=32, l1_k=64, l2_n=32, l2_k=64)


@pytest.fixture(scope="module")
def experts():
    w1, w2 = full_weights(0)
    q = quantize_experts_fp4(w1, w2)
    params = (q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj, q.down_proj_scale_inv)
    return PackedExperts.from_params(*params), DequantizedExperts.from_fp4(*params)


def staged(num_tokens, seed, **kw):
    x, idx, w = routing(num_tokens, seed, **kw)
    q, sf = quantize_fp8(x)
    return q, float_to_ue8m0_bytes(sf), idx, w


def assert_matches(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.bfloat16
    assert calc_diff(out.float(), ref.float()) < 1e-4
    assert (out != ref).sum() <= 0.01 * out.numel()  # FP32 sum order may flip a rare BF16 rounding, never more


def test_route_cuts_sorted_slots_into_blocks_of_one_expert():
    idx = torch.tensor([[3, -1, 5], [5, 3, 0], [9, 3, 3]])  # 9: another rank's expert
    slots, expert, row, end = route(idx, first_expert=0, num_local_experts=8, block_t=2)
    assert expert.numel() == max_blocks(9, 8, 2) == 5 + 8
    e = idx.reshape(-1)
    valid = expert < 8
    assert valid.sum() == 4  # expert 0: 1 row (1 block), 3: 4 rows (2), 5: 2 rows (1)
    for b in range(int(valid.sum())):
        rows = slots[row[b]:min(row[b] + 2, end[b])].long()
        assert len(rows) >= 1 and bool((e[rows] == expert[b]).all())
    assert sorted(slots[:7].tolist()) == sorted(int(i) for i in torch.nonzero((e >= 0) & (e < 8)).flatten())


def test_fused_route_equals_the_torch_route():
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        e_loc, t, k = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 300), (1, 120), (1, 8)))
        first = int(torch.randint(0, 3, (1,), generator=g)) * e_loc
        idx = torch.randint(-1, 3 * e_loc, (t, k), generator=g)
        kw = dict(first_expert=first, num_local_experts=e_loc, block_t=(16, 32, 64)[trial % 3])
        fused, ref = route_fused(idx, **kw), route_torch(idx, **kw)
        valid = ref[1] < e_loc  # rows of the unused blocks are not read
        assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1])
        assert torch.equal(fused[2][valid], ref[2][valid]) and torch.equal(fused[3][valid], ref[3][valid])


@pytest.mark.parametrize("how", ["torch", "chunked"])
def test_the_large_batch_routes_put_no_fill_kernel_into_a_graph(how):
    """Batches above `FUSED_ROUTE_MAX_SLOTS` route inside every captured layer, by three launches on a GPU
    (`route_chunked`), by torch ops elsewhere: neither may make a tensor from a Python number or fill one (each a
    kernel replayed with the graph)."""
    idx = torch.randint(-1, 40, (700, 6), generator=torch.Generator().manual_seed(3))
    assert idx.numel() > routing_module.FUSED_ROUTE_MAX_SLOTS
    kw = dict(first_expert=8, num_local_experts=16, block_t=64)
    # chunks of 256 pairs: a sort of 2048 keys takes seconds under the interpreter
    torch_route, chunked = (lambda: route(idx, **kw)), (lambda: route_chunked(idx, **kw, chunk=256))
    routed, fills = fill_ops(torch_route if how == "torch" else chunked)
    assert not fills, fills
    other = chunked() if how == "torch" else route_torch(idx, **kw)  # the other implementation
    assert all(torch.equal(a, b) for a, b in zip(routed[:2], other[:2]))


def test_chunked_route_equals_the_torch_route():
    """`route_chunked` (three launches over chunks of pairs; on a GPU every batch above `FUSED_ROUTE_MAX_SLOTS`)
    gives `route_torch`'s output: one chunk or many, batches a whole number of chunks or not, one local expert or
    hundreds, first experts of other ranks, -1 slots."""
    g = torch.Generator().manual_seed(5)
    for t, k, e_loc, first_rank, block_t, chunk in [(70, 6, 16, 1, 64, 64), (409, 6, 384, 0, 80, 256),
                                                     (100, 8, 37, 2, 16, 32), (500, 4, 1, 0, 32, 128),
                                                     (3, 2, 5, 0, 16, 64), (64, 1, 4, 0, 16, 64)]:
        idx = torch.randint(-1, 3 * e_loc, (t, k), generator=g)
        kw = dict(first_expert=first_rank * e_loc, num_local_experts=e_loc, block_t=block_t)
        got, ref = route_chunked(idx, **kw, chunk=chunk), route_torch(idx, **kw)
        valid = ref[1] < e_loc  # rows of the unused blocks are not read
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (t, k, e_loc)
        assert torch.equal(got[2][valid], ref[2][valid]) and torch.equal(got[3][valid], ref[3][valid]), (t, k, e_loc)


def test_combine_kernel_is_the_reference_combine():
    g = torch.Generator().manual_seed(1)
    slots = (torch.randn(5, 6, 96, generator=g) * torch.logspace(-3, 3, 96)).bfloat16()
    assert torch.equal(combine(slots), reference_combine(slots))
    assert torch.equal(combine(slots[:2]), reference_combine(slots[:2])) and combine(slots[:0]).shape == (0, 96)


@pytest.mark.parametrize("num_tokens,rows", [(3, 3), (5, 8), (0, 2)])
def test_stage_kernel_writes_the_reference_bytes(num_tokens, rows):
    """The one-kernel staging: the same FP8 bytes (zero groups, -0.0, subnormals), scales, routing and padding."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(num_tokens, 1536, generator=g) * torch.logspace(-6, 3, 1536)).bfloat16()
    if num_tokens:
        x[0, :32], x[-1, 32:64] = 0.0, -0.0
    idx = torch.randint(-1, 8, (num_tokens, 3), generator=g)
    w = torch.rand(num_tokens, 3, generator=g)
    bufs = ReferenceBuffer(8, 1536, 3, torch.device("cpu")), ReferenceBuffer(8, 1536, 3, torch.device("cpu"))
    for buf in bufs:
        for t in (buf.x.view(torch.uint8), buf.x_sf, buf.topk_idx, buf.topk_weights):
            t.fill_(77)  # poison: every row below `rows` must be written
    reference_stage(bufs[0], x, idx, w, rows)
    stage(bufs[1], x, idx, w, rows)
    ref, out = ((b.x[:rows].view(torch.uint8), b.x_sf[:rows], b.topk_idx[:rows], b.topk_weights[:rows]) for b in bufs)
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
    scales = (ref[1].to(torch.int32) << 23).view(torch.float32).bfloat16().repeat_interleave(32, 1)
    assert torch.equal(dequantize_x(bufs[1].x[:rows], out[1]), bufs[0].x[:rows].bfloat16() * scales)


def test_weight_layout_holds_every_code_and_scale_once():
    """shuffle_fp4 only reorders bits and bytes: the same multiset of scale bytes, the same count of set bits."""
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (2, 32, 64), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (2, 32, 4), generator=g, dtype=torch.uint8)
    words, sbytes = shuffle_fp4(packed, scales)
    assert words.shape == (2, 32, 16) and words.dtype == torch.int32 and sbytes.shape == scales.shape
    assert torch.equal(sbytes.flatten(1).sort(1).values, scales.flatten(1).sort(1).values)
    bits = lambda t: sum(int(((t.view(torch.uint8).to(torch.int32) >> b) & 1).sum()) for b in range(8))  # noqa: E731 - a one-line bit count
    assert bits(words) == bits(packed)


@pytest.fixture(params=[True, False], ids=["register_prefetch", "cp_async_pipeline"])
def weight_stream(request, monkeypatch):
    """Both ways the GEMM loops stream the weights (`REGISTER_PREFETCH`: Triton >= 3.5, or the pipeline)."""
    monkeypatch.setattr(target, "REGISTER_PREFETCH", request.param)
    return request.param


@pytest.mark.parametrize("num_tokens,clamp,masked", [(1, None, 0.0), (3, 0.5, 0.3), (7, 0.5, 0.0), (29, None, 0.2)])
def test_kernels_match_the_reference(experts, weight_stream, num_tokens, clamp, masked):
    packed, deq = experts
    q, sf, idx, w = staged(num_tokens, num_tokens, masked=masked)
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=clamp)
    assert_matches(triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=clamp,
                                                config=TINY), ref)


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_l1_matches_the_reference(experts, weight_stream, split):
    """L1 over hidden slices (`l1_split`, for 1-2 token batches), summed in `_l1_reduce_kernel` before the epilogue."""
    packed, deq = experts
    q, sf, idx, w = staged(3, 11, masked=0.3)
    cfg = dataclasses.replace(TINY, l1_split=split)
    assert cfg.fit(packed.hidden, packed.intermediate).l1_split == min(split, packed.hidden // TINY.l1_k)
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=0.5)
    assert_matches(triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.5,
                                                config=cfg), ref)


def test_l2_n_tiles_of_128_match_the_reference(experts, weight_stream):
    """16-row blocks with L2 N tiles of 128, which `pick_config` gives wide decode batches."""
    packed, deq = experts
    q, sf, idx, w = staged(7, 5, masked=0.2)
    cfg = dataclasses.replace(TINY, l2_n=128)
    assert cfg.fit(packed.hidden, packed.intermediate).l2_n == 128
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=0.5)
    assert_matches(triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.5,
                                                config=cfg), ref)


@pytest.fixture(scope="module")
def wide_experts():
    """4 experts of hidden 256, intermediate 128: 4 and 2 K tiles of 64, enough for both decode GEMMs to split."""
    w1, w2 = full_weights(5, num_experts=4, hidden=256, inter=128)
    q = quantize_experts_fp4(w1, w2)
    params = (q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj, q.down_proj_scale_inv)
    return PackedExperts.from_params(*params), DequantizedExperts.from_fp4(*params)


DECODE = KernelConfig(block_t=16, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_stages=3, decode=2)


@pytest.mark.parametrize("prefetch,depth,l1_split,l2_split,extra", [
    (1, 2, 2, 1, {}), (0, 1, 4, 2, {}), (0, 1, 2, 2, dict(persistent=1, l2_n=128))],
    ids=["prefetch_depth2", "pipeline_l2split", "persistent_l2n128"])
def test_split_k_decode_kernels_match_the_reference(wide_experts, monkeypatch, prefetch, depth, l1_split, l2_split,
                                                    extra):
    """The decode kernels (`decode`): both GEMMs split over K, each tile's last program reducing the partials (also
    as one persistent launch with L2 N tiles of 128); the arrival counters are back at zero afterwards (the next call
    relies on it). With L2 unsplit, the same bits as the general kernels with the same L1 split (the same FP32
    partials, summed in the same order)."""
    packed, deq = wide_experts
    monkeypatch.setattr(target, "REGISTER_PREFETCH", True)
    x, idx, w = routing(2, 8, num_experts=4, masked=0.3, hidden=256)
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    cfg = dataclasses.replace(DECODE, prefetch=prefetch, decode=depth, l1_split=l1_split, l2_split=l2_split, **extra)
    fit = cfg.fit(packed.hidden, packed.intermediate)
    assert (fit.decode, fit.l1_split, fit.l2_split) == (depth, l1_split, l2_split)
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=0.5)
    out = triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.5, config=cfg)
    assert_matches(out, ref)
    assert not arrival_counters(out.device, 1).any()
    if l2_split == 1:
        general = dataclasses.replace(TINY, l1_n=64, l2_n=64, l1_split=l1_split)
        assert torch.equal(out, triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0,
                                                             activation_clamp=0.5, config=general))


def test_decode_prologue_and_persistent_kernel_give_the_bits_of_the_separate_launches(wide_experts):
    """The decode prologue (routing, the tokens' BF16 values and the zeros of slots on no local expert in one launch)
    against the three launches it replaces, and L1 with L2 in one persistent launch (work items by ticket) against
    two launches: the same output bits (the same partial sums in the same order), the arrival counters and tickets
    back at 0, no stalled wait, zeros where no local expert (or -1) is named;
    `prologue` alone, on an output of NaNs, shows a slot it misses."""
    packed, _ = wide_experts
    first_expert = 2  # this rank holds experts 2 and 3 of 4
    experts = PackedExperts(*(t[2:] for t in (packed.w1, packed.s1, packed.w2, packed.s2)), packed.large_scales)
    x, idx, w = routing(3, 17, num_experts=4, masked=0.3, hidden=256)
    idx[0, -1], w[0, -1] = -1, 0.0  # an unused slot
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    cfg = dataclasses.replace(DECODE, decode=1, l1_split=2, l2_split=2)
    runs = [triton_local_experts_forward(q, sf, idx, w, experts, first_expert=first_expert, activation_clamp=0.5,
                                         config=dataclasses.replace(cfg, prologue=p, persistent=t))
            for p, t in ((1, 0), (0, 0), (1, 1))]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    assert not arrival_counters(q.device, 1).any() and not decode.stalls(q.device).any()
    other = (idx < first_expert) | (idx >= first_expert + experts.num_local_experts)
    assert other.any() and not runs[0][other].any() and runs[0][~other].abs().sum(-1).all()


def test_decode_prologue_routes_dequantizes_and_zeroes_the_other_slots():
    x, idx, _ = routing(5, 3, num_experts=8, masked=0.3, hidden=256)
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    out = torch.full((idx.numel(), 256), float("nan"), dtype=torch.bfloat16)
    xb, routed = decode.prologue(q, sf, idx, out, first_expert=2, num_local_experts=3, block_t=16)
    assert torch.equal(xb, dequantize_x(q, sf))
    for got, want in zip(routed, route_torch(idx, first_expert=2, num_local_experts=3, block_t=16)):
        assert torch.equal(got, want)
    other = ((idx < 2) | (idx >= 5)).reshape(-1)
    assert other.any() and (~other).any()
    assert torch.equal(out[other], torch.zeros_like(out[other])) and out[~other].isnan().all()


@pytest.mark.parametrize("pre_pass", ["dequantize_x", "x_blocks"])
def test_pre_pass_zeroes_exactly_the_slots_of_no_local_expert(pre_pass):
    """The general and FP8 paths' slot output starts uninitialized: the pre-pass over the tokens' rows
    (`dequantize_x`, `fp8.x_blocks`) writes zeros into every slot whose expert is not local (other ranks' and -1)
    and leaves the local ones (NaN here) for L2; its own output is the same bits as without zeroing."""
    x, idx, _ = routing(5, 3, num_experts=8, masked=0.3, hidden=256)
    idx[1, 0] = -1
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    out = torch.full((idx.numel(), 256), float("nan"), dtype=torch.bfloat16)
    zero = routing_module.other_slots(idx, out, 2, 3)
    if pre_pass == "dequantize_x":
        assert torch.equal(dequantize_x(q, sf, zero), dequantize_x(q, sf))
    else:
        for got, want in zip(fp8.x_blocks(q, sf, permute=True, zero=zero), fp8.x_blocks(q, sf, permute=True)):
            assert torch.equal(got, want)
    other = ((idx < 2) | (idx >= 5)).reshape(-1)
    assert other.any() and (~other).any()
    assert torch.equal(out[other], torch.zeros_like(out[other])) and out[~other].isnan().all()


def test_decode_fit_keeps_whole_steps_per_slice():
    """`fit` shrinks the depth to divide both K dimensions in tiles of 64, then each split to whole steps."""
    assert dataclasses.replace(DECODE, decode=4, l1_split=8, l2_split=8).fit(512, 128) == dataclasses.replace(
        DECODE, decode=2, l1_split=4, l2_split=1)
    assert dataclasses.replace(DECODE, decode=3).fit(256, 192).decode == 1  # 3 K tiles of I: depth 1


@pytest.mark.parametrize(
    "config",
    [TINY, dataclasses.replace(TINY, l1_k=128, l2_k=128), dataclasses.replace(TINY, l1_split=2)],
    ids=["k64", "k128", "split2"],
)
def test_both_weight_streams_give_the_same_bits(experts, monkeypatch, config):
    """The register-prefetch loop and the cp.async pipeline run the same MMAs in the same K order."""
    packed, _ = experts
    q, sf, idx, w = staged(13, 4, masked=0.2)
    outs = []
    for triton_prefetches, cfg in ((True, config), (True, dataclasses.replace(config, prefetch=0)), (False, config)):
        monkeypatch.setattr(target, "REGISTER_PREFETCH", triton_prefetches)
        outs.append(triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.5,
                                                 config=cfg))
    assert outs[0].any() and torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_all_routes_to_one_expert_span_several_blocks(experts):
    packed, deq = experts
    q, sf, idx, w = staged(20, 5)
    idx = torch.full_like(idx, 6)
    idx[:, 1] = -1  # padding slots are skipped
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=0.5)
    out = triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.5, config=TINY)
    assert_matches(out, ref)
    assert not out[:, 1].any()


def test_local_expert_range_and_no_local_expert(experts):
    """Global ids: this rank owns [4, 8) of 8 experts; slots of other ranks' experts give zeros."""
    packed, deq = experts
    half_packed = PackedExperts(*(t[4:] for t in (packed.w1, packed.s1, packed.w2, packed.s2)))
    half_deq = DequantizedExperts(deq.gate_up[4:], deq.down[4:])
    q, sf, idx, w = staged(9, 2)
    ref = local_experts_forward(q, sf, idx, w, half_deq, first_expert=4, activation_clamp=None)
    assert_matches(triton_local_experts_forward(q, sf, idx, w, half_packed, first_expert=4, activation_clamp=None,
                                                config=TINY), ref)
    none_local = idx % 4  # every id below 4: nothing for this rank
    out = triton_local_experts_forward(q, sf, none_local, w, half_packed, first_expert=4, activation_clamp=None,
                                       config=TINY)
    assert out.shape == (9, idx.shape[1], packed.hidden) and not out.any()


def test_decode_batches_pick_the_split_k_kernels():
    """Up to 24 (token, slot) rows (4 tokens at top-6) the decode kernels run, their splits sized from the SM count."""
    one = pick_config(6, 384, 7168, 3072)  # 1 token: 6 x 48 L1 tiles and 6 x 112 L2 tiles
    assert (one.decode, one.l1_split, one.l2_split, one.block_t) == (2, 4, 2, 16)  # 1152 and 1344 programs
    assert (pick_config(6, 384, 7168, 3072, num_sms=66).l1_split, pick_config(6, 384, 7168, 3072, num_sms=66)
            .l2_split) == (2, 1)  # half the SMs: half the programs needed
    assert [(c.l1_split, c.l2_split) for c in (pick_config(t * 6, 384, 7168, 3072) for t in (2, 4))] == [
        (2, 1), (1, 1)]
    mid = pick_config(6, 64, 2048, 1408)  # mid-size: 22 L1 tiles of 64; 22 K tiles of I: no even L2 split
    assert (mid.decode, mid.l1_split, mid.l2_split) == (2, 8, 1)
    assert not pick_config(25, 384, 7168, 3072).decode and not pick_config(48, 384, 7168, 3072).decode


def test_ep_picks_tiles_for_the_rows_a_local_expert_receives():
    """Under EP the gathered rows are ep_size times what the local experts receive (uniform routing): the pick is the
    one-rank pick of those rows, not of every rank's rows over the local experts."""
    assert local_rows(8 * 32 * 8, 32, 256) == 32 * 8 and local_rows(6, 384) == 6
    # DeepSeek-V3-like layer, EP 8 (32 of 256 experts per rank), 24 tokens per rank padded to 32, top-8: 2048 slots
    # gathered, 8 rows per expert; counted over the local experts alone it looked like 64 (80-row Gluon blocks)
    v3 = pick_config(8 * 32 * 8, 32, 7168, 2048, gluon=True, num_experts=256)
    assert v3.block_t == 16 and not v3.gluon
    assert pick_config(8 * 32 * 8, 32, 7168, 2048, gluon=True).block_t == 80  # the EP-blind count
    for ep, tokens in ((8, 1), (8, 4), (8, 16), (4, 256), (8, 4096)):
        gathered = ep * tokens * 6
        assert pick_config(gathered, 384 // ep, 7168, 3072, gluon=True, num_experts=384) == pick_config(
            tokens * 6, 384 // ep, 7168, 3072, gluon=True), (ep, tokens)
    one = pick_config(8 * 6, 48, 7168, 3072, num_experts=384)  # 1 token per rank at EP 8: 6 local rows, decode
    assert one.decode and one == pick_config(6, 48, 7168, 3072)
    with pytest.raises(ValueError, match="384 local experts of 48 global"):
        pick_config(6, 384, 7168, 3072, num_experts=48)


def test_picked_config_fits_the_shapes(monkeypatch):
    monkeypatch.setattr(triton_config, "DECODE_CONFIGS", ())  # the general kernels' rule at every batch size
    cfg = pick_config(6, 384, 7168, 3072)
    assert 7168 % cfg.l1_k == 0 and 3072 % cfg.l1_n == 0 and 3072 % cfg.l2_k == 0 and 7168 % cfg.l2_n == 0
    assert cfg.l1_split == 4 and 7168 % (cfg.l1_k * cfg.l1_split) == 0  # 1 token: 6 x 48 L1 programs, split in 4
    assert pick_config(6, 384, 7168, 3072, num_sms=66).l1_split == 2  # half the SMs: half the programs needed
    assert pick_config(6, 64, 2048, 1408).l1_split == 2  # mid-size: 32 K tiles, each slice keeps 4 pipeline depths
    v4_prefill = pick_config(4096 * 6, 384, 7168, 3072)  # 64 rows per expert, registers capped: 2 programs per SM
    assert v4_prefill.block_t == 64 and v4_prefill.maxnreg == 128
    prefill = pick_config(4096 * 6, 64, 2048, 1408)  # mid-size prefill: 384 rows per expert, 192 row blocks
    assert prefill.block_t == 64 and prefill.l1_split == 1  # blocks fill the GPU: no split-K
    assert prefill.prefetch == v4_prefill.prefetch == 1  # register prefetch: no cp.async pipeline
    assert pick_config(96, 384, 7168, 3072).l1_split == 1  # 16 tokens fill the GPU unsplit
    # L2 N tiles of 128 for 16-row blocks only with >= 16 such L2 programs per SM
    assert [pick_config(t * 6, 384, 7168, 3072).l2_n for t in (1, 16, 64, 256)] == [64, 128, 128, 128]
    assert [pick_config(t * 6, 64, 2048, 1408).l2_n for t in (1, 16, 64)] == [64, 64, 64]  # 0.7 / 7.8 / 7.8 per SM
    assert pick_config(96, 384, 7168, 3072, num_sms=528).l2_n == 64  # 4x the SMs: 10 per SM
    assert pick_config(597 * 6, 64, 2048, 1408).l1_split == 1  # 704 programs of 64-row blocks: prefill, no split
    assert [pick_config(t * 6, 384, 7168, 3072).block_t for t in (256, 2048, 2560, 4096, 5120)] == [16, 32, 64, 64, 64]
    small = pick_config(24576, 8, 128, 64)
    assert 64 % small.l1_n == 0 and 128 % small.l1_k == 0 and small.l1_n % 32 == 0
    assert KernelConfig(l1_k=256, maxnreg=56, prefetch=0).fit(128, 64) == KernelConfig(l1_k=128, l2_k=64, maxnreg=56,
                                                                                      prefetch=0)
    with pytest.raises(ValueError, match="divisible by 64.*backend: reference"):
        KernelConfig().fit(128, 48)
    # Where the Hopper Gluon kernels can run they take 35-512 rows per expert: blocks of 80 rows up to 68 (V4 at 4096
    # tokens: 64), of 96 above.
    gluon = pick_config(4096 * 6, 384, 7168, 3072, gluon=True)
    assert gluon.gluon and gluon.block_t == 80 and gluon.l1_n == gluon.l2_n == 16 * gluon.num_warps
    # With the warp-specialized L2 (its own register cap), or where this Triton cannot build it the cp.async L2.
    assert (gluon.gluon, gluon.l2_maxnreg) == (2, 64)
    plain = pick_config(4096 * 6, 384, 7168, 3072, gluon=True, warp_specialized=False)
    assert (plain.gluon, plain.l2_maxnreg, plain.maxnreg, plain.block_t) == (1, 0, 168, 80)
    assert not pick_config(256 * 6, 384, 7168, 3072, gluon=True).gluon  # decode: the Triton kernels
    assert pick_config(4096 * 6, 64, 2048, 1408, gluon=True).block_t == 96  # the mid-size layer, 384 rows per expert
    assert not pick_config(4096 * 6, 384, 7168, 3072 - 64, gluon=True).gluon  # L2's K tiles do not pair: 3008 % 128
    assert pick_config(3072 * 6, 384, 7168, 3072, gluon=True).block_t == 80  # 48 rows per expert
    assert pick_config(2560 * 6, 384, 7168, 3072, gluon=True).block_t == 80  # 40 rows
    assert not pick_config(2048 * 6, 384, 7168, 3072, gluon=True).gluon  # 32 rows: Triton's 32-row blocks
    assert pick_config(4608 * 6, 384, 7168, 3072, gluon=True).block_t == 96  # 72 rows: an expert fits 96 rows, not 80
    assert pick_config(5120 * 6, 384, 7168, 3072, gluon=True).block_t == 96  # 80 rows: one 96-row block per expert
    assert pick_config(6144 * 6, 384, 7168, 3072, gluon=True).block_t == 96  # 96 rows: an expert spans two blocks
    assert pick_config(4096 * 6, 48, 7168, 3072, gluon=True).block_t == 96  # 512 rows: EP 8's share of V4's prefill
    assert pick_config(4096 * 6, 24, 7168, 3072, gluon=True).block_t == 64  # 1024 rows: not measured, Triton's
    with pytest.raises(ValueError, match="blocks of 80 or 96 rows, not block_t=64"):
        dataclasses.replace(gluon, block_t=64).fit(7168, 3072)  # the kernels have no loop body for it


# The batches `planc verify` runs through one rank's experts: (gathered (token, slot) rows, local experts, hidden,
# intermediate) for DeepSeek-V4 at ep_size 8 (32 of 256 experts, 8 ranks of 1, 24 and 256-8192 tokens gathered,
# top-6), V4 with every expert local and the mid-size layer.
VERIFY_BATCHES = [(8 * t * 6, 32, 4096, 2048) for t in (1, 24, 256, 1024, 2048, 4096, 8192)] + [
    (t * 6, 384, 7168, 3072) for t in (1, 16, 256, 2048, 4096, 6144, 16384)] + [
    (t * 6, 64, 2048, 1408) for t in (1, 16, 256, 597, 4096, 16384)]


@pytest.mark.parametrize("register_prefetch", [True, False], ids=["triton_3.5+", "older_triton"])
def test_no_batch_picks_a_config_whose_l2_races(register_prefetch):
    """Blocks of 128 rows through Triton's cp.async pipeline (the verify prefill of DeepSeek-V4: 8 x 4096 tokens
    gathered, ~770 rows on each of the rank's 32 experts) gave random slots of garbage on an H100: no batch picks
    such a config, with or without the Gluon kernels."""
    for rows, num_local, hidden, inter in VERIFY_BATCHES:
        for gluon in (False, True):
            cfg = pick_config(rows, num_local, hidden, inter, gluon=gluon)
            assert cfg.pipeline_race(register_prefetch) is None, (rows, num_local, cfg)
    v4_prefill = pick_config(8 * 4096 * 6, 32, 4096, 2048, gluon=True)
    assert (v4_prefill.block_t, v4_prefill.prefetch, v4_prefill.gluon) == (64, 1, 0)


def test_a_config_whose_l2_races_is_refused_before_any_launch(experts, monkeypatch):
    packed, _ = experts
    q, sf, idx, w = staged(5, 1)
    racing = KernelConfig(block_t=128, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=8, num_stages=4, prefetch=0)
    assert racing.pipeline_race(register_prefetch=True) is not None
    assert dataclasses.replace(racing, prefetch=1).pipeline_race(register_prefetch=False) is not None  # the pipeline
    assert dataclasses.replace(racing, prefetch=1).pipeline_race(register_prefetch=True) is None
    assert dataclasses.replace(racing, num_stages=1).pipeline_race(register_prefetch=False) is None
    assert dataclasses.replace(racing, block_t=64).pipeline_race(register_prefetch=False) is None
    monkeypatch.setattr(target, "interpreting", lambda: False)  # compiled for a GPU: the check comes first
    monkeypatch.setattr(target, "REGISTER_PREFETCH", True)
    with pytest.raises(ValueError, match=r"block_t=128, num_stages=4\) with prefetch=0 .* races on blocks of 128\+ "
                                         r"rows .*use block_t=64, num_stages=1, or prefetch=1"):
        triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=None, config=racing)


def test_a_gathered_prefill_with_several_blocks_per_expert_matches_the_reference(experts, monkeypatch):
    """The verify prefill's structure at tiny widths: 4 ranks' tokens gathered, this rank owning experts [6, 8) of 8,
    other ranks' slots in between, ~90 rows per local expert (two row blocks each), the config `pick_config` picks."""
    packed, deq = experts
    mine = PackedExperts(*(t[6:] for t in (packed.w1, packed.s1, packed.w2, packed.s2)))
    q, sf, idx, w = staged(4 * 64, 9, masked=0.05)
    # routed by torch ops (a prefill on a GPU: `route_chunked`, the same output; see its test)
    monkeypatch.setattr(routing_module, "FUSED_ROUTE_MAX_SLOTS", 0)
    cfg = pick_config(idx.numel(), 2, packed.hidden, packed.intermediate).fit(packed.hidden, packed.intermediate)
    assert cfg.block_t == 64 and cfg.pipeline_race(register_prefetch=True) is None
    local = (idx >= 6) & (idx < 8)
    assert int(torch.bincount(idx[local] - 6, minlength=2).min()) > cfg.block_t  # several blocks per expert
    ref = local_experts_forward(q, sf, idx, w, DequantizedExperts(deq.gate_up[6:], deq.down[6:]), first_expert=6,
                                activation_clamp=0.5)
    out = triton_local_experts_forward(q, sf, idx, w, mine, first_expert=6, activation_clamp=0.5, config=cfg)
    assert_matches(out, ref)
    assert not out[~local].any() and out[local].any()


def test_installed_backend_equals_the_reference_backend_and_keeps_fp4_only(world1):
    w1, w2 = full_weights(3)
    ref_m, tri_m = mixtral_experts(w1, w2), mixtral_experts(w1, w2)
    install_megamoe_forward(ref_m, backend="reference", quantize="fp4", activation_clamp=0.5)
    install_megamoe_forward(tri_m, backend="triton", quantize="fp4", activation_clamp=0.5)
    state = megamoe_state(tri_m)
    assert state.backend == "triton" and "triton" in state.reason
    groups = types.SimpleNamespace(ep_group=world1, ep_rank=0, ep_size=1, tp_group=world1, tp_size=1, shares_batch=True)
    strategy = MegaMoeEP(reason="the Mega MoE experts")
    ref_layer, tri_layer = MegaMoeEPRuntime(ref_m, strategy, groups), MegaMoeEPRuntime(tri_m, strategy, groups)
    with torch.no_grad():
        for t in (0, 3, 17):
            x, idx, w = routing(t, t, masked=0.2)
            y = tri_layer(x, idx, w)
            assert y.shape == (t, x.shape[1]) and y.dtype == x.dtype
            assert_matches(y, ref_layer(x, idx, w))
    # The backend's weights are views of the module's FP4 parameters: no dequantized copy exists.
    packed = state.runner.weights(torch.device("cpu"))
    assert packed.w1.data_ptr() == tri_m.gate_up_proj.data_ptr()
    assert packed.s2.data_ptr() == tri_m.down_proj_scale_inv.data_ptr()
    assert packed.nbytes == sum(getattr(tri_m, n).nbytes for n in
                                ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"))


def test_a_rocm_torch_is_refused_by_name(monkeypatch):
    """A ROCm torch reports `cuda` devices (MI300: capability (9, 4)): the PTX kernels, Triton's and Gluon's, must
    not be picked there, and an explicit `backend: triton` must say why."""
    from planc.kernels.megamoe.triton import hopper_prefill

    monkeypatch.setattr(target, "interpreting", lambda: False)  # what a GPU machine's import gives
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    reason = target.triton_unavailable_reason(torch.device("cuda"))
    assert reason is not None and "ROCm" in reason and "6.2.41133" in reason
    if hopper_prefill.gluon is not None:
        assert hopper_prefill.gluon_unavailable_reason(torch.device("cuda")) == reason
    m = mixtral_experts(*full_weights(0))
    with pytest.raises(RuntimeError, match="ROCm.*backend: reference"):
        install_megamoe_forward(m, backend="triton", quantize="fp4")


def test_explicit_triton_where_it_cannot_run_names_the_reason(monkeypatch):
    from planc.kernels.megamoe.triton import target

    monkeypatch.setattr(target, "triton_unavailable_reason", lambda device: "no triton here")
    m = mixtral_experts(*full_weights(0))
    with pytest.raises(RuntimeError, match="no triton here.*backend: reference"):
        install_megamoe_forward(m, backend="triton", quantize="fp4")
    assert megamoe_state(m) is None and m.gate_up_proj.dtype == torch.bfloat16



@pytest.mark.parametrize("total,programs", [(24, 5), (24, 16), (7, 7), (5, 9), (112 * 48 * 6, 660), (0, 4)])
def test_stream_k_schedule_matches_a_brute_force_enumeration(total, programs):
    """`stream_k`'s closed forms against walking every step: contiguous spans of even size (+-1) that cover the
    space once; per schedule tile of `run` steps the programs that touch it, first and count; each program's
    segments (one per schedule tile it touches) numbered in order as `partial_slot` numbers them, at most
    `max_segments` of them, also for every smaller space."""
    spans = [stream_k.span(p, total, programs) for p in range(programs)]
    assert spans[0][0] == 0 and spans[-1][1] == total and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert max(e - s for s, e in spans) - min(e - s for s, e in spans) <= 1
    owners = [p for p, (s, e) in enumerate(spans) for _ in range(s, e)]
    assert [stream_k.owner(i, total, programs) for i in range(total)] == owners
    for run in (1, 2, 4, 7) if total % 7 == 0 else (1,) if total % 2 else (1, 2, 4):
        segments = [sorted({i // run for i in range(s, e)}) for s, e in spans]
        for piece in range(total // run):
            touching = sorted({owners[i] for i in range(piece * run, (piece + 1) * run)})
            assert stream_k.tile_contributors(piece, run, total, programs) == (touching[0], len(touching))
            assert [stream_k.partial_slot(p, piece, run, total, programs) for p in touching] == [
                segments[p].index(piece) for p in touching]
        assert all(len(segments[p]) <= stream_k.max_segments(t, programs, run)
                   for t in (total, total - run) if t >= 0 for p in range(programs))


if target.triton is not None:

    @target.triton.jit
    def _schedule_kernel(out_ptr, steps, total, programs, TILES: target.tl.constexpr):
        """The Triton side of the schedule for every tile: its first contributor and count, and program
        `program_id`'s span."""
        tl = target.tl
        p = tl.program_id(0)
        start, end = stream_k._span(p, total, programs)
        tl.store(out_ptr + 2 * TILES + 2 * p, start)
        tl.store(out_ptr + 2 * TILES + 2 * p + 1, end)
        if p == 0:
            for t in tl.range(0, TILES):
                first, count = stream_k._contributors(t, steps, total, programs)
                tl.store(out_ptr + 2 * t, first)
                tl.store(out_ptr + 2 * t + 1, count)


@pytest.mark.parametrize("steps,tiles,programs", [(4, 6, 5), (2, 12, 16), (7, 6, 4)])
def test_stream_k_schedule_in_triton_is_the_python_schedule(steps, tiles, programs):
    """What the kernels compute (`stream_k._span`, `_contributors`) equals the host's schedule."""
    total = steps * tiles
    out = torch.zeros(2 * tiles + 2 * programs, dtype=torch.int32)
    _schedule_kernel[(programs,)](out, steps, total, programs, TILES=tiles)
    assert out[:2 * tiles].view(tiles, 2).tolist() == [
        list(stream_k.tile_contributors(t, steps, total, programs)) for t in range(tiles)]
    assert out[2 * tiles:].view(programs, 2).tolist() == [list(stream_k.span(p, total, programs))
                                                           for p in range(programs)]


@pytest.mark.parametrize("num_tokens,programs,contributors,slices", [
    (1, None, {1}, 1), (3, 13, {1, 2, 3}, 1), (4, 20, {1, 2, 4}, 1), (2, 7, {2, 3}, 2)])
def test_stream_k_decode_matches_the_reference(wide_experts, monkeypatch, num_tokens, programs, contributors,
                                               slices):
    """The decode kernels under the stream-K schedule (`KernelConfig.stream_k`) on grids that give tiles of 1, 2, 3
    and 4 contributors (L1: 4 K steps per tile; L2: 2; 3 tokens on 13 programs: 1, 2 and 3 in one call), tile by tile
    and in 2 K slices: the reference's numerics, three runs with the same bits, the arrival counters back at 0; on one
    contributor per tile (a grid of whole tiles) the bits of the unsplit decode path."""
    packed, deq = wide_experts
    x, idx, w = routing(num_tokens, 30 + num_tokens, num_experts=4, masked=0.2, hidden=256)
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)
    blocks = int((route_torch(idx, first_expert=0, num_local_experts=4, block_t=16)[1] < 4).sum())
    programs = programs or 2 * blocks  # 4 K steps each: one L1 tile (2 L2 tiles) per program
    monkeypatch.setattr(target, "sm_count", lambda device: programs)  # a GPU of this many SMs
    counts = set()  # contributors per output tile, L1 (hidden 256: 4 K steps, 2 N tiles of 64) and L2 (128: 2, 4)
    for steps, tiles_per_block in ((4, 2), (2, 4)):
        tiles, run = tiles_per_block * blocks, steps // slices
        counts |= {sum(stream_k.tile_contributors(s * tiles + t, run, tiles * steps, programs)[1]
                       for s in range(slices)) for t in range(tiles)}
    assert counts == contributors
    cfg = dataclasses.replace(DECODE, decode=1, stream_k=1, l1_split=slices, l2_split=slices)
    assert (cfg.fit(packed.hidden, packed.intermediate).l1_split, cfg.fit(256, 128).l2_split) == (slices, slices)
    ref = local_experts_forward(q, sf, idx, w, deq, first_expert=0, activation_clamp=0.5)
    runs = [triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0, activation_clamp=0.5, config=cfg)
            for _ in range(3 if num_tokens == 3 else 1)]
    assert_matches(runs[0], ref)
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert not arrival_counters(q.device, 1).any()
    if contributors == {1}:
        unsplit = dataclasses.replace(DECODE, prefetch=0, decode=1)
        assert torch.equal(runs[0], triton_local_experts_forward(q, sf, idx, w, packed, first_expert=0,
                                                                 activation_clamp=0.5, config=unsplit))


def test_stream_k_decode_refuses_a_second_schedule():
    with pytest.raises(ValueError, match="two schedules"):
        dataclasses.replace(DECODE, stream_k=4, persistent=1).fit(256, 128)


@pytest.mark.parametrize("other", [dict(stream_k=4), dict(persistent=1), dict(pdl=1)])
def test_warp_specialized_decode_refuses_another_schedule_or_pdl(other):
    """`decode_ws` runs the split-K grid in two plain launches: a config that also asks for stream-K, the persistent
    kernel or PDL is refused by name, not half-applied."""
    with pytest.raises(ValueError, match=r"decode_ws=2\) runs the split-K grid in two plain launches"):
        dataclasses.replace(DECODE, decode_ws=2, **other).fit(256, 128)
