"""SGLang's FP8 `fused_moe` on planc's Mega MoE layer: the peer of bench/megamoe_gpu.py, in a process of its own.

Why this way: importing SGLang's `fused_moe` pulls in its serving stack and `sgl_kernel` (a CUDA wheel of its own,
hundreds of MB), which the device cannot install (docs/megamoe.md, "Peers"). The kernels that do the work are Triton
and need only triton: `kernel_module` takes them verbatim from SGLang's PyPI wheel (its name and sha256 checked,
nothing installed) and `SGLangFusedMoE` launches them in the order SGLang 0.5.23's `fused_experts` does for a
block-quantized FP8 layer with a SwiGLU limit (DeepSeek-V4's path, `filter_expert` on), on CUDA:

1. the activations cast to e4m3 per (token, 128 channels), FP32 scales: `_per_token_group_quant_8bit` (SGLang on CUDA
   runs sgl_kernel's CUDA kernel of the same math);
2. `moe_align_block_size`: up to `SMALL_NUMEL_LIMIT` (token, slot) pairs its one-program Triton kernel, as SGLang on
   CUDA; above, `align_torch` (torch ops, the same buffers) where SGLang runs its JIT-compiled CUDA kernel;
3. `fused_moe_kernel`, gate and up rows (swap-AB where SGLang's `should_enable_swap_ab` says so);
4. `act_and_mul_triton` with the SwiGLU limit (SGLang's own kernel for V4);
5. step 1's cast of its output;
6. `fused_moe_kernel`, down, times the routing weight;
7. `moe_sum_reduce_triton` (SGLang on CUDA runs it up to 32 tokens, sgl_kernel's `moe_sum_reduce` above).

The tile config is SGLang's choice (`sglang_config`): its tuned file for this expert count, intermediate size and
device from the wheel where one exists, else its default for block FP8 (64 x 128 x 128, group 32, 4 warps, 3
stages); `--configs` adds candidates, and the bench reports SGLang's own pick and the best.

Weights: the FP4 experts planc serves (built as bench/megamoe_gpu.py builds them, same seed), dequantized and cast
per 128 x 128 block to e4m3 with FP32 scales (amax / 448), the layout of SGLang's block-FP8 checkpoints (`from_fp4`).

GPU, DeepSeek-V4 layer:  python bench/sglang_fused_moe.py --wheel .whl/sglang-0.5.23-*.whl --tokens 1,16,4096
CPU smoke test (tiny):   TRITON_INTERPRET=1 python bench/sglang_fused_moe.py --wheel W --device cpu --tiny
"""

from __future__ import annotations

import argparse
import ast
import atexit
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zipfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The wheel the kernels come from: SGLang's release on PyPI (`pip download --no-deps sglang==0.5.23`).
WHEEL_NAME = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
# What is taken from it, file by file: top-level functions and constants, their source unchanged.
KERNEL_SOURCES = {
    "sglang/kernels/ops/quantization/fp8_kernel.py": ("_per_token_group_quant_8bit",),
    "sglang/kernels/ops/moe/moe_align_small_numel.py": ("SMALL_NUMEL_LIMIT", "_moe_align_small_numel_kernel",
                                                        "moe_align_small_numel"),
    "sglang/kernels/ops/moe/fused_moe_triton_kernels.py": (
        "write_zeros_to_output", "fused_moe_kernel", "tanh", "_apply_activation", "act_and_mul_kernel",
        "act_and_mul_triton", "_moe_sum_reduce_kernel", "moe_sum_reduce_triton"),
}
CONFIG_DIR = "sglang/srt/layers/moe/moe_runner/triton_utils/configs"
BLOCK = 128  # the block of SGLang's FP8 path: (token, 128 channels) activations, 128 x 128 weights
# SGLang's default tile config for block-FP8 weights (`fused_moe_triton_config.get_default_config`, CUDA).
DEFAULT_CONFIG = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=BLOCK, BLOCK_SIZE_K=BLOCK, GROUP_SIZE_M=32, num_warps=4,
                      num_stages=3)
# The header of the extracted module: the imports the functions use, and `is_arch_support_pdl` as SGLang defines it
# (`sglang.kernels.jit.utils.arch`: not ROCm or MUSA, compute capability 9 or newer).
_HEADER = '''"""Extracted from {wheel} (sha256 {sha}) by bench/sglang_fused_moe.py; the functions below are unchanged."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import triton
import triton.language as tl


def is_arch_support_pdl() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
'''


def find_wheel(path: str | None) -> str:
    """The SGLang wheel: `path`, else `$PLANC_SGLANG_WHEEL`, else .whl/ beside the repository (git-ignored, what
    device calls carry). Raises FileNotFoundError saying how to get it."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for candidate in (path, os.environ.get("PLANC_SGLANG_WHEEL"), os.path.join(here, ".whl", WHEEL_NAME)):
        if candidate and os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(f"no SGLang wheel (looked at --wheel, $PLANC_SGLANG_WHEEL and .whl/{WHEEL_NAME}); get it "
                            f"with `pip download --no-deps -d .whl sglang==0.5.23`")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def extract(source: str, names: tuple[str, ...], where: str) -> str:
    """The top-level definitions `names` of `source` (functions with their decorators, or assignments), verbatim, in
    the order given. Raises KeyError naming what the file lacks (a wheel other than the pinned one)."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.Assign)):
            name = node.name if isinstance(node, ast.FunctionDef) else getattr(node.targets[0], "id", None)
            if name in names:
                first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
                found[name] = "\n".join(source.splitlines()[first - 1:node.end_lineno])
    missing = [n for n in names if n not in found]
    if missing:
        raise KeyError(f"{where} has no top-level {', '.join(missing)}")
    return "\n\n\n".join(found[n] for n in names)


_MODULES: dict[str, object] = {}


def kernel_module(wheel: str):
    """SGLang's Triton kernels (`KERNEL_SOURCES`) from `wheel`, as a module written to a temporary directory and
    imported from there (Triton compiles a kernel from its source file). Checks the wheel's sha256 first: the bench
    names the release it measured."""
    if wheel in _MODULES:
        return _MODULES[wheel]
    sha = _sha256(wheel)
    if sha != WHEEL_SHA256:
        raise ValueError(f"{wheel}: sha256 {sha}, expected {WHEEL_SHA256} ({WHEEL_NAME} from PyPI)")
    parts = [_HEADER.format(wheel=os.path.basename(wheel), sha=sha)]
    with zipfile.ZipFile(wheel) as z:
        for member, names in KERNEL_SOURCES.items():
            parts.append(f"# --- {member}\n" + extract(z.read(member).decode(), names, member))
    where = tempfile.mkdtemp(prefix="sglang_kernels_")
    atexit.register(shutil.rmtree, where, True)
    path = os.path.join(where, "sglang_fused_moe_kernels.py")
    with open(path, "w") as f:
        f.write("\n\n\n".join(parts) + "\n")
    spec = importlib.util.spec_from_file_location("sglang_fused_moe_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _MODULES[wheel] = module
    return module


def sglang_config(wheel: str, experts: int, intermediate: int, tokens: int, device_name: str) -> tuple[dict, str]:
    """SGLang's tile config for the gate-up GEMM (and the down GEMM, which has no file of its own here) at `tokens`:
    `get_moe_configs` + `try_get_optimal_moe_config` (the tuned file for this E, N, device and dtype under its Triton
    version's directory, else the newest other version's; the entry of the nearest batch size), else
    `DEFAULT_CONFIG`. Returns the config and where it came from."""
    import triton

    name = (f"E={experts},N={intermediate},device_name={device_name.replace(' ', '_')},dtype=fp8_w8a8,"
            f"block_shape=[{BLOCK}, {BLOCK}].json")
    with zipfile.ZipFile(wheel) as z:
        files = {m for m in z.namelist() if m.startswith(CONFIG_DIR + "/")}
        versions = sorted({m[len(CONFIG_DIR) + 1:].split("/")[0].removeprefix("triton_") for m in files
                           if m[len(CONFIG_DIR) + 1:].startswith("triton_")},
                          key=lambda v: tuple(int(x) for x in v.split("_")), reverse=True)
        mine = triton.__version__.split("+")[0].replace(".", "_")
        for version in [mine] + [v for v in versions if v != mine]:
            member = f"{CONFIG_DIR}/triton_{version}/{name}"
            if member in files:
                table = {int(k): v for k, v in json.loads(z.read(member)).items()}
                config = dict(table[min(table, key=lambda m: abs(m - tokens))])
                config.pop("USE_TMA", None)
                return config, f"tuned: {member.split('/')[-2]}/{name}"
    return dict(DEFAULT_CONFIG), f"default (no {name} in the wheel)"


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], FP32 scales [N / 128, K / 128]): per 128 x 128 block scale = amax / 448, values
    w / scale rounded to e4m3 (the block-FP8 checkpoints SGLang serves, e.g. DeepSeek-V3's)."""
    n, k = w.shape
    fmax = torch.finfo(torch.float8_e4m3fn).max
    blocks = w.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fmax
    q = (blocks / scale[:, None, :, None]).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    return q.view(n, k), scale


def from_fp4(experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """planc's FP4 experts (the module layout: `gate_up_proj` [E, 2I, H / 2] e2m1 pairs and per-32 scales, `down_proj`
    [E, H, I / 2]) as SGLang's block-FP8 weights w13 [E, 2I, H], w2 [E, H, I] and their scales, one expert at a time
    (the FP32 copy of one expert at most)."""
    from planc.kernels.megamoe.quant import dequantize_fp4

    out = []
    for name in ("gate_up_proj", "down_proj"):
        packed, sf = getattr(experts, name), getattr(experts, name + "_scale_inv")
        e, n, half = packed.shape
        q = torch.empty((e, n, 2 * half), dtype=torch.float8_e4m3fn, device=packed.device)
        s = torch.empty((e, n // BLOCK, 2 * half // BLOCK), dtype=torch.float32, device=packed.device)
        for i in range(e):
            q[i], s[i] = block_fp8(dequantize_fp4(packed[i], sf[i]))
        out += [q, s]
    return tuple(out)


def served_experts(args, device):
    """The experts module bench/megamoe_gpu.py serves (`build_experts`, same seed) with its FP4 parameters only (the
    BF16 originals freed): what every peer's weights are made from."""
    from bench.megamoe_gpu import build_experts
    from planc.runtime.megamoe import install_megamoe_forward

    experts, _ = build_experts(args, device)
    undo = install_megamoe_forward(experts, backend="reference", quantize="fp4", activation_clamp=args.clamp,
                                   num_global_experts=args.experts, ep_rank=0, ep_size=1)
    del undo  # frees the BF16 originals: the FP4 parameters stay
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return experts


def block_fp8_experts(args, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`served_experts` as block-FP8 weights (`from_fp4`), the FP4 module freed."""
    experts = served_experts(args, device)
    weights = from_fp4(experts)
    del experts
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return weights


def align_torch(topk_ids: torch.Tensor, block_m: int, num_experts: int, sorted_ids: torch.Tensor,
                expert_ids: torch.Tensor, num_post_pad: torch.Tensor) -> None:
    """`moe_align_block_size`'s buffers by torch ops, with no host sync (a graph captures it): the (token, slot)
    pairs sorted by expert (stable), each expert's run padded to a multiple of `block_m` with `numel`, the expert of
    each block (-1 past the end), the padded total. SGLang's "+1 offset" buckets: expert -1 (filtered under EP)
    would be bucket 0; here every expert is local."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    bucket = flat + 1
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    end = torch.cumsum(padded, 0)
    start = end - padded
    order = torch.sort(bucket, stable=True).indices
    first = torch.cumsum(counts, 0) - counts  # each bucket's first position among the sorted pairs
    rank = torch.arange(numel, device=flat.device) - first[bucket[order]]
    sorted_ids.fill_(numel)
    sorted_ids.scatter_(0, start[bucket[order]] + rank, order.to(sorted_ids.dtype))
    block_start = torch.arange(expert_ids.numel(), device=flat.device) * block_m
    owner = torch.searchsorted(end, block_start, right=True)
    expert_ids.copy_(torch.where(block_start < end[-1], owner - 1, -1).to(expert_ids.dtype))
    num_post_pad.copy_(end[-1:].to(num_post_pad.dtype))


class SGLangFusedMoE:
    """SGLang 0.5.23's block-FP8 `fused_experts` sequence (the module docstring's steps) over fixed weights."""

    def __init__(self, wheel: str, w13, w13_scale, w2, w2_scale, top_k: int, swiglu_limit: float | None):
        self.k = kernel_module(wheel)
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13, w13_scale, w2, w2_scale
        self.top_k, self.swiglu_limit = top_k, swiglu_limit

    def quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1: `_per_token_group_quant_8bit` as `_per_token_group_quant_8bit_raw` launches it (row-major scales)."""
        info = torch.finfo(torch.float8_e4m3fn)
        q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
        s = torch.empty((*x.shape[:-1], x.shape[-1] // BLOCK), dtype=torch.float32, device=x.device)
        self.k._per_token_group_quant_8bit[(x.numel() // BLOCK,)](
            x, q, s, BLOCK, BLOCK, 1e-10, bit8_min=info.min, bit8_max=info.max, BLOCK=BLOCK,
            num_warps=min(max(BLOCK // 256, 1), 8), num_stages=1)
        return q, s

    def align(self, topk_ids: torch.Tensor, block_m: int):
        """Step 2: `moe_align_block_size`'s buffers, sized as SGLang sizes them."""
        numel, experts = topk_ids.numel(), self.w13.shape[0]
        padded = numel * block_m if numel < experts + 1 else numel + (experts + 1) * (block_m - 1)
        padded = (padded + 3) // 4 * 4
        dev = topk_ids.device
        sorted_ids = torch.empty(padded, dtype=torch.int32, device=dev)
        expert_ids = torch.empty((padded + block_m - 1) // block_m, dtype=torch.int32, device=dev)
        num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)
        if dev.type == "cuda" and numel <= self.k.SMALL_NUMEL_LIMIT:
            self.k.moe_align_small_numel(topk_ids, experts + 1, block_m, sorted_ids, expert_ids, num_post_pad)
        else:
            align_torch(topk_ids, block_m, experts, sorted_ids, expert_ids, num_post_pad)
        return sorted_ids, expert_ids, num_post_pad

    def gemm(self, a, a_scale, b, b_scale, c, topk_weights, aligned, mul_routed_weight: bool, top_k: int,
             num_valid: int, config: dict) -> None:
        """Steps 3 and 6: `fused_moe_kernel` launched as `invoke_fused_moe_kernel` does for block FP8 without TMA."""
        import triton
        import triton.language as tl

        sorted_ids, expert_ids, num_post_pad = aligned
        swap_ab = (a.is_cuda and torch.cuda.get_device_capability(a.device) == (9, 0)
                   and config["BLOCK_SIZE_M"] < 64 and config["BLOCK_SIZE_N"] >= 64)  # `should_enable_swap_ab`
        pdl = (dict(USE_GDC=True, launch_pdl=True, GDC_EARLY=a.shape[0] <= 512) if self.k.is_arch_support_pdl()
               else {})
        n, k = b.shape[1], b.shape[2]
        grid = (triton.cdiv(sorted_ids.shape[0], config["BLOCK_SIZE_M"]) * triton.cdiv(n, config["BLOCK_SIZE_N"]),)
        self.k.fused_moe_kernel[grid](
            a, None, b, None, None, c, a_scale, b_scale, topk_weights, sorted_ids, expert_ids, num_post_pad, None,
            n, k, sorted_ids.shape[0], num_valid,
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), 0, 0, c.stride(-2), c.stride(-1),
            a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(2), b_scale.stride(1),
            BLOCK, BLOCK, MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=tl.bfloat16,
            use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
            even_Ks=k % config["BLOCK_SIZE_K"] == 0, c_sorted=False, swap_ab=swap_ab, FUSE_ADD_TO_OUTPUT=False,
            A_OUTPUT_SLICES=1, A_OUTPUT_SLICE_WIDTH=0, A_OUTPUT_SLICE_K=0, MASK_OUTPUT=False,
            FUSE_SUM_ALL_REDUCE=False, ROUTER_TOPK=self.top_k, FUSE_SWIGLU=False, **pdl, **config)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, config: dict):
        tokens, top_k = topk_ids.shape
        n = self.w13.shape[1]
        aligned = self.align(topk_ids, config["BLOCK_SIZE_M"])
        xq, xs = self.quant(x)
        cache1 = torch.empty((tokens * top_k, n), dtype=x.dtype, device=x.device)
        self.gemm(xq, xs, self.w13, self.w13_scale, cache1, topk_weights, aligned, False, top_k, topk_ids.numel(),
                  config)
        cache2 = torch.empty((tokens * top_k, n // 2), dtype=x.dtype, device=x.device)
        self.k.act_and_mul_triton(cache1, cache2, config, topk_ids, aligned[1], False, "silu",
                                  swiglu_limit=self.swiglu_limit)
        hq, hs = self.quant(cache2)
        cache3 = torch.empty((tokens, top_k, self.w2.shape[1]), dtype=x.dtype, device=x.device)
        self.gemm(hq, hs, self.w2, self.w2_scale, cache3, topk_weights, aligned, True, 1, topk_ids.numel(), config)
        out = torch.empty_like(x)
        self.k.moe_sum_reduce_triton(cache3, out, 1.0)
        return out


def parse_args(argv=None):
    from bench.megamoe_gpu import add_peer_args, tiny_shapes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_peer_args(p)
    p.add_argument("--wheel", default=None, help=f"SGLang's wheel ({WHEEL_NAME}; `find_wheel`)")
    p.add_argument("--configs", default=None, metavar="M,N,K,GROUP,WARPS,STAGES;...",
                   help="tile configs to time beside SGLang's pick (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, warps, stages)")
    args = p.parse_args(argv)
    tiny_shapes(args)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    keys = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
    args.configs = [dict(zip(keys, (int(v) for v in c.split(",")))) for c in (args.configs or "").split(";")
                    if c.strip()]
    return args


def main(argv=None):
    from bench.megamoe_gpu import capture_graph, graph_or_eager, random_batch, timer, write_peer

    args = parse_args(argv)
    wheel = find_wheel(args.wheel)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    moe = SGLangFusedMoE(wheel, *block_fp8_experts(args, device), args.topk, args.clamp)
    measure = timer(args.device, args.warmup, args.iters)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    rows, outputs = [], {}
    for n in args.tokens:
        x, w, idx = random_batch(args, n, device, seed=n)
        picked, source = sglang_config(wheel, args.experts, args.intermediate, n, name)
        row = dict(tokens=n, config=picked, config_source=source, candidates=[])
        with torch.no_grad():
            for config in [picked, *(c for c in args.configs if c != picked)]:
                try:
                    spread = []
                    us, y = graph_or_eager(device, measure, lambda c=config: moe(x, idx, w, c), cuda, args.captures,
                                           spread)
                except Exception as e:  # noqa: BLE001 - a candidate that does not compile (shared memory): say so
                    row["candidates"].append(dict(config=config, error=f"{type(e).__name__}: {str(e)[:160]}"))
                    continue
                y = moe(x, idx, w, config) if y is None else y
                row["candidates"].append(dict(config=config, us=us, captures=spread))
                if config is picked:
                    row["us"], outputs[f"tokens_{n}"] = us, y.cpu().contiguous()  # BF16, as the layer returns it
            if cuda:  # the align step alone (step 2), graph replay: what this bench runs in SGLang's JIT kernel's place
                graph, _ = capture_graph(lambda: moe.align(idx, picked["BLOCK_SIZE_M"]))
                row["align_us"] = measure(graph.replay)
                row["align"] = "triton (SGLang's)" if idx.numel() <= moe.k.SMALL_NUMEL_LIMIT else "torch ops"
        timed = [c for c in row["candidates"] if "us" in c]
        row["best"] = min(timed, key=lambda c: c["us"]) if timed else None
        rows.append(row)
        print(f"tokens {n}: SGLang's pick {row.get('us', float('nan')):.1f} us ({source}); best "
              f"{row['best']['us'] if row['best'] else float('nan'):.1f} us {row['best'] and row['best']['config']}",
              file=sys.stderr)
    result = dict(peer="sglang fused_moe (Triton kernels of " + WHEEL_NAME + ")", wheel_sha256=WHEEL_SHA256,
                  device=name, torch=torch.__version__, shapes=dict(hidden=args.hidden, intermediate=args.intermediate,
                                                                    experts=args.experts, topk=args.topk), rows=rows)
    print(f"\nSGLang 0.5.23 fused_moe, block FP8 ({name}; H={args.hidden}, I={args.intermediate}, E={args.experts}, "
          f"top-{args.topk}; {'graph replay' if cuda else 'eager'}, µs)\n")
    print("| tokens | SGLang's pick | its config | best | best config | align step | align by |")
    print("|---:|---:|---|---:|---|---:|---|")
    for r in rows:
        b = r["best"] or {}
        print(f"| {r['tokens']} | {r.get('us', float('nan')):.1f} | {r['config_source']} | {b.get('us', float('nan')):.1f}"
              f" | {b.get('config')} | {r.get('align_us', float('nan')):.1f} | {r.get('align', '-')} |")
    return write_peer(args, result, outputs)


if __name__ == "__main__":
    main()
