"""Triton Mega MoE experts for Hopper (and any GPU Triton runs on): FP4 weights stay packed in memory.

Why: the real kernel needs SM100 and the reference caches a dequantized BF16 copy (4x the FP4 bytes).
Here the e2m1 codes and the UE8M0 exponent bytes stay 4 bits and 1 byte per weight group in GPU memory and are
expanded to BF16 in registers, inside the GEMM; nothing else of the weights exists on the GPU. Before the first
forward those bytes are reordered once (`layout.shuffle_fp4`: same dtypes, shapes and sizes) into the register
fragments of the Hopper MMA, so each thread loads exactly its operand words (16 contiguous bytes) and expands 8
weights in 13 instructions (`jit`), with no shuffle through shared memory.

Numerics are the reference backend's (docs/megamoe.md, steps 3-6): an FP8 value times its UE8M0 scale and
an e2m1 value times its UE8M0 scale are exact in BF16 and their product is exact in FP32, so a BF16 MMA
with FP32 accumulation over the exactly converted operands computes the reference's products; only the
order of the FP32 sums differs. L1 rounds to BF16 once; the epilogue clamps in BF16, computes
``silu(gate) * up * topk_weight`` in FP32 and requantizes per 32 intermediate channels with the kernel's
cast (no 1e-4 floor, RNE to e4m3 with saturation, emulated bit for bit); L2 rounds to BF16; the combine sums
the slots in FP32 in slot order (`forward.combine`, one kernel, the same arithmetic as `reference.combine`).

How it is organized (the ideas of vLLM's fused_moe, triton_kernels' matmul_ogs and its Hopper MX layouts, Marlin):
- staging (`forward.stage`: the FP8 cast of the tokens, the routing copy, the exchange padding) and the L1 input
  (`forward.dequantize_x`) are one kernel each, the same bytes as the reference's torch ops (~20 launches at decode).
- (token, slot) pairs are sorted by local expert on the device and cut into blocks of `block_t` rows of
  one expert (`routing.route`: one Triton program up to `FUSED_ROUTE_MAX_SLOTS` pairs, torch ops above); the grid
  covers an upper bound of blocks, so nothing reads a device value on the host (CUDA-graph capturable) and programs past
  the last block return at once.
- swap-AB: the weight rows are the MMA's M dimension and the few tokens its N dimension, so decode
  batches of 1-16 rows per expert do not waste a 64-row MMA tile. Each weight tile is expanded in registers to
  BF16 (`jit`: inline PTX on the GPU, Triton ops under the interpreter) and meets the activations in one MMA.
- one program per (block, N tile) reads its weight slice once; at decode every SM streams weights. A 1-2 token
  batch has too few such programs, so L1 then splits the hidden dimension (`KernelConfig.l1_split`,
  `jit.l1_reduce_kernel`).
- each program prefetches the next K tile's bytes into registers (`target.REGISTER_PREFETCH`, Triton >= 3.5)
  instead of staging them in shared memory through Triton's cp.async pipeline: 15-30% fewer instructions per weight.
- L1 fuses SwiGLU, the clamp, the routing weight and the FP8 requantization into its epilogue; L2 writes
  each slot's output straight to its slot.
On Hopper, the batches `config.GLUON_CONFIGS` names (by rows per expert) run the Gluon kernels of `hopper_prefill`
(async wgmma) and `hopper_prefill_ws` (L2 with a TMA producer warp) instead.
Both GEMMs are issue-bound at decode (Nsight Compute: instructions issued in ~80-85% of cycles with 3-4 other warps
eligible), so what counts is instructions per weight at a given register and shared-memory budget per program: the
expansion is 13 per 8 weights; tiles with fewer instructions overall but more registers or shared-memory traffic ran
slower, keeping several wgmma in flight changed nothing, and narrower MMAs over row sub-blocks (to skip a block's
padding at prefill) cost more than they skipped. docs/benchmarks.md has the measured layer times.

Modules, in import order: `target` (is Triton here, and which: availability, interpreter, version features, SM
count), `layout` (the FP4 weight layout the kernels read), `config` (tile configs and the tuned table), `jit` (the
`@triton.jit` code), `routing` (tokens sorted into per-expert row blocks), `hopper_prefill` / `hopper_prefill_ws`
(the Gluon kernels and their launchers), `hopper_fp8` (the FP8 path's Gluon kernels), `fp8` (the FP8 path),
`forward` (the launchers: the local experts computation).
"""
