"""The one tiny-config derivation (planc.models.tiny) on real transformers config classes.

transformers' default configs of several families cannot build a model (fields left None that the model
needs, per-layer lists that do not match the layer count, towers of different widths); the derivation
must fill and shrink them in general. Each test builds the real config (and model, where it says so) and
checks the property the derivation promises; the sweep (tests/families/test_sweep.py) then runs every family on 2 ranks.
"""

from __future__ import annotations

import pytest
import torch

from planc.models import build
from planc.models.families import family, text_config_of
from planc.models.build import TINY_CONFIGS, build_tiny_model, tiny_config


def _text(name: str):
    fam = family(name)
    return text_config_of(fam, tiny_config(fam))


def test_one_derivation_for_demo_tests_and_sweep():
    from planc.models.tiny import tiny_family_config
    from tests.families import sweep

    for gone in ("derive_tiny_config", "shrink_config", "shrink_other_config", "_TINY_DERIVED"):
        assert not hasattr(build, gone), gone
    # the hand-tuned values are overrides on top of the derivation, not a second derivation
    want = tiny_family_config(family("mixtral"), **TINY_CONFIGS["mixtral"]).to_dict()
    assert tiny_config("mixtral").to_dict() == want
    # the sweep builds through the same tiny_config: no tiny-config or model builder of its own
    assert not {"tiny_family_config", "build_family_model"} & set(vars(sweep)), sorted(vars(sweep))
    assert tiny_config("qwen2_moe").num_experts == 8  # derived: no hand-tuned entry


def test_per_layer_kinds_the_defaults_leave_none_are_filled():
    lfm2 = _text("lfm2_moe")  # layer_types None by default; the model indexes it
    assert set(lfm2.layer_types) == {"conv", "full_attention"} and len(lfm2.layer_types) == lfm2.num_hidden_layers
    ocr = _text("deepseek_ocr2_text")  # mlp_layer_types None: its docstring names "dense" and "sparse"
    assert set(ocr.mlp_layer_types) == {"dense", "sparse"}


def test_all_recurrent_default_gets_its_attention_layer():
    granite = _text("granitemoehybrid")  # the default computes every layer as linear_attention
    assert "full_attention" in granite.layer_types and "linear_attention" in granite.layer_types


def test_required_sizes_left_none_are_filled():
    dots1 = _text("dots1")
    assert (dots1.n_shared_experts, dots1.n_routed_experts) == (1, 8)
    gemma = _text("diffusion_gemma_text")
    assert (gemma.num_experts, gemma.top_k_experts, gemma.moe_intermediate_size) == (8, 2, 32)
    qwen4 = _text("qwen4_exp_text")  # indexed layers need every QSA field
    assert qwen4.indexer_kv_heads == 1 and qwen4.indexer_budget % qwen4.indexer_compress_ratio == 0


def test_computed_values_and_relations_hold():
    granite = _text("granitemoehybrid")  # mamba_d_head "auto": computed from the tiny sizes
    assert granite.mamba_d_head * granite.mamba_n_heads == granite.mamba_expand * granite.hidden_size
    glm5 = _text("glm5_next_text")  # NoPE attention stays NoPE; topk stays a multiple of the pool
    assert glm5.qk_rope_head_dim == 0 and glm5.index_topk % glm5.index_kpool == 0
    nemo = _text("nemotron_h")  # groups of mamba heads still divide the heads
    assert nemo.mamba_num_heads % nemo.n_groups == 0


def test_per_layer_overrides_follow_the_kept_layers():
    dots3 = _text("dots3_note_text")
    per_layer = dots3.to_dict()["per_layer_config"]  # {"2": {...}}: what differs from the config, by layer
    assert per_layer and max(int(k) for k in per_layer) < dots3.num_hidden_layers
    for entry in per_layer.values():
        if "qk_nope_head_dim" in entry:  # SWA layers: nope + rope == head_dim, as in the defaults
            assert entry["qk_nope_head_dim"] + dots3.qk_rope_head_dim == dots3.head_dim


def test_mrope_sections_fit_the_tiny_rotary_dim():
    glm4v = _text("glm4v_moe_text")  # sections only in the modeling code's default
    rotary = glm4v.hidden_size // glm4v.num_attention_heads * glm4v.rope_parameters["partial_rotary_factor"]
    assert sum(glm4v.rope_parameters["mrope_section"]) * 2 == rotary
    ernie = _text("ernie4_5_vl_moe_text")  # height and width sections stay equal
    sections = ernie.rope_parameters["mrope_section"]
    assert sections[0] == sections[1] and sum(sections) * 2 == ernie.hidden_size // ernie.num_attention_heads


def test_every_tower_of_a_multimodal_model_is_tiny():
    for name in ("muse_spark_text", "mistral_large4_text", "unlimited_ocr_text", "qwen3_omni_moe_talker_text"):
        config = tiny_config(family(name))
        with torch.device("meta"):
            model = family(name).model_class(config)._from_config(config)
        assert sum(p.numel() for p in model.parameters()) < 20_000_000, name


@pytest.mark.parametrize("name", [
    "deepseek_ocr2_text", "diffusion_gemma_text", "dots1", "dots3_note_text", "dots3_note_vision_encoder",
    "ernie4_5_vl_moe_text", "glm4v_moe_text", "glm5_next_text", "granitemoehybrid", "lfm2_moe",
    "mistral_large4_text", "muse_spark_text", "nemotron_h", "qwen4_exp_text", "step3p5", "unlimited_ocr_text",
])
def test_transformers_own_forward_runs_on_the_tiny_config(name):
    """transformers' own unsharded forward on the derived config: finite logits, the same for the same seed."""
    model = build_tiny_model(family(name))
    ids = torch.randint(0, model.get_input_embeddings().weight.shape[0], (2, 7), generator=torch.Generator().manual_seed(1))
    outs = []
    for _ in range(2):
        torch.manual_seed(2)
        with torch.no_grad():
            outs.append(model(input_ids=ids).logits)
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


def test_a_top_model_that_only_generates_is_compared_on_the_submodule_of_its_config():
    """transformers' Qwen3 Omni MoE top model (thinker + talker + code2wav) only generates (calling it raises
    NotImplementedError): the sweep compares the forward of the talker, the outermost module with a forward
    of its own whose config holds the family's (talker) text config, fed embeddings (it ignores input_ids)."""
    from tests.families.sweep import _logits, comparison_inputs, comparison_path

    fam = family("qwen3_omni_moe_talker_text")
    model = build_tiny_model(fam)
    assert type(model).forward is torch.nn.Module.forward
    with pytest.raises(NotImplementedError):
        model(torch.zeros(1, 3, dtype=torch.long))
    path = comparison_path(model, fam)
    assert path == "talker" and type(model.talker).__name__ == "Qwen3OmniMoeTalkerForConditionalGeneration"
    assert model.talker.config.text_config is text_config_of(fam, model.config)
    inputs = comparison_inputs(model.talker, top=False)
    hidden = model.talker.config.text_config.hidden_size
    assert set(inputs) == {"inputs_embeds"} and inputs["inputs_embeds"].shape[-1] == hidden
    with torch.no_grad():
        logits = _logits(model.talker(**inputs))
    assert logits.shape[:2] == (2, 7) and torch.isfinite(logits).all()
    assert comparison_path(build_tiny_model(family("qwen3_moe")), family("qwen3_moe")) == ""


def test_parameters_transformers_leaves_uninitialized_are_seeded():
    """The omni top model's `_init_weights` knows only the thinker's MoE block: the talker's experts come out of
    `torch.empty`. The tiny model seeds them, so every rank (and every build) holds the same weights."""
    fam = family("qwen3_omni_moe_talker_text")
    a = build_tiny_model(fam)
    torch.randn(1000, 1000)  # reuse the allocator's memory with other values
    b = build_tiny_model(fam)
    sb = b.state_dict()
    assert all(torch.equal(v, sb[k]) for k, v in a.state_dict().items()), "two builds differ"
    experts = a.talker.model.layers[0].mlp.experts
    assert torch.isfinite(experts.gate_up_proj).all() and 0.01 < experts.gate_up_proj.std().item() < 0.04
    assert not torch.are_deterministic_algorithms_enabled()


def test_init_plans_every_stack_of_experts_in_the_model():
    """A diffusion model runs the family's layers twice (its encoder's language model and its decoder, built
    from the top config); dots3_note has experts in its vision encoder and its language model: the plan init
    writes shards all of them (transformers' own EP plan leaves the decoder's experts replicated)."""
    from planc.models.synthesis import init_plan

    for name, prefixes in (("diffusion_gemma_text", ("model.encoder.language_model.layers", "model.decoder.layers")),
                           ("dots3_note_vision_encoder", ("model.vision_tower.blocks", "model.language_model.layers"))):
        fam = family(name)
        text = init_plan(fam.model_type, tiny_config(fam).to_dict(), sizes=(2,))
        for prefix in prefixes:
            assert f"  {prefix}.*.mlp.experts: ep_dispatch_experts\n" in text or \
                f"  {prefix}.*.experts: ep_dispatch_experts\n" in text, (name, prefix, text)


def test_a_switch_that_turns_the_experts_on_is_on():
    gemma4 = _text("gemma4_text")  # enable_moe_block is False by default; Gemma 4's MoE checkpoints set it
    assert gemma4.enable_moe_block is True and (gemma4.num_experts, gemma4.top_k_experts) == (8, 2)
    model = build_tiny_model(family("gemma4_text"))
    assert any(n.endswith(".experts") for n, _ in model.named_modules())


def test_dense_layer_lists_keep_a_dense_and_a_moe_layer():
    # mlp_only_layers [0, 1]: cutting to the first layer of each attention kind kept only dense ones
    flint = _text("flint")
    assert flint.mlp_only_layers and len(flint.mlp_only_layers) < flint.num_hidden_layers
    assert all(0 <= i < flint.num_hidden_layers for i in flint.mlp_only_layers)
    model = build_tiny_model(family("flint"))
    assert any(n.endswith(".experts") for n, _ in model.named_modules())


def test_expert_counts_exercise_expert_parallelism():
    assert _text("hunyuan_v1_moe").num_experts == 8  # the default has 1 expert (Hunyuan-A13B has 64)
    longcat = _text("longcat_flash")  # parameter-free "zero" experts shrink with the routed ones
    assert (longcat.n_routed_experts, longcat.zero_expert_num) == (8, 4)


def test_one_expert_is_refused_for_expert_parallelism_with_its_reason():
    from planc.models.synthesis import init_plan
    import planc
    from planc.errors import CompileError

    fam = family("hunyuan_v1_moe")
    config = tiny_config(fam, num_experts=1)  # transformers' default expert count
    text = init_plan(fam.model_type, config.to_dict(), sizes=(2,))
    assert "ep_size" not in text.split("version: 1")[1].split("experts:")[0]  # written without EP
    assert "PLC606 1 experts cannot be split evenly over ep_size=2" in text  # and says why
    with torch.device("meta"):
        meta = fam.model_class(config)._from_config(config, dtype=torch.float32)
    plan = text.replace("  tp_size: 2\n", "  tp_size: 2\n  ep_size: 2\n") + (
        "ep_plan:\n  model.layers.*.mlp.experts.gate_up_proj: grouped_gemm\n"
        "  model.layers.*.mlp.experts.down_proj: grouped_gemm\n  model.layers.*.mlp.experts: ep_dispatch_experts\n")
    plan = "\n".join(ln for ln in plan.splitlines() if "mlp.experts" not in ln or "grouped_gemm" in ln
                     or "ep_dispatch" in ln) + "\n"
    with pytest.raises(CompileError) as e:
        planc.compile(meta, plan)
    assert [p.code for p in e.value.problems] == ["PLC606"]
    assert "1 experts cannot be split evenly over ep_size=2" in e.value.problems[0].message


def test_a_shorter_tiny_context_keeps_yarns_factor(capfd):
    """gpt-oss's YaRN factor (32) is its context over the original one: the tiny context (128) shortens the original
    with it, or transformers warns at every model built (three times in `planc demo gpt_oss`)."""
    config = tiny_config("gpt_oss")
    rope = config.rope_parameters
    assert rope["rope_type"] == "yarn" and config.max_position_embeddings == 128
    assert config.max_position_embeddings / rope["original_max_position_embeddings"] == rope["factor"] == 32
    build_tiny_model("gpt_oss")
    assert "RoPE scaling factor" not in capfd.readouterr().err
