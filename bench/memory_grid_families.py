"""The families section of the memory grid: MoE families of the installed transformers without a shipped plan.

Each family runs the plan `planc init --from-transformers TYPE` writes for it (at tp_size/ep_size `SIZES[family]`)
on transformers' default config of the family at full width, cut to the fewest layers that hold one of each kind
(`planc.models.tiny`'s rule, as `planc verify --memory --no-shrink` keeps them: usually two), with one dense and one
MoE layer where the family starts with dense layers. Where a training point at full width would not fit the
shared machine (~6 GiB, ~90 s a point), `SHRINK[family]` says what is smaller (fewer routed experts).
Two points a family: a prefill (`serve`) and a training step (`replicate`), rank 0 under the fake process group,
measured and predicted by `bench/memory_grid.py --families` (which this module feeds).

The plan is written once, when a point is first measured, and stored with the measurement
(`bench/memory_grid_families.json`): re-predicting the cached points (CI) needs no `planc init`.
"""

from __future__ import annotations

from typing import Optional

# Most distinct first: what each family adds to the grid's eleven shipped plans.
ORDER = (
    "olmoe",  # plain top-k softmax router, q/k norm over the whole projected width
    "qwen2_moe",  # shared expert with a sigmoid gate
    "jamba",  # hybrid: mamba layers, attention every 8th, MoE every 2nd
    "granitemoehybrid",  # hybrid mamba2, shared MLP
    "kimi_linear",  # linear attention (KDA) with MLA full-attention layers
    "qwen3_5_moe_text",  # gated delta-rule linear attention, gated full attention
    "mistral4",  # MLA (DeepSeek-V3 attention) without dense layers
    "glm4_moe_lite",  # MLA with GLM's router
    "phimoe",  # sparsemixer router
    "minimax",  # lightning (linear) attention
    "deepseek_v32",  # sparse attention indexer
    "cohere2_moe",  # sliding window layers
    "ernie4_5_moe",  # fp32 router with a bias
    "granitemoeshared",  # shared MLP
    "exaone_moe",  # sliding/full, dense-first
    "sarvam_moe",
    "flex_olmo",
    "granitemoe",
    "aria_text",
    "afmoe",
    "param2moe",
    "zaya",
    "solar_open",
    "mellum",
    "laguna",
    "lara_mini",
    "openai_privacy_filter",
)

# tp_size = ep_size of the plan `planc init` writes (a family absent here runs at 2): larger where rank 0 of a
# full-width training point would not fit the shared machine at 2 (the fake group makes any world size cheap).
SIZES: dict[str, int] = {
    "olmoe": 4, "qwen2_moe": 4, "jamba": 8, "granitemoehybrid": 8, "kimi_linear": 8, "qwen3_5_moe_text": 8,
    "mistral4": 8, "glm4_moe_lite": 4, "phimoe": 8, "minimax": 8, "deepseek_v32": 8, "cohere2_moe": 8,
    "ernie4_5_moe": 4, "granitemoeshared": 8, "exaone_moe": 8, "sarvam_moe": 8, "flex_olmo": 8, "granitemoe": 8,
    "aria_text": 4, "afmoe": 4, "param2moe": 4, "zaya": 8, "solar_open": 8, "mellum": 4, "laguna": 4,
}

# What is smaller than the family's default config, where full width at SIZES would still not fit (stated in
# docs/memory.md's families table).
SHRINK: dict[str, dict] = {
    "mistral4": {"n_routed_experts": 64}, "deepseek_v32": {"n_routed_experts": 32}, "jamba": {"num_experts": 8},
    "kimi_linear": {"num_local_experts": 128}, "solar_open": {"n_routed_experts": 64}, "sarvam_moe": {"num_experts": 64},
}

# Layer overrides where the fewest layers of each kind hold no attention layer (transformers' hybrid cache needs one):
# one mamba and one attention layer, both MoE (Jamba); one mamba2 and one attention layer (Granite MoE hybrid)
LAYERS: dict[str, dict] = {
    "jamba": {"num_hidden_layers": 2, "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 0,
              "expert_layer_period": 1},
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "attention"]},
}

POINTS = {"serve": (1, 1024), "replicate": (1, 1024)}
# Kimi Delta Attention keeps several fp32 [tokens, heads, 64, key_dim] chunk tensors per layer for backward: 1024
# tokens would not fit the shared machine. Jamba's slow Mamba scan is a Python loop over the tokens: 1024 of them
# under MemTracker take over 15 minutes to train
POINTS_OF: dict[str, dict] = {"kimi_linear": {"replicate": (1, 256)}, "jamba": {"replicate": (1, 128)}}
_LAYER_COUNTS = ("num_hidden_layers", "num_layers")
_DENSE_FIRST = ("first_k_dense_replace", "num_dense_layers", "first_k_dense")


def layer_overrides(model_type: str) -> dict:
    """Config overrides for the fewest layers of each kind (per-layer lists cut to them), one dense layer first
    where the family starts dense, `mlp_only_layers` renumbered."""
    from planc.models.build import overridden_config
    from planc.models.tiny import _kept_layers

    d = overridden_config(model_type, SHRINK.get(model_type, {})).to_dict()
    key = next(k for k in _LAYER_COUNTS if isinstance(d.get(k), int))
    n = d[key]
    keep = _kept_layers(d, n)
    out: dict = {key: len(keep)}
    for k, v in d.items():
        if isinstance(v, list) and len(v) == n and n > 1:
            out[k] = [v[i] for i in keep]
    for k in _DENSE_FIRST:
        if isinstance(d.get(k), int) and d[k] > 0:
            out[k] = 1
    if isinstance(d.get("mlp_only_layers"), list) and d["mlp_only_layers"]:
        out["mlp_only_layers"] = [j for j, i in enumerate(keep) if i in d["mlp_only_layers"]]
    return {**out, **LAYERS.get(model_type, {})}


def family_overrides(model_type: str) -> dict:
    return {**SHRINK.get(model_type, {}), **layer_overrides(model_type)}


def init_plan_data(model_type: str, overrides: dict, size: Optional[int] = None) -> dict:
    """The plan `planc init` writes for the family on the point's config, at `size` (tp = ep)."""
    import yaml

    from planc.models.synthesis import init_plan

    text = init_plan(model_type, None, overrides, sizes=(size or SIZES.get(model_type, 2),))
    data = yaml.safe_load(text)
    data["parallel"].setdefault("dp_size", 1)
    return data


def points(only=None, modes=("serve", "replicate")) -> list[dict]:
    """The grid points of the families section (plans written by `planc init`, so this costs seconds a family)."""
    out = []
    for model_type in ORDER:
        if only and model_type not in only:
            continue
        overrides = family_overrides(model_type)
        base = init_plan_data(model_type, overrides)
        for mode in modes:
            batch, seq = POINTS_OF.get(model_type, {}).get(mode, POINTS[mode])
            plan = dict(base)
            if mode != "serve":
                plan["training"] = {"data_parallel": "replicate"}
            out.append({"family": model_type, "mode": mode, "batch": batch, "seq": seq, "overrides": overrides,
                        "dp": 1, "plan": plan})
    return out
