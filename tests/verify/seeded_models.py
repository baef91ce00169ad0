"""Custom models for the seeded-bug corpus: transformers' module names, math of their own (`planc verify --build`).

Each is a tiny random transformers MoE model (planc.models.build) with one part replaced, the way a team's own
modeling code differs from the family's; the plans in tests/verify/plans shard each wrongly and rightly.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.mixtral.modeling_mixtral import MixtralAttention, apply_rotary_pos_emb, eager_attention_forward

from planc.models.build import build_tiny_model


class FusedMLP(nn.Module):
    """A dense MLP with gate and up fused in one projection (`gate_up_proj`, gate rows then up rows, as Phi-3)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class NormQAttention(MixtralAttention):
    """Normalises q over the whole projection (all heads) before splitting the heads: a statistic over the dim that
    a `colwise` q_proj shards."""

    def _q(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(hidden_states)
        return q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        return _attention(self, self._q(hidden_states), hidden_states, position_embeddings, attention_mask, cache,
                          **kwargs)


class Gain(nn.Module):
    """A learnable scalar gain."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0]) + 0.1 * torch.randn(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class GainQAttention(MixtralAttention):
    """A learnable scalar gain on q between q_proj and the heads (`q_scale`): replicated, its gradient is the sum
    over every head, so with q_proj `colwise` each rank holds only its heads' part."""

    def _q(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.q_scale(self.q_proj(hidden_states))

    forward = NormQAttention.forward


def _attention(self, q, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = q.view(hidden_shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    out, weights = eager_attention_forward(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                           **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _with_attention(cls) -> nn.Module:
    model = build_tiny_model("mixtral", seed=0)
    for layer in model.model.layers:
        layer.self_attn.__class__ = cls
        if cls is GainQAttention:
            layer.self_attn.q_scale = Gain()
    return model


def norm_q_model() -> nn.Module:
    """Mixtral whose attention normalises q over all heads."""
    return _with_attention(NormQAttention)


def gain_q_model() -> nn.Module:
    """Mixtral whose attention scales q by a learnable scalar."""
    return _with_attention(GainQAttention)


def fused_mlp_model() -> nn.Module:
    """Qwen3-MoE whose first (dense) layer's MLP fuses gate and up in one projection."""
    model = build_tiny_model("qwen3_moe", seed=0, mlp_only_layers=[0])
    config = model.config
    model.model.layers[0].mlp = FusedMLP(config.hidden_size, config.intermediate_size)
    return model


def mixtral_model() -> nn.Module:
    """Plain Mixtral, built as --build targets are (the control)."""
    return build_tiny_model("mixtral", seed=0)


def not_a_module() -> object:
    """A build target that returns no model."""
    return {"model": "mixtral"}


def raises() -> nn.Module:
    """A build target that fails."""
    raise RuntimeError("the checkpoint bucket is not reachable")
