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
    "axk1",
    "axk2",
    "bailing_hybrid",
    "beam",
    "dots3_note_text",
    "ergo",
    "ernie4_5_vl_moe_text",
    "flint",
    "gemma4_text",
    "glm4v_moe_text",
    "glm5_next_text",
    "glm_moe_dsa",
    "granitemoe_swa",
    "hy_v3",
    "hy_v4",
    "hy_v4_vl_text",
    "inkling2_loop_text",
    "inkling2_text",
    "inkling_text",
    "kolibri1",
    "kolibri1_1",
    "longcat_flash",
    "mimo_v2_flash",
    "minicpm5_moe",
    "minimax_m3_vl_text",
    "mistral_large4_text",
    "nemotron_h",
    "qwen3_omni_moe_text",
    "sarvam_mla",
    "step3p5",
    "unlimited_ocr_text",
    "cohere2_moe",
    "deepseek_ocr2_text",
    "dots1",
    "hunyuan_v1_moe",
    "lfm2_moe",
    "muse_spark_text",
    "qwen4_exp_text",
)

# tp_size = ep_size of the plan `planc init` writes (a family absent here runs at 2): larger where rank 0 of a
# full-width training point would not fit the shared machine at 2 (the fake group makes any world size cheap).
SIZES: dict[str, int] = {
    "olmoe": 4, "qwen2_moe": 4, "jamba": 8, "granitemoehybrid": 8, "kimi_linear": 8, "qwen3_5_moe_text": 8,
    "mistral4": 8, "glm4_moe_lite": 4, "phimoe": 8, "minimax": 8, "deepseek_v32": 8, "cohere2_moe": 8,
    "ernie4_5_moe": 4, "granitemoeshared": 8, "exaone_moe": 8, "sarvam_moe": 8, "flex_olmo": 8, "granitemoe": 8,
    "aria_text": 4, "afmoe": 4, "param2moe": 4, "zaya": 8, "solar_open": 8, "mellum": 4, "laguna": 4, "axk1": 8,
    "axk2": 2, "bailing_hybrid": 8, "beam": 8, "dots3_note_text": 8, "ergo": 8, "ernie4_5_vl_moe_text": 4,
    "flint": 4, "gemma4_text": 8, "glm4v_moe_text": 8, "glm5_next_text": 8, "glm_moe_dsa": 8, "granitemoe_swa": 4,
    "hy_v3": 8, "hy_v4": 8, "hy_v4_vl_text": 8, "inkling2_loop_text": 8, "inkling2_text": 8, "inkling_text": 8,
    "kolibri1": 8, "kolibri1_1": 8, "lara_mini": 2, "longcat_flash": 8, "mimo_v2_flash": 8, "minicpm5_moe": 2,
    "minimax_m3_vl_text": 8, "mistral_large4_text": 8, "nemotron_h": 8, "openai_privacy_filter": 2,
    "qwen3_omni_moe_text": 2, "sarvam_mla": 8, "step3p5": 8, "unlimited_ocr_text": 2, "deepseek_ocr2_text": 4,
    "dots1": 8, "hunyuan_v1_moe": 8, "lfm2_moe": 2, "muse_spark_text": 8, "qwen4_exp_text": 8,
}

# What is smaller than the family's default config, where full width at SIZES would still not fit (stated in
# docs/memory.md's families table).
SHRINK: dict[str, dict] = {
    "mistral4": {'n_routed_experts': 64}, "deepseek_v32": {'n_routed_experts': 32}, "jamba": {'num_experts': 8},
    "kimi_linear": {'num_local_experts': 128}, "solar_open": {'n_routed_experts': 64},
    "sarvam_moe": {'num_experts': 64}, "axk1": {'n_routed_experts': 48}, "beam": {'num_experts': 32},
    "dots3_note_text": {'n_routed_experts': 16},
    "ergo": {"num_experts": 16, "vocab_size": 32768, "hidden_size": 4096, "first_dense_intermediate_size": 16384},
    "glm5_next_text": {'n_routed_experts': 16}, "glm_moe_dsa": {'n_routed_experts': 64},
    "hy_v4_vl_text": {'n_routed_experts': 16}, "inkling2_loop_text": {'n_routed_experts': 64},
    "inkling2_text": {'n_routed_experts': 24}, "inkling_text": {'n_routed_experts': 16},
    "longcat_flash": {'n_routed_experts': 32}, "mimo_v2_flash": {'n_routed_experts': 32},
    "minimax_m3_vl_text": {'num_local_experts': 16}, "mistral_large4_text": {'n_routed_experts': 16},
    "sarvam_mla": {'n_routed_experts': 64}, "step3p5": {'n_routed_experts': 16},
    # a vocabulary of 32768 where planc init's plan keeps the embedding or lm_head whole on every rank (Cohere2-MoE's
    # tied 256000 x 8192 embedding alone is 3.9 GiB a rank; Ergo's, kept fp32, 8 GiB), and narrower layers where
    # even that does not fit: Cohere2-MoE's 8 experts (one a rank at ep 8) half as wide, Ergo at hidden 4096, Muse
    # Spark's attention (not split by the plan) at 64 heads
    "cohere2_moe": {"vocab_size": 32768, "intermediate_size": 11264},
    "hunyuan_v1_moe": {"vocab_size": 65536},
    "muse_spark_text": {"num_local_experts": 16, "vocab_size": 32768, "num_attention_heads": 64},
}

# Values a released checkpoint's config.json sets where transformers' default config of the family leaves them
# unset (the model cannot be built) or inconsistent; only those keys, the rest stays transformers' default (stated in
# docs/memory.md's families table with the shrink)
CONFIG: dict[str, dict] = {
    # Qwen/Qwen3-Omni-30B-A3B-Instruct's thinker: 32 heads (the default's 28 heads over hidden 2048 give 73-wide heads,
    # which its rotary embedding cannot rotate; the checkpoint's head_dim 128 is not a key of the config class, so
    # the heads are 64 wide)
    "qwen3_omni_moe_text": {"num_attention_heads": 32},
    # rednote-hilab/dots.llm1.inst: 6 of 128 routed experts and 2 shared experts
    "dots1": {"n_routed_experts": 128, "n_shared_experts": 2, "num_experts_per_tok": 6},
    # tencent/Hunyuan-A13B-Instruct: head_dim 128 (unset by default), 8 of 64 experts of width 3072, 8 KV heads,
    # its vocabulary (the default is one expert of width 11008)
    "hunyuan_v1_moe": {"head_dim": 128, "num_experts": 64, "moe_topk": 8, "intermediate_size": 3072,
                       "num_key_value_heads": 8, "vocab_size": 128167},
    # LiquidAI/LFM2-8B-A1B: 24 layers, attention at 2, 6, 10, 14, 18 and 21, short convolutions elsewhere
    "lfm2_moe": {"num_hidden_layers": 24, "layer_types": [
        "full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]},
    # google/diffusiongemma-26B-A4B-it's text config: 8 of 128 experts of width 704 (Gemma 4 26B-A4B's)
    "diffusion_gemma_text": {"num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704},
    # Qwen/Qwen4-Exp's text config: the QSA indexer (4 query heads and 1 key head of 128, 2048 tokens from blocks of
    # 4), the sigmoid output gate of its linear attention, rotary over a quarter of each 256-wide head (which the
    # config checks against the indexer's head)
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
                       "indexer_compress_ratio": 4, "output_gate_type": "sigmoid",
                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                           "partial_rotary_factor": 0.25}},
    # DeepSeek-OCR's DeepSeek-3B-MoE decoder: greedy top-6 of the 64 routed experts in one group, the first layer
    # dense, experts 896 wide (the default's 1407 leaves grouped_mm's rows unaligned: "strides should be multiple
    # of 16 bytes")
    "deepseek_ocr2_text": {"num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 896,
                           "mlp_layer_types": ["dense"] + ["sparse"] * 31},
    # zai-org/GLM-4.5V's text config (GLM-4.5-Air's decoder): head_dim 128, which the config class has no field for;
    # without it the heads are 4096 / 96 = 42 wide and the default mrope_section [8, 12, 12] (32 rotary frequencies:
    # half of a 128-wide head) cannot split the 11 frequencies such a head has
    "glm4v_moe_text": {"head_dim": 128},
    # stepfun-ai/Step-3.5-Flash's text config: a 512-token sliding window, three sliding layers to every full one
    # (full at 0, 4, 8, ...), 96 query heads in the sliding layers (`attention_other_setting`); the default config
    # leaves the window unset while the model builds a sliding mask in every forward
    "step3p5": {"sliding_window": 512, "num_sliding_attention_heads": 96,
                "layer_types": ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(45)]},
}

# Layer overrides where the fewest layers of each kind hold no attention layer (transformers' hybrid cache needs one):
# one mamba and one attention layer, both MoE (Jamba); one mamba2 and one attention layer (Granite MoE hybrid)
LAYERS: dict[str, dict] = {
    "jamba": {"num_hidden_layers": 2, "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 0,
              "expert_layer_period": 1},
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "attention"]},
}

POINTS = {"serve": (1, 1024), "replicate": (1, 1024)}
# Prefill shapes per family measured to check the pricing on points it was not written against (the same tokens in
# two sequences; twice the tokens); a cached point kept from the pricing until it was written says `held_out`
HELD_OUT = {"serve": ((2, 512), (1, 2048))}
# Kimi Delta Attention keeps several fp32 [tokens, heads, 64, key_dim] chunk tensors per layer for backward: 1024
# tokens would not fit the shared machine. Jamba's slow Mamba scan is a Python loop over the tokens: 1024 of them
# under MemTracker take over 15 minutes to train
POINTS_OF: dict[str, dict] = {"kimi_linear": {"replicate": (1, 256)}, "jamba": {"replicate": (1, 128)}}
# Shapes held out from the rules they check: the DSA indexer's prefills at batch > 1 and at more tokens (the rule, read
# at 2 x 512: its score product copies the fp32 keys for every query, planc.compiler.indexer_memory); training at another batch and token count than the point each family's training rule was read at
# (Kimi Delta Attention's backward at 1 x 256; the other families' at 1 x 1024 on an H100)
_TRAIN_2X512 = {"replicate": ((2, 512),)}
HELD_OUT_OF: dict[str, dict] = {
    "axk2": {"serve": ((4, 512),)}, "glm_moe_dsa": {"serve": ((2, 1024),)},
    "deepseek_v32": {"serve": ((2, 1024),), "replicate": ((1, 4096),)},
    "kimi_linear": {"replicate": ((2, 192), (1, 1024))},
    # Kimi Delta Attention's training at 1 x 256 besides 1 x 1024: 1024 tokens' chunk tensors do not fit this box
    "bailing_hybrid": {"replicate": ((2, 512), (1, 256))}, "glm5_next_text": {"replicate": ((1, 256),)},
    **{name: _TRAIN_2X512 for name in (
        "qwen4_exp_text", "mistral_large4_text", "longcat_flash", "hy_v4_vl_text", "minimax_m3_vl_text",
        "inkling_text", "ergo", "muse_spark_text", "lfm2_moe", "kolibri1_1")},
}
_LAYER_COUNTS = ("num_hidden_layers", "num_layers")
_DENSE_FIRST = ("first_k_dense_replace", "num_dense_layers", "first_k_dense")


def layer_overrides(model_type: str) -> dict:
    """Config overrides for the fewest layers of each kind (per-layer lists cut to them), one dense layer first
    where the family starts dense, `mlp_only_layers` renumbered. Keys are dotted from the plan's model config: a
    family whose decoder sits in a composite model (`glm4v_moe_text` in `glm4v_moe`) gets `text_config.` keys, and
    every other tower of that model (vision, audio, a second decoder) is cut to one layer: a text batch never runs
    them, so they only hold their weights."""
    from planc.models.build import ModelBuildError, overridden_config
    from planc.models.families import family
    from planc.models.tiny import _kept_layers

    fam = family(model_type)
    prefix = "".join(f"{p}." for p in fam.config_path)
    top = overridden_config(fam.model_type, {prefix + k: v for k, v in _given(model_type).items()})
    config = top
    for part in fam.config_path:
        config = getattr(config, part)
    d = config.to_dict()
    key = next((k for k in _LAYER_COUNTS if isinstance(d.get(k), int)), None)
    out: dict = {}
    if key is not None:  # else the layers are a per-kind list already (Nemotron-H's `layers_block_type`)
        n = d[key]
        keep = _kept_layers(d, n)
        out[key] = len(keep)
        for k, v in d.items():
            if isinstance(v, list) and len(v) == n and n > 1:
                out[k] = [v[i] for i in keep]
        for k in _DENSE_FIRST:
            if isinstance(d.get(k), int) and d[k] > 0:
                out[k] = 1
        if isinstance(d.get("mlp_only_layers"), list) and d["mlp_only_layers"]:
            out["mlp_only_layers"] = [j for j, i in enumerate(keep) if i in d["mlp_only_layers"]]
    out = {prefix + k: v for k, v in {**out, **LAYERS.get(model_type, {})}.items()}
    given = {prefix + k: v for k, v in _given(model_type).items()}
    towers = {}
    for k, v in _other_towers(top, fam.config_path).items():
        # a tower whose config checks its layer count against per-layer lists (Muse Spark's audio pyramid: one
        # patch size, width and depth per layer) keeps its own count
        try:
            overridden_config(fam.model_type, {**given, **out, **towers, k: v})
        except ModelBuildError:
            continue
        towers[k] = v
    return {**out, **towers}


def _other_towers(config, text_path: tuple, path: tuple = ()) -> dict:
    """`{dotted key: 1}` for the layer count of every sub-config of `config` not on `text_path`."""
    out = {}
    for attr in getattr(type(config), "sub_configs", None) or {}:
        sub, here = getattr(config, attr, None), (*path, attr)
        if sub is None or here == text_path:
            continue
        on_path = here == text_path[: len(here)]  # a config holding the text decoder (Qwen3-Omni's thinker)
        if not on_path:  # a tower of its own: one layer
            count = next((k for k in (*_LAYER_COUNTS, "depth", "encoder_layers")
                          if isinstance(getattr(sub, k, None), int)), None)
            if count is not None and getattr(sub, count) > 1:
                out[".".join((*here, count))] = 1
        out.update(_other_towers(sub, text_path if on_path else (), here))
    return out


def family_overrides(model_type: str) -> dict:
    from planc.models.families import family

    prefix = "".join(f"{p}." for p in family(model_type).config_path)
    return {**{prefix + k: v for k, v in _given(model_type).items()}, **layer_overrides(model_type)}


def _given(model_type: str) -> dict:
    """The family's config values other than its layers: a checkpoint's (`CONFIG`), then what is smaller (`SHRINK`)."""
    return {**CONFIG.get(model_type, {}), **SHRINK.get(model_type, {})}


def init_plan_data(model_type: str, overrides: dict, size: Optional[int] = None) -> dict:
    """The plan `planc init` writes for the family on the point's config, at `size` (tp = ep)."""
    import yaml

    from planc.models.synthesis import init_plan

    text = init_plan(model_type, None, overrides, sizes=(size or SIZES.get(model_type, 2),))
    data = yaml.safe_load(text)
    data["parallel"].setdefault("dp_size", 1)
    return data


def points(only=None, modes=("serve", "replicate"), held_out: bool = True) -> list[dict]:
    """The grid points of the families section (plans written by `planc init`, so this costs seconds a family)."""
    out = []
    for model_type in ORDER:
        if only and model_type not in only:
            continue
        overrides = family_overrides(model_type)
        base = init_plan_data(model_type, overrides)
        for mode in modes:
            shapes = [POINTS_OF.get(model_type, {}).get(mode, POINTS[mode])]
            if held_out:
                shapes += HELD_OUT.get(mode, ()) + HELD_OUT_OF.get(model_type, {}).get(mode, ())
            plan = dict(base)
            if mode != "serve":
                plan["training"] = {"data_parallel": "replicate"}
            out += [{"family": model_type, "mode": mode, "batch": batch, "seq": seq, "overrides": overrides, "dp": 1,
                     "plan": plan} for batch, seq in shapes]
    return out


def _machine(entry: dict) -> str:
    machine = entry.get("machine", "")
    if entry["point"].get("device") == "cuda":
        return machine.split(",")[0]
    return "GPU host's CPU" if "16 cores" in machine else "2-core CPU"


def table(cache: dict, predictions: dict) -> str:
    """docs/memory.md's families table: one row per cached point (`predictions`: cache key -> `planc explain`'s
    memory JSON for it), families in ORDER, first points before held-out ones."""
    rows = ["| family | mode | plan (`planc init`) | layers | config changed | batch x seq | predicted GiB | "
            "measured GiB | error | point | explain | measured on | peak moment |",
            "| --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
    rank = {f: i for i, f in enumerate(ORDER)}

    def order(key: str):
        p = cache[key]["point"]
        return (rank.get(p["family"], len(rank)), p["mode"] != "serve", p.get("device", "cpu"),
                (p["batch"], p["seq"]) in HELD_OUT.get(p["mode"], ()) + HELD_OUT_OF.get(p["family"], {}).get(p["mode"], ()),
                p["seq"])

    for key in sorted(cache, key=order):
        entry, pred = cache[key], predictions[key]
        p = entry["point"]
        par = p["plan"]["parallel"]
        changed = ", ".join([*(f"{k.rsplit('.', 1)[-1]} {v}" for k, v in SHRINK.get(p["family"], {}).items()),
                             *([f"a checkpoint's {', '.join(CONFIG[p['family']])}"] if p["family"] in CONFIG else [])])
        changed = changed or "-"
        layers = next((v for k, v in p["overrides"].items() if k.rsplit(".", 1)[-1] in _LAYER_COUNTS), "default")
        held = entry.get("held_out", False)
        error = pred["peak_per_rank"] / entry["peak"] - 1
        verdict = ("no verdict" if not pred.get("validated", True) else "flagged" if pred.get("unpriced")
                   else "validated")
        rows.append(f"| {p['family']} | {p['mode']} | tp {par['tp_size']} / ep {par.get('ep_size', 1)} | {layers} | "
                     f"{changed} | {p['batch']} x {p['seq']} | {pred['peak_per_rank'] / 2**30:.3f} | "
                     f"{entry['peak'] / 2**30:.3f} | {error:+.1%} | {'held out' if held else 'fit'} | {verdict} | "
                     f"{_machine(entry)} | {pred['peak_moment']} |")
    return "\n".join(rows) + "\n"


TABLE_MARKERS = ("<!-- families table -->\n", "<!-- end families table -->")


def with_table(doc: str, rendered: str) -> str:
    """`doc` with the text between TABLE_MARKERS replaced by `rendered`."""
    head, rest = doc.split(TABLE_MARKERS[0], 1)
    _, tail = rest.split(TABLE_MARKERS[1], 1)
    return head + TABLE_MARKERS[0] + rendered + TABLE_MARKERS[1] + tail


if __name__ == "__main__":  # python bench/memory_grid_families.py [docs/memory.md]: print (or write) the table
    import json
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent))
    sys.path.insert(0, str(here))
    from memory_grid import predict_all

    cache = json.loads((here / "memory_grid_families.json").read_text())
    keys = list(cache)
    rendered = table(cache, dict(zip(keys, predict_all([cache[k]["point"] for k in keys]))))
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(with_table(Path(sys.argv[1]).read_text(), rendered))
    else:
        print(rendered, end="")
