"""planc.save and planc.export of a model loaded from an FP8 checkpoint with FP8 kept (`dequantize=False`), 2 gloo ranks.

The kept model holds float8_e4m3fn weights and fp32 block scales (transformers' FP8Linear / FP8Experts). planc.save
writes them as they are; planc.load of that directory keeps them FP8 (the config still says `quantization_config`) and
gets every local shard back bit for bit, while asking it to dequantize is refused before reading. planc.export gathers
the FP8 shards (as bytes: gloo has no float8) and writes the hub layout back through transformers' reverse
conversion: the very tensors of the original checkpoint, which plain `from_pretrained` loads (dequantizing on the CPU)
to the same logits as the original.
"""

import pytest
import torch
from safetensors import safe_open

from tests.checkpoint.workers import fp8_kept_world
from tests.distributed import run_distributed
from tests.runtime.load_fp8_workers import write_fp8_checkpoint
from tests.runtime.workers import batch


def _tensors(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.distributed
def test_fp8_kept_model_saves_reloads_and_exports(tmp_path):
    write_fp8_checkpoint("deepseek_v3", tmp_path / "fp8")
    results = run_distributed(fp8_kept_world, 2, str(tmp_path))
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        assert res["keys"] == [] and res["differ"] == [], (rank, res["keys"], res["differ"])
        assert "torch.float8_e4m3fn" in res["dtypes"]
        linears, experts = res["fp8_modules"][:2]
        assert linears > 0 and experts > 0 and res["fp8_modules"][2:] == [linears, experts]
        assert res["quantization_config"] and res["fingerprint"]
        assert res["dequantized_reload"].startswith("ApplyError") and "FP8 kept only" in res["dequantized_reload"]

    exported, original = _tensors(tmp_path / "exported"), _tensors(tmp_path / "fp8")
    assert sorted(exported) == sorted(original)
    for key, t in original.items():
        assert exported[key].dtype == t.dtype and torch.equal(exported[key].view(torch.uint8), t.view(torch.uint8)), key

    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32)(batch(3)).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32)(batch(3)).logits
    assert torch.equal(a, b)
