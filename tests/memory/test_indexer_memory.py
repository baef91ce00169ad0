"""DeepSeek Sparse Attention's indexer priced from transformers' code (planc.compiler.indexer_memory) against each
family's indexer module really running: its default widths, bf16, a prefill of the same 256 tokens as one sequence
and split over 2 and 4, torch's MemTracker counting what the indexer allocates beyond its parameters and inputs.
At batch > 1 the score product copies the keys for every query (the broadcast of their batch dimensions): 2-3x
the indexer's batch-1 memory at the same tokens, which is what the rule must follow."""

from __future__ import annotations

import functools
import importlib
import inspect

import pytest
import torch
import transformers
from torch.distributed._tools.mem_tracker import MemTracker, _ModState

from planc.compiler.family_memory import family_memory
from planc.compiler.indexer_memory import indexer_rope, prefill_bytes
from planc.verification.memory import no_backward_hooks_without_grad

# model type -> (the grid's family row, the indexer class in its modeling file); index heads / head dim:
# A.X K2 16 / 128 (the keys' broadcast 8x its scores), DeepSeek-V3.2 64 / 128, Mistral Large 4 32 / 128 (queries from
# the hidden states, a log-position scaling), dots.llm3 64 / 128 (fp32 rotary: fp32 queries)
INDEXERS = {
    "axk2": ("axk2", "AXK2Indexer"),
    "deepseek_v32": ("deepseek_v32", "DeepseekV32Indexer"),
    "mistral_large4": ("mistral_large4_text", "MistralLarge4TextIndexer"),
    "dots3_note": ("dots3_note_text", "Dots3NoteTextIndexer"),
}


@functools.cache
def _indexer(model_type: str):
    config = transformers.CONFIG_MAPPING[model_type]()
    config = getattr(config, "text_config", None) or config
    config.no_rope_layers = [1]  # Mistral Large 4: layer 0 applies rotary (the larger of its two paths)
    config.allow_global_per_layer_attribute_access = True
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    indexer = getattr(module, INDEXERS[model_type][1])(config, 0).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in indexer.parameters():
            p.normal_(0, 0.02)
    return indexer, config


@pytest.mark.parametrize("model_type, batch, seq", [
    *((m, b, s) for m in sorted(INDEXERS) for b, s in ((1, 256), (2, 128))), ("axk2", 4, 64)])
def test_the_indexer_prefill_is_priced_from_its_code(model_type, batch, seq):
    indexer, config = _indexer(model_type)
    row = family_memory(INDEXERS[model_type][0])
    rope = indexer_rope(config.to_dict())
    # the rotary tables as the model hands them to its indexed layers: fp32 where it computes them from
    # `inputs_embeds.float()` (dots.llm3), else the model dtype
    table_dtype = torch.float32 if row.indexer_rope_fp32 else torch.bfloat16
    tracker = MemTracker()
    tracker.track_external(indexer)
    with no_backward_hooks_without_grad(), tracker, torch.no_grad():  # the inputs too, so that they count before it
        _run(indexer, config, batch, seq, rope, table_dtype)
    # the module's own peak above what was live as it started (its parameters and inputs)
    stats = tracker.memory_tracking[indexer].snapshots
    dev = torch.device("cpu")
    allocated = stats[_ModState.PEAK_FW][-1][dev]["Total"] - stats[_ModState.PRE_FW][-1][dev]["Total"]
    rule = prefill_bytes(batch, seq, config.index_n_heads, config.index_head_dim, 2, rope, row.indexer_rope_fp32)
    assert -0.02 <= rule / allocated - 1 <= 0.05, (allocated, rule)


def _run(indexer, config, batch: int, seq: int, rope: int, table_dtype: torch.dtype) -> None:
    """One prefill of the indexer on random inputs of the shapes its attention hands it."""
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * torch.rand(rope)[None, :]
    cos, sin = (f(angles).expand(batch, seq, rope).to(table_dtype) for f in (torch.cos, torch.sin))
    inputs = {
        "hidden_states": torch.randn(batch, seq, config.hidden_size, dtype=torch.bfloat16),
        "q_resid": torch.randn(batch, seq, getattr(config, "q_lora_rank", None) or 1, dtype=torch.bfloat16),
        "position_embeddings": (cos, sin),
        "attention_mask": torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, seq, seq),
        "position_ids": torch.arange(seq).expand(batch, seq),
        "cache": None,
    }
    accepted = inspect.signature(indexer.forward).parameters
    indexer(**{k: v for k, v in inputs.items() if k in accepted})
