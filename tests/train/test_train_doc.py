"""docs/train.md's script, run as users run it: torchrun, 4 ranks for steps 0-2 with a checkpoint, then 2 ranks
from that checkpoint at other plan sizes for steps 2-4; its losses equal 4 uninterrupted steps on 4 ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import planc
from tests.checkout_env import checkout_env

ROOT = Path(__file__).resolve().parents[2]
PLAN = """\
version: 1
model: {type: mixtral}
parallel: {tp_size: 2, ep_size: 2, dp_size: 2}
experts: {implementation: grouped_mm, ep_implementation: all_to_all}
training: {data_parallel: fsdp}
tp_plan:
  model.layers.*.self_attn.{q,k,v}_proj: colwise
  model.layers.*.self_attn.o_proj: rowwise
ep_plan:
  model.layers.*.mlp.experts.{gate_up_proj,down_proj}: grouped_gemm
  model.layers.*.mlp.experts: ep_dispatch_experts
"""


def script_text(name: str = "train.py") -> str:
    text = (ROOT / "docs" / "train.md").read_text(encoding="utf-8")
    found = re.search(rf"<!-- {re.escape(name)} -->\n```python\n(.*?)```", text, re.DOTALL)
    assert found, f"docs/train.md lost its `<!-- {name} -->` block"
    return found.group(1)


def torchrun(tmp: Path, nproc: int, *args: str, script: str = "train.py") -> list[tuple[int, float, float]]:
    env = checkout_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(tmp / script), "--plan", str(tmp / "plan.yaml"), *args]
    run = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    # an fsdp save gathers FSDP's strided shards: torch's reduction-order warning is a false alarm there (no reduction)
    assert "inconsistent results between ranks" not in run.stderr, run.stderr[-3000:]
    if script != "train.py":
        return [(int(s), float(loss), 0.0) for s, loss in re.findall(r"step (\d+) loss ([\d.]+)", run.stdout)]
    return [(int(s), float(loss), float(norm)) for s, loss, norm in
            re.findall(r"step (\d+) loss ([\d.]+) grad_norm ([\d.]+)", run.stdout)]


@pytest.mark.distributed
def test_train_md_script_trains_checkpoints_and_resumes_at_another_size(tmp_path):
    if not hasattr(planc, "load_optimizer"):
        pytest.skip("planc.load_optimizer (optimizer state in planc.save) is not in this tree yet")
    from planc.models.build import build_tiny_model

    (tmp_path / "train.py").write_text(script_text(), encoding="utf-8")
    (tmp_path / "plan.yaml").write_text(PLAN, encoding="utf-8")
    build_tiny_model("mixtral", seed=0).save_pretrained(tmp_path / "hub")
    hub = str(tmp_path / "hub")
    whole = torchrun(tmp_path, 4, "--model", hub, "--steps", "4")
    first = torchrun(tmp_path, 4, "--model", hub, "--steps", "2", "--save", str(tmp_path / "ckpt2"))
    resumed = torchrun(tmp_path, 2, "--model", str(tmp_path / "ckpt2"), "--parallel", "2,2,1", "--steps", "4",
                       "--resume")
    assert [s for s, *_ in whole] == [0, 1, 2, 3] and [s for s, *_ in first + resumed] == [0, 1, 2, 3]
    for (s, loss, norm), (_, loss2, norm2) in zip(whole, first + resumed):
        assert abs(loss - loss2) <= 1e-5, f"step {s}: loss {loss2} after resuming, {loss} uninterrupted"
        assert abs(norm - norm2) <= 1e-5 * norm, f"step {s}: grad norm {norm2} after resuming, {norm} uninterrupted"


def _recipe(tmp_path, script: str, data_parallel: str):
    """docs/train.md's `script` and its plan at tp 1, ep 2, dp 2 with `data_parallel`, written to tmp_path; the tiny
    Mixtral it loads saved there (`hub`) and returned as the unsharded reference; the script imported here (its
    batch schedule) and the rows it reads on 2 ranks."""
    import importlib.util

    from planc.models.build import build_tiny_model

    (tmp_path / script).write_text(script_text(script), encoding="utf-8")
    (tmp_path / "plan.yaml").write_text(PLAN.replace("tp_size: 2, ep_size: 2, dp_size: 2",
                                                     "tp_size: 1, ep_size: 2, dp_size: 2")
                                        .replace("data_parallel: fsdp", f"data_parallel: {data_parallel}"),
                                        encoding="utf-8")
    ref = build_tiny_model("mixtral", seed=0)
    ref.save_pretrained(tmp_path / "hub")
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), tmp_path / script)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe, ref, recipe.all_rows(2, ref.config.vocab_size)


@pytest.mark.distributed
def test_hf_train_md_script_trains_with_trainer_and_accelerate_as_the_unsharded_model(tmp_path):
    """docs/train.md's Trainer and Accelerate recipe on 2 ranks (tp 1, ep 2, dp 2, fsdp) against the unsharded
    model trained in this process on the same global batches (accumulation 2, clipping at 0.5)."""
    import torch

    recipe, ref, rows = _recipe(tmp_path, "hf_train.py", "fsdp")
    ref.set_experts_implementation("grouped_mm")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    per_step = recipe.ACCUM * 2 * recipe.MICRO
    want = []
    for step in range(recipe.STEPS):
        ids = rows[step * per_step:(step + 1) * per_step]
        loss = ref(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for client in ("trainer", "accelerate"):
        got = torchrun(tmp_path, 2, "--model", str(tmp_path / "hub"), "--client", client, script="hf_train.py")
        assert [s for s, *_ in got] == [0, 1, 2], f"{client}: {got}"
        for (s, loss, _), w in zip(got, want):
            assert abs(loss - w) <= 1e-5, f"{client} step {s}: loss {loss}, unsharded {w}"


@pytest.mark.distributed
def test_lora_train_md_script_writes_the_unsharded_runs_adapter(tmp_path):
    """docs/train.md's LoRA recipe on 2 ranks (tp 1, ep 2, dp 2, replicate: peft sizes the adapters whole, so the
    seed gives the unsharded run's init) against the unsharded model with the same LoRA trained in this process on
    the same global batches (accumulation 2, clipping at 0.5): the adapter files agree."""
    import torch
    from safetensors.torch import load_file

    recipe, ref, rows = _recipe(tmp_path, "lora_train.py", "replicate")
    ref.set_experts_implementation("grouped_mm")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    ref = get_peft_model(ref, LoraConfig(r=8, lora_alpha=16, target_modules=recipe.TARGETS, lora_dropout=0.0))
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)
    per_step = recipe.ACCUM * 2 * recipe.MICRO
    for step in range(recipe.STEPS):
        ids = rows[step * per_step:(step + 1) * per_step]
        ref(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        opt.step()
        opt.zero_grad()
    ref.save_pretrained(tmp_path / "ref_adapter")
    torchrun(tmp_path, 2, "--model", str(tmp_path / "hub"), "--out", str(tmp_path / "adapter"), script="lora_train.py")
    got = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    want = load_file(tmp_path / "ref_adapter" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and len(want) == 16  # 2 layers x (q, k, v, o) x (lora_A, lora_B)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-4, f"the adapter file is {worst} off the unsharded run's"
