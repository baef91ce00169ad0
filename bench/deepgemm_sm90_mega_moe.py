"""DeepGEMM's SM90 Mega MoE kernels on planc's Mega MoE layer: a peer of bench/megamoe_gpu.py, in a process of its own.

Where they come from: upstream deepseek-ai/DeepGEMM's Mega MoE is SM100-only; the Hopper kernels are SGLang's fork's,
sgl-project/DeepGEMM: `sm90_fp8_mega_moe.cuh` (FP8 x FP8, block-128 FP32 weight scales; pull requests 36 and 48) and
`sm90_fp8_fp4_mega_moe.cuh` (FP8 x FP4: DeepSeek-V4's packed e2m1 experts with per-32 UE8M0 scales, decoded to e4m3
in shared memory for the FP8 wgmma; pull request 53). Each does the dispatch, both GEMMs, the SwiGLU and the combine
in one kernel. The tree that holds both and builds is qiushixiaoyu/DeepGEMM's main at `SOURCE["deepgemm"]` ("Merge
sgl-project/DeepGEMM PR #53", then "Fix SM90 FP4 MegaMoE build against post-#364 signatures"), with the two
submodules at the commits that tree pins (NVIDIA/cutlass, fmtlib/fmt) and its host module bound through
apache-tvm-ffi (its pyproject's pin).

- `assemble` writes one archive of that tree: `git archive` of each pinned commit (from a local clone, or cloned
  from GitHub), the submodule commits checked against the tree's gitlinks. A machine without GitHub (the device)
  gets the archive.
- `prepare` unpacks it into a cache directory and stages the package as the fork's `build_sgl_deep_gemm.sh` does:
  CUTLASS's `cute` and `cutlass` headers under `deep_gemm/include` (what its JIT compiles against) and
  `sgl_deep_gemm`'s Python files (the tvm-ffi bindings) into `deep_gemm/`.
- `load` imports it: the first import builds `deep_gemm/_C.so` (the fork's `_build_module`: `tvm_ffi.cpp.build` over
  `csrc/tvm_ffi_api.cpp`, CUDA's and torch's headers); the kernel compiles at its first call per config (DeepGEMM's
  JIT, nvcc, cached under `<cache>/jit`).

What runs (`SM90MegaMoE`, one per `--kinds` entry): the kernel at one rank, as the fork's tests call it
(`tests/test_mega_moe_hopper.py`, `sgl_deep_gemm/tests/test_mega_moe_fp4_hopper.py`): the inputs copied into the
kernel's buffer (FP8 tokens, their scales, top-k ids and weights), then the one kernel. Its buffer is symmetric memory
across ranks; at one rank it is a plain device buffer whose own address is the only peer pointer
(`_C.get_symm_buffer_size_for_sm90_mega_moe` sizes and slices it, as `SM90SymmBuffer` does). `fast_math` is the
bindings' default (on).

Weights: the FP4 experts planc serves (built as bench/megamoe_gpu.py builds them, same seed).
- `fp4`: those very bytes and scales (planc's module layout is DeepGEMM's `per_token_cast_to_fp4(use_ue8m0=True,
  gran_k=32)`: low nibble the even K), gate and up rows interleaved and the scales packed by
  `transform_weights_for_mega_moe_sm90_fp4`, recipe (1, 1, 32).
- `fp8`: dequantized and cast per 128 x 128 block to e4m3 with FP32 scales (amax / 448; `sglang_fused_moe.from_fp4`:
  the recipe the kernel asserts, (128, 128, 128)), gate and up rows interleaved by `transform_weights_for_mega_moe_sm90`.
Activations: per (token, 128 channels) e4m3 with FP32 scales (`deep_gemm.utils.per_token_cast_to_fp8`, as its tests
do), cast outside the timed call: `us` is the input copies and the kernel (the part a serving stack runs per layer
once its tokens are FP8), `kernel_us` the kernel alone; planc's layer time includes its own FP8 cast, so the ratio
leans toward the peer.

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
    "deepgemm": ("https://github.com/qiushixiaoyu/DeepGEMM", "820861bd3edb77c88d2e7d8d8030249afc1c6b5b", None),
    "cutlass": ("https://github.com/NVIDIA/cutlass", "f3fde58372d33e9a5650ba7b80fc48b3b49d40c8", None),
    "fmt": ("https://github.com/fmtlib/fmt", "553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28", None),
}
# Each submodule's path in the tree and the parts of it the build reads.
SUBMODULES = {"cutlass": ("third-party/cutlass", ("include", "LICENSE.txt")),
              "fmt": ("third-party/fmt", ("include", "LICENSE"))}
TVM_FFI = "apache-tvm-ffi==0.1.11"  # sgl_deep_gemm/pyproject.toml's pin
ARCHIVE_ROOT = "DeepGEMM"
# What build_sgl_deep_gemm.sh copies from sgl_deep_gemm/ into the package, the bindings as deep_gemm/__init__.py.
STAGED = ("__init__.py", "cuda_helpers.py", "VERSION")


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
    for name in STAGED:  # build_sgl_deep_gemm.sh: sgl_deep_gemm's files over deep_gemm's
        want, dst = _read(os.path.join(root, "sgl_deep_gemm", name)), os.path.join(root, "deep_gemm", name)
        if not os.path.exists(dst) or _read(dst) != want:
            with open(dst, "wb") as f:
                f.write(want)
    return root


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


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


def fp8_weights(dg, experts):
    """Block-FP8 weights (`sglang_fused_moe.from_fp4` of planc's FP4 experts) in the FP8 kernel's layout:
    `transform_weights_for_mega_moe_sm90` (gate and up rows interleaved by 8), one expert at a time into the FP8
    gate-up tensor itself (its copy of every expert at once is a second 16 GB at V4's size, which a GPU of 80 GB
    holding the FP4 and FP8 experts does not have). It leaves the scales and L2 as they are; a version that changes
    them is refused rather than half applied."""
    from bench.sglang_fused_moe import from_fp4

    w13, s13, w2, s2 = from_fp4(experts)
    for i in range(w13.shape[0]):
        l1, l2 = (w13[i : i + 1], s13[i : i + 1]), (w2[i : i + 1], s2[i : i + 1])
        (t13, t_s13), t2 = dg.transform_weights_for_mega_moe_sm90(l1, l2)
        if t_s13 is not l1[1] or t2 is not l2:
            raise RuntimeError("transform_weights_for_mega_moe_sm90 changes more than the gate/up row order here")
        w13[i : i + 1].copy_(t13)
    return (w13, s13), (w2, s2)


def fp4_weights(dg, experts):
    """planc's FP4 experts, the same bytes, in the FP8 x FP4 kernel's layout: `transform_weights_for_mega_moe_sm90_fp4`
    (gate and up rows and their scales interleaved by 8, the scales as UE8M0 bytes packed 4 to an int32 along K) over
    each expert's packed e2m1 and its per-32 scales as FP32 powers of two, one expert at a time into tensors of their
    own (the module's parameters stay as they are)."""
    import torch

    out = None
    for i in range(experts.gate_up_proj.shape[0]):
        l1 = (experts.gate_up_proj[i : i + 1], experts.gate_up_proj_scale_inv[i : i + 1].float())
        l2 = (experts.down_proj[i : i + 1], experts.down_proj_scale_inv[i : i + 1].float())
        got = [t for pair in dg.transform_weights_for_mega_moe_sm90_fp4(l1, l2) for t in pair]
        if out is None:
            out = [torch.empty((experts.gate_up_proj.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
                   for t in got]
        for dst, t in zip(out, got):
            dst[i : i + 1].copy_(t)
    return (out[0], out[1]), (out[2], out[3])


# The FP8 kernel's swap-AB path (pull request 48; `should_use_swap_ab_for_mega_moe_sm90` takes it up to this many
# tokens a rank at small blocks) computes something else at one rank in this tree: calc_diff 0.6-0.7 against planc on
# an H100 where its other batches and the FP8 x FP4 kernel's are ~2e-3 to 5e-3 apart. Its rows there are no peer's.
FP8_SWAP_AB_TOKENS = 128
FP8_SWAP_AB_WRONG = (f"DeepGEMM's FP8 Mega MoE (qiushixiaoyu/DeepGEMM 820861b) takes its swap-AB path (sgl-project/"
                     f"DeepGEMM pull request 48) up to {FP8_SWAP_AB_TOKENS} tokens a rank, and there its output is not "
                     f"the layer's at one rank")

# Each kernel this peer runs: its weights (from planc's FP4 experts), its binding in `deep_gemm._C`, its recipe.
KINDS = {
    "fp4": (fp4_weights, "fp8_fp4_mega_moe_sm90", (1, 1, 32)),
    "fp8": (fp8_weights, "fp8_mega_moe", (128, 128, 128)),
}


class SM90MegaMoE:
    """One of DeepGEMM's SM90 Mega MoE kernels (`kind`, a key of `KINDS`) at one rank over planc's FP4 experts
    (`experts`: the module with FP4 parameters, `gate_up_proj` [E, 2I, H / 2] ...) for up to `max_tokens` tokens a
    call."""

    def __init__(self, dg, kind: str, experts, top_k: int, max_tokens: int, clamp: float | None):
        import torch

        make, self.binding, self.recipe = KINDS[kind]
        self.dg, self.kind, self.top_k, self.clamp = dg, kind, top_k, clamp
        self.experts, two_i, _ = experts.gate_up_proj.shape
        self.hidden, self.intermediate = experts.down_proj.shape[1], two_i // 2
        self.l1, self.l2 = make(dg, experts)
        self.max_tokens = dg.utils.math.align(max_tokens, dg._C.get_token_alignment_for_mega_moe())
        nbytes, slicer = dg._C.get_symm_buffer_size_for_sm90_mega_moe(
            1, self.experts, self.max_tokens, top_k, self.hidden, self.intermediate, True, "swiglu")
        self.buffer = torch.zeros(nbytes, dtype=torch.int8, device=experts.gate_up_proj.device)
        x, x_sf, idx, w, *_ = slicer(self.buffer)
        self.x = dg._from_dlpack_if_needed(x, torch.float8_e4m3fn)
        self.x_sf = dg._from_dlpack_if_needed(x_sf)
        self.idx = dg._from_dlpack_if_needed(idx)
        self.w = dg._from_dlpack_if_needed(w)

    def cast(self, x):
        """BF16 tokens -> (e4m3, FP32 scales per 128 channels), as the fork's tests cast them."""
        return self.dg.utils.per_token_cast_to_fp8(x, use_ue8m0=False, gran_k=128, use_packed_ue8m0=False)

    def kernel(self, y):
        """The kernel alone on the inputs in its buffer, into `y` [T, H] BF16."""
        getattr(self.dg._C, self.binding)(y, *self.l1, *self.l2, None, self.buffer, [self.buffer.data_ptr()], 0,
                                          self.max_tokens, self.experts, self.top_k, self.recipe, "swiglu",
                                          self.clamp, True)
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
    p.add_argument("--kinds", default=",".join(KINDS), help=f"the kernels to run, of {', '.join(KINDS)}")
    for name in SOURCE:
        p.add_argument(f"--git-{name}", default=None, metavar="DIR", help=f"a local clone holding {name}'s commit")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.kinds = args.kinds.split(",")
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        p.error(f"--kinds: {', '.join(sorted(unknown))} is none of {', '.join(KINDS)}")
    return args


def default_cache() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "planc", "deepgemm_sm90", SOURCE["deepgemm"][1][:12])


def time_kernel(args, moe: SM90MegaMoE, measure, outputs: dict) -> dict:
    """Each batch of `args.tokens` through `moe` (graph replay, `args.captures` graphs): its row per batch size, and
    its output into `outputs` (`tokens_<n>_<kind>`)."""
    import torch

    from bench.megamoe_gpu import graph_or_eager, random_batch

    device, rows = torch.device("cuda"), {}
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
            us, _ = graph_or_eager(device, measure, lambda: moe(xq, x_sf, idx, w, y), True, args.captures, spread)
            kernel_us, _ = graph_or_eager(device, measure, lambda: moe.kernel(y), True, args.captures, kspread)
            moe(xq, x_sf, idx, w, y)
            torch.cuda.synchronize()
        outputs[f"tokens_{n}_{moe.kind}"] = y.cpu().contiguous()
        rows[n] = dict(us=us, captures=spread, kernel_us=kernel_us, kernel_captures=kspread, first_call_s=first_s)
        print(f"{moe.kind}, tokens {n}: {us:.1f} us with the input copies, kernel {kernel_us:.1f} us (first call "
              f"{first_s:.1f} s)", file=sys.stderr)
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.assemble:
        print(assemble(args.assemble, {k: getattr(args, f"git_{k}") for k in SOURCE}))
        return None
    import torch

    from bench.megamoe_gpu import timer, write_peer
    from bench.sglang_fused_moe import served_experts

    if not args.source:
        raise SystemExit("no DeepGEMM source: --source or $PLANC_DEEPGEMM_SM90 (write it with --assemble)")
    cache = args.cache or default_cache()
    os.makedirs(cache, exist_ok=True)
    dg = load(prepare(args.source, cache), cache)
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    experts = served_experts(args, device)
    measure = timer("cuda", args.warmup, args.iters)
    rows = {n: dict(tokens=n) for n in args.tokens}
    outputs = {}
    for kind in args.kinds:
        for n, row in time_kernel(args, SM90MegaMoE(dg, kind, experts, args.topk, max(args.tokens), args.clamp),
                                  measure, outputs).items():
            rows[n][kind] = row
        torch.cuda.empty_cache()
    result = dict(peer=f"DeepGEMM SM90 Mega MoE ({', '.join(args.kinds)}; {SOURCE['deepgemm'][0].split('/')[-2]}/"
                       f"DeepGEMM {SOURCE['deepgemm'][1][:12]})",
                  kinds=args.kinds, source={k: dict(url=v[0], commit=v[1]) for k, v in SOURCE.items()},
                  tvm_ffi=TVM_FFI, device=name, torch=torch.__version__,
                  shapes=dict(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, topk=args.topk),
                  rows=list(rows.values()))
    print(f"\nDeepGEMM SM90 Mega MoE, one rank ({name}; H={args.hidden}, I={args.intermediate}, E={args.experts}, "
          f"top-{args.topk}; graph replay, µs)\n")
    print("| kernel | tokens | input copies + kernel | kernel alone | first call (s, JIT) |")
    print("|---|---:|---:|---:|---:|")
    for kind in args.kinds:
        for r in rows.values():
            k = r[kind]
            print(f"| {kind} | {r['tokens']} | {k['us']:.1f} | {k['kernel_us']:.1f} | {k['first_call_s']:.1f} |")
    return write_peer(args, result, outputs)


if __name__ == "__main__":
    main()
