"""Build transformers MoE models from configs: tiny random ones for tests and the demo, full-size on meta.

Tests, `planc demo` and `planc explain` need real transformers models without the hub. The tiny
configs keep every dimension the shipped plans shard divisible by 4 (heads, KV heads, experts), so
the same model runs on 1, 2 and 4 ranks; `build_meta_model` builds the family's default (full-size)
config on the meta device, which costs no memory, for the compiler to walk.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from planc.errors import PlancError

# Small enough for CPU tests (forward < 50 ms), big enough that every sharded dim splits over 4 ranks.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128,
    ),
    "qwen3_moe": dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128,
    ),
    "gpt_oss": dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
    ),
    "deepseek_v3": dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128,
    ),
    "deepseek_v4": dict(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
        sliding_window=8, qk_rope_head_dim=8, hc_mult=2, hc_sinkhorn_iters=2,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"], max_position_embeddings=128,
    ),
}

MODEL_TYPES = tuple(TINY_CONFIGS)


class ModelBuildError(PlancError, ValueError):
    """transformers could not build a config or a model: one line that names the model type and the cause.

    `planc init`, `planc explain` and `planc demo` print it as is (exit 2) instead of transformers'
    traceback; every way planc builds a model goes through this module, so none of them can leak one.
    """


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def known_model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def config_class(model_type: str):
    """transformers' config class for `model_type`; an unknown type names the closest few known ones."""
    import difflib

    from transformers import AutoConfig

    try:
        return type(AutoConfig.for_model(model_type))
    except Exception:  # noqa: BLE001 - ValueError with every model type listed (~7 KB): replaced below
        known = known_model_types()
        close = difflib.get_close_matches(str(model_type), known, n=3, cutoff=0.6)
        moe = [t for t in MODEL_TYPES if t not in close]
        hint = (f"did you mean {', '.join(f'`{c}`' for c in close)}?" if close
                else "use a transformers `config.model_type`, e.g. " + ", ".join(f"`{t}`" for t in moe))
        raise ModelBuildError(f"transformers knows no model type `{model_type}`; {hint}") from None


def build_config(model_type: str, overrides: Optional[dict] = None):
    """The config of `model_type` with `overrides` (config keyword arguments); ModelBuildError on any failure."""
    cls = config_class(model_type)
    try:
        return cls(**(overrides or {}))
    except Exception as e:  # noqa: BLE001 - e.g. transformers' StrictDataclassFieldValidationError for a bad value
        raise ModelBuildError(f"cannot build a `{model_type}` config ({cls.__name__}): {_one_line(e)}") from e


def causal_lm_class(config):
    """The `*ForCausalLM` class transformers builds for a config (what a plan's `model.` paths refer to)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        raise ModelBuildError(
            f"`{config.model_type}` has no *ForCausalLM class in transformers: planc plans shard causal LMs"
        ) from None


def build_model(config, *, meta: bool = False, **kwargs):
    """`AutoModelForCausalLM.from_config(config, **kwargs)` (on the meta device: no memory); any exception
    from transformers becomes one ModelBuildError line naming the model type and what failed."""
    import torch
    from transformers import AutoModelForCausalLM

    cls = causal_lm_class(config)
    try:
        if meta:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, **kwargs)
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers raises anything from a config it cannot build
        raise ModelBuildError(
            f"transformers cannot build a `{config.model_type}` model ({cls.__name__}) from this config: {_one_line(e)}"
        ) from e


# Shrunk values for any MoE family, by config attribute name (only the attributes a family's config has
# are set). Heads are a multiple of 4 and experts of 8, so every size planc demo and the tests use
# (1, 2, 4 ranks) divides them.
_TINY_HEADS = 4
_TINY_EXPERTS = 8
_TINY_DERIVED: dict[str, Any] = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, expert_intermediate_size=32, ffn_hidden_size=64,
    num_attention_heads=_TINY_HEADS, num_key_value_heads=_TINY_HEADS, head_dim=16,
    num_local_experts=_TINY_EXPERTS, num_experts=_TINY_EXPERTS, n_routed_experts=_TINY_EXPERTS,
    moe_num_experts=_TINY_EXPERTS, num_experts_per_tok=2, moe_topk=2, n_group=1, topk_group=1,
    n_shared_experts=1, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=128, max_position_embeddings=128,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
)


def derive_tiny_config(model_type: str, **overrides):
    """A tiny config for any family transformers can build, derived from the family's own config class:
    its defaults with layers, widths, vocabulary, heads and experts shrunk (`_TINY_DERIVED`), per-layer
    lists cut to the new depth, and token ids that would fall outside the small vocabulary unset.

    Families with a hand-tuned entry in TINY_CONFIGS use that instead (`tiny_config`). Raises
    ModelBuildError when the derived config does not build.
    """
    defaults = build_config(model_type).to_dict()
    kwargs = {k: v for k, v in _TINY_DERIVED.items() if k in defaults}
    layers = kwargs.get("num_hidden_layers", defaults.get("num_hidden_layers"))
    for key, value in defaults.items():
        if isinstance(value, list) and layers and len(value) > layers and key.endswith("layer_types"):
            kwargs[key] = value[:layers]
        elif key.endswith("_token_id") and isinstance(value, int) and value >= kwargs.get("vocab_size", value + 1):
            kwargs[key] = None
    if defaults.get("first_k_dense_replace"):
        kwargs["first_k_dense_replace"] = 1  # one dense layer, one MoE layer
    if defaults.get("sliding_window"):
        kwargs["sliding_window"] = 8
    kwargs.update(overrides)
    kwargs.setdefault("tie_word_embeddings", False)
    config = build_config(model_type, kwargs)
    config._attn_implementation = "eager"
    return config


def tiny_config(model_type: str, **overrides):
    """The tiny config of `model_type` (fp32, eager attention), with `overrides` applied: the hand-tuned
    one of TINY_CONFIGS, else one derived from the family's own config class (`derive_tiny_config`)."""
    if model_type not in TINY_CONFIGS:
        return derive_tiny_config(model_type, **overrides)
    kwargs = {**TINY_CONFIGS[model_type], **overrides}
    kwargs.setdefault("tie_word_embeddings", False)
    config = build_config(model_type, kwargs)
    config._attn_implementation = "eager"
    return config


def build_tiny_model(model_type: str, *, seed: int = 0, experts_implementation: Optional[str] = None, **overrides):
    """A tiny random `*ForCausalLM` of `model_type`, fp32, eval mode, identical for the same seed on every rank."""
    import torch

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    kwargs = {"experts_implementation": experts_implementation} if experts_implementation else {}
    model = build_model(config, dtype=torch.float32, **kwargs)
    _randomize_zero_inits(model, seed)
    return model.eval()


def _randomize_zero_inits(model, seed: int) -> None:
    """Give zero/one-initialised parameters (router biases, norms, sinks) random values too.

    A parameter left at zero or one hides sharding mistakes (a wrongly sliced zero bias is still zero).
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            flat = p.detach().flatten()
            if flat.numel() and bool((flat == flat[0]).all()):
                p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=gen, dtype=b.dtype))


def clone_model(model):
    """An independent deep copy (the unsharded reference in tests and the demo)."""
    return copy.deepcopy(model)


def build_meta_model(model_type: str, config_overrides: Optional[dict] = None):
    """The full-size `*ForCausalLM` of `model_type` from transformers' default config, on the meta device.

    No memory is allocated, so `planc explain` can resolve a plan against a 600B-parameter model.
    """
    import torch

    config = build_config(model_type, _nest(config_overrides or {}))
    cls = model_class_for(config)
    try:
        with torch.device("meta"):
            return cls._from_config(config)
    except Exception as e:  # noqa: BLE001 - transformers raises anything from a config it cannot build
        raise ModelBuildError(
            f"transformers cannot build a `{config.model_type}` model ({cls.__name__}) from this config: {_one_line(e)}"
        ) from e


def _nest(flat: dict) -> dict:
    """`{"text_config.num_hidden_layers": 4}` -> `{"text_config": {"num_hidden_layers": 4}}` (sub-config overrides)."""
    out: dict = {}
    for key, value in flat.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def model_class_for(config):
    """The class users load for `config`: the family's top model (planc.runtime.families), else the *ForCausalLM."""
    from planc.runtime.families import _direct_family

    fam = _direct_family(config.model_type)
    if fam is not None and fam.head is not None:
        return fam.model_class(config)
    return causal_lm_class(config)


# ---- tiny configs derived from any family's config class ----------------------------------------------------
#
# The sweep over every MoE family of the installed transformers cannot keep a hand-written config per
# family, so a tiny config is derived from the class's own defaults: every size the plans shard gets a
# small value that splits over 2 ranks (heads, KV heads, experts, intermediate sizes), the layer count
# shrinks to the fewest layers that still hold one of each kind of layer (attention/linear/mamba,
# dense/MoE), and every per-layer list is cut to those layers. Structural switches stay as the family
# ships them.

_TINY_SIZES: dict[str, int] = {
    "hidden_size": 64, "vocab_size": 128, "head_dim": 16, "num_attention_heads": 4,
    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "qk_head_dim": 24,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "o_lora_rank": 16, "o_groups": 2,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_num_heads": 4, "linear_head_dim": 16,
    "swa_num_attention_heads": 4, "swa_head_dim": 16, "num_sliding_attention_heads": 4,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_d_state": 16,
    "ssm_state_size": 16, "mamba_dt_rank": 8, "rotary_dim": 8, "router_hidden_size": 32,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128, "ple_embed_dim": 16,
    "unpadded_vocab_size": 128, "query_pre_attn_scalar": 16, "loop_gate_rank": 8, "gated_norm_rank": 8,
    "hc_lowrank": 8, "adapter_in_dim": 64, "adapter_out_dim": 64, "d_rel": 8,
}
_TINY_NUM_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TINY_TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k")
_TINY_SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_TINY_INTERMEDIATE_MARKERS = ("intermediate_size", "ffn_hidden_size", "moe_hidden_size", "intermediate_dim")
_LAYER_COUNTS = ("num_hidden_layers", "num_layers")
_MAX_LAYERS = 4


def _per_layer_lists(d: dict, n: int) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, list) and len(v) == n and n > 1}


def _kept_layers(d: dict, n: int) -> list[int]:
    """The fewest leading-first layer indices that cover every distinct kind in the per-layer lists."""
    lists = _per_layer_lists(d, n)
    seen, keep = set(), []
    for i in range(n):
        kind = tuple(repr(v[i]) for v in lists.values())
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    keep = keep[:_MAX_LAYERS]
    for i in range(n):  # at least two layers
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def shrink_config(config_cls, **overrides):
    """A tiny instance of `config_cls`, derived from its defaults; `overrides` win. fp32, eager attention.

    Raises whatever the config class raises; callers report it as one line.
    """
    try:
        base = config_cls()
        d = base.to_dict()
    except Exception:  # noqa: BLE001 - some defaults cannot even build a config; start from nothing then
        d = {}
    kw: dict = {}
    for k, v in _TINY_SIZES.items():
        if k in d and (d[k] is None or (isinstance(d[k], int) and not isinstance(d[k], bool))):
            kw[k] = v
    heads = d.get("num_attention_heads")
    kv = d.get("num_key_value_heads")
    if "num_key_value_heads" in d:
        kw["num_key_value_heads"] = 2 if isinstance(kv, int) and isinstance(heads, int) and kv < heads else 4
    if "swa_num_key_value_heads" in d:
        kw["swa_num_key_value_heads"] = 2
    if d.get("q_lora_rank") is not None:
        kw["q_lora_rank"] = 32
    for k, v in d.items():
        if isinstance(v, bool):
            continue
        if any(m in k for m in _TINY_INTERMEDIATE_MARKERS):
            if isinstance(v, int):
                kw[k] = 32 if ("moe" in k or "expert" in k or "shared" in k) else 64
            elif isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                kw[k] = [32] * len(v)
    for k in _TINY_NUM_EXPERTS:
        if k in d and (d[k] is None or (isinstance(d[k], int) and d[k] > 1)):
            kw[k] = 4
    for k in _TINY_TOP_K:
        if k in d and (d[k] is None or (isinstance(d[k], int) and not isinstance(d[k], bool))):
            kw[k] = min(d[k] or 2, 2)
    for k in _TINY_SHARED:
        if isinstance(d.get(k), int) and d[k] > 1:
            kw[k] = 1
    if isinstance(d.get("n_group"), int) and d["n_group"] > 1:
        kw["n_group"], kw["topk_group"] = 2, 1
    if isinstance(d.get("num_expert_group"), int) and d["num_expert_group"] > 1:
        kw["num_expert_group"] = 2
        if "topk_group" in d:
            kw["topk_group"] = 1
    for key in _LAYER_COUNTS:
        n = d.get(key)
        if isinstance(n, int) and n > 2:
            keep = _kept_layers(d, n)
            kw[key] = len(keep)
            for lk, lv in _per_layer_lists(d, n).items():
                kw[lk] = [lv[i] for i in keep]
            for lk in ("mlp_only_layers", "moe_layers", "no_rope_layers", "kv_source_layers", "ple_layer_ids"):
                if isinstance(d.get(lk), list) and lk not in kw:
                    kw[lk] = [x for x in d[lk] if isinstance(x, int) and x < len(keep)] if lk != "no_rope_layers" else d[lk]
            if isinstance(d.get("first_k_dense_replace"), int):
                kw["first_k_dense_replace"] = min(d["first_k_dense_replace"], 1)
            if isinstance(d.get("num_dense_layers"), int):
                kw["num_dense_layers"] = min(d["num_dense_layers"], 1)
            if isinstance(d.get("decoder_sparse_step"), int):
                kw["decoder_sparse_step"] = 1
            # every-k-th-layer switches (attention every 8 layers from layer 4) must still fire
            for lk, lv in d.items():
                if isinstance(lv, int) and not isinstance(lv, bool) and lk.endswith(("_period", "_interval")) and lv > 1:
                    kw[lk] = min(lv, len(keep))
                elif isinstance(lv, int) and not isinstance(lv, bool) and lk.endswith("_offset") and lv > 0:
                    kw[lk] = min(lv, len(keep) - 1)
    vocab = kw.get("vocab_size", d.get("vocab_size"))
    for k, v in d.items():
        if k.endswith("_token_id") and isinstance(v, int) and isinstance(vocab, int) and v >= vocab:
            kw[k] = vocab - 1
        elif k.endswith("_token_id") and isinstance(v, list):
            kw[k] = [min(x, vocab - 1) if isinstance(x, int) and isinstance(vocab, int) else x for x in v]
    _keep_equalities(d, kw)
    _scale_rope_sections(d, kw)
    if "tie_word_embeddings" in d:
        kw.setdefault("tie_word_embeddings", False)
    kw.update(overrides)
    config = config_cls(**kw)
    config._attn_implementation = "eager"
    return config


def _keep_equalities(d: dict, kw: dict) -> None:
    """Sizes that were equal (head_dim == qk_rope_head_dim) or a sum (qk_head_dim = nope + rope) stay so."""
    if all(k in kw for k in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")) and all(
        isinstance(d.get(k), int) for k in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")
    ) and d["qk_head_dim"] == d["qk_nope_head_dim"] + d["qk_rope_head_dim"]:
        kw["qk_head_dim"] = kw["qk_nope_head_dim"] + kw["qk_rope_head_dim"]
    ints = {k: v for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool) and k in kw}
    for a in ("head_dim", "v_head_dim", "index_head_dim"):
        for b in ("qk_head_dim", "qk_rope_head_dim", "qk_nope_head_dim"):
            if a in ints and b in ints and ints[a] == ints[b] and kw[a] != kw[b]:
                kw[a] = kw[b]
                break


def _scale_rope_sections(d: dict, kw: dict) -> None:
    """Multimodal RoPE sections sum to half the rotary dim: rescale them to the tiny rotary dim."""
    rope = d.get("rope_parameters")
    if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), list):
        return
    sections = rope["mrope_section"]
    for key in ("qk_rope_head_dim", "head_dim"):
        if isinstance(d.get(key), int) and key in kw and sum(sections) * 2 in (d[key], int(d[key] * rope.get("partial_rotary_factor", 1.0))):
            factor = sum(sections) * 2 / d[key]
            target = int(kw[key] * factor) // 2
            scaled = [max(1, s * target // sum(sections)) for s in sections]
            scaled[0] += target - sum(scaled)
            kw["rope_parameters"] = {**rope, "mrope_section": scaled}
            return


def shrink_other_config(config_cls, hidden_sizes: dict):
    """A small instance of a sub-config that is not the family's (vision, audio): one layer, narrow.

    `hidden_sizes` maps a default width of the language model (its hidden size) to the tiny one, so
    projector widths that must equal the text hidden size still do.
    """
    d = config_cls().to_dict()
    kw: dict = {}
    for k, v in d.items():
        if isinstance(v, bool) or not isinstance(v, int):
            continue
        if v in hidden_sizes and ("hidden" in k or "width" in k or "dim" in k or "size" in k):
            kw[k] = hidden_sizes[v]
        elif k in ("depth", "num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers"):
            kw[k] = 1
        elif k in ("num_heads", "num_attention_heads", "encoder_attention_heads", "decoder_attention_heads"):
            kw[k] = 2
        elif k in ("hidden_size", "embed_dim", "d_model", "width"):
            kw[k] = 32
        elif "intermediate_size" in k or k in ("encoder_ffn_dim", "decoder_ffn_dim"):
            kw[k] = 64
    for k, v in d.items():
        if isinstance(v, list) and v and all(isinstance(x, int) for x in v) and k.endswith(("indexes", "layers_idx", "layer_ids")):
            kw[k] = [0]
    return config_cls(**kw)
