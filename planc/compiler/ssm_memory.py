"""What a Mamba2 layer allocates without the mamba_ssm kernels, read from transformers' `mamba2_chunk_scan` (5.25).

Granite MoE hybrid and Nemotron-H (and every family that copies the same `mamba2_chunk_scan`, `segment_sum` and
`mamba2_scan_forward`) run a Mamba2 mixer's prefill on transformers' reference scan (state space duality, chunked):
`in_proj` gives `[tokens, 2 * d_inner + 2 * groups * d_state + heads]` in the model dtype and the causal conv its
activated `[tokens, d_inner + 2 * groups * d_state]`; the scan then works in fp32 on chunks of `chunk_size` tokens:

- x (`[tokens, heads, head_dim]`) upcast, weighted by the time step, padded into chunks, and the `D` residual;
- B and C upcast and repeated from their groups to every head, then padded (copies), `[tokens, heads, d_state]`;
- `L = exp(segment_sum(A))`, `G = einsum(C, B)` and `M = G * L`, three `[chunks, chunk, chunk, heads]` per sequence
  (`chunk` x `heads` floats per token each), all three bound to the end of the scan;
- `B_decay` (`[tokens, heads, d_state]`), the chunk states `[chunks + 1, heads, head_dim, d_state]` and the zeros
  before them, the diagonal output `Y_diag`;
- and at its peak, the last einsum `C_times_states = einsum(C, states)`: torch's bmm takes C permuted to
  `(chunk, heads)`-major order as a copy, and gives `[tokens, heads, head_dim]` out.

So the peak holds three chunk-square tensors, four `[tokens, heads, d_state]` and five `[tokens, heads, head_dim]`
fp32 tensors and the chunk states. Checked against the tensors live at the scan's peak of Granite MoE hybrid's and
Nemotron-H's mixers (bf16, 1 x 1024 tokens: 1154 and 707 MiB measured, the rule's 1154 and 704) and the grid's
points (docs/memory.md). Pure arithmetic, no torch.
"""

from __future__ import annotations

FP32 = 4


def mamba2_prefill_bytes(*, heads: int, head_dim: int, d_state: int, groups: int, chunk: int, batch: int, seq: int,
                         a: int) -> int:
    """Bytes a Mamba2 mixer holds at the peak of its prefill on transformers' chunked scan: the projections and the
    conv's output in the model dtype (`a` bytes) and the scan's fp32 work."""
    inner = heads * head_dim
    conv = inner + 2 * groups * d_state
    chunks = -(-seq // chunk)
    padded = batch * chunks * chunk  # the scan pads every sequence to whole chunks
    projections = batch * seq * a * (inner + conv + heads + conv)  # in_proj's output, the conv's activated output
    square = 3 * padded * chunk * heads  # L, G, M
    per_state = 4 * padded * heads * d_state  # B, C, B_decay, C's permuted copy for the last bmm
    per_value = 5 * padded * inner  # x, D residual, Y_diag, the states broadcast to every token and the bmm output
    states = (chunks + 2) * batch * heads * head_dim * d_state  # the chunk states (with the initial) and its zeros
    # the diagonal block's einsum, earlier: L, G, M and M's permuted copy, B and C, x, D residual, x's copy and Y_diag
    diagonal = 4 * padded * chunk * heads + 2 * padded * heads * d_state + 4 * padded * inner
    return projections + FP32 * max(square + per_state + per_value + states, diagonal)


def mamba2_saved_bytes(*, heads: int, head_dim: int, d_state: int, groups: int, chunk: int, batch: int, seq: int,
                       a: int) -> int:
    """Bytes a Mamba2 mixer keeps for backward in training (no cache: the same chunked scan, no final state).

    Autograd keeps L, G and M; five `[tokens, heads, d_state]` (a padded B, the permuted copies of C and B that G's
    bmm takes, B_decay's for the states' einsum, C's for the last one); the chunk states; eleven fp32
    `[tokens, d_inner]` (x padded, the permuted copies the einsums take and the last bmm's output; x upcast, the
    scan's output and the gated norm's fp32 gate, its SiLU, their product and the normalised product); and in the
    model dtype in_proj's output, the conv's, and out_proj's input. Granite MoE hybrid's and Nemotron-H's mixers at
    1 x 1024 tokens kept 1485 and 975 MiB besides their output; the rule says 1482 and 972."""
    inner = heads * head_dim
    conv = inner + 2 * groups * d_state
    chunks = -(-seq // chunk)
    padded = batch * chunks * chunk
    # x's padded copy and the einsums' copies and output are padded to whole chunks; x upcast, the scan's output and
    # the gated norm's four are not
    fp32 = 3 * padded * chunk * heads + 5 * padded * heads * d_state + 5 * padded * inner + 6 * batch * seq * inner
    fp32 += (chunks + 1) * batch * heads * head_dim * d_state
    return FP32 * fp32 + batch * seq * a * (inner + conv + heads + conv + inner)


__all__ = ["mamba2_prefill_bytes", "mamba2_saved_bytes"]
