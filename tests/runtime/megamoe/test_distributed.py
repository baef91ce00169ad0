"""Multi-rank (gloo): the reference's dispatch/combine and the MegaMoeEP sliced forward equal one process."""

import types

import pytest
import torch
import torch.distributed as dist

from planc.kernels.megamoe.quant import quantize_experts_fp4
from planc.kernels.megamoe.reference import DequantizedExperts, reference_mega_moe
from planc.runtime.ep.megamoe import MegaMoeEPRuntime, slice_for_rank
from planc.runtime.megamoe import buffer_stats, install_megamoe_forward
from tests.distributed import run_distributed
from tests.kernels.megamoe.common import E, full_weights, mixtral_experts, routing

CLAMP = 1.0  # small enough to be active on these inputs


def dequantized(lo=0, hi=E):
    w1, w2 = full_weights(0)
    q = quantize_experts_fp4(w1[lo:hi], w2[lo:hi])
    return DequantizedExperts.from_fp4(q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj, q.down_proj_scale_inv)


def _reference_rank(rank, world_size, counts):
    """Each rank routes its own tokens over the whole group; several calls, ragged counts per rank."""
    e_loc = E // world_size
    experts = dequantized(rank * e_loc, (rank + 1) * e_loc)
    outs = []
    with torch.no_grad():
        for call, per_rank in enumerate(counts):
            x, idx, w = routing(per_rank[rank], seed=100 * call + rank, masked=0.15)
            outs.append(reference_mega_moe(x, idx, w, experts, num_experts=E, group=dist.group.WORLD,
                                           activation_clamp=CLAMP))
    return outs, buffer_stats().allocations


# per call, the token count of each rank (every call's counts share a power-of-two bucket; zeros included)
COUNTS = {
    2: [(3, 4), (0, 1), (5, 8), (2, 2)],
    4: [(3, 4, 4, 3), (0, 1, 0, 1), (7, 5, 8, 6)],
}


def check_reference(world_size, results):
    single = dequantized()
    for call, per_rank in enumerate(COUNTS[world_size]):
        for rank, n in enumerate(per_rank):
            x, idx, w = routing(n, seed=100 * call + rank, masked=0.15)
            expected = reference_mega_moe(x, idx, w, single, num_experts=E, activation_clamp=CLAMP)
            assert torch.equal(results[rank][0][call], expected), (call, rank)
    assert len({allocations for _, allocations in results}) == 1  # every rank took the same buffer path


def _megamoe_ep_rank(rank, world_size, batch_sizes, backend="reference"):
    e_loc = E // world_size
    w1, w2 = full_weights(0)
    experts = mixtral_experts(w1[rank * e_loc:(rank + 1) * e_loc], w2[rank * e_loc:(rank + 1) * e_loc])
    install_megamoe_forward(experts, backend=backend, quantize="fp4", activation_clamp=CLAMP,
                            num_global_experts=E, ep_rank=rank, ep_size=world_size)
    group = dist.group.WORLD
    experts._is_expert_parallel = True  # sliced by hand above, as `grouped_gemm` would
    from planc.spec.ep import MegaMoeEP

    runtime = MegaMoeEPRuntime(
        experts, MegaMoeEP(reason="test"),
        types.SimpleNamespace(ep_group=group, ep_rank=rank, ep_size=world_size, tp_group=group, tp_size=world_size,
                              shares_batch=True),
    )
    outs = []
    with torch.no_grad():
        for t in batch_sizes:
            x, idx, w = routing(t, seed=t, masked=0.15)  # the shared batch: same on every rank
            outs.append(runtime(x.float(), idx, w))
    return outs


BATCHES = {2: [1, 3, 4, 7], 4: [1, 2, 3, 5, 9]}  # smaller than the ranks, not dividing, dividing


def check_megamoe_ep(world_size, results):
    single = dequantized()
    for i, t in enumerate(BATCHES[world_size]):
        x, idx, w = routing(t, seed=t, masked=0.15)
        expected = reference_mega_moe(x.float(), idx, w, single, num_experts=E, activation_clamp=CLAMP).float()
        for rank in range(world_size):
            y = results[rank][i]
            assert y.shape == (t, x.shape[1]) and y.dtype == torch.float32
            assert torch.equal(y, expected), (t, rank)


TRITON_BATCHES = [3, 5]  # the Triton backend under Triton's CPU interpreter: slow, so two batches on 2 ranks


def _rank(rank, world_size):
    # one spawn per world size (process start-up dominates the cost of these tests)
    from planc.kernels.megamoe.triton.target import triton_unavailable_reason

    triton = None
    if world_size == 2 and triton_unavailable_reason(torch.device("cpu")) is None:
        triton = _megamoe_ep_rank(rank, world_size, TRITON_BATCHES, backend="triton")
    return (
        _reference_rank(rank, world_size, COUNTS[world_size]),
        _megamoe_ep_rank(rank, world_size, BATCHES[world_size]),
        triton,
    )


def check_triton(results):
    """The Triton backend's local experts inside the reference's real dispatch/combine, through MegaMoeEP."""
    from planc.kernels.megamoe.quant import calc_diff

    if results[0][2] is None:
        return
    single = dequantized()
    for i, t in enumerate(TRITON_BATCHES):
        x, idx, w = routing(t, seed=t, masked=0.15)
        expected = reference_mega_moe(x.float(), idx, w, single, num_experts=E, activation_clamp=CLAMP).float()
        for rank in range(2):
            assert calc_diff(results[rank][2][i], expected) < 1e-4, (t, rank)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_multi_rank_equals_single_process(world_size):
    """The reference's real dispatch/combine over gloo, then MegaMoeEP's sliced forward (batches smaller than
    the ranks and not dividing): both equal the single-process reference bit for bit. On 2 ranks the Triton
    backend runs through the same MegaMoeEP (calc_diff < 1e-4 against the reference)."""
    results = run_distributed(_rank, world_size)
    check_reference(world_size, [r[0] for r in results])
    check_megamoe_ep(world_size, [r[1] for r in results])
    check_triton(results)


def test_slices_are_equal_and_padded():
    x, idx, w = routing(3, seed=0)
    parts = [slice_for_rank(x, idx, w, r, 4) for r in range(4)]
    assert all(p[0].shape[0] == 1 for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts[:3]]), x)
    px, pidx, pw = parts[3]  # only padding
    assert not px.any() and (pidx == -1).all() and not pw.any()
    x, idx, w = routing(5, seed=0)
    a, b = slice_for_rank(x, idx, w, 0, 2), slice_for_rank(x, idx, w, 1, 2)
    assert torch.equal(a[1], idx[:3]) and torch.equal(b[1][:2], idx[3:]) and (b[1][2] == -1).all()


def test_megamoe_ep_refuses_grad(world1):
    experts = mixtral_experts(*full_weights(0))
    install_megamoe_forward(experts, backend="reference", quantize="fp4")
    from planc.spec.ep import MegaMoeEP

    runtime = MegaMoeEPRuntime(
        experts, MegaMoeEP(reason="test"),
        types.SimpleNamespace(ep_group=world1, ep_rank=0, ep_size=1, tp_group=world1, tp_size=1, shares_batch=True),
    )
    x, idx, w = routing(2, seed=0)
    with pytest.raises(RuntimeError, match="deepgemm_megamoe EP implementation on MixtralExperts is inference only"):
        runtime(x.float().requires_grad_(), idx, w)
    with torch.no_grad():
        assert runtime(x, idx, w).shape == x.shape
