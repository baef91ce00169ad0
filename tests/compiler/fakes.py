"""Duck-typed stand-ins for nn.Module: the compiler must work on them without torch.

They implement exactly what the compiler reads (`named_modules`, `named_parameters(recurse=False)`,
`p.shape`, `p.numel()`, `p.element_size()`, `p.dtype`, `config`), so a test can shape a model that
no transformers family has (experts without a gate, top-k 40, hidden 96) in microseconds.
"""

from __future__ import annotations

import math
from types import SimpleNamespace


class FakeParam:
    def __init__(self, *shape, dtype="bfloat16", size=2):
        self.shape = tuple(shape)
        self.dtype = dtype
        self._size = size

    def numel(self):
        return math.prod(self.shape)

    def element_size(self):
        return self._size


class FakeModule:
    def __init__(self, **children):
        self._params = {}
        self._children = {}
        for name, value in children.items():
            (self._params if isinstance(value, FakeParam) else self._children)[name] = value

    def named_parameters(self, recurse=True):
        assert recurse is False, "the compiler reads each module's own parameters"
        return iter(self._params.items())

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, child in self._children.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)


class FakeExperts(FakeModule):
    """transformers' experts contract: forward(hidden_states, top_k_index, top_k_weights)."""

    def __init__(self, num_experts, hidden, inter, *, has_gate=True, dtype="bfloat16", size=2):
        if has_gate:
            super().__init__(
                gate_up_proj=FakeParam(num_experts, 2 * inter, hidden, dtype=dtype, size=size),
                down_proj=FakeParam(num_experts, hidden, inter // (2 if dtype == "int8" else 1), dtype=dtype, size=size),
            )
        else:
            super().__init__(
                up_proj=FakeParam(num_experts, inter, hidden, dtype=dtype, size=size),
                down_proj=FakeParam(num_experts, hidden, inter, dtype=dtype, size=size),
            )
        self.num_experts = num_experts
        self.has_gate = has_gate

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise AssertionError("the compiler never runs a forward")


def fake_moe(
    *, layers=2, num_experts=8, hidden=256, inter=256, top_k=2, has_gate=True, dtype="bfloat16", model_type="fake_moe"
):
    """A `*ForCausalLM`-shaped MoE: model.layers.N.{self_attn.{q,o}_proj, mlp.{gate,experts}}, lm_head."""

    def layer():
        return FakeModule(
            self_attn=FakeModule(
                q_proj=FakeModule(weight=FakeParam(hidden, hidden)), o_proj=FakeModule(weight=FakeParam(hidden, hidden))
            ),
            mlp=FakeModule(
                gate=FakeModule(weight=FakeParam(num_experts, hidden)),
                experts=FakeExperts(num_experts, hidden, inter, has_gate=has_gate, dtype=dtype),
            ),
            input_layernorm=FakeModule(weight=FakeParam(hidden)),
        )

    root = FakeModule(
        model=FakeModule(
            embed_tokens=FakeModule(weight=FakeParam(512, hidden)),
            layers=FakeModule(**{str(i): layer() for i in range(layers)}),
        ),
        lm_head=FakeModule(weight=FakeParam(512, hidden)),
    )
    root.config = SimpleNamespace(
        model_type=model_type, hidden_size=hidden, num_attention_heads=hidden // 32, num_experts_per_tok=top_k
    )
    return root


def fake_plan(ep_size=2, tp_size=2, model_type="fake_moe", **experts):
    """A mapping plan for `fake_moe` (or the tiny `model_type` model) that compiles: attention TP, experts EP.

    The fake's attention has q_proj and o_proj only; a real model's q/k/v all feed o_proj (the layout pass)."""
    qkv = "q_proj" if model_type == "fake_moe" else "{q,k,v}_proj"
    plan = {
        "version": 1,
        "model": {"type": model_type},
        "parallel": {"tp_size": tp_size, "ep_size": ep_size},
        "tp_plan": {f"model.layers.*.self_attn.{qkv}": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"},
        "ep_plan": {
            "model.layers.*.mlp.experts.{gate_up_proj,down_proj}": "grouped_gemm",
            "model.layers.*.mlp.experts": "ep_dispatch_experts",
        },
    }
    if experts:
        plan["experts"] = experts
    return plan
