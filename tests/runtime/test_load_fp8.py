"""planc.load of DeepSeek-V3-style FP8 block-scaled checkpoints, on 2 gloo ranks.

On this CPU-only machine transformers dequantizes an FP8 checkpoint as it loads (its quantizer's rule: FP8 kernels
need a CUDA GPU of compute capability >= 8.9), so the reference is exactly that: an unsharded `from_pretrained` of the
FP8 checkpoint followed by `planc.apply`. planc.load must give bit-identical logits while each rank reads only its
shard of each weight and of its `weight_scale_inv`. The FP8-kept load (`dequantize=False`, what a GPU gets) cannot
run transformers' FP8 kernels here; its FP8 and scale shards are checked against the dequantized ones through
transformers' own Fp8Dequantize, bit for bit.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.runtime.load_fp8_workers import (
    FP8_CASES,
    OFF_GRID,
    fp4_world,
    fp8_world,
    write_fp4_experts_checkpoint,
    write_fp8_checkpoint,
)

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("planc_load")]
CASES = sorted(FP8_CASES)
ON_GRID = [c for c in CASES if c not in OFF_GRID]


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    for case in CASES:
        write_fp8_checkpoint(case, root / case)
    return root


@pytest.fixture(scope="module")
def two_ranks(fp8_checkpoints):
    return run_distributed(fp8_world, 2, str(fp8_checkpoints), CASES)


@pytest.mark.parametrize("model_type", CASES)
def test_fp8_load_is_bit_identical_to_full_load_then_apply(two_ranks, model_type):
    # Off the grid too: each rank reads the scale blocks its 1.5-block shards touch, expanded per element.
    for rank, res in enumerate(two_ranks):
        assert res[model_type] is True, (rank, res[model_type])
        assert res[model_type + "/compiled"] is True, rank
        assert res[model_type + "/shards"] == [], (rank, res[model_type + "/shards"])
        assert res[model_type + "/no_quantization_left"], rank  # as from_pretrained: dequantized, config dropped


@pytest.mark.parametrize("model_type", ON_GRID)
def test_fp8_kept_shards_hold_the_checkpoint_blocks(two_ranks, model_type):
    for rank, res in enumerate(two_ranks):
        kept = res[model_type + "/kept"]
        assert isinstance(kept, dict), (rank, kept)
        assert kept["bad"] == [], (rank, kept["bad"])
        assert kept["fp8_linears"] > 0 and kept["fp8_experts"] > 0, kept
        assert kept["sharded_scales"] > 0, kept  # the scales of TP/EP-sharded weights are sharded with them


def test_fp8_kept_off_grid_is_refused_on_every_rank_before_reading(two_ranks):
    messages = [res["mixtral_off_grid/kept"] for res in two_ranks]
    for msg in messages:
        assert msg.startswith("ApplyError: planc.load: nothing was installed"), msg
        assert "PLC625" in msg and "self_attn.q_proj.weight" in msg and "192 rows" in msg, msg
        assert "dequantize=True" in msg, msg  # the hint names the way that works
    assert messages[0] == messages[1]


def test_fp8_checkpoint_into_megamoe_fp4_experts(two_ranks):
    """A Mega MoE plan on an FP8 checkpoint: dequantized per shard, then FP4 per layer, as full load + apply."""
    for rank, res in enumerate(two_ranks):
        assert res["megamoe"] is True, (rank, res["megamoe"])
        assert res["megamoe/fp4"] == "torch.int8", res["megamoe/fp4"]  # e2m1 packed
        kept = res["megamoe/kept"]
        assert kept.startswith("ApplyError: planc.load: nothing was installed") and "dequantize=True" in kept, kept
        assert "deepgemm_megamoe" in kept, kept


def test_fp4_experts_load_straight_into_megamoe(tmp_path_factory):
    """DeepSeek-V4's FP4 experts (e2m1 + UE8M0 per 32) under the Mega MoE plan: each rank's experts hold exactly the
    checkpoint's FP4 bytes and scales of its own experts (int8 on `meta` before reading: never a bf16 copy), and
    the logits equal transformers' unsharded from_pretrained (FP4 dequantized) + planc.apply (quantized back to
    FP4: the same values, as planc's cast of a dequantized FP4 block gives it back)."""
    path = tmp_path_factory.mktemp("fp4") / "deepseek_v4"
    write_fp4_experts_checkpoint(path)
    per_rank = run_distributed(fp4_world, 2, str(path))
    for rank, res in enumerate(per_rank):
        assert "fp4/error" not in res, res["fp4/error"]
        assert res["fp4/bytes"] == [] and res["fp4/checked"] == 8, (rank, res)
        assert res["fp4/logits"] is True, (rank, res["fp4/logits"])
        msg = res["fp4/not_megamoe"]  # the shipped all-reduce plan has no Mega MoE experts: refused before reading
        assert msg.startswith("ApplyError: planc.load: nothing was installed") and "`expert_dtype: fp4`" in msg, msg
        assert "deepgemm_megamoe" in msg, msg


def test_block_scale_slice_reads_weight_coordinates(fp8_checkpoints):
    """A scale indexed with its weight's shard reads only that shard's blocks; off the grid, one factor per element."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from planc.checkpoint.files import CheckpointFiles
    from planc.checkpoint.quantized import BlockScaleSlice

    files = CheckpointFiles.open(fp8_checkpoints / "deepseek_v3")
    try:
        key = "model.layers.0.self_attn.q_b_proj.weight"  # [768, 256], scale [6, 2]
        slices = files.slices()
        w, s = slices[key][...], slices[key + "_scale_inv"][...]
        scale = BlockScaleSlice(slices[key + "_scale_inv"], (768, 256), (6, 2), "F32", (128, 128))
        assert scale.get_shape() == [768, 256]
        assert torch.equal(scale[256:512, 0:256], s[2:4, 0:2])  # on the grid: blocks only
        assert torch.equal(scale[...], s)
        off = scale[64:320, 100:256]  # off the grid: per element
        assert off.shape == (256, 156)
        assert torch.equal(off, s.repeat_interleave(128, 0).repeat_interleave(128, 1)[64:320, 100:256])
        deq = Fp8Dequantize(None)
        full = deq._dequantize_one(w, s, output_dtype=torch.float32)
        assert torch.equal(deq._dequantize_one(w[64:320, 100:256], off, output_dtype=torch.float32), full[64:320, 100:256])
        assert torch.equal(deq._dequantize_one(w[256:512], scale[256:512, 0:256], output_dtype=torch.float32),
                           full[256:512])
    finally:
        files.close()
    # A weight ending in a partial block (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows, 4.5 blocks): per element.
    w = torch.randn(192, 256).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2) + 0.5
    partial = BlockScaleSlice(s, (192, 256), (2, 2), "F32", (128, 128))
    expected = w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:192]
    assert torch.equal(deq._dequantize_one(w, partial[...], output_dtype=torch.float32), expected)
    assert torch.equal(deq._dequantize_one(w[96:192], partial[96:192, 0:256], output_dtype=torch.float32), expected[96:])
    # UE8M0 scales (DeepSeek-V4's FP8 linears: powers of two as float8_e8m0fnu), off the grid.
    e8 = torch.tensor([[0.25, 2.0], [4.0, 0.5]]).to(torch.float8_e8m0fnu)
    ue = BlockScaleSlice(e8, (256, 256), (2, 2), "F8_E8M0", (128, 128))
    w = torch.randn(256, 256).to(torch.float8_e4m3fn)
    full = w.float() * e8.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(deq._dequantize_one(w[64:192], ue[64:192, 0:256], output_dtype=torch.float32), full[64:192])


def test_off_grid_plan_is_refused_at_compile_time(fp8_checkpoints):
    """PLC625: at tp 4 the 256-wide shared-expert and dense MLP weights would split into 64-row shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import planc
    from planc.errors import CompileError
    from planc.checkpoint.quantized import prepare_meta_model, quantizer_for
    from tests.runtime.workers import shipped_plan

    path = fp8_checkpoints / "deepseek_v3"
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    prepare_meta_model(model, quantizer_for(config, path / "config.json", torch.device("cpu"), dequantize=False))
    planc.compile(model, shipped_plan("deepseek_v3", tp=2))  # on the grid at 2
    with pytest.raises(CompileError) as e:
        planc.compile(model, shipped_plan("deepseek_v3", tp=4))
    text = str(e.value)
    assert "PLC625" in text and "shared_experts.gate_proj.weight" in text and "64 rows" in text, text
    assert "128x128 scale blocks" in text and "weight_scale_inv" in text, text
