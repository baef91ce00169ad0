"""The SGLang peer of bench/megamoe_gpu.py (`bench/sglang_fused_moe.py`).

The bench's ratios against SGLang are only worth what its launch of SGLang's kernels is. On a GPU (`gpu`) the
kernels taken from the wheel run at small shapes against a float64 emulation of SGLang's block-FP8 math written apart
from them, and against planc's reference on the same FP4 experts within DeepGEMM's FP8 bound. Under Triton's CPU
interpreter only the align kernel runs (against the bench's torch align): the interpreter (Triton 3.9) multiplies
two BF16 values as their raw 16-bit patterns (SGLang's `act_and_mul_kernel` does) and rounds some FP32 values just
below a power of two to e4m3 one binade low, so the whole sequence there would test the interpreter. Needs SGLang's
wheel (`bench/sglang_fused_moe.find_wheel`; CI downloads it).
"""

import pytest
import torch

from planc.kernels.megamoe.quant import calc_diff, quantize_experts_fp4
from planc.kernels.megamoe.triton import target
from tests.kernels.megamoe.common import full_weights, planc_reference, routing

from bench import sglang_fused_moe as peer
from bench.megamoe_gpu import PEER_BOUND

WHY = ""
try:
    WHEEL: str | None = peer.find_wheel(None)
except FileNotFoundError as e:
    WHEEL, WHY = None, str(e)

pytestmark = pytest.mark.skipif(WHEEL is None, reason=WHY)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
interpreted = pytest.mark.skipif(not target.interpreting(), reason="CPU tensors need Triton's interpreter")

E, H, I, TOPK = 4, 256, 128, 2
LIMIT = 1.0  # V4's is 10; at 1 it clamps about a sixth of the gate and a third of the up values here


def layer(seed=0, device="cuda"):
    w1, w2 = full_weights(seed, num_experts=E, hidden=H, inter=I)
    fp4 = quantize_experts_fp4(w1.to(device), w2.to(device))
    return fp4, peer.from_fp4(fp4)


def fp8_cast(a: torch.Tensor) -> torch.Tensor:
    """SGLang's per-(row, 128) e4m3 cast, emulated: fp32 scale amax / 448 (amax at least 1e-10), values times its fp32
    reciprocal, clamped, rounded to e4m3; returned dequantized in float64."""
    rows, cols = a.shape
    g = a.float().view(rows, cols // 128, 128)
    s = g.abs().amax(-1).clamp(min=1e-10) / 448.0
    q = (g * (1.0 / s)[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.double() * s.double()[..., None]).view(rows, cols)


def emulate(x, idx, w, w13, s13, w2, s2, limit=LIMIT):
    """SGLang's block-FP8 fused_experts in float64 with its BF16 roundings: gate-up GEMM (rounded to BF16), gate
    clamped above and up on both sides at LIMIT, silu in FP32 rounded to BF16, times up (BF16), cast, down GEMM times
    the routing weight (BF16), the top-k sum (FP32, rounded to BF16)."""
    def deq(q, s):
        return (q.double().view(q.shape[0], q.shape[1] // 128, 128, q.shape[2] // 128, 128)
                * s.double()[:, :, None, :, None]).view(q.shape)

    x, idx, w, w13, s13, w2, s2 = (t.cpu() for t in (x, idx, w, w13, s13, w2, s2))
    w13d, w2d = deq(w13, s13), deq(w2, s2)
    xq = fp8_cast(x)
    out = torch.zeros(x.shape[0], H, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gu = (w13d[e] @ xq[t]).to(torch.bfloat16)
            gate, up = gu[:I].float().clamp(max=limit).bfloat16(), gu[I:].float().clamp(-limit, limit).bfloat16()
            h = ((gate.float() * torch.sigmoid(gate.float())).bfloat16().float() * up.float()).bfloat16()
            y = ((w2d[e] @ fp8_cast(h[None].float())[0]) * float(w[t, j])).to(torch.bfloat16)
            out[t] += y.float()
    return out.bfloat16()


# SGLang's default tile config, and 16-row blocks (swap-AB on an H100 or H200: `should_enable_swap_ab`).
SWAP_AB = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", [peer.DEFAULT_CONFIG, SWAP_AB], ids=["default", "swap_ab"])
@pytest.mark.parametrize("tokens", [1, 5, 40])  # SGLang's align kernel (up to 64 pairs), then the torch align
def test_peer_matches_the_emulation_of_its_math_and_planc_within_the_fp8_bound(tokens, config):
    fp4, (w13, s13, w2, s2) = layer()
    moe = peer.SGLangFusedMoE(WHEEL, w13, s13, w2, s2, TOPK, LIMIT)
    x, idx, w = (t.cuda() for t in routing(tokens, seed=tokens, num_experts=E, topk=TOPK, hidden=H))
    y = moe(x, idx, w.float(), dict(config)).float().cpu()
    assert torch.isfinite(y).all()
    # Not bit for bit: the emulation sums in float64, the kernels in their MMAs' FP32 order, which moves some BF16 and
    # e4m3 roundings (on an H100 with V4's limit of 10: under 1e-5 at 1 and 5 tokens, 6.4e-5 at 40). A launch mistake
    # (a stride, the gate and up halves, a scale, the routing weight, the limit) moves it by orders of magnitude more.
    assert calc_diff(y, emulate(x, idx, w.float(), w13, s13, w2, s2).float()) < 2e-4
    assert calc_diff(y, emulate(x, idx, w.float(), w13, s13, w2, s2, limit=2 * LIMIT).float()) > 2e-3  # it can fail
    planc = planc_reference(fp4, x, idx, w, LIMIT)
    assert calc_diff(y, planc.float().cpu()) < PEER_BOUND  # DeepGEMM's bound for FP8 GEMMs against BF16


def test_sglangs_config_lookup_reads_the_wheels_tuned_files():
    config, source = peer.sglang_config(WHEEL, 384, 128, 4, "NVIDIA H200")  # a file the wheel holds
    assert source.startswith("tuned: triton_") and {"BLOCK_SIZE_M", "num_warps"} <= set(config)
    config, source = peer.sglang_config(WHEEL, 384, 3072, 4096, "NVIDIA H100 80GB HBM3")  # V4 on an H100: none
    assert config == peer.DEFAULT_CONFIG and source.startswith("default")


@interpreted
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_torch_align_is_sglangs_align_kernel(tokens, block_m):
    """`align_torch` (the bench's align above SGLang's SMALL_NUMEL_LIMIT pairs) writes what SGLang's own align kernel
    writes, where both run: the sorted pairs, each block's expert and the padded total."""
    k = peer.kernel_module(WHEEL)
    experts = 9
    idx = torch.randint(0, experts, (tokens, 2), generator=torch.Generator().manual_seed(tokens))
    got, want = [], []
    for out, fn in ((got, lambda *a: peer.align_torch(idx, block_m, experts, *a)),
                    (want, lambda *a: k.moe_align_small_numel(idx, experts + 1, block_m, *a))):
        padded = (idx.numel() * block_m + 3) // 4 * 4
        bufs = (torch.full((padded,), -7, dtype=torch.int32), torch.full(((padded + block_m - 1) // block_m,), -7,
                                                                          dtype=torch.int32),
                torch.zeros(1, dtype=torch.int32))
        fn(*bufs)
        out.extend(bufs)
    total = int(want[2])
    assert int(got[2]) == total and total % block_m == 0
    assert torch.equal(got[0][:total], want[0][:total])
    assert torch.equal(got[1][:total // block_m], want[1][:total // block_m])


def test_a_wheel_without_a_kernel_or_with_other_bytes_is_refused(tmp_path):
    with pytest.raises(KeyError, match="has no top-level fused_moe_kernel"):
        peer.extract("def other():\n    pass\n", ("fused_moe_kernel",), "sglang/x.py")
    fake = tmp_path / peer.WHEEL_NAME
    fake.write_bytes(b"not the wheel")
    with pytest.raises(ValueError, match="sha256"):
        peer.kernel_module(str(fake))
