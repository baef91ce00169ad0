"""DeepGEMM's SM90 FP8 Mega MoE on planc's Mega MoE layer: a peer of bench/megamoe_gpu.py, in a process of its own.

Where it comes from: upstream deepseek-ai/DeepGEMM's Mega MoE is SM100-only; the Hopper kernel
(`sm90_fp8_mega_moe.cuh`, FP8 x FP8, block-128 FP32 scales, dispatch, both GEMMs, SwiGLU and combine in one
kernel) is SGLang's fork, sgl-project/DeepGEMM, pull request 36 ("Add SM90 MegaMoE support with TVM FFI bindings",
"Apply SM90 MegaMoE kernel fixes"), at its head `SOURCE["deepgemm"]`, with the two submodules at the commits that
tree pins (NVIDIA/cutlass, fmtlib/fmt) and its host module bound through apache-tvm-ffi (its pyproject's pin).

- `assemble` writes one archive of that tree: `git archive` of each pinned commit (from a local clone, or cloned
  from GitHub), the submodule commits checked against the tree's gitlinks. A machine without GitHub (the device)
  gets the archive.
- `prepare` unpacks it into a cache directory and stages the package as the fork's `build_sgl_deep_gemm.sh` does:
  CUTLASS's `cute` and `cutlass` headers under `deep_gemm/include` (what its JIT compiles against) and
  `sgl_deep_gemm/__init__.py` (the tvm-ffi bindings, `fp8_mega_moe`) as `deep_gemm/__init__.py`.
- `load` imports it: the first import builds `deep_gemm/_C.so` (the fork's `_build_module`: `tvm_ffi.cpp.build` over
  `csrc/tvm_ffi_api.cpp`, CUDA's and torch's headers); the kernel compiles at its first call per config (DeepGEMM's
  JIT, nvcc, cached under `<cache>/jit`).

What runs (`SM90MegaMoE`): `deep_gemm.fp8_mega_moe` at one rank, as the fork's `tests/test_mega_moe_hopper.py`
calls it: the inputs copied into the kernel's buffer (FP8 tokens, their scales, top-k ids and weights), then the
one kernel. Its buffer is symmetric memory across ranks; at one rank it is a plain device buffer whose own address
is the only peer pointer (`_C.get_symm_buffer_size_for_sm90_mega_moe` sizes and slices it, as `SM90SymmBuffer`
does). `fast_math` is the binding's default (on).

Weights: the FP4 experts planc serves (built as bench/megamoe_gpu.py builds them, same seed), dequantized and cast
per 128 x 128 block to e4m3 with FP32 scales (amax / 448; `sglang_fused_moe.from_fp4`: the recipe the kernel asserts,
(128, 128, 128)), gate and up rows interleaved by `transform_weights_for_mega_moe_sm90`. Activations: per (token, 128
channels) e4m3 with FP32 scales (`deep_gemm.utils.per_token_cast_to_fp8`, as its test does), cast outside the timed
call: `us` is the input copies and the kernel (the part a serving stack runs per layer once its tokens are FP8),
`kernel_us` the kernel alone; planc's layer time includes its own FP8 cast, so the ratio leans toward the peer.

GPU, DeepSeek-V4 layer:  python bench/deepgemm_sm90_mega_moe.py --source .dg/deepgemm-sm90.tar.xz --tokens 1,16,4096
Assemble the source:     python bench/deepgemm_sm90_mega_moe.py --assemble .dg/deepgemm-sm90.tar.xz \
                           [--git-deepgemm DIR --git-cutlass DIR --git-fmt DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The source, pinned: (repository, commit) of the tree and of each submodule, and where a clone finds the commit.
SOURCE = {
    "deepgemm": ("https://github.com/sgl-project/DeepGEMM", "3f9268b5c15d4b939957051a1b5d22d2ef3dcf4e",
                 "refs/pull/36/head"),
    "cutlass": ("https://github.com/NVIDIA/cutlass", "f3fde58372d33e9a5650ba7b80fc48b3b49d40c8", None),
    "fmt": ("https://github.com/fmtlib/fmt", "553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28", None),
}
# Each submodule's path in the tree and the parts of it the build reads.
SUBMODULES = {"cutlass": ("third-party/cutlass", ("include", "LICENSE.txt")),
              "fmt": ("third-party/fmt", ("include", "LICENSE"))}
TVM_FFI = "apache-tvm-ffi==0.1.9"  # sgl_deep_gemm/pyproject.toml's pin
ARCHIVE_ROOT = "DeepGEMM"


def _git(repo: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, **kw)


def _clone(url: str, ref: str | None, where: str) -> str:
    """A bare clone of `url`, with `ref` fetched where the default branches do not reach the pinned commit (which
    `assemble` checks for every repository, cloned or given)."""
    subprocess.run(["git", "clone", "--bare", "--filter=blob:none", url, where], check=True)
    if ref:
        _git(where, "fetch", "origin", f"{ref}:{ref}")
    return where


def assemble(out: str, git: dict[str, str | None]) -> str:
    """One .tar.xz of the pinned tree with its submodules' needed parts; the gitlinks in the tree must name the
    pinned submodule commits (else the pins disagree with the tree and the archive is refused). Returns `out`."""
    with tempfile.TemporaryDirectory(prefix="deepgemm_src_") as tmp:
        repos = {}
        for name, (url, commit, ref) in SOURCE.items():
            repos[name] = git.get(name) or _clone(url, ref, os.path.join(tmp, name + ".git"))
            _git(repos[name], "cat-file", "-e", f"{commit}^{{commit}}")
        tree = SOURCE["deepgemm"][1]
        for name, (path, _) in SUBMODULES.items():
            line = _git(repos["deepgemm"], "ls-tree", tree, path, text=True).stdout.split()
            if len(line) < 3 or line[1] != "commit" or line[2] != SOURCE[name][1]:
                raise ValueError(f"{SOURCE['deepgemm'][0]} at {tree[:12]} pins {path} at "
                                 f"{line[2] if len(line) > 2 else 'nothing'}, not {SOURCE[name][1]}: fix SOURCE")
        root = os.path.join(tmp, ARCHIVE_ROOT)
        os.makedirs(root)
        _untar(_git(repos["deepgemm"], "archive", tree).stdout, root)
        for name, (path, parts) in SUBMODULES.items():
            dest = os.path.join(root, path)
            os.makedirs(dest, exist_ok=True)
            _untar(_git(repos[name], "archive", SOURCE[name][1], *parts).stdout, dest)
        with open(os.path.join(root, "PLANC_SOURCE.json"), "w") as f:
            json.dump({k: dict(url=v[0], commit=v[1]) for k, v in SOURCE.items()}, f, indent=2)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with tarfile.open(out, "w:xz") as t:
            t.add(root, arcname=ARCHIVE_ROOT)
    return out


def _untar(data: bytes, dest: str) -> None:
    import io

    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        t.extractall(dest, filter="data")


def prepare(source: str, cache: str) -> str:
    """The staged tree under `cache` (unpacked from the archive `source`, or a directory holding such a tree), built
    artifacts of earlier runs (`_C.so`, the JIT cache) kept. Returns the tree's root (what goes on sys.path)."""
    root = os.path.join(cache, ARCHIVE_ROOT)
    pins = os.path.join(root, "PLANC_SOURCE.json")
    if not os.path.exists(pins):
        if os.path.isdir(source):
            shutil.copytree(os.path.join(source, ARCHIVE_ROOT) if os.path.isdir(os.path.join(source, ARCHIVE_ROOT))
                            else source, root, symlinks=True, dirs_exist_ok=True)
        else:
            with tarfile.open(source) as t:
                t.extractall(cache, filter="data")
    with open(pins) as f:
        got = {k: v["commit"] for k, v in json.load(f).items()}
    if got != {k: v[1] for k, v in SOURCE.items()}:
        raise ValueError(f"{source} holds {got}, not the pinned {SOURCE}: assemble it again (--assemble)")
    include = os.path.join(root, "deep_gemm", "include")
    for name in ("cute", "cutlass"):  # build_sgl_deep_gemm.sh: CUTLASS's headers where the JIT looks for them
        link = os.path.join(include, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "..", "third-party", "cutlass", "include", name), link)  # relative: movable
    init = os.path.join(root, "deep_gemm", "__init__.py")
    with open(os.path.join(root, "sgl_deep_gemm", "__init__.py")) as f:
        sgl_init = f.read()
    with open(init) as f:
        staged = f.read() == sgl_init
    if not staged:
        with open(init, "w") as f:
            f.write(sgl_init)
        shutil.copy(os.path.join(root, "sgl_deep_gemm", "VERSION"), os.path.join(root, "deep_gemm", "VERSION"))
    return root


def load(root: str, cache: str):
    """`import deep_gemm` from the staged tree (building `_C.so` on the first import; its time is printed)."""
    # absolute: the JIT compiles from a directory of its own, where a relative path names nothing
    os.environ.setdefault("DG_JIT_CACHE_DIR", os.path.abspath(os.path.join(cache, "jit")))
    sys.path.insert(0, root)
    built = os.path.exists(os.path.join(root, "deep_gemm", "_C.so"))
    t0 = time.perf_counter()
    import deep_gemm

    if not built:
        print(f"built deep_gemm/_C.so in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return deep_gemm


def transform_weights(dg, w13, s13, w2, s2):
    """`transform_weights_for_mega_moe_sm90` (gate and up rows interleaved by 8), one expert at a time into `w13`
    itself: its copy of every expert at once is a second 16 GB at V4's size, which a GPU of 80 GB holding the FP4 and
    FP8 experts does not have. The transform leaves the scales and L2 as they are; a version that changes them is
    refused rather than half applied."""
    for i in range(w13.shape[0]):
        l1, l2 = (w13[i : i + 1], s13[i : i + 1]), (w2[i : i + 1], s2[i : i + 1])
        (t13, t_s13), t2 = dg.transform_weights_for_mega_moe_sm90(l1, l2)
        if t_s13 is not l1[1] or t2 is not l2:
            raise RuntimeError("transform_weights_for_mega_moe_sm90 changes more than the gate/up row order here")
        w13[i : i + 1].copy_(t13)
    return w13, s13, w2, s2


class SM90MegaMoE:
    """`deep_gemm.fp8_mega_moe` at one rank over block-FP8 weights (`w13` [E, 2I, H] e4m3, `w2` [E, H, I], FP32
    scales per 128 x 128) for up to `max_tokens` tokens a call."""

    def __init__(self, dg, w13, s13, w2, s2, top_k: int, max_tokens: int, clamp: float | None):
        import torch

        self.dg, self.top_k, self.clamp = dg, top_k, clamp
        self.experts, self.hidden, self.intermediate = w13.shape[0], w2.shape[1], w2.shape[2]
        self.w13, self.s13, self.w2, self.s2 = transform_weights(dg, w13, s13, w2, s2)
        self.max_tokens = dg.utils.math.align(max_tokens, dg._C.get_token_alignment_for_mega_moe())
        nbytes, slicer = dg._C.get_symm_buffer_size_for_sm90_mega_moe(
            1, self.experts, self.max_tokens, top_k, self.hidden, self.intermediate, True, "swiglu")
        self.buffer = torch.zeros(nbytes, dtype=torch.int8, device=w13.device)
        x, x_sf, idx, w, *_ = slicer(self.buffer)
        self.x = dg._from_dlpack_if_needed(x, torch.float8_e4m3fn)
        self.x_sf = dg._from_dlpack_if_needed(x_sf)
        self.idx = dg._from_dlpack_if_needed(idx)
        self.w = dg._from_dlpack_if_needed(w)

    def cast(self, x):
        """BF16 tokens -> (e4m3, FP32 scales per 128 channels), as the fork's test casts them."""
        return self.dg.utils.per_token_cast_to_fp8(x, use_ue8m0=False, gran_k=128, use_packed_ue8m0=False)

    def kernel(self, y):
        """The kernel alone on the inputs in its buffer, into `y` [T, H] BF16."""
        self.dg._C.fp8_mega_moe(y, self.w13, self.s13, self.w2, self.s2, None, self.buffer, [self.buffer.data_ptr()],
                                0, self.max_tokens, self.experts, self.top_k, (128, 128, 128), "swiglu", self.clamp,
                                True)
        return y

    def __call__(self, xq, x_sf, topk_ids, topk_weights, y):
        n = xq.shape[0]
        self.x[:n].copy_(xq)
        self.x_sf[:n].copy_(x_sf)
        self.idx[:n].copy_(topk_ids)
        self.w[:n].copy_(topk_weights)
        return self.kernel(y)


def parse_args(argv=None):
    from bench.megamoe_gpu import add_peer_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_peer_args(p)
    p.add_argument("--source", default=os.environ.get("PLANC_DEEPGEMM_SM90"),
                   help="the archive `--assemble` writes, or its unpacked tree (default: $PLANC_DEEPGEMM_SM90)")
    p.add_argument("--cache", default=None, help="where it is staged and built (default: ~/.cache/planc/deepgemm_sm90/"
                   "<commit>; `_C.so` and the JIT cache are kept there)")
    p.add_argument("--assemble", default=None, metavar="OUT", help="write the source archive to OUT and exit")
    for name in SOURCE:
        p.add_argument(f"--git-{name}", default=None, metavar="DIR", help=f"a local clone holding {name}'s commit")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


def default_cache() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "planc", "deepgemm_sm90", SOURCE["deepgemm"][1][:12])


def main(argv=None):
    args = parse_args(argv)
    if args.assemble:
        print(assemble(args.assemble, {k: getattr(args, f"git_{k}") for k in SOURCE}))
        return None
    import torch

    from bench.megamoe_gpu import graph_or_eager, random_batch, timer, write_peer
    from bench.sglang_fused_moe import block_fp8_experts

    if not args.source:
        raise SystemExit("no DeepGEMM source: --source or $PLANC_DEEPGEMM_SM90 (write it with --assemble)")
    cache = args.cache or default_cache()
    os.makedirs(cache, exist_ok=True)
    dg = load(prepare(args.source, cache), cache)
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    moe = SM90MegaMoE(dg, *block_fp8_experts(args, device), args.topk, max(args.tokens), args.clamp)
    measure = timer("cuda", args.warmup, args.iters)
    rows, outputs = [], {}
    for n in args.tokens:
        x, w, idx = random_batch(args, n, device, seed=n)
        xq, x_sf = moe.cast(x)
        y = torch.empty(n, args.hidden, dtype=torch.bfloat16, device=device)
        t0 = time.perf_counter()
        with torch.no_grad():
            moe(xq, x_sf, idx, w, y)  # the JIT compiles here, outside any capture
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            spread, kspread = [], []
            us, out = graph_or_eager(device, measure, lambda: moe(xq, x_sf, idx, w, y), True, args.captures, spread)
            kernel_us, _ = graph_or_eager(device, measure, lambda: moe.kernel(y), True, args.captures, kspread)
            moe(xq, x_sf, idx, w, y)
            torch.cuda.synchronize()
        outputs[f"tokens_{n}"] = y.cpu().contiguous()
        rows.append(dict(tokens=n, us=us, captures=spread, kernel_us=kernel_us, kernel_captures=kspread,
                         first_call_s=first_s))
        print(f"tokens {n}: {us:.1f} us with the input copies, kernel {kernel_us:.1f} us (first call {first_s:.1f} s)",
              file=sys.stderr)
    result = dict(peer=f"DeepGEMM SM90 FP8 Mega MoE (sgl-project/DeepGEMM {SOURCE['deepgemm'][1][:12]})",
                  source={k: dict(url=v[0], commit=v[1]) for k, v in SOURCE.items()}, tvm_ffi=TVM_FFI, device=name,
                  torch=torch.__version__, shapes=dict(hidden=args.hidden, intermediate=args.intermediate,
                                                       experts=args.experts, topk=args.topk), rows=rows)
    print(f"\nDeepGEMM SM90 FP8 Mega MoE, one rank ({name}; H={args.hidden}, I={args.intermediate}, "
          f"E={args.experts}, top-{args.topk}; graph replay, µs)\n")
    print("| tokens | input copies + kernel | kernel alone | first call (s, JIT) |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['us']:.1f} | {r['kernel_us']:.1f} | {r['first_call_s']:.1f} |")
    return write_peer(args, result, outputs)


if __name__ == "__main__":
    main()
