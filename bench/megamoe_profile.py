"""The Triton Mega MoE experts computation alone, on random FP4 bytes, for a profiler.

Why: `megamoe_gpu.py --profile` profiles the whole layer but first builds BF16 weights and the reference backend
(~50 GB and most of a minute on the V4 layer); a kernel profiler needs only the kernels' inputs. Random words are a
valid packed FP4 layout (every 4-bit code is an e2m1 value); the scale bytes are kept near 2**-6 so nothing
overflows. Warm-up calls first, then `--calls` timed ones: under Nsight Compute profile the first launches of the
GEMMs, e.g.

    ncu -k 'regex:l1_swiglu|l2_kernel' -c 2 --section SpeedOfLight --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats \\
        python3 bench/megamoe_profile.py --tokens 16

`--table` prints torch.profiler's per-kernel device time of the timed calls instead (no ncu needed); with `--graph`
of CUDA-graph replays, e.g. `--tokens 1 --table --graph --calls 20` for the decode kernels as the layer runs them.
CPU smoke test (Triton's interpreter): TRITON_INTERPRET=1 python bench/megamoe_profile.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planc.kernels.megamoe.quant import float_to_ue8m0_bytes, quantize_fp8
from planc.kernels.megamoe.triton.config import KernelConfig
from planc.kernels.megamoe.triton.forward import triton_local_experts_forward
from planc.kernels.megamoe.triton.layout import PackedExperts

from megamoe_gpu import (  # this folder
    DECODE_VARIANTS, add_layer_args, capture_graph, decode_row, kernel_table, random_batch, tiny_shapes,
)


def random_packed_experts(experts: int, hidden: int, inter: int, device, generator) -> PackedExperts:
    """FP4 experts already in the kernels' layout (`shuffle_fp4`), from random words and scale bytes 118-123."""

    def words(n, k):
        return torch.randint(-2**31, 2**31 - 1, (experts, n, k // 8), generator=generator, device=device,
                             dtype=torch.int32)

    def scales(n, k):
        return torch.randint(118, 124, (experts, n, k // 32), generator=generator, device=device, dtype=torch.uint8)

    return PackedExperts(words(2 * inter, hidden), scales(2 * inter, hidden), words(hidden, inter),
                         scales(hidden, inter), large_scales=False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_args(p)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--clamp", type=float, default=10.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--table", action="store_true", help="print torch.profiler's kernel table of the timed calls")
    p.add_argument("--graph", action="store_true",
                   help="with --table: the timed calls are replays of a CUDA graph of one call (as megamoe_gpu.py "
                        "times the layer): the kernels' time without launch gaps, and what the graph replays")
    p.add_argument("--decode-variant", default=None, choices=list(DECODE_VARIANTS),
                   help="run the decode rows as this variant (megamoe_gpu.py's `DECODE_VARIANTS`)")
    p.add_argument("--config", default=None, metavar="INTS",
                   help="run this KernelConfig instead of the table's pick: its fields as comma-separated ints, as "
                        "in megamoe_gpu.py --configs (e.g. an FP8 Gluon config)")
    args = p.parse_args(argv)
    args.config = KernelConfig(*(int(v) for v in args.config.split(","))) if args.config else None
    if args.decode_variant:
        with decode_row(**DECODE_VARIANTS[args.decode_variant]):
            return run(args)
    return run(args)


def run(args):
    tiny_shapes(args)
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    packed = random_packed_experts(args.experts, args.hidden, args.intermediate, device, g)
    x, weights, idx = random_batch(args, args.tokens, device, seed=args.tokens)
    q, sf = quantize_fp8(x)
    sf = float_to_ue8m0_bytes(sf)

    def call():
        return triton_local_experts_forward(q, sf, idx, weights, packed, first_expert=0,
                                            activation_clamp=args.clamp, config=args.config)

    for _ in range(args.warmup):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if not args.table:
        for _ in range(args.calls):
            call()
        return None
    timed = capture_graph(call)[0].replay if args.graph and device.type == "cuda" else call
    table = kernel_table(device, timed, calls=args.calls, rows=10)
    print(table)
    return table


if __name__ == "__main__":
    main()
