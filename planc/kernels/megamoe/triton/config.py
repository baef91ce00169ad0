"""Tile configs of the Triton kernels (`KernelConfig`) and the table tuned on an H200 (`pick_config`): what a
batch runs from its shapes and the device's SM count alone, with no device read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from planc.kernels.megamoe.triton import target
from planc.kernels.megamoe.triton.target import TUNED_SMS


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes: `block_t` rows (token slots) of one expert per block; N and K tiles of each GEMM."""

    block_t: int = 16
    l1_n: int = 64  # gate columns per program (and as many up columns); multiple of 32 (requant groups)
    l1_k: int = 128
    l2_n: int = 64
    l2_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    l1_split: int = 1  # L1 split-K: hidden slices per (block, N tile), a power of two
    # Registers per thread for the L1 and L2 kernels (0: ptxas's choice). ptxas does not weigh how many programs
    # fit on an SM; a cap that it can meet without spilling buys more of them (`bench/megamoe_gpu.py --sweep`).
    maxnreg: int = 0
    # Stream the weights by register prefetch where Triton lowers it well (`REGISTER_PREFETCH`), else through
    # Triton's cp.async pipeline (then `num_stages` buffers); 0 forces the pipeline.
    prefetch: int = 1
    # 1: the Hopper kernels in Gluon (`hopper_prefill`: async wgmma, blocks of 80 or 96 rows, `num_stages` cp.async
    # stages, l1_n = l2_n = 16 * num_warps, K tiles of 64). `pick_config` picks them only on sm_90. 2: the same L1,
    # and L2 with its copies in a producer warp (`hopper_prefill_ws`: TMA, mbarriers, `num_stages` stages).
    gluon: int = 0
    # L2's register cap where it is not `maxnreg` (0: the same). The warp-specialized L2 runs 8 warps per program
    # (4 MMA warps and the producer's warpgroup at 24): 64 fits four programs per SM, the MMA warps getting 104.
    l2_maxnreg: int = 0
    # The FP8-math kernels (`fp8`: e4m3 operands, FP32 promotion per 128-deep K block, l1_n = 128 channels per
    # scale block, K tiles of 128; the numerics of the FP8 path, docs/megamoe.md, not the BF16 path's): 1 swap-AB (the
    # weight rows are the MMA's M dimension, the expanded tile its register operand), 2 the block's rows are M (the
    # expanded tile is the shared-memory operand), 3 the Hopper Gluon kernels (`hopper_fp8`: FP8 async wgmma on the
    # FP8 weight layout, blocks of `FP8_GLUON_BLOCK_ROWS`, L1 16 x num_warps gate and as many up rows (8 warps: the
    # output cast in the epilogue; 4: its FP32 output cast by a kernel of its own), L2 `l2_n` rows on l2_n / 16 warps,
    # `num_stages` cp.async stages), 4 the same kernels warp-specialized (`hopper_fp8_ws`: a producer warp streams
    # `num_stages` stages by TMA and cp.async; register caps `maxnreg` / `l2_maxnreg`, 128 where unset; an L1 program
    # covers `l1_n` channels, 128 on 4 warps in two passes cast in the kernel, 64 on 4 warps cast by a kernel), 5 the
    # same with a converter warpgroup (`hopper_fp8_ws`, CONVERT: as many warps as the MMA's expand each stage into
    # e4m3 tiles in shared memory, both wgmma operands from there; caps 80 where unset: two programs per SM), 6 the
    # kernels of 3 with one scale per row of each operand instead of per 128-deep K block (`hopper_fp8`, ROW_SCALED:
    # every K block's wgmma accumulates into the same registers, no promotion; the numerics of the row-scaled path).
    fp8: int = 0
    # The split-K decode kernels (`decode`: both GEMMs split over K, the partial sums reduced by each tile's last
    # program, this many 64-deep K tiles in flight per program: 1, 2 or 4); 0 the general kernels. `l1_split` then
    # splits L1's hidden dimension and `l2_split` L2's intermediate dimension; `l1_k` and `l2_k` are 64.
    decode: int = 0
    l2_split: int = 1
    # With `decode`: 1 routes, dequantizes the tokens and zeroes the slots of no local expert in one launch
    # (`decode.prologue_kernel`), 0 in three (the general path's routing, dequantization and fill), as the decode
    # path ran before the prologue: kept to time one against the other (`bench/megamoe_gpu.py`).
    prologue: int = 1
    # With `decode`: 1 runs L1 and L2 as one persistent launch (`decode.decode_persistent_kernel`: work items by
    # ticket, an L2 item waiting for its block's L1 tiles), 0 as two launches.
    persistent: int = 0
    # With `decode` and the cp.async pipeline: L2's stages where they differ from L1's (0: `num_stages`). An L2 K tile
    # of 64 N rows is half an L1 tile (no up rows): 6 stages keep ~10 KB in flight per program against L1's ~20 KB.
    l2_stages: int = 0
    # With `decode`: 1 launches the prologue, L1 and L2 (or the persistent kernel) with programmatic dependent launch
    # where the device has it (`target.pdl_available`): each starts while the one before finishes, then waits.
    pdl: int = 0
    # With `decode`: n > 0 runs L1 and L2 under the stream-K schedule (`decode.decode_l1_stream_k_kernel`,
    # `stream_k.py`): n programs per SM (L2: `l2_stream_k` where set), each an even share of its GEMM's (K slice,
    # output tile, 64-deep K step) space through the cp.async pipeline, so no ragged last wave; `l1_split` and
    # `l2_split` are then the slices (1: tile by tile); 0 the split-K grid.
    stream_k: int = 0
    l2_stream_k: int = 0
    # With `decode` on Hopper: the split-K grid's L1 and L2 as warp-specialized Gluon kernels (`hopper_decode`: a
    # producer warp copies each K tile into `num_stages` shared-memory stages by TMA, the MMA warps only expand and
    # multiply), 1 on wgmma, 2 on mma.sync (each MMA warp on its own); 0 the Triton decode kernels.
    decode_ws: int = 0

    # The block sizes the Gluon kernels have loop bodies for: a 64-row MMA and up to one (80) or two (96) 16-row MMAs;
    # 80-row blocks compile without the two-tail body, in fewer registers (see `GLUON_CONFIGS`).
    GLUON_BLOCK_ROWS: ClassVar[tuple[int, ...]] = (80, 96)

    def gluon_fits(self, hidden: int, inter: int) -> bool:
        """Whether the Gluon kernels run these tiles on these shapes as they are (they do not shrink them): N tiles
        that divide, and L2's K tiles of 64 in pairs."""
        return not (inter % self.l1_n or hidden % self.l2_n or inter % 128)

    # The block sizes the FP8 Gluon kernels (`fp8=3`) take: the wgmma's N, one MMA per block.
    FP8_GLUON_BLOCK_ROWS: ClassVar[tuple[int, ...]] = (32, 64)
    # fp8=6 (no block sums to promote: the registers of a 128-wide accumulator fit) also takes blocks of 128 rows,
    # and of 80: a 64-row MMA and, where the block has more rows, a 16-row one on the same expanded operand.
    FP8_ROW_SCALED_BLOCK_ROWS: ClassVar[tuple[int, ...]] = (32, 64, 80, 128)

    # From this many rows per block the BF16 L2 races through Triton's cp.async pipeline (`pipeline_race`).
    PIPELINE_RACE_ROWS: ClassVar[int] = 128

    def pipeline_race(self, register_prefetch: bool) -> str | None:
        """Why this config's BF16 L2 would compute garbage on a GPU, or None. Streamed through Triton's cp.async
        pipeline (`prefetch=0`, or a Triton without register prefetch) with blocks of 128 rows and `num_stages` > 1,
        the L2 kernel races on its shared-memory activation tiles: on an H100 under Triton 3.6 (2026-12-06) a few
        blocks' slots per call came out wrong, up to 1.9e38, at random (the same inputs gave 0 to 291 wrong slots);
        L1 through the same pipeline, 64-row blocks and `num_stages=1` were exact in every run. The interpreter runs
        programs one at a time: no race there."""
        if self.gluon or self.fp8 or self.block_t < self.PIPELINE_RACE_ROWS or self.num_stages <= 1:
            return None
        if self.prefetch and register_prefetch:
            return None
        how = "prefetch=0" if not self.prefetch else "this Triton has no register prefetch (before 3.5)"
        return (f"KernelConfig(block_t={self.block_t}, num_stages={self.num_stages}) with {how} streams the L2 "
                f"kernel through Triton's cp.async pipeline, which races on blocks of {self.PIPELINE_RACE_ROWS}+ rows "
                f"(random slots come out as garbage): use block_t=64, num_stages=1, or prefetch=1 on Triton 3.5+")

    def launch_registers(self, layer: str = "L1") -> dict:
        """The launch's register cap, where the config sets one and the kernels are compiled (not interpreted)."""
        cap = self.l2_maxnreg if layer == "L2" and self.l2_maxnreg else self.maxnreg
        return {"maxnreg": cap} if cap and not target.interpreting() else {}

    def fit(self, hidden: int, inter: int) -> "KernelConfig":
        """The same config with each tile shrunk to a power of two that divides its dimension (K tiles: 64 or
        more, the weight layout's K block; N tiles: 32 or more, the requantization groups)."""
        if hidden % 64 or inter % 64:
            raise ValueError(
                f"the Triton Mega MoE backend needs hidden and intermediate sizes divisible by 64 (its weight "
                f"layout), got hidden={hidden}, intermediate={inter}: use `experts.megamoe.backend: reference`"
            )

        def div(tile, dim, floor):
            tile = max(tile, floor)
            while tile > floor and dim % tile:
                tile //= 2
            return tile

        if self.fp8:
            if self.fp8 > 6:
                raise ValueError(f"KernelConfig(fp8={self.fp8}) names no FP8 kernels: 1 to 6")
            if hidden % 128 or inter % 128 or (self.l1_n % 128 and self.fp8 < 3) or inter % self.l1_n \
                    or hidden % self.l2_n:
                raise ValueError(f"the FP8 kernels need hidden and intermediate % 128 and N tiles of 128 that divide "
                                 f"them, got hidden={hidden}, intermediate={inter}, l1_n={self.l1_n}, "
                                 f"l2_n={self.l2_n}: `pick_config` picks them only where they fit")
            l1_n_ok = self.l1_n == 128 or (self.fp8 in (4, 5) and self.l1_n == 64 and self.num_warps == 4)
            block_rows = self.FP8_ROW_SCALED_BLOCK_ROWS if self.fp8 == 6 else self.FP8_GLUON_BLOCK_ROWS
            if self.fp8 >= 3 and (self.block_t not in block_rows or not l1_n_ok
                                  or self.l2_n not in (64, 128) or self.num_stages < 3 or self.num_warps not in (4, 8)):
                raise ValueError(f"the FP8 Gluon kernels (fp8={self.fp8}) take block_t in {block_rows}, "
                                 f"l1_n=128 (fp8=4 or 5 on 4 warps: or 64), l2_n 64 or 128, num_warps 4 or 8 and "
                                 f"num_stages >= 3, got "
                                 f"block_t={self.block_t}, l1_n={self.l1_n}, l2_n={self.l2_n}, "
                                 f"num_warps={self.num_warps}, num_stages={self.num_stages}")
            if self.fp8 >= 3 and (inter // 128) % 2:
                raise ValueError(f"the FP8 Gluon kernels (fp8={self.fp8}) run L2's 128-deep K blocks in pairs: "
                                 f"intermediate {inter} has an odd number of them; use fp8=1 or a BF16 config")
            return dataclasses.replace(self, l1_k=128, l2_k=128, l1_split=1)
        if self.decode:
            return self._fit_decode(hidden, inter, div)
        l1_k = div(self.l1_k, hidden, 64)
        split = self.l1_split
        while split > 1 and hidden % (l1_k * split):
            split //= 2
        if self.gluon:
            if not self.gluon_fits(hidden, inter):
                raise ValueError(f"the Gluon kernels' tiles ({self.l1_n}, {self.l2_n}) do not divide intermediate "
                                 f"{inter} and hidden {hidden}, or L2's K tiles do not pair (intermediate % 128): "
                                 f"`pick_config` picks them only where they do")
            if self.block_t not in self.GLUON_BLOCK_ROWS:
                raise ValueError(f"the Gluon kernels take blocks of {' or '.join(map(str, self.GLUON_BLOCK_ROWS))} "
                                 f"rows, not block_t={self.block_t}: set KernelConfig(block_t=...) to one of them")
            return self
        return dataclasses.replace(self, l1_n=div(self.l1_n, inter, 32), l1_k=l1_k, l2_n=div(self.l2_n, hidden, 32),
                                   l2_k=div(self.l2_k, inter, 64), l1_split=split)

    def _fit_decode(self, hidden: int, inter: int, div) -> "KernelConfig":
        """`fit` for the decode kernels: a depth of 1, 2 or 4 K tiles that divides both K dimensions in tiles of 64,
        and splits (powers of two) that leave each slice a whole number of such steps."""
        depth = 4 if self.decode >= 4 else 2 if self.decode >= 2 else 1
        while depth > 1 and ((hidden // 64) % depth or (inter // 64) % depth):
            depth //= 2

        def split(s, k):
            while s > 1 and (k // 64) % (depth * s):
                s //= 2
            return max(s, 1)

        if self.decode_ws and (self.stream_k or self.persistent or self.pdl):
            raise ValueError(f"KernelConfig(decode_ws={self.decode_ws}) runs the split-K grid in two plain launches: "
                             f"set stream_k=0, persistent=0 and pdl=0 (got {self.stream_k}, {self.persistent}, "
                             f"{self.pdl})")
        if self.stream_k and self.persistent:
            raise ValueError(f"KernelConfig(stream_k={self.stream_k}, persistent=1) names two schedules of the decode "
                             f"kernels: set stream_k=0 (the persistent kernel) or persistent=0 (stream-K)")
        return dataclasses.replace(self, l1_n=div(self.l1_n, inter, 32), l1_k=64, l2_n=div(self.l2_n, hidden, 32),
                                   l2_k=64, decode=depth, l1_split=split(self.l1_split, hidden),
                                   l2_split=split(self.l2_split, inter), gluon=0, fp8=0,
                                   prefetch=0 if self.stream_k else self.prefetch)  # stream-K: the cp.async pipeline

    def cp_async_l2(self) -> "KernelConfig":
        """This Gluon config with the cp.async L2 (`hopper_prefill`) in place of the warp-specialized one, under L1's
        register cap: where this Triton cannot build the latter (`hopper_prefill_ws.unavailable_reason`)."""
        return dataclasses.replace(self, gluon=1, l2_maxnreg=0)


# Tuned on an H200 with `bench/megamoe_gpu.py --sweep` on the DeepSeek-V4 and the mid-size layer under Triton 3.6
# and 3.7.1 (docs/benchmarks.md has the sweeps), keyed by the average (token, slot) rows per local expert, a function
# of the shapes only. K tiles of 64 everywhere: under Triton 3.7.1 a K-128 program holds ~125 registers and runs V4
# at 16 tokens ~1.5x slower.
CONFIGS = (
    # (up to this many rows per local expert on average, config)
    (16, KernelConfig(block_t=16, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=4, num_stages=4)),
    # 32-row blocks only while one block holds an average expert: at 40 rows per expert 64-row blocks are ~1.3x
    # faster on V4 and ~1.1x on the mid-size layer.
    (32, KernelConfig(block_t=32, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=4, num_stages=5)),
    # 64-row blocks, every batch above 32 rows per expert: ptxas gives L1 175-191 registers, one program of 8 warps
    # per SM; capped at 128 (no spill) two fit (V4 at 4096 tokens 9-14% faster). No batch picks 128-row blocks: through
    # Triton's cp.async pipeline their L2 races (`KernelConfig.pipeline_race`), and with register prefetch they ran
    # slower than these on an H100 (2026-12-06, Triton 3.6; V4 layer, 32 of 256 experts, 8 x 4096 tokens gathered:
    # 4.40 against 4.13 ms; 4096 tokens on 32 experts: 3.54 against 3.27 ms; the mid-size layer at 4096 tokens: 1.71
    # against 1.48 ms).
    (None, KernelConfig(block_t=64, l1_n=128, l1_k=64, l2_n=128, l2_k=64, num_warps=8, num_stages=4, maxnreg=128)),
)


# On Hopper, where the Gluon kernels run (`hopper_prefill`), they take the batches of 35-512 rows per local expert
# from the Triton kernels: blocks of 80 rows up to 68 rows per expert, 96 above (an average expert no longer fits 80
# rows), 1.05-1.2x faster than the best Triton config from 48 to 80 rows on V4. From 36 rows the 80-row blocks also beat
# the Triton pick and the FP8 path (H100, 2026-12-07, Triton 3.6, V4 experts alone, µs: 36 rows 7335.3 against fp8=3's
# 7581.2, 40 rows 7010.7 against 7797.3 and 7877.2, 44 rows 6867.3 against 7816.3 and 7767.9; the 96-row kernel had
# lost at 40 rows by 1.09x on an H200); the bound sits between 32 rows, where the FP8 path wins, and 36. Measured on
# V4 only. 4 warps with 64-column tiles and 4 stages beat 8 warps with 128 and 6
# stages. Registers: L1 holds 214 with the two-tail body of 96-row blocks (two programs per SM), 191 without it
# (80-row blocks); capped at 168, three fit (spills outside the K loops only, which the compile test checks): ptxas
# then serializes the 96-row L1's wgmma and keeps the 80-row L1's async, and both run 3-14% faster than uncapped.
# L2 is the warp-specialized one (`hopper_prefill_ws`): at 4096 tokens with 80-row blocks ~5% faster than the
# cp.async L2 with four programs per SM (64 registers, 104 for the MMA warps), ahead of three (80) and two (96);
# 6 stages are slower. 96-row blocks: 80 registers (three programs; ptxas serializes the wgmma at 136) beat 96 (two).
# The 96-row blocks also take 81-512 rows, where an expert spans several blocks (one rank's share of an EP 8 prefill:
# 48 of 384 V4 experts at 2048 and 4096 tokens, 256 and 512 rows each): 1.27x and 1.21x faster there than Triton's
# 64-row blocks (H100, 2026-12-07, Triton 3.6, the experts alone, µs: 3318.7 against 4225.0, 6383.9 against 7753.9;
# 80-row blocks 3804.5 / 6403.1, with L2 tiles of 128 3760.0 / 6368.6; fp8=3 4351.8 / 7690.7), 1.14-1.15x at 96 and 128
# rows (768 and 1024 tokens: 1770.0 against 2043.1, 2166.8 against 2466.1), and 1.11-1.13x on the mid-size layer at
# 192 and 384 rows (64 experts, 2048 and 4096 tokens: 750.1 against 828.9, 1189.0 against 1348.9). Not measured above
# 512.
GLUON_CONFIGS = (
    (34, None),
    (68, KernelConfig(block_t=80, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=4, num_stages=4, maxnreg=168, gluon=2,
                      l2_maxnreg=64)),
    (512, KernelConfig(block_t=96, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=4, num_stages=4, maxnreg=168, gluon=2,
                       l2_maxnreg=80)),
)


# The FP8-math path (`fp8`): rows (from this many rows per local expert on average, config; None: the BF16 tables
# from there on) that `pick_config` takes before the BF16 tables on Hopper with Gluon and FP8 MMAs. Measured on an
# H100 (2026-12-07, Triton 3.6, the experts alone, `bench/megamoe_gpu.py --sweep`, docs/megamoe.md "The row-scaled
# FP8 path"): the row-scaled Gluon kernels (`fp8=6`) beat the BF16 pick and `fp8=3` from 16 rows per expert on V4
# (1024 tokens: 32-row blocks 5044.0 against fp8=3's 5511.3 and the BF16 pick's 6014.0 µs; 2048: 64-row blocks 5797.3
# against 7095.9 and 7586.9). From 52 rows, 80-row blocks (a 64-row MMA and a 16-row one on the same expanded operand:
# one expansion per expert up to 80 rows), L1 on 4 warps capped at 168 (three programs an SM). With L2 on 4 warps
# (commit 1262e8b) 3072 / 3584 / 4096 tokens (48 / 56 / 64 rows) took 5760.4 / 5708.0 / 5925.6 µs against 64-row
# blocks' 5628.7 / 6028.6 / 7184.8 and the BF16 pick's 6698.7 / 6872.9 / 7293.9 (the bound sits between 48 and 56).
# The row runs L2 on 8 warps of 128 hidden rows at 128 registers (half the programs, each reading its block's
# activations): on an H100 (2026-12-07, commit 1d2bd63) 3584 / 4096 tokens took 5588.8 / 5830.2 µs against 5701.8 /
# 5943.3 with L2 on 4 warps (the BF16 pick 6845.9 / 7310.2). Same call, 4608 / 5120 / 5632 tokens (72 / 80 / 88 rows):
# this row 7016.4 / 9052.7 / 11252.0, fp8=6's 128-row blocks 9617.4 / 9837.7 / 9737.4, the BF16 pick (96-row blocks)
# 8506.2 / 9071.6 / 10330.9: the 128-row blocks from 84 rows (between the 80 and 88 measured); no BF16 row is left
# from 16 rows up.
# On an EP 8 rank's share (48 of V4's 384 experts) 96 rows went to fp8=6 (768 tokens: 1477.7 with 64-row and 1489.2
# with 128-row blocks against 1762.1), 128 and 512 rows too (1024 / 4096 tokens, 128-row blocks: 1830.2 / 5015.6
# against 2149.7 / 6426.2). The bound at 31 (32- against 64-row blocks: 6324.1 against 5797.3 at 32 rows, 5044.0
# against 5362.5 at 16) sits between measured points; above 512 was not measured.
FP8_CONFIGS: tuple[tuple[int, KernelConfig | None], ...] = (
    (16, KernelConfig(32, 128, 128, 64, 128, 4, 4, fp8=6)),
    (31, KernelConfig(64, 128, 128, 64, 128, 4, 4, fp8=6)),
    (52, KernelConfig(80, 128, 128, 128, 128, 4, 4, maxnreg=168, l2_maxnreg=128, fp8=6)),
    (84, KernelConfig(128, 128, 128, 64, 128, 4, 4, fp8=6)),
)


# The split-K decode kernels (`decode`): (up to this many (token, slot) rows in the batch, config), before the tables
# above. Measured on an H100 (2026-12-06, Triton 3.6, V4 layer, docs/megamoe.md "Split-K decode"): the layer at 1 / 2 /
# 4 tokens 1.14x / 1.07x / 1.08x faster than the general kernels in the same process (the experts computation alone at
# 1 token 103.9 against 106.0 µs), at 8 tokens (48 rows) a tie (577.3 against 575.0 µs): up to 24 rows (4 tokens at
# top-6). Of the swept rows at 1 token, 6 cp.async stages with L1 split in 4 and L2 in 2 (what `_decode_splits`
# gives) ran fastest; 4 and 8 stages, other splits, register prefetch of 2 K tiles and 8 warps were 2-34% slower.
# The row runs the prologue (`KernelConfig.prologue`: routing, dequantization and zero fill in one launch): on an H100
# (2026-12-06, main 562fe97) the layer at 1 / 2 / 4 tokens took 105.0 / 177.6 / 319.0 µs against 108.8 / 180.8 / 323.4
# with the three launches; the persistent kernel (111.6 / 182.9 / 324.8), PDL (within 1%) and N tiles of 128 (6-33%
# slower) measured no better, so the row sets none of them (docs/megamoe.md, "Launches at decode"). Nor stream-K
# (`stream_k`): on an H100 (2026-12-06, commit 7579272) its best variant ran the layer 9-16% slower than this row at 1-8
# tokens (116.9 against 107.0 µs at 1 token), and in K slices (commit 1e0c38f) 12-32% slower (docs/megamoe.md,
# "Stream-K decode"). Nor the warp-specialized Gluon kernels (`decode_ws`): on wgmma they ran the layer 2-12% slower
# on an H100 (2026-12-06, commit 7a45eb6: 108.7-119.1 against 106.4 µs at 1 token); on mma.sync (`decode_ws=2`) they
# gave this row's bits and at best its time (H100, 2026-12-07, commit a9f92a4, 8-row blocks at 48 registers: 103.9 /
# 172.4 / 311.8 against 104.2 / 176.7 / 317.5 µs at 1 / 2 / 4 tokens; docs/megamoe.md, "Warp-specialized decode").
DECODE_CONFIGS: tuple[tuple[int, KernelConfig], ...] = (
    (24, KernelConfig(block_t=16, l1_n=64, l1_k=64, l2_n=64, l2_k=64, num_warps=4, num_stages=6, prefetch=0,
                      decode=2)),
)
# The decode kernels split each GEMM's K (`l1_split`, `l2_split`: powers of two up to 16) until its programs reach
# this many per SM, each slice a whole number of steps of `decode` K tiles, at least 2.
_DECODE_PROGRAMS_PER_SM = 8
_DECODE_MAX_SPLIT = 16


def _decode_splits(config: KernelConfig, num_rows: int, num_local_experts: int, hidden: int, inter: int,
                   num_sms: int) -> KernelConfig:
    """The decode config with its K splits for this batch: row blocks (one per expert that gets rows, at most) times
    N tiles, times the split, up to `_DECODE_PROGRAMS_PER_SM` programs per SM."""
    config = config.fit(hidden, inter)
    blocks = max(min(num_rows, num_local_experts), -(-num_rows // config.block_t))

    def split(tiles: int, k: int) -> int:
        s = 1
        while (s < _DECODE_MAX_SPLIT and tiles * s < _DECODE_PROGRAMS_PER_SM * num_sms
               and (k // 64) % (config.decode * 2 * s) == 0 and (k // 64) // (config.decode * 2 * s) >= 2):
            s *= 2
        return s

    return dataclasses.replace(config, l1_split=split(blocks * (inter // config.l1_n), hidden),
                               l2_split=split(blocks * (hidden // config.l2_n), inter)).fit(hidden, inter)


# L1 splits its hidden dimension (`l1_split`) until there are ~8 L1 programs per SM, keeping at least 4 pipeline
# depths of K tiles per slice. One program streams weights at only a few GB/s (it waits on its loads and MMAs), so
# a 1-token batch (6 experts x I / l1_n programs) needs several per SM: V4 at 1 token (288 programs) is fastest in 4
# slices, the mid-size layer (132 programs, 32 K tiles) in 2.
_L1_PROGRAMS_PER_SM = 8
_L1_MIN_SLICE_STAGES = 4
# 16-row blocks take L2 N tiles of 128 (half the programs, each expanding twice the weight rows per activation tile)
# where that still leaves at least this many L2 programs per SM: V4 at 16-256 tokens (41-163 such programs per SM)
# runs up to 5% faster; at 1 token (2.5 per SM) and the mid-size layer at 16 tokens (7.8 per SM) 3-6% slower.
_L2_WIDE_PROGRAMS_PER_SM = 16


def local_rows(num_rows: int, num_local_experts: int, num_experts: int | None = None) -> float:
    """The (token, slot) rows this rank's experts receive out of `num_rows` gathered from every rank, under uniform
    routing: each slot names one of `num_experts` global experts, `num_local_experts` of them here (None: every
    expert is local, one rank). Under EP the gathered rows are ep_size times what the local experts get."""
    total = num_local_experts if num_experts is None else num_experts
    if total < num_local_experts or num_local_experts < 1:
        raise ValueError(f"{num_local_experts} local experts of {total} global ones: the local experts must be a "
                         f"non-empty part of the layer's experts")
    return num_rows * num_local_experts / total


def pick_config(
    num_rows: int, num_local_experts: int, hidden: int, inter: int, num_sms: int = TUNED_SMS, gluon: bool = False,
    warp_specialized: bool = True, fp8: bool = False, num_experts: int | None = None,
) -> KernelConfig:
    """The tuned config for a batch of `num_rows` (token, slot) pairs gathered from every rank, of which this rank's
    `num_local_experts` of the layer's `num_experts` (None: all of them) get their share (`local_rows`; shapes and SM
    count only: no device read); `fp8`: the device has FP8 MMAs (with `gluon`, `FP8_CONFIGS` takes its batches);
    `gluon`: the Hopper Gluon kernels can run (`hopper_prefill.gluon_unavailable_reason`); `warp_specialized`: and this Triton
    builds the warp-specialized L2 (`hopper_prefill_ws.unavailable_reason`), else the cp.async L2 runs under L1's
    register cap."""
    rows = local_rows(num_rows, num_local_experts, num_experts)
    per_expert = rows / num_local_experts
    for decode_bound, decode_config in DECODE_CONFIGS:
        if rows <= decode_bound:
            return _decode_splits(decode_config, max(round(rows), 1), num_local_experts, hidden, inter, num_sms)
    if fp8 and gluon and hidden % 128 == 0 and inter % 256 == 0:  # the Gluon FP8 L2 takes K blocks in pairs
        for fp8_bound, fp8_config in reversed(FP8_CONFIGS):
            if per_expert >= fp8_bound:
                if fp8_config is not None:
                    return fp8_config.fit(hidden, inter)
                break
    if gluon:
        for bound, config in GLUON_CONFIGS:
            if per_expert <= bound:
                if config is not None and config.gluon_fits(hidden, inter):
                    return config if warp_specialized else config.cp_async_l2()
                break
    # The last bound is None: some config always matches.
    config = next(c for b, c in CONFIGS if b is None or per_expert <= b).fit(hidden, inter)
    # L1 programs: row blocks (at least one per expert that gets rows) times N tiles. A prefill batch (blocks of 64
    # rows and more) must not split, even with few programs: the mid-size layer at 56-80 rows per expert (704
    # programs of 64-row blocks) runs 9-13% slower split in 2.
    blocks = max(min(rows, num_local_experts), -(-rows // config.block_t))
    programs = blocks * max(inter // config.l1_n, 1)
    k_tiles = hidden // config.l1_k
    split = 1
    while (config.block_t < 64 and split < 8 and programs * split < _L1_PROGRAMS_PER_SM * num_sms
           and k_tiles // (2 * split) >= _L1_MIN_SLICE_STAGES * config.num_stages):
        split *= 2
    l2_n = config.l2_n
    if config.block_t == 16 and hidden % 128 == 0 and blocks * (hidden // 128) >= _L2_WIDE_PROGRAMS_PER_SM * num_sms:
        l2_n = 128
    return dataclasses.replace(config, l1_split=split, l2_n=l2_n).fit(hidden, inter)
