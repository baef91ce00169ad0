"""The deep_gemm binding: the real kernel where it can run, the pinned call contract everywhere, and errors."""

import importlib.util
import sys
import types

import pytest
import torch

from planc.runtime.megamoe import deep_gemm_backend, install_megamoe_forward, megamoe_state, resolve_backend
from planc.runtime.megamoe.quant import calc_diff, pack_ue8m0, quantize_experts_fp4, quantize_fp8
from planc.runtime.megamoe.reference import DequantizedExperts, reference_mega_moe
from tests.megamoe.common import full_weights, mixtral_experts, routing


class RecordingDeepGemm(types.ModuleType):
    """A stand-in `deep_gemm` module that records how planc calls it.

    It proves the call contract (names, keyword arguments, staging into the buffer, once-only weight
    transform), NOT the kernel: its `fp8_fp4_mega_moe` computes nothing. Its functions have the pinned
    parameter names and are keyword-only, so a positional call fails.
    """

    TOKEN_ALIGNMENT = 384

    def __init__(self):
        super().__init__("deep_gemm")
        self.__version__ = "recording-stand-in"
        self.calls = []

    def get_symm_buffer_for_mega_moe(self, *, group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                     intermediate_hidden, use_fp8_dispatch=None, mma_type="fp8xfp4",
                                     activation="swiglu"):
        self.calls.append(("get_symm_buffer_for_mega_moe", dict(
            group=group, num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_topk=num_topk, hidden=hidden, intermediate_hidden=intermediate_hidden)))
        t = -(-num_max_tokens_per_rank // self.TOKEN_ALIGNMENT) * self.TOKEN_ALIGNMENT
        buf = types.SimpleNamespace(
            num_max_tokens_per_rank=t, buffer=torch.zeros(t * hidden, dtype=torch.int8),
            x=torch.zeros(t, hidden, dtype=torch.float8_e4m3fn), x_sf=torch.zeros(t, hidden // 128, dtype=torch.int32),
            topk_idx=torch.zeros(t, num_topk, dtype=torch.int64), topk_weights=torch.zeros(t, num_topk),
        )
        buf.destroy = lambda: self.calls.append(("destroy", buf))
        return buf

    def transform_sf_into_required_layout(self, *, sf, mn, k, recipe, num_groups=None, is_sfa=None,
                                          disable_ue8m0_cast=False):
        self.calls.append(("transform_sf_into_required_layout", dict(sf=sf, mn=mn, k=k, recipe=recipe,
                                                                      num_groups=num_groups)))
        return pack_ue8m0(sf)

    def transform_weights_for_mega_moe(self, *, l1_weights, l2_weights, activation="swiglu"):
        self.calls.append(("transform_weights_for_mega_moe", dict(l1_weights=l1_weights, l2_weights=l2_weights)))
        return (l1_weights[0].clone(), l1_weights[1].clone()), l2_weights

    def fp8_fp4_mega_moe(self, *, y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                         recipe=(1, 1, 32), activation="swiglu", activation_clamp=None, fast_math=True):
        n = y.shape[0]
        self.calls.append(("fp8_fp4_mega_moe", dict(
            y=y, l1_weights=l1_weights, l2_weights=l2_weights, sym_buffer=sym_buffer,
            activation_clamp=activation_clamp,
            staged=dict(x=sym_buffer.x[:n].clone(), x_sf=sym_buffer.x_sf[:n].clone(),
                        topk_idx=sym_buffer.topk_idx[:n].clone(), topk_weights=sym_buffer.topk_weights[:n].clone()),
        )))
        y.zero_()

    def named(self, name):
        return [kw for n, kw in self.calls if n == name]


@pytest.fixture
def recording(monkeypatch):
    stand_in = RecordingDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    # The contract test runs on CPU: only the SM100 device check is bypassed, the API check still runs.
    monkeypatch.setattr(deep_gemm_backend, "check_device", lambda device=None: None)
    return stand_in


def test_call_contract_with_recording_stand_in(recording, world1):
    w1, w2 = full_weights(0, hidden=256, inter=128)
    m = mixtral_experts(w1, w2)
    install_megamoe_forward(m, backend="deep_gemm", quantize="fp4", activation_clamp=7.0)
    q = quantize_experts_fp4(w1, w2)
    assert megamoe_state(m).backend == "deep_gemm"
    assert recording.calls == []  # weights are transformed lazily, at the first forward

    outs = []
    with torch.no_grad():
        for n, seed in ((5, 1), (3, 2)):
            x, idx, w = routing(n, seed, hidden=256, masked=0.2)
            outs.append((x, idx, w, m(x, idx, w, process_group=world1)))

    sfs = recording.named("transform_sf_into_required_layout")
    assert len(sfs) == 2 and len(recording.named("transform_weights_for_mega_moe")) == 1  # once, not per call
    assert (sfs[0]["mn"], sfs[0]["k"], sfs[0]["recipe"], sfs[0]["num_groups"]) == (256, 256, (1, 32), 8)
    assert (sfs[1]["mn"], sfs[1]["k"], sfs[1]["num_groups"]) == (256, 128, 8)
    assert sfs[0]["sf"].dtype == torch.float32 and torch.equal(sfs[0]["sf"], q.gate_up_proj_scale_inv.float())
    tw = recording.named("transform_weights_for_mega_moe")[0]
    assert torch.equal(tw["l1_weights"][0], q.gate_up_proj) and torch.equal(tw["l2_weights"][0], q.down_proj)

    (alloc,) = recording.named("get_symm_buffer_for_mega_moe")  # the 3-token call reuses the 8-token buffer
    assert alloc == dict(group=world1, num_experts=8, num_max_tokens_per_rank=8, num_topk=3, hidden=256,
                         intermediate_hidden=128)

    runs = recording.named("fp8_fp4_mega_moe")
    assert len(runs) == 2
    for (x, idx, w, y), run in zip(outs, runs):
        x_fp8, x_sf = quantize_fp8(x)
        assert torch.equal(run["staged"]["x"].view(torch.uint8), x_fp8.view(torch.uint8))
        assert torch.equal(run["staged"]["x_sf"], pack_ue8m0(x_sf))
        assert torch.equal(run["staged"]["topk_idx"], idx)  # global ids, -1 kept
        assert torch.equal(run["staged"]["topk_weights"], w.float())
        assert run["y"].dtype == torch.bfloat16 and run["y"].shape == x.shape and run["y"].is_contiguous()
        assert run["activation_clamp"] == 7.0
        assert run["l1_weights"] is runs[0]["l1_weights"] and run["sym_buffer"] is runs[0]["sym_buffer"]
        assert y.shape == x.shape


def test_api_check_names_what_is_missing(monkeypatch):
    stand_in = RecordingDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    deep_gemm_backend.load_deep_gemm()  # the full pinned API passes

    def old_mega_moe(y, l1_weights, l2_weights, sym_buffer, recipe=(1, 1, 32)):  # no activation_clamp
        pass

    stand_in.fp8_fp4_mega_moe = old_mega_moe
    stand_in.transform_weights_for_mega_moe = None
    with pytest.raises(ImportError) as err:
        deep_gemm_backend.load_deep_gemm()
    msg = str(err.value)
    assert "`deep_gemm.transform_weights_for_mega_moe` is missing" in msg
    assert "`deep_gemm.fp8_fp4_mega_moe` has no parameter(s) activation_clamp" in msg
    assert deep_gemm_backend.PINNED_COMMIT[:7] in msg and "backend: reference" in msg


def test_pybind_style_signatures_are_read_from_the_docstring():
    """pybind11 functions (transform_sf_into_required_layout) have no inspect.signature, only a docstring."""
    fn = types.SimpleNamespace(__doc__="transform_sf_into_required_layout(sf: torch.Tensor, mn: int, k: int, "
                               "recipe: tuple, num_groups: Optional[int] = None) -> torch.Tensor\n")
    assert deep_gemm_backend._parameter_names(fn) == {"sf", "mn", "k", "recipe", "num_groups"}


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10,
                    reason="this machine has an SM100 GPU")
def test_deep_gemm_backend_without_sm100_names_the_device():
    with pytest.raises(RuntimeError, match=r"SM100.*this device is .*(no CUDA device|sm_\d+).*backend: reference"):
        resolve_backend("deep_gemm")
    m = mixtral_experts(*full_weights(0, hidden=256, inter=128))
    with pytest.raises(RuntimeError, match="sm_|no CUDA device"):
        install_megamoe_forward(m, backend="deep_gemm", quantize="fp4")
    assert megamoe_state(m) is None and m.gate_up_proj.dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10
                    and importlib.util.find_spec("deep_gemm") is not None, reason="deep_gemm can run here")
def test_auto_backend_error_names_the_reference_opt_in():
    with pytest.raises(RuntimeError, match="`experts.megamoe.backend: reference`"):
        resolve_backend("auto")


def test_unknown_backend():
    with pytest.raises(ValueError, match="auto, deep_gemm, reference"):
        resolve_backend("triton")


_HAS_KERNEL = (
    torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10
    and importlib.util.find_spec("deep_gemm") is not None
)


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_KERNEL, reason="needs deep_gemm and an SM100 GPU")
def test_real_kernel_matches_reference():
    """One rank over NCCL: the kernel and the reference agree (calc_diff; bitwise is not expected)."""
    import torch.distributed as dist

    from tests.distributed import free_port

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        w1, w2 = full_weights(0, num_experts=16, hidden=1024, inter=512)
        m = mixtral_experts(w1.cuda(), w2.cuda())
        install_megamoe_forward(m, backend="deep_gemm", quantize="fp4", activation_clamp=10.0)
        q = quantize_experts_fp4(w1.cuda(), w2.cuda())
        deq = DequantizedExperts.from_fp4(q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj,
                                          q.down_proj_scale_inv)
        x, idx, w = routing(96, 1, num_experts=16, topk=6, hidden=1024)
        x, idx, w = x.cuda(), idx.cuda(), w.cuda()
        with torch.no_grad():
            y = m(x, idx, w, process_group=group)
        expected = reference_mega_moe(x, idx, w, deq, num_experts=16, activation_clamp=10.0)
        assert calc_diff(y, expected) < 1e-3
    finally:
        from planc.runtime.megamoe import destroy_megamoe_buffers

        destroy_megamoe_buffers()
        if created:
            dist.destroy_process_group()
