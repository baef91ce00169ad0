"""The DeepGEMM SM90 Mega MoE peer of bench/megamoe_gpu.py (`bench/deepgemm_sm90_mega_moe.py`).

The bench's ratios against DeepGEMM are only worth what the peer's source and call are. On CPU: `assemble` takes each
pinned commit and refuses a tree whose submodule gitlinks name other commits, and `prepare` stages the tree as the
fork's build script does and refuses an archive of other pins (local git repositories stand in for GitHub, with
`SOURCE` pointed at them). On an H100 or H200 (`gpu`, with the archive in $PLANC_DEEPGEMM_SM90): each kernel (FP8 x
FP4, FP8 x FP8) at small shapes against a float64 emulation of its math (the fork's own references, `_reference_fused`
in tests/test_mega_moe_hopper.py and sgl_deep_gemm/tests/test_mega_moe_fp4_hopper.py, with the kernels' power-of-two
scales for the down GEMM's input and, for FP4, the weights as the e4m3 values its decode table holds), and against
planc's reference on the same FP4 experts within DeepGEMM's FP8 bound.
"""

import json
import os
import subprocess
import tarfile

import pytest
import torch

from bench import deepgemm_sm90_mega_moe as peer
from bench.megamoe_gpu import PEER_BOUND

ARCHIVE = os.environ.get("PLANC_DEEPGEMM_SM90")


def _commit(repo, files: dict[str, str], gitlinks: dict[str, str] = {}) -> str:  # noqa: B006 - read only
    """A commit in a fresh repository `repo` holding `files` and submodule gitlinks (path -> commit)."""
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    subprocess.run([*git, "add", "-A"], check=True)
    for path, sha in gitlinks.items():
        subprocess.run([*git, "update-index", "--add", "--cacheinfo", f"160000,{sha},{path}"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repos(tmp_path, monkeypatch):
    """Three local repositories shaped like the fork and its submodules, `SOURCE` pinned to their commits."""
    cutlass = _commit(tmp_path / "cutlass", {"include/cute/a.hpp": "// cute", "include/cutlass/b.h": "// cutlass",
                                             "LICENSE.txt": "l", "tools/big.cu": "not taken"})
    fmt = _commit(tmp_path / "fmt", {"include/fmt/core.h": "// fmt", "LICENSE": "l"})
    tree = _commit(tmp_path / "deepgemm", {"deep_gemm/__init__.py": "# upstream's torch binding",
                                           "deep_gemm/include/deep_gemm/k.cuh": "// kernel",
                                           "sgl_deep_gemm/__init__.py": "# the tvm-ffi binding",
                                           "sgl_deep_gemm/cuda_helpers.py": "# its helpers",
                                           "sgl_deep_gemm/VERSION": "0.0.0\n", "csrc/tvm_ffi_api.cpp": "//"},
                   {"third-party/cutlass": cutlass, "third-party/fmt": fmt})
    source = {"deepgemm": ("u", tree, None), "cutlass": ("u", cutlass, None), "fmt": ("u", fmt, None)}
    monkeypatch.setattr(peer, "SOURCE", source)
    return {name: str(tmp_path / name) for name in source}


def test_assemble_then_prepare_stages_the_tree_as_the_forks_build_script(repos, tmp_path):
    archive = peer.assemble(str(tmp_path / "dg.tar.xz"), repos)
    with tarfile.open(archive) as t:
        names = set(t.getnames())
    assert "DeepGEMM/third-party/cutlass/include/cute/a.hpp" in names
    assert "DeepGEMM/third-party/fmt/include/fmt/core.h" in names
    assert not any("tools/big.cu" in n for n in names)  # only the parts the build reads
    root = peer.prepare(archive, str(tmp_path / "cache"))
    include = os.path.join(root, "deep_gemm", "include")
    for name, text in (("cute/a.hpp", "// cute"), ("cutlass/b.h", "// cutlass")):
        assert open(os.path.join(include, name)).read() == text
        assert not os.path.isabs(os.readlink(os.path.join(include, name.split("/")[0])))  # the cache can move
    assert open(os.path.join(root, "deep_gemm", "__init__.py")).read() == "# the tvm-ffi binding"
    assert open(os.path.join(root, "deep_gemm", "cuda_helpers.py")).read() == "# its helpers"
    assert open(os.path.join(root, "deep_gemm", "VERSION")).read() == "0.0.0\n"
    (tmp_path / "cache" / "DeepGEMM" / "deep_gemm" / "_C.so").write_bytes(b"built")  # a build survives again
    assert peer.prepare(archive, str(tmp_path / "cache")) == root
    assert (tmp_path / "cache" / "DeepGEMM" / "deep_gemm" / "_C.so").read_bytes() == b"built"
    with open(os.path.join(root, "PLANC_SOURCE.json")) as f:
        assert {k: v["commit"] for k, v in json.load(f).items()} == {k: v[1] for k, v in peer.SOURCE.items()}


def test_a_tree_pinning_other_submodule_commits_is_refused(repos, tmp_path, monkeypatch):
    other = _commit(tmp_path / "cutlass2", {"include/cute/a.hpp": "// another", "LICENSE.txt": "l"})
    monkeypatch.setitem(peer.SOURCE, "cutlass", ("u", other, None))
    with pytest.raises(ValueError, match="pins third-party/cutlass at .* not " + other):
        peer.assemble(str(tmp_path / "dg.tar.xz"), {**repos, "cutlass": str(tmp_path / "cutlass2")})


def test_an_archive_of_other_pins_is_refused(repos, tmp_path, monkeypatch):
    archive = peer.assemble(str(tmp_path / "dg.tar.xz"), repos)
    monkeypatch.setitem(peer.SOURCE, "fmt", ("u", "0" * 40, None))
    with pytest.raises(ValueError, match="assemble it again"):
        peer.prepare(archive, str(tmp_path / "cache"))


def test_the_flags_the_bench_passes_are_the_peers():
    """`bench/megamoe_gpu.py` runs the peer with `layer_flags` and its result files (`child_peer`)."""
    from bench import megamoe_gpu

    bench = megamoe_gpu.parse_args(["--tokens", "1,16,4096", "--experts", "48", "--clamp", "7", "--captures", "2"])
    args = peer.parse_args(["--source", "dg.tar.xz", *megamoe_gpu.layer_flags(bench), "--json", "p.json",
                            "--outputs", "o.safetensors"])
    assert (args.tokens, args.experts, args.hidden, args.clamp, args.captures) == ([1, 16, 4096], 48, 7168, 7.0, 2)
    assert (args.source, args.json, args.outputs) == ("dg.tar.xz", "p.json", "o.safetensors")


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


E, H, I, TOPK = 8, 512, 512, 2  # the shapes of the fork's own smoke test
LIMIT = 1.0  # V4's is 10; at 1 it clamps a good share of the gate and up values here


@pytest.fixture(scope="module")
def deep_gemm(tmp_path_factory):
    if not ARCHIVE:
        pytest.skip("no DeepGEMM SM90 source archive ($PLANC_DEEPGEMM_SM90; bench/deepgemm_sm90_mega_moe.py --assemble)")
    if not _sm90():
        pytest.skip("DeepGEMM's SM90 Mega MoE needs an sm_90 GPU")
    cache = os.environ.get("PLANC_DEEPGEMM_CACHE") or str(tmp_path_factory.mktemp("deepgemm"))
    return peer.load(peer.prepare(ARCHIVE, cache), cache)


def fp8_dense(w13, s13, w2, s2):
    """Block-FP8 weights (128 x 128 FP32 scales) as float64."""

    def deq(q, s):
        n, k = q.shape[-2:]
        return (q.double().view(-1, n // 128, 128, k // 128, 128) * s.double()[:, :, None, :, None]).view(q.shape)

    return deq(w13.cpu(), s13.cpu()), deq(w2.cpu(), s2.cpu())


def fp4_dense(fp4):
    """planc's FP4 experts as the FP8 x FP4 kernel multiplies them: each e2m1 value times its scale as an e4m3 byte
    of its decode table (`kScaledE4M3LutFromE8M0`: the value rounded to e4m3, RNE, which these weights' scales keep
    in range), no scale left over."""
    from planc.kernels.megamoe.quant import dequantize_fp4_batched

    return tuple(dequantize_fp4_batched(p.cpu(), s.cpu()).to(torch.float8_e4m3fn).double()
                 for p, s in ((fp4.gate_up_proj, fp4.gate_up_proj_scale_inv), (fp4.down_proj, fp4.down_proj_scale_inv)))


def emulate(xq, x_sf, idx, w, w13d, w2d, limit=LIMIT):
    """A kernel's math in float64 over its weights as float64 (`fp8_dense`, `fp4_dense`): FP8 tokens dequantized, the
    gate-up GEMM, gate clamped above and up on both sides at `limit`, silu(gate) * up times the routing weight, cast
    to e4m3 per 64 channels with a power-of-two scale, 2^ceil(log2(amax / 448)) (`sm90_fp8_mega_moe_get_e4m3_sf_and_sf_inv`
    and its FP4 twin; the fork's own references take amax / 448, which the FP8 kernel's output misses by ~6e-4 in
    calc_diff), the down GEMM rounded to BF16 per slot, the slots summed in FP32 and rounded to BF16
    (`_reference_fused` in its tests)."""
    xq, x_sf, idx, w = (t.cpu() for t in (xq, x_sf, idx, w))
    x = (xq.double().view(xq.shape[0], -1, 128) * x_sf.double()[..., None]).view(xq.shape)
    out = torch.zeros(x.shape[0], H, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gu = w13d[e] @ x[t]
            gate, up = gu[:I].clamp(max=limit), gu[I:].clamp(-limit, limit)
            h = (gate * torch.sigmoid(gate) * up * float(w[t, j])).view(I // 64, 64)
            amax = (h.abs().amax(-1).float() * (1 / 448.0)).double()  # the kernel: fl32(amax * fl32(1 / 448))
            sf = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax))), torch.ones_like(amax))
            hq = ((h / sf[:, None]).to(torch.float8_e4m3fn).double() * sf[:, None]).view(I)
            out[t] += (w2d[e] @ hq).to(torch.bfloat16).float()
    return out.bfloat16()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(peer.KINDS))
@pytest.mark.parametrize("tokens", [1, 5, 40, 300])
def test_peer_matches_the_emulation_of_its_math_and_planc_within_the_fp8_bound(deep_gemm, kind, tokens, request):
    if kind == "fp8" and tokens <= peer.FP8_SWAP_AB_TOKENS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=peer.FP8_SWAP_AB_WRONG))
    from bench.sglang_fused_moe import from_fp4
    from planc.kernels.megamoe.quant import calc_diff, quantize_experts_fp4
    from tests.kernels.megamoe.common import full_weights, planc_reference, routing

    w1, w2 = full_weights(0, num_experts=E, hidden=H, inter=I)
    fp4 = quantize_experts_fp4(w1.cuda(), w2.cuda())
    moe = peer.SM90MegaMoE(deep_gemm, kind, fp4, TOPK, 512, LIMIT)
    x, idx, w = (t.cuda() for t in routing(tokens, seed=tokens, num_experts=E, topk=TOPK, hidden=H))
    xq, x_sf = moe.cast(x)
    y = moe(xq, x_sf, idx, w.float(), torch.empty(tokens, H, dtype=torch.bfloat16, device="cuda")).float().cpu()
    assert torch.isfinite(y).all()
    dense = fp8_dense(*from_fp4(fp4)) if kind == "fp8" else fp4_dense(fp4)
    got = calc_diff(y, emulate(xq, x_sf, idx, w.float(), *dense).float())
    # Not bit for bit: the emulation sums in float64, the kernel in its MMAs' FP32 order with fast math, which moves
    # some BF16 and e4m3 roundings; a launch mistake (a scale, the gate and up order, the routing weight, the limit)
    # moves it by orders of magnitude more, as the wrong limit shows.
    print(f"{kind}, tokens {tokens}: calc_diff against the emulation {got:.2e}")
    assert got < 2e-4
    assert calc_diff(y, emulate(xq, x_sf, idx, w.float(), *dense, limit=2 * LIMIT).float()) > 2e-3
    planc = planc_reference(fp4, x, idx, w, LIMIT)
    assert calc_diff(y, planc.float().cpu()) < PEER_BOUND  # DeepGEMM's bound for FP8 GEMMs against BF16
