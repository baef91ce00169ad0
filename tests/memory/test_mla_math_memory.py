"""What an MLA attention keeps for backward where sdpa runs its math path (a CPU; the value heads narrower than the
query's), priced by `peak_memory.layer_saved` on the shapes `layer_shapes` reads, and what its forward holds at
the peak of a prefill, against the attention module really running forward under torch's MemTracker: dots.llm3's indexed layer (128 heads of 128 + 64, a 512 latent,
its indexer) and its sliding layer, whose own entry in the config's `per_layer_config` gives it 64 heads of 192 + 64
over a 1024 latent: priced at the model-wide widths, the sliding layer would keep twice the S x S scores it does."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch
import transformers
from torch.distributed._tools.mem_tracker import MemTracker, _ModState

from planc.compiler import attention_memory, indexer_memory, peak_memory
from planc.compiler.family_memory import family_memory
from planc.verification.memory import no_backward_hooks_without_grad
from tests.memory.test_layer_parts import compiled_point, shapes_of

FAMILY = "dots3_note_text"


@pytest.fixture(scope="module")
def grid_point():
    """The layer shapes the families grid's dots.llm3 point prices on a CPU, and its model config."""
    compiled, walk = compiled_point(FAMILY)
    shapes = attention_memory.with_sdpa_math(shapes_of(compiled, walk), "cpu")
    return shapes, peak_memory.text_config(walk.config.to_dict())


@pytest.mark.parametrize("layer, seq", [(0, 512), (2, 512)])
def test_the_mla_math_path_keeps_what_the_rule_prices(grid_point, layer, seq):
    shapes, config = grid_point
    s = shapes[layer]
    assert s.attention == "mla" and s.sdpa_math
    attn, text = _attention(config, layer)
    assert (s.heads, s.kv_lora) == (attn.num_heads, attn.kv_lora_rank)  # the layer's own widths
    hidden, a, batch = int(config["hidden_size"]), 2, 1
    tokens = batch * seq
    rule = peak_memory.layer_saved(replace(s, mlp="none"), hidden, a, tokens, 0, 8, family_memory(FAMILY), batch)
    rule -= tokens * (peak_memory._norm(hidden, a) + a * hidden)  # the layer's input norm, outside the attention
    kept, _ = _forward(attn, text, s.layer_type, batch, seq)
    assert -0.02 <= rule / kept - 1 <= 0.05, (kept, rule)


@pytest.mark.parametrize("layer, batch, seq", [(0, 1, 512), (2, 2, 256)])
def test_the_mla_math_path_prefill_is_priced_from_its_code(grid_point, layer, batch, seq):
    """A prefill's peak in the attention: the math path's fp32 scores and q, k, v beside what the layer's forward
    holds in the model dtype, the picks' masks; in an indexed layer, or the indexer's scores beside the same."""
    shapes, config = grid_point
    s = shapes[layer]
    attn, text = _attention(config, layer)
    a, tokens = 2, batch * seq
    held = tokens * attention_memory.mla_math_held(s, a)
    rule = attention_memory.sdpa_math_prefill(s, batch, seq) + held
    if s.indexer_heads:
        rule = max(rule + indexer_memory.attention_mask_bytes(batch, seq, a, s.attn_impl, s.sdpa_math),
                   held + indexer_memory.prefill_bytes(batch, seq, s.indexer_heads, s.indexer_dim, a, s.indexer_rope,
                                                       family_memory(FAMILY).indexer_rope_fp32))
    with torch.no_grad():
        _, peak = _forward(attn.eval(), text, s.layer_type, batch, seq)
    assert -0.02 <= rule / peak - 1 <= 0.05, (peak, rule)


def _attention(config: dict, layer: int):
    """The attention module of decoder layer `layer` built from the grid point's config (its per-layer entries too),
    in bf16, weights drawn at random."""
    text = transformers.CONFIG_MAPPING["dots3_note"]().text_config
    for key in ("num_hidden_layers", "layer_types", "mlp_layer_types"):
        setattr(text, key, config[key])
    text._attn_implementation = "sdpa"
    module = importlib.import_module("transformers.models.dots3_note.modeling_dots3_note")
    with torch.device("meta"):
        attn = module.Dots3NoteTextAttention(text, layer)
    attn = attn.to_empty(device="cpu").to(torch.bfloat16).train()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02)
    return attn, text


def _forward(attn, text, kind: str, batch: int, seq: int) -> tuple[int, int]:
    """Bytes the module holds after its forward beyond its parameters, inputs and output (what backward will read),
    and its forward's peak above its parameters and inputs. The inputs as the model hands them over: fp32 rotary tables to an indexed layer (computed from
    `inputs_embeds.float()`), model-dtype ones to the others, a boolean causal mask (a sliding one for the sliding
    layer)."""
    tracker = MemTracker()
    tracker.track_external(attn)
    with no_backward_hooks_without_grad(), tracker:  # the inputs too, so that they count before it
        rope = text.qk_rope_head_dim
        table = torch.float32 if kind == indexer_memory.INDEXED else torch.bfloat16
        angles = torch.arange(seq, dtype=torch.float32)[:, None] * torch.rand(rope)[None, :]
        cos, sin = (f(angles).expand(batch, seq, rope).to(table) for f in (torch.cos, torch.sin))
        i = torch.arange(seq)
        mask = i[None, :] <= i[:, None]
        if kind == "sliding_attention":
            mask = mask & (i[:, None] - i[None, :] < text.sliding_window)
        x = torch.randn(batch, seq, text.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        out, _ = attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask.expand(batch, 1, seq, seq))
    snapshots = tracker.memory_tracking[attn].snapshots
    dev = torch.device("cpu")
    before = snapshots[_ModState.PRE_FW][-1][dev]["Total"]
    held = snapshots[_ModState.POST_FW][-1][dev]["Total"] - before
    return held - out.numel() * out.element_size(), snapshots[_ModState.PEAK_FW][-1][dev]["Total"] - before
