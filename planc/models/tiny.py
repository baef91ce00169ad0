"""Tiny configs for any MoE family: the one derivation used by tests, `planc demo` and the family sweep.

The sweep over every MoE family of the installed transformers cannot keep a hand-written config per
family, so a tiny config is derived from the family's own config class, starting from its defaults:

- every size the plans shard gets a small value that splits over 1, 2 and 4 ranks (heads, KV heads,
  8 experts, intermediate sizes); sizes that were equal or a sum in the defaults stay so;
- the layer count shrinks to the fewest layers that still hold one of each kind of layer
  (attention/linear/mamba, dense/MoE), and every per-layer list is cut to those layers;
- a value the class computes in `__post_init__` from others (a `"auto"` default) is left to it;
- fields the defaults leave `None` although the model needs them (transformers' default config cannot
  build these models; real checkpoints set them) get tiny values: per-layer kind lists (`layer_types`,
  `mlp_layer_types`) filled with every kind the config documents or the modeling code tests for,
  expert counts and sizes, a sliding window when a layer slides, the attributes the modeling code reads
  that the config class does not declare;
- the other towers of a multimodal model (vision, audio, the talker of an omni model) shrink by the
  same rules, and a width that equals another tower's hidden size (a projector's output) follows it.

Structural switches stay as the family ships them, except one that turns the experts on (gemma4's
`enable_moe_block`, off by default; its MoE checkpoints set it): the sweep is about the experts. An expert
count of 1 in the defaults (hunyuan_v1_moe) becomes 8 too, so that expert parallelism is exercised.
`TINY_CONFIGS` (planc.models.build) holds
hand-tuned values for the shipped plans' families; they are overrides on top of this derivation.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from functools import cache
from typing import Optional, TypeGuard

TINY_HIDDEN = 64
TINY_HEADS = 4
TINY_EXPERTS = 8
_MAX_LAYERS = 4

_TINY_SIZES: dict[str, int] = {
    "hidden_size": TINY_HIDDEN, "vocab_size": 128, "head_dim": 16, "num_attention_heads": TINY_HEADS,
    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "qk_head_dim": 24,
    # an indexer scores with at most the query heads of one KV head (kolibri1_1): 4 heads over 2 KV heads
    "index_n_heads": 2, "index_num_heads": 2, "index_head_dim": 16, "index_topk": 4, "o_lora_rank": 16,
    "o_groups": 2,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_num_heads": 4, "linear_head_dim": 16,
    "swa_num_attention_heads": 4, "swa_head_dim": 16, "num_sliding_attention_heads": 4,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_d_state": 16,
    "ssm_state_size": 16, "mamba_dt_rank": 8, "rotary_dim": 8, "router_hidden_size": 32,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128, "ple_embed_dim": 16,
    "unpadded_vocab_size": 128, "query_pre_attn_scalar": 16, "loop_gate_rank": 8, "gated_norm_rank": 8,
    "hc_lowrank": 8, "adapter_in_dim": TINY_HIDDEN, "adapter_out_dim": TINY_HIDDEN, "d_rel": 8,
    # other towers (vision, audio encoders)
    "embed_dim": TINY_HIDDEN, "d_model": TINY_HIDDEN, "num_heads": TINY_HEADS,
    "encoder_attention_heads": TINY_HEADS, "decoder_attention_heads": TINY_HEADS,
}
_NUM_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k", "top_k_experts")
_SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# parameter-free experts the router also picks (longcat_flash's identity "zero" experts): a few of them
_EXTRA_EXPERTS = ("zero_expert_num",)
# a structural switch that turns the experts on (gemma4's `enable_moe_block`): the family's MoE checkpoints set it
_EXPERTS_SWITCH = re.compile(r"^(enable|use|with|has)_(moe|experts?|sparse_moe)(_block|_layers?|_mlp)?$")
_INTERMEDIATE_MARKERS = ("intermediate_size", "ffn_hidden_size", "moe_hidden_size", "intermediate_dim", "ffn_dim")
_LAYER_COUNTS = ("num_hidden_layers", "num_layers")
_TOWER_DEPTHS = ("depth", "encoder_layers", "decoder_layers")
_LAYER_ID_LISTS = ("mlp_only_layers", "moe_layers", "no_rope_layers", "kv_source_layers", "ple_layer_ids")
_RECURRENT_KINDS = ("linear", "mamba", "conv", "recurrent")  # layer kinds without softmax attention
_WIDTH_WORDS = ("hidden", "width", "dim", "size")
# `None` means "off" for these (no q LoRA, no sliding window): never filled in
_NONE_MEANS_OFF = ("q_lora_rank", "sliding_window", "moe_latent_size")
# tiny values for a size the defaults leave None, by the end of its name
_NONE_SIZE_SUFFIXES = (("kv_heads", 1), ("n_heads", 2), ("num_heads", 2), ("head_dim", 16), ("budget", 8),
                       ("compress_ratio", 4), ("topk", 4))


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _fields(cls) -> dict:
    try:
        return {f.name: f for f in dataclasses.fields(cls)}
    except TypeError:
        return {}


def _declared_int(cls, key: str) -> bool:
    f = _fields(cls).get(key)
    return f is not None and "int" in str(f.type)


def _computed_from_others(cls, key: str) -> bool:
    """The class default is a string marker (`"auto"`) that `__post_init__` replaces with a computed value."""
    f = _fields(cls).get(key)
    return f is not None and isinstance(f.default, str)


@cache
def _modeling_source(config_module: str) -> str:
    import inspect

    name = config_module.replace(".configuration_", ".modeling_")
    try:
        return inspect.getsource(importlib.import_module(name))
    except Exception:  # noqa: BLE001 - no modeling module next to the config: nothing to read
        return ""


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


def _layer_kinds(cls, key: str) -> list[str]:
    """The kinds a per-layer list `key` can hold: the quoted values its docstring names, then the values the
    modeling code compares `config.<key>[i]` with; `*layer_types` always has transformers' `full_attention`."""
    kinds: list[str] = []
    doc = cls.__doc__ or ""
    m = re.search(rf"^(\s*){re.escape(key)} \(.*\n((?:\1\s+\S.*\n?)*)", doc, re.M)
    if m:
        kinds += re.findall(r'"([A-Za-z_]+)"', m.group(2))
    src = _modeling_source(cls.__module__)
    aliases = [a for a, t in (getattr(cls, "attribute_map", None) or {}).items() if t == key]
    for name in (key, *aliases):
        kinds += re.findall(rf'\b{re.escape(name)}\[[^\]]+\]\s*(?:==|!=)\s*"([A-Za-z_]+)"', src)
    if key.endswith("layer_types") and not key.startswith(("mlp", "moe", "ffn")) and "full_attention" not in kinds:
        kinds.append("full_attention")
    return list(dict.fromkeys(kinds))


def shrink_dict(cls, d: dict, *, family: bool, widths: Optional[dict] = None) -> dict:
    """Constructor keyword arguments of a tiny `cls` derived from its defaults `d` (`to_dict()` of a default
    instance). `family`: the config whose plans are tested (the MoE tower); the others (vision, audio) shrink
    by the same rules. `widths` maps another tower's default hidden size to its tiny one."""
    kw: dict = {}
    for k, v in _TINY_SIZES.items():
        if k in d and (d[k] is None and family and k not in _NONE_MEANS_OFF or _is_int(d[k]) and d[k] != 0):
            kw[k] = v  # a size of 0 is a switch (no RoPE dims: NoPE attention) and stays 0
    heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if "num_key_value_heads" in d:
        kw["num_key_value_heads"] = 2 if _is_int(kv) and _is_int(heads) and kv < heads else TINY_HEADS
    if "swa_num_key_value_heads" in d:
        kw["swa_num_key_value_heads"] = 2
    if d.get("q_lora_rank") is not None:
        kw["q_lora_rank"] = 32
    for k, v in d.items():
        if isinstance(v, bool):
            continue
        if any(m in k for m in _INTERMEDIATE_MARKERS):
            small = 32 if ("moe" in k or "expert" in k or "shared" in k) else 64
            if _is_int(v) or (v is None and family and _declared_int(cls, k)):
                kw[k] = small
            elif isinstance(v, list) and v and all(_is_int(x) for x in v):
                kw[k] = [32] * len(v)
    if family:
        for k, v in d.items():
            if v is False and _EXPERTS_SWITCH.match(k):
                kw[k] = True
    for k in _NUM_EXPERTS:
        # a default of 1 expert (hunyuan_v1_moe; its checkpoints have 64) exercises no expert parallelism:
        # every count of 1 or more becomes TINY_EXPERTS (0 stays: no experts is a switch)
        if k in d and (d[k] is None or (_is_int(d[k]) and d[k] >= 1)):
            kw[k] = TINY_EXPERTS
    for k in _EXTRA_EXPERTS:
        if _is_int(d.get(k)) and d[k] > 0:
            kw[k] = TINY_EXPERTS // 2
    for k in _TOP_K:
        if k in d and (d[k] is None or _is_int(d[k])):
            kw[k] = min(d[k] or 2, 2)
    for k in _SHARED:
        if _is_int(d.get(k)) and d[k] > 1 or (k in d and d[k] is None and family and _declared_int(cls, k)):
            kw[k] = 1
    if _is_int(d.get("n_group")) and d["n_group"] > 1:
        kw["n_group"], kw["topk_group"] = 2, 1
    if _is_int(d.get("num_expert_group")) and d["num_expert_group"] > 1:
        kw["num_expert_group"] = 2
        if "topk_group" in d:
            kw["topk_group"] = 1
    if family:
        _fill_none_sizes(cls, d, kw)
    _shrink_layers(cls, d, kw, family)
    vocab = kw.get("vocab_size", d.get("vocab_size"))
    for k, v in d.items():
        if k.endswith("_token_id") and _is_int(v) and _is_int(vocab) and v >= vocab:
            kw[k] = vocab - 1
        elif k.endswith("_token_id") and isinstance(v, list):
            kw[k] = [min(x, vocab - 1) if _is_int(x) and _is_int(vocab) else x for x in v]
    _keep_equalities(d, kw)
    _keep_divisibility(d, kw)
    _scale_rope_sections(cls, d, kw)
    if widths:
        for k, v in d.items():
            if k not in kw and _is_int(v) and v in widths and any(w in k for w in _WIDTH_WORDS):
                kw[k] = widths[v]
    if not family:  # every tower is TINY_HIDDEN wide, so any other hidden width (a projector's) is too
        for k, v in d.items():
            if _is_int(v) and k not in kw and (k == "dim" or k.endswith("_dim")) and v >= 256:
                kw[k] = TINY_HIDDEN  # a decoder's / projector's channel width
                continue
            if not any(w in k for w in ("hidden_size", "hidden_dim")):
                continue
            v = kw.get(k, v)
            if _is_int(v) and v > TINY_HIDDEN and k not in kw:
                kw[k] = TINY_HIDDEN
            elif isinstance(v, list) and v and all(_is_int(x) for x in v):
                kw[k] = [TINY_HIDDEN] * len(v)
        depths = kw.get("depths", d.get("depths"))
        if isinstance(depths, list) and all(_is_int(x) for x in depths):
            kw["depths"] = [1] * len(depths)
    for k in list(kw):
        if _computed_from_others(cls, k):
            del kw[k]  # `"auto"`: the class computes it from the tiny sizes
    if family:
        _fill_undeclared(cls, d, kw)
    if "tie_word_embeddings" in d:
        kw.setdefault("tie_word_embeddings", False)
    return kw


def _fill_none_sizes(cls, d: dict, kw: dict) -> None:
    """Sizes the defaults leave None that name a part of the model (an indexer's heads, budget): tiny values."""
    for k, v in d.items():
        if v is not None or k in kw or k in _NONE_MEANS_OFF or not _declared_int(cls, k) or k.endswith("_token_id"):
            continue
        for suffix, value in _NONE_SIZE_SUFFIXES:
            if k.endswith(suffix):
                kw[k] = value
                break
    if d.get("n_group", 0) is None and "n_group" not in kw and _declared_int(cls, "n_group"):
        kw["n_group"], kw["topk_group"] = 1, 1


def _fill_undeclared(cls, d: dict, kw: dict) -> None:
    """Sizes the modeling code reads from the config (`config.shared_expert_intermediate_size`) that the
    class does not declare: real checkpoints carry them as extra keys, the defaults cannot."""
    src = _modeling_source(cls.__module__)
    for k in sorted(set(re.findall(r"\bconfig\.([a-z_][a-z0-9_]*)", src))):
        if k in d or k in kw or hasattr(cls, k) or k in (getattr(cls, "attribute_map", None) or {}):
            continue  # declared, or an alias of a declared field
        if any(m in k for m in _INTERMEDIATE_MARKERS) and re.search(rf"intermediate_size\s*=\s*config\.{k}\b", src):
            kw[k] = 32


def _shrink_layers(cls, d: dict, kw: dict, family: bool) -> None:
    # per-layer overrides keyed by layer index ("02": {num_attention_heads: 64}, heterogeneous configs)
    by_layer = {k: v for k, v in d.items() if isinstance(v, dict) and v and all(isinstance(x, str) and x.isdigit() for x in v)}
    for key in _LAYER_COUNTS:
        n = d.get(key)
        if not _is_int(n) or n <= 2:
            continue
        as_lists: dict[str, list[object]] = {
            f"{k} (by layer)": [repr(_by_index(v, i)) for i in range(n)] for k, v in by_layer.items()
        }
        # lists of layer indices (`mlp_only_layers`: the dense ones) are kinds too: keep a dense and a MoE layer
        ids = {lk: set(d[lk]) for lk in _LAYER_ID_LISTS
               if lk != "no_rope_layers" and isinstance(d.get(lk), list) and len(d[lk]) != n}
        as_lists.update({f"{lk} (member)": [i in members for i in range(n)] for lk, members in ids.items()})
        keep = _kept_layers({**d, **as_lists}, n)
        kw[key] = len(keep)
        for lk, lv in _per_layer_lists(d, n).items():
            kw[lk] = [lv[i] for i in keep]
        base = {k: v for k, v in d.items() if k not in by_layer}
        for lk, lv in by_layer.items():
            width = len(next(iter(lv)))
            kw[lk] = {f"{j:0{width}d}": _shrink_entry(cls, base, _by_index(lv, i), family)
                      for j, i in enumerate(keep) if _by_index(lv, i) is not None}
        for lk in _LAYER_ID_LISTS:
            if lk in ids and lk not in kw:
                kw[lk] = [j for j, i in enumerate(keep) if i in ids[lk]]  # the kept layers, renumbered
            elif isinstance(d.get(lk), list) and lk not in kw:
                kw[lk] = [x for x in d[lk] if _is_int(x) and x < len(keep)] if lk != "no_rope_layers" else d[lk]
        if _is_int(d.get("first_k_dense_replace")):
            kw["first_k_dense_replace"] = min(d["first_k_dense_replace"], 1)
        if _is_int(d.get("num_dense_layers")):
            kw["num_dense_layers"] = min(d["num_dense_layers"], 1)
        if _is_int(d.get("decoder_sparse_step")):
            kw["decoder_sparse_step"] = 1
        # every-k-th-layer switches (attention every 8 layers from layer 4) must still fire
        for lk, lv in d.items():
            if _is_int(lv) and lk.endswith(("_period", "_interval")) and lv > 1:
                kw[lk] = min(lv, len(keep))
            elif _is_int(lv) and lk.endswith("_offset") and lv > 0:
                kw[lk] = min(lv, len(keep) - 1)
    for key in _TOWER_DEPTHS:
        if _is_int(d.get(key)) and d[key] > 1:
            kw[key] = 1
    for k, v in d.items():  # vision towers: full-attention block indexes, deepstack layers
        if isinstance(v, list) and v and all(_is_int(x) for x in v) and k.endswith(("indexes", "layers_idx", "layer_ids")) \
                and k not in kw:
            kw[k] = [0]
    if not family:
        return
    # per-layer kind lists the defaults leave None although the model indexes them
    n = kw.get("num_hidden_layers", d.get("num_hidden_layers"))
    for k, v in d.items():
        if v is None and k.endswith("layer_types") and not k.startswith("mtp") and _is_int(n):
            kinds = _layer_kinds(cls, k)
            if kinds:
                n = max(n, len(kinds))
                kw[k] = [kinds[min(i, len(kinds) - 1)] for i in range(n)]
    for k, v in list({**d, **kw}.items()):
        # an attention-kind list whose layers are all linear/recurrent (the class computed it from a default that
        # real checkpoints override): the last layer becomes the full attention layer the model also has
        if k.endswith("layer_types") and not k.startswith(("mlp", "moe", "ffn", "mtp")) and isinstance(v, list) \
                and len(v) > 1 and all(isinstance(x, str) and any(w in x for w in _RECURRENT_KINDS) for x in v) \
                and "full_attention" in _layer_kinds(cls, k) and _fields(cls).get(k) is not None \
                and _fields(cls)[k].default is None:
            kw[k] = [*v[:-1], "full_attention"]
    if _is_int(n) and n != kw.get("num_hidden_layers", d.get("num_hidden_layers")):
        kw["num_hidden_layers"] = n
        for k, v in list(kw.items()):
            if k.endswith("layer_types") and isinstance(v, list) and len(v) < n:
                kw[k] = v + [v[-1]] * (n - len(v))
    sliding = any("sliding" in str(x) for k, v in {**d, **kw}.items() if k.endswith("layer_types") and isinstance(v, list)
                  for x in v)
    # a model whose layer kinds include a sliding one builds the sliding mask even when no layer slides
    sliding = sliding or ("layer_types" in d and any("sliding" in k for k in _layer_kinds(cls, "layer_types")))
    if sliding and "sliding_window" in d and d["sliding_window"] is None:
        kw["sliding_window"] = 8


def _by_index(by_layer: dict, i: int):
    return next((v for k, v in by_layer.items() if int(k) == i), None)


def _shrink_entry(cls, base: dict, entry: dict, family: bool) -> dict:
    """One layer's overrides, shrunk by the same rules as the config they override."""
    merged = {**base, **entry}
    tiny = shrink_dict(cls, merged, family=family)
    out = {k: tiny.get(k, v) for k, v in entry.items()}
    base_tiny = None
    for total, part, other in _SUMS:  # a layer whose head width is the config's: nope + rope == head_dim
        if part in entry and total not in entry and all(_is_int(merged.get(k)) for k in (total, part, other)) \
                and merged[total] == merged[part] + merged[other]:
            base_tiny = base_tiny if base_tiny is not None else shrink_dict(cls, base, family=family)
            t, o = base_tiny.get(total, merged[total]), tiny.get(other, merged[other])
            if t > o:
                out[part] = t - o
    return out


_SUMS = (("head_dim", "qk_nope_head_dim", "qk_rope_head_dim"), ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim"))


def _keep_equalities(d: dict, kw: dict, fixed=()) -> None:
    """Sizes that were equal (head_dim == qk_rope_head_dim) or a sum (qk_head_dim = nope + rope) stay so;
    `fixed` (the caller's overrides) are never changed, the sizes derived from them follow them."""
    if all(k in kw for k in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")) and all(
        _is_int(d.get(k)) for k in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")
    ) and d["qk_head_dim"] == d["qk_nope_head_dim"] + d["qk_rope_head_dim"] and "qk_head_dim" not in fixed:
        kw["qk_head_dim"] = kw["qk_nope_head_dim"] + kw["qk_rope_head_dim"]
    ints = {k: v for k, v in d.items() if _is_int(v) and k in kw}
    for a in ("head_dim", "v_head_dim", "index_head_dim"):
        for b in ("qk_head_dim", "qk_rope_head_dim", "qk_nope_head_dim"):
            if a in ints and b in ints and ints[a] == ints[b] and kw[a] != kw[b] and a not in fixed:
                kw[a] = kw[b]
                break


def _keep_divisibility(d: dict, kw: dict) -> None:
    """A shrunk size that a sibling field (same prefix: `index_topk`, `index_kpool`) divided in the defaults
    still does: the sibling shrinks to a common divisor. So do groups of heads (`n_groups` of `mamba_num_heads`)."""
    for g, vg in d.items():
        if not g.endswith("groups") or not _is_int(vg) or vg <= 1:
            continue
        for h, vh in d.items():
            if h.endswith("heads") and _is_int(vh) and vh % vg == 0 and _is_int(kw.get(h)):
                tiny_g = kw.get(g, vg)
                if kw[h] % tiny_g:
                    kw[g] = math.gcd(kw[h], tiny_g)
    for a, tiny_a in list(kw.items()):
        if not _is_int(tiny_a) or not _is_int(d.get(a)) or "_" not in a:
            continue
        prefix = a.split("_")[0] + "_"
        for b, vb in d.items():
            if b == a or b in kw or not b.startswith(prefix) or not _is_int(vb) or vb <= 1 or d[a] % vb:
                continue
            tiny_b = kw.get(b, vb)
            if _is_int(tiny_b) and tiny_b > 0 and tiny_a % tiny_b:
                kw[b] = math.gcd(tiny_a, tiny_b)


def _keep_yarn_ratio(d: dict, kw: dict) -> None:
    """YaRN's `factor` is the context it extends to over the context it was trained on (`max_position_embeddings /
    original_max_position_embeddings`): a shorter tiny context shortens the original one with it, so the ratio
    stays what the family's config says (transformers warns at every model built when they disagree)."""
    rope = kw.get("rope_parameters", d.get("rope_parameters"))
    longest, default = kw.get("max_position_embeddings"), d.get("max_position_embeddings")
    if not (isinstance(rope, dict) and rope.get("rope_type") == "yarn" and _is_int(longest) and _is_int(default)):
        return
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if isinstance(factor, (int, float)) and factor >= 1 and _is_int(original) and original * factor == default != longest:
        kw["rope_parameters"] = {**rope, "original_max_position_embeddings": max(1, int(longest / factor))}


def _scale_rope_sections(cls, d: dict, kw: dict) -> None:
    """Multimodal RoPE sections sum to half the rotary dim: rescale them to the tiny rotary dim. Sections the
    config leaves out take the modeling code's own default (`rope_parameters.get("mrope_section", [8, 12, 12])`)."""
    rope = d.get("rope_parameters")
    if not isinstance(rope, dict):
        return
    sections = rope.get("mrope_section")
    if sections is None and "mrope_section" in (getattr(cls, "ignore_keys_at_rope_validation", None) or ()):
        m = re.search(r'"mrope_section",\s*(\[[\d,\s]+\])', _modeling_source(cls.__module__))
        sections = [int(x) for x in m.group(1).strip("[]").split(",") if x.strip()] if m else None
    if not isinstance(sections, list) or not sections or not all(_is_int(x) for x in sections):
        return
    prf = rope.get("partial_rotary_factor", 1.0) or 1.0
    if "qk_rope_head_dim" in kw and _is_int(d.get("qk_rope_head_dim")) and sum(sections) * 2 == d["qk_rope_head_dim"]:
        rotary = kw["qk_rope_head_dim"]
    else:
        head_dim = kw.get("head_dim", d.get("head_dim"))
        if not _is_int(head_dim):
            hidden = kw.get("hidden_size", d.get("hidden_size"))
            heads = kw.get("num_attention_heads", d.get("num_attention_heads"))
            if not (_is_int(hidden) and _is_int(heads) and heads):
                return
            head_dim = hidden // heads
        rotary = int(head_dim * prf)
    target = rotary // 2
    if target < len(sections):
        return
    scaled = [max(1, s * target // sum(sections)) for s in sections]
    # the rest goes to a section no other equals, so that equal sections (height, width) stay equal
    lone = [i for i, s in enumerate(sections) if sections.count(s) == 1]
    scaled[lone[0] if lone else 0] += target - sum(scaled)
    if min(scaled) > 0:
        kw["rope_parameters"] = {**rope, "mrope_section": scaled}


# ---- whole configs ------------------------------------------------------------------------------------------


def _defaults(cls) -> dict:
    try:
        return cls().to_dict()
    except Exception:  # noqa: BLE001 - some defaults cannot even build a config; start from nothing then
        return {}


def shrink_config(config_cls, defaults: Optional[dict] = None, **overrides):
    """A tiny instance of the family config `config_cls`, derived from its defaults (or `defaults`, the dict
    of the instance a multimodal config holds); `overrides` win. Eager attention. Raises whatever the
    config class raises; callers report it as one line."""
    d = _defaults(config_cls) if defaults is None else defaults
    kw = shrink_dict(config_cls, d, family=True)
    kw.update(overrides)
    if overrides:
        _keep_equalities(d, kw, fixed=overrides)  # sizes derived from an overridden one follow it
    _keep_yarn_ratio(d, kw)
    config = config_cls(**kw)
    config._attn_implementation = "eager"
    return config


def _sub_configs(config) -> dict:
    """{attribute: sub-config instance} of a config (vision_config, text_config, thinker_config...)."""
    from transformers import PreTrainedConfig

    out = {}
    for attr in (getattr(type(config), "sub_configs", None) or {}):
        sub = getattr(config, attr, None)
        if isinstance(sub, PreTrainedConfig):
            out[attr] = sub
    return out


def _hidden_sizes(config, out: dict) -> dict:
    """{default hidden size of every tower in the tree: TINY_HIDDEN}: a projector's width follows its tower."""
    for attr in ("hidden_size", "embed_dim", "d_model", "out_hidden_size"):
        v = getattr(config, attr, None)
        if _is_int(v) and attr != "out_hidden_size":
            out[v] = TINY_HIDDEN
    for sub in _sub_configs(config).values():
        _hidden_sizes(sub, out)
    return out


def _shrink_tower(config, path: tuple, family_tiny, widths: dict):
    """A tiny copy of `config` (a tower of a multimodal model); `path` leads from it to the family's config,
    which is replaced by `family_tiny`. A tower whose derived config its class refuses keeps fewer changes:
    only its layers cut, else its defaults."""
    cls = type(config)
    subs = _sub_configs(config)
    nested = {}
    for attr, sub in subs.items():
        if path and attr == path[0]:
            nested[attr] = family_tiny if len(path) == 1 else _shrink_tower(sub, path[1:], family_tiny, widths)
        else:
            nested[attr] = _shrink_tower(sub, (), None, widths)
    d = {k: v for k, v in config.to_dict().items() if k not in subs}
    kw = shrink_dict(cls, d, family=False, widths=widths)
    layers_only = {k: v for k, v in kw.items() if k in _LAYER_COUNTS or k in _TOWER_DEPTHS or isinstance(v, list)}
    nested_dicts = {k: v.to_dict() for k, v in nested.items()}
    for attempt in (kw, layers_only, {}):
        try:
            built = cls(**{**attempt, **nested_dicts})
            break
        except Exception:  # noqa: BLE001 - the next, milder attempt
            continue
    else:
        built = config
    for attr, sub in nested.items():
        if path and attr == path[0]:
            setattr(built, attr, sub)  # the family's config object itself (its class, its attention setting)
    return built


def tiny_family_config(fam, **overrides):
    """The tiny config of a family's top model: the family's own config shrunk (`overrides` win) inside its
    multimodal model when it has one, whose other towers shrink too. Eager attention."""
    top_default = None
    if fam.multimodal:
        try:
            top_default = fam.top_config_class()()
        except Exception:  # noqa: BLE001 - a top config that cannot build from defaults: the family's own classes
            top_default = None
    text_default = None
    if top_default is not None:
        text_default = top_default
        for attr in fam.config_path:
            text_default = getattr(text_default, attr, None)
    text = shrink_config(fam.config_class(), text_default.to_dict() if text_default is not None else None, **overrides)
    if not fam.multimodal:
        return text
    if top_default is None:  # the top config's defaults do not build: it holds only the family's tiny config
        holder: dict = {}
        node = holder
        for attr in fam.config_path[:-1]:
            node = node.setdefault(attr, {})
        node[fam.config_path[-1]] = text.to_dict()
        config = fam.top_config_class()(**holder)
    else:
        widths = _hidden_sizes(top_default, {})
        config = _shrink_tower(top_default, fam.config_path, text, widths)
        _borrow_missing_attributes(fam, config, top_default)
    config._attn_implementation = "eager"
    return config


_MISSING_ATTRIBUTE = re.compile(r"'(\w+)' object has no attribute '(\w+)'")


def _borrow_missing_attributes(fam, config, top_default, limit: int = 8) -> None:
    """An attribute the model reads from one tower's config that its class does not declare (the talker of
    an omni model reads `spatial_merge_size`, which only the vision config declares; real checkpoints
    carry it as an extra key): the value another config of the same model declares, found by building the
    model on the meta device."""
    import torch

    for _ in range(limit):
        try:
            with torch.device("meta"):
                fam.model_class(config)._from_config(config)
            return
        except AttributeError as e:
            m = _MISSING_ATTRIBUTE.search(str(e))
            if m is None:
                return
            cls_name, attr = m.groups()
            owner = next((c for c in _all_configs(config) if type(c).__name__ == cls_name), None)
            value = next((getattr(c, attr) for c in _all_configs(config) if attr in c.__dict__), None)
            if owner is None or value is None:
                return
            setattr(owner, attr, value)
        except Exception:  # noqa: BLE001 - any other failure is reported by whoever builds the model
            return


def _all_configs(config) -> list:
    out = [config]
    for sub in _sub_configs(config).values():
        out += _all_configs(sub)
    return out
