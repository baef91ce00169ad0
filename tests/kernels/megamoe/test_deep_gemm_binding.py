"""The deep_gemm binding: the real kernel where it can run, the pinned call contract everywhere, and errors."""

import importlib.util
import sys
import types

import pytest
import torch

from planc.kernels.megamoe import deep_gemm as binding
from planc.kernels.megamoe.quant import (
    calc_diff,
    float_to_ue8m0_bytes,
    pack_ue8m0,
    quantize_experts_fp4,
    quantize_fp8,
    unpack_ue8m0,
)
from planc.kernels.megamoe.reference import DequantizedExperts, combine, local_experts_forward, reference_mega_moe
from planc.runtime.megamoe import install_megamoe_forward, megamoe_state, resolve_backend
from tests.kernels.megamoe.common import full_weights, mixtral_experts, routing


def _interleave_gate_up(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    """DeepGEMM's `_interleave_weights`: L1 rows [gate | up] -> [g0..7, u0..7, g8..15, u8..15, ...]."""
    e, two_i = t.shape[:2]
    gate, up = t[:, : two_i // 2], t[:, two_i // 2:]
    rest = t.shape[2:]
    return torch.stack([gate.reshape(e, -1, gran, *rest), up.reshape(e, -1, gran, *rest)], 2).reshape(t.shape)


def _deinterleave_gate_up(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    e, two_i = t.shape[:2]
    rest = t.shape[2:]
    blocks = t.reshape(e, two_i // (2 * gran), 2, gran, *rest)
    return torch.cat([blocks[:, :, 0].reshape(e, two_i // 2, *rest), blocks[:, :, 1].reshape(e, two_i // 2, *rest)], 1)


def _utccp(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's `_transpose_sf_for_utccp`: each 128-row block of the scales (4, 32) -> (32, 4)."""
    g, mn, k = sf.shape
    assert mn % 128 == 0, "UTCCP transposition needs N % 128 == 0"
    return sf.reshape(g, mn // 128, 4, 32, k).transpose(2, 3).reshape(g, mn, k)


def _un_utccp(sf: torch.Tensor) -> torch.Tensor:
    g, mn, k = sf.shape
    return sf.reshape(g, mn // 128, 32, 4, k).transpose(2, 3).reshape(g, mn, k)


class RecordingDeepGemm(types.ModuleType):
    """A stand-in `deep_gemm` module that records how planc calls it and reproduces the real layouts.

    - `transform_sf_into_required_layout` returns packed UE8M0 int32 scales, MN-major (stride 1 along MN),
      as DeepGEMM's does; `transform_weights_for_mega_moe` interleaves gate/up rows in blocks of 8 (weights
      and scales) and applies the UTCCP reordering of each 128-row scale block.
    - `fp8_fp4_mega_moe` checks the layouts the real host code checks (K-major contiguous weights, MN-major
      int32 scales), undoes the transforms and computes the MoE from the staged buffer with planc's reference
      numerics, so a layout or staging error changes `y` and the test comparing it with the reference fails.
    Its functions have the pinned parameter names and are keyword-only, so a positional call fails.
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
            num_max_tokens_per_rank=t, num_experts=num_experts, buffer=torch.zeros(t * hidden, dtype=torch.int8),
            x=torch.zeros(t, hidden, dtype=torch.float8_e4m3fn), x_sf=torch.zeros(t, hidden // 128, dtype=torch.int32),
            topk_idx=torch.zeros(t, num_topk, dtype=torch.int64), topk_weights=torch.zeros(t, num_topk),
        )
        buf.destroy = lambda: self.calls.append(("destroy", buf))
        return buf

    def transform_sf_into_required_layout(self, *, sf, mn, k, recipe, num_groups=None, is_sfa=None,
                                          disable_ue8m0_cast=False):
        self.calls.append(("transform_sf_into_required_layout", dict(sf=sf, mn=mn, k=k, recipe=recipe,
                                                                      num_groups=num_groups)))
        assert sf.dtype == torch.float32 and sf.shape == (num_groups, mn, k // 32) and recipe == (1, 32)
        packed = pack_ue8m0(sf)  # [G, mn, k / 128] int32
        return packed.transpose(1, 2).contiguous().transpose(1, 2)  # MN-major, as the real one (TMA-aligned)

    def transform_weights_for_mega_moe(self, *, l1_weights, l2_weights, activation="swiglu"):
        self.calls.append(("transform_weights_for_mega_moe", dict(l1_weights=l1_weights, l2_weights=l2_weights)))
        (w1, sf1), (w2, sf2) = l1_weights, l2_weights
        mn_major = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731 - a one-line layout helper
        return ((_interleave_gate_up(w1), mn_major(_utccp(_interleave_gate_up(sf1)))),
                (w2, mn_major(_utccp(sf2))))

    @staticmethod
    def _check_layout(w, sf, rows, k):
        assert w.dtype == torch.int8 and w.is_contiguous() and w.shape[1:] == (rows, k // 2), "K-major FP4 weights"
        assert sf.dtype == torch.int32 and sf.shape[1:] == (rows, k // 128) and sf.stride(1) == 1, "MN-major SF"

    def fp8_fp4_mega_moe(self, *, y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                         recipe=(1, 1, 32), activation="swiglu", activation_clamp=None, fast_math=True):
        n = y.shape[0]
        self.calls.append(("fp8_fp4_mega_moe", dict(
            y=y, l1_weights=l1_weights, l2_weights=l2_weights, sym_buffer=sym_buffer,
            activation_clamp=activation_clamp,
            staged=dict(x=sym_buffer.x[:n].clone(), x_sf=sym_buffer.x_sf[:n].clone(),
                        topk_idx=sym_buffer.topk_idx[:n].clone(), topk_weights=sym_buffer.topk_weights[:n].clone()),
        )))
        (w1, sf1), (w2, sf2) = l1_weights, l2_weights
        hidden, inter = w2.shape[1], w1.shape[1] // 2
        self._check_layout(w1, sf1, 2 * inter, hidden)
        self._check_layout(w2, sf2, hidden, inter)
        unpack = lambda sf: unpack_ue8m0(sf.contiguous())  # noqa: E731 - float32 [G, mn, k / 32]
        experts = DequantizedExperts.from_fp4(
            _deinterleave_gate_up(w1), _deinterleave_gate_up(_un_utccp(unpack(sf1))), w2, _un_utccp(unpack(sf2)),
            torch.float32,
        )
        x_sf = float_to_ue8m0_bytes(unpack_ue8m0(sym_buffer.x_sf[:n]))
        slots = local_experts_forward(sym_buffer.x[:n], x_sf, sym_buffer.topk_idx[:n], sym_buffer.topk_weights[:n],
                                      experts, first_expert=0, activation_clamp=activation_clamp)
        y.copy_(combine(slots))

    def named(self, name):
        return [kw for n, kw in self.calls if n == name]


@pytest.fixture
def recording(monkeypatch):
    stand_in = RecordingDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    # The contract test runs on CPU: only the SM100 device check is bypassed, the API check still runs.
    monkeypatch.setattr(binding, "check_device", lambda device=None: None)
    return stand_in


def test_call_contract_with_recording_stand_in(recording, world1):
    w1, w2 = full_weights(0, hidden=256, inter=256)  # the smallest shape the real kernel accepts (% 256)
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
    assert (sfs[0]["mn"], sfs[0]["k"], sfs[0]["recipe"], sfs[0]["num_groups"]) == (512, 256, (1, 32), 8)
    assert (sfs[1]["mn"], sfs[1]["k"], sfs[1]["num_groups"]) == (256, 256, 8)
    assert sfs[0]["sf"].dtype == torch.float32 and torch.equal(sfs[0]["sf"], q.gate_up_proj_scale_inv.float())
    tw = recording.named("transform_weights_for_mega_moe")[0]
    assert torch.equal(tw["l1_weights"][0], q.gate_up_proj) and torch.equal(tw["l2_weights"][0], q.down_proj)

    (alloc,) = recording.named("get_symm_buffer_for_mega_moe")  # the 3-token call reuses the 8-token buffer
    assert alloc == dict(group=world1, num_experts=8, num_max_tokens_per_rank=8, num_topk=3, hidden=256,
                         intermediate_hidden=256)

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
        # the stand-in computed y from the transformed layouts: equal to the reference on the FP4 weights
        deq = DequantizedExperts.from_fp4(q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj,
                                          q.down_proj_scale_inv)
        assert torch.equal(y, reference_mega_moe(x, idx, w, deq, num_experts=8, activation_clamp=7.0))

    with torch.no_grad():  # 0 tokens: the kernel gets one padding row with no valid slot, as in transformers
        y0 = m(torch.zeros(0, 256, dtype=torch.bfloat16), torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 3),
               process_group=world1)
    assert y0.shape == (0, 256)
    last = recording.named("fp8_fp4_mega_moe")[-1]
    assert last["y"].shape == (1, 256) and bool((last["staged"]["topk_idx"] == -1).all())


def test_stand_in_catches_a_layout_error(recording, world1, monkeypatch):
    """Skipping the gate/up interleave (here: undoing it before the call) changes the stand-in's result."""
    w1, w2 = full_weights(0, hidden=256, inter=256)
    m = mixtral_experts(w1, w2)
    install_megamoe_forward(m, backend="deep_gemm", quantize="fp4")
    good = recording.transform_weights_for_mega_moe

    def without_interleave(*, l1_weights, l2_weights, activation="swiglu"):
        (w1t, sf1t), l2 = good(l1_weights=l1_weights, l2_weights=l2_weights)
        return (l1_weights[0], sf1t), l2

    monkeypatch.setattr(recording, "transform_weights_for_mega_moe", without_interleave)
    x, idx, w = routing(4, 1, hidden=256)
    q = quantize_experts_fp4(w1, w2)
    deq = DequantizedExperts.from_fp4(q.gate_up_proj, q.gate_up_proj_scale_inv, q.down_proj, q.down_proj_scale_inv)
    with torch.no_grad():
        y = m(x, idx, w, process_group=world1)
    assert calc_diff(y, reference_mega_moe(x, idx, w, deq, num_experts=8)) > 0.01


def test_api_check_names_what_is_missing(monkeypatch):
    stand_in = RecordingDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    binding.load_deep_gemm()  # the full pinned API passes

    def old_mega_moe(y, l1_weights, l2_weights, sym_buffer, recipe=(1, 1, 32)):  # no activation_clamp
        pass

    stand_in.fp8_fp4_mega_moe = old_mega_moe
    stand_in.transform_weights_for_mega_moe = None
    with pytest.raises(ImportError) as err:
        binding.load_deep_gemm()
    msg = str(err.value)
    assert "`deep_gemm.transform_weights_for_mega_moe` is missing" in msg
    assert "`deep_gemm.fp8_fp4_mega_moe` has no parameter(s) activation_clamp" in msg
    assert binding.PINNED_COMMIT[:7] in msg and "backend: reference" in msg


def test_pybind_style_signatures_are_read_from_the_docstring():
    """pybind11 functions (transform_sf_into_required_layout) have no inspect.signature, only a docstring."""
    fn = types.SimpleNamespace(__doc__="transform_sf_into_required_layout(sf: torch.Tensor, mn: int, k: int, "
                               "recipe: tuple, num_groups: Optional[int] = None) -> torch.Tensor\n")
    assert binding.parameter_names(fn) == {"sf", "mn", "k", "recipe", "num_groups"}


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10,
                    reason="this machine has an SM100 GPU")
def test_deep_gemm_backend_without_sm100_names_the_device():
    with pytest.raises(RuntimeError, match=r"SM100.*this device is .*(no CUDA device|sm_\d+).*backend: reference"):
        resolve_backend("deep_gemm")
    m = mixtral_experts(*full_weights(0, hidden=256, inter=128))
    with pytest.raises(RuntimeError, match="sm_|no CUDA device"):
        install_megamoe_forward(m, backend="deep_gemm", quantize="fp4")
    assert megamoe_state(m) is None and m.gate_up_proj.dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here: auto picks deep_gemm or Triton")
def test_auto_falls_back_to_the_reference_with_a_warning_naming_why():
    with pytest.warns(RuntimeWarning, match="no deep_gemm.*reference runs instead.*backend: reference"):
        assert resolve_backend("auto") == "reference"
    m = mixtral_experts(*full_weights(0))
    with pytest.warns(RuntimeWarning):
        install_megamoe_forward(m, backend="auto", quantize="fp4")
    assert megamoe_state(m).backend == "reference" and "no deep_gemm" in megamoe_state(m).reason


@pytest.mark.parametrize("error", [AssertionError("CUDA_HOME is not set"), NameError("name 'symm_mem' is not defined")])
def test_import_errors_of_deep_gemm_mean_it_cannot_run(monkeypatch, error):
    """deep_gemm's import asserts a CUDA toolkit and can hit a NameError: both read as "not importable"."""
    real_import = binding.importlib.import_module

    def failing(name, *a, **kw):
        if name == "deep_gemm":
            raise error
        return real_import(name, *a, **kw)

    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    monkeypatch.setattr(binding.importlib, "import_module", failing)
    monkeypatch.setattr(binding, "check_device", lambda device=None: None)  # as on an SM100 machine
    with pytest.raises(ImportError, match=f"{type(error).__name__}.*PyPI"):
        binding.load_deep_gemm()
    reason = binding.deep_gemm_unavailable_reason()
    assert type(error).__name__ in reason


def test_auto_skips_the_kernel_for_sizes_it_rejects(recording):
    from planc.runtime.megamoe.experts import choose_backend

    assert choose_backend("auto", sizes=(256, 256))[0] == "deep_gemm"
    with pytest.warns(RuntimeWarning):  # no GPU here: the reference, naming the kernel's size rule
        name, reason = choose_backend("auto", sizes=(256, 128))
    assert name != "deep_gemm" and "intermediate=128" in reason


def test_bf16_math_passes_the_fp8_kernel_over(recording):
    """`experts.megamoe.math: bf16` asks for BF16 MMAs at every batch; deep_gemm's kernel multiplies in FP8: `auto`
    passes it over where it would run, and a plan that names it is refused with what to write instead."""
    from planc.runtime.megamoe.experts import choose_backend

    assert choose_backend("auto", sizes=(256, 256))[0] == "deep_gemm"
    with pytest.warns(RuntimeWarning):  # no GPU here for Triton: the reference
        name, reason = choose_backend("auto", sizes=(256, 256), math="bf16")
    assert name == "reference" and "no deep_gemm (it multiplies in FP8, not as `math: bf16` asks)" in reason
    with pytest.raises(ValueError, match="multiplies in FP8, not as `math: bf16` asks: use `backend: triton`"):
        choose_backend("deep_gemm", sizes=(256, 256), math="bf16")
    with pytest.raises(ValueError, match="unknown `experts.megamoe.math` 'fp8': use one of auto, bf16"):
        choose_backend("auto", math="fp8")


def test_destroy_barriers_each_group_before_freeing(monkeypatch):
    from planc.kernels.megamoe import buffers

    events = []
    group = types.SimpleNamespace(group_name="g", size=lambda: 2)
    monkeypatch.setattr(buffers.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(buffers.dist, "barrier", lambda group=None: events.append(("barrier", group.group_name)))
    key = buffers.BufferKey("deep_gemm", "g", 256, 2, 8, 256)
    buffers.get_buffer(key, 4, group=group, allocate=lambda c: (object(), 0, lambda: events.append(("destroy", "g"))))
    buffers.destroy_megamoe_buffers()
    assert events == [("barrier", "g"), ("destroy", "g")]


def test_unknown_backend():
    with pytest.raises(ValueError, match="auto, deep_gemm, triton, reference"):
        resolve_backend("tpu")


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
