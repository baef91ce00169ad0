"""The memory budget: `planc explain --device-memory` refuses a plan whose shard cannot fit (PLC660), and
`--checkpoint` prints the bytes each rank reads from the checkpoint's files, by dtype."""

import subprocess
import sys

import pytest

from planc.compiler.memory import parse_size


def _explain(*args):
    return subprocess.run([sys.executable, "-m", "planc", "explain", *args], capture_output=True, text=True)


def test_parse_size():
    assert parse_size("141GiB") == 141 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 TiB") == int(1.5 * 2**40)
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("141 gigs")


def test_deepseek_v3_bf16_does_not_fit_an_h200():
    from tests.fp32_routers import routers_kept_fp32

    # transformers 5.24 on keeps the 58 routers fp32 (0.19 GiB more per rank than 5.23's bf16 ones)
    held, over = ("158.11", "17.1") if routers_kept_fp32("deepseek_v3") else ("157.92", "16.9")
    r = _explain("plans/deepseek_v3.yaml", "--device-memory", "141GiB")
    assert r.returncode == 1, r.stderr
    assert "PLC660" in r.stderr and f"{held} GiB" in r.stderr and "141.0 GiB" in r.stderr
    assert "tp_size/ep_size 16/16" in r.stderr and "FP8 weights" in r.stderr  # what would fit
    assert f"OVER by {over} GiB" in r.stdout


def test_fits_when_the_device_is_large_enough():
    r = _explain("plans/deepseek_v3.yaml", "--device-memory", "200GiB")
    assert r.returncode == 0, r.stderr
    assert "PLC660" not in r.stderr and "left for activations" in r.stdout


def test_checkpoint_reads_per_rank(tmp_path):
    """fp32 checkpoint, fp32 model: each rank reads exactly the bytes it holds (only its shards)."""
    import json

    from planc.models.build import build_tiny_model
    from planc.lint.plan_loader import load_plan

    build_tiny_model("mixtral").save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    plan = load_plan("plans/mixtral.yaml").plan.model_dump(mode="json", exclude_none=True)
    plan.pop("extends", None)
    plan["parallel"] = {"tp_size": 2, "ep_size": 2}
    (tmp_path / "plan.yaml").write_text(json.dumps(plan))
    r = _explain(str(tmp_path / "plan.yaml"), "--checkpoint", str(tmp_path / "ckpt"), "--format", "json")
    assert r.returncode == 0, r.stderr
    memory = json.loads(r.stdout)["memory"]
    assert memory["read_per_rank"] == memory["hold_per_rank"]
    total = sum(p.stat().st_size for p in (tmp_path / "ckpt").glob("*.safetensors"))
    assert memory["read_per_rank"]["float32"] < 0.6 * total  # half the sharded bytes, plus the replicated ones
