"""What hyper-connection streams around a common decoder layer keep for backward (transformers 5.25).

The residual is `N` streams `[tokens, N, hidden]` in the model dtype. Before each sublayer (attention or linear
attention, then the MLP) a mixer reads the streams and hands the sublayer one hidden; the sublayer's output is
spread back over the streams. The sublayers themselves are the decoder layer `planc.compiler.peak_memory` prices;
the mixers and the spreading are priced here, per token, from each family's code:

- `gated_residual` (Qwen4-Exp's `Qwen4ExpTextGatedResidual`, `hc_count` streams): the mixer replaces the layer's
  norms. Its `hc_norm`, a grouped Gemma-style RMSNorm (`_norm(x.float()) * (1 + weight.float())`) over the whole
  streams, keeps the fp32 upcast the square reads and the fp32 normalized states the weight's product reads, two fp32
  `[N * hidden]`, and its model-dtype output, which the low-rank projection and the mix read; the mixing weights
  keep `silu(down(normed) / N)`'s quotient and activation (`hc_lowrank` wide each) and `sigmoid(up(...))`'s
  `[N * hidden]` output. The spreading, `hidden.unsqueeze(-2) * injection_weights`, keeps the sublayer's output.
  The model's final norm is one more mixer.
- `independent` (HY-V4's `HYV4HyperConnection`, `hc_mult` streams and `hc_magnitude`, no Sinkhorn): the layer keeps
  its norms after the mixer. The mixer flattens the streams to fp32 (`F.linear(flat, fn)` and the unweighted norm's
  square keep it) and weights them, `pre.unsqueeze(-1) * streams`, which keeps the streams; its `[2N]` mixes, their
  rsqrt and sigmoids are fp32 and small. The spreading, `post * hidden.float() + residual.float()`, keeps the
  sublayer's output in fp32. `hc_head` before the final norm is one more mixer.

DeepSeek-V4's hyper-connections (Sinkhorn mixing, its own attention and compressors: the whole layer) are
planc.compiler.deepseek_v4_memory's. Pure arithmetic, no torch.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

FP32 = 4
GATED_RESIDUAL, INDEPENDENT = "gated_residual", "independent"


class StreamMixer(NamedTuple):
    """The config facts of the hyper-connections around a common decoder layer."""

    kind: str  # gated_residual | independent
    streams: int  # N
    lowrank: int = 0  # gated_residual: the mixing weights' low rank (hc_lowrank)

    @property
    def replaces_norms(self) -> bool:
        """The mixer is the sublayer's norm (the layer has no RMSNorm of the hidden of its own)."""
        return self.kind == GATED_RESIDUAL


def stream_mixer(config: Mapping[str, Any]) -> Optional[StreamMixer]:
    """The hyper-connections of `config` wrapped around a common layer: Qwen4-Exp's `hc_count` gated residual, HY-V4's
    `hc_mult` streams with `hc_magnitude` (no Sinkhorn); None otherwise (DeepSeek-V4's are not of this kind)."""
    count = int(config.get("hc_count") or 1)
    if count > 1:
        return StreamMixer(GATED_RESIDUAL, count, int(config.get("hc_lowrank") or 0))
    mult = int(config.get("hc_mult") or 1)
    if mult > 1 and config.get("hc_magnitude") is not None and not config.get("hc_sinkhorn_iters"):
        return StreamMixer(INDEPENDENT, mult)
    return None


def mixer_saved(m: StreamMixer, hidden: int, a: int) -> int:
    """Bytes per token one mixer keeps (`a`: the model dtype's itemsize)."""
    width = m.streams * hidden
    if m.kind == GATED_RESIDUAL:
        return 2 * FP32 * width + 2 * a * width + 2 * a * m.lowrank
    return (FP32 + a) * width + FP32 * (4 * m.streams + 1)


def output_saved(m: StreamMixer, hidden: int, a: int) -> int:
    """Bytes per token the spreading of one sublayer's output over the streams keeps."""
    return a * (hidden + m.streams) if m.kind == GATED_RESIDUAL else FP32 * (hidden + m.streams)


__all__ = ["GATED_RESIDUAL", "INDEPENDENT", "StreamMixer", "mixer_saved", "output_saved", "stream_mixer"]
