"""`planc explain --train/--serve --batch --seq`: the peak per rank against rank 0 really running, and its input.

The measured check: rank 0 of the shipped Mixtral plan (tp 8 / ep 8) at full width, one decoder layer, under the
fake process group with real CPU tensors and torch's MemTracker (planc/verification/memory.py), serving a prefill and
training a step, and gpt-oss (eager attention with sinks) serving a prefill; each prediction within 5% and never
more than 2% under. The full grid (every shipped plan, four modes, two points each) is `bench/memory_grid.py`, its
table in docs/memory.md; its committed measurements are predicted again here on every run.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planc.cli import main as planc_main
from tests.checkout_env import checkout_env

REPO = Path(__file__).resolve().parents[2]
OVER, UNDER = 0.05, 0.02  # the acceptance: within 5% of the measured peak, never more than 2% under it


def within(predicted: int, measured: int) -> bool:
    return -UNDER <= predicted / measured - 1 <= OVER


def explain(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = planc_main(["explain", *args])
    return rc, out.getvalue(), err.getvalue()


def memory(*args: str) -> dict:
    rc, out, err = explain(*args, "--format", "json")
    assert rc == 0, err
    return json.loads(out)["memory"]


MIXTRAL = (str(REPO / "plans" / "mixtral.yaml"), "--set", "num_hidden_layers=1")


def test_predicted_peak_is_what_rank0_allocates():
    """One process (one fake world, tp 8): a prefill, then a training step, each its own MemTracker."""
    points = [{"family": "mixtral", "mode": mode, "batch": 1, "seq": 512, "overrides": {"num_hidden_layers": 1},
               "root": str(REPO)} for mode in ("serve", "replicate")]
    points.append({"family": "gpt_oss", "mode": "serve", "batch": 1, "seq": 512, "overrides": {"num_hidden_layers": 1},
                   "root": str(REPO)})
    run = subprocess.run([sys.executable, "-m", "planc.verification.memory", json.dumps(points)], cwd=REPO,
                         env=checkout_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    for point, real in zip(points, measured):
        flag = ["--serve" if point["mode"] == "serve" else "--train", "--device-type", "cpu"]
        plan = (str(REPO / "plans" / f"{point['family']}.yaml"), "--set", "num_hidden_layers=1")
        predicted = memory(*plan, *flag, "--batch", "1", "--seq", "512")["peak_per_rank"]
        assert within(predicted, real["peak"]), (point["family"], point["mode"], predicted, real["peak"])


@pytest.mark.parametrize("cache, device", [("memory_grid_measured.json", "cpu"),
                                           ("memory_grid_measured_h100.json", "cuda")])
def test_the_committed_grid_is_predicted_again(cache, device):
    """Every point of the measured grids (bench/memory_grid_measured.json on CPU, bench/memory_grid_measured_h100.json
    on an H100: docs/memory.md's tables) predicted by this checkout: a change to the model that moves any point out
    of tolerance fails here, without measuring."""
    sys.path.insert(0, str(REPO / "bench"))
    import memory_grid

    measured = json.loads((REPO / "bench" / cache).read_text())
    points = [p for p in ({**q, "device": device} if device != "cpu" else q for q in memory_grid.grid())
              if memory_grid.cache_key(p) in measured]
    outside = []
    for point, predicted in zip(points, memory_grid.predict_all(points)):
        real = measured[memory_grid.cache_key(point)]
        if not within(predicted["peak_per_rank"], real["peak"]):
            outside.append((point["family"], point["mode"], point["batch"], point["seq"],
                            f"{predicted['peak_per_rank'] / real['peak'] - 1:+.1%}"))
    assert len(points) >= 30 and not outside, (len(points), outside)


def test_peak_json_text_and_max_batch():
    m = memory(*MIXTRAL, "--train", "--batch", "2", "--seq", "2048", "--device-memory", "141GiB")
    assert m["peak_per_rank"] == sum(m["breakdown"].values())
    assert m["fits"] is True and m["max_batch"] >= 2
    # the search's answer on the same compiled plan: max_batch fits, one more does not
    from planc.commands.explain import explain_one, workload_peak
    from planc.compiler.train_memory import train_memory

    rc, compiled, model = explain_one(MIXTRAL[0], {}, {"num_hidden_layers": 1}, "config")
    train = train_memory(compiled, model)

    def peak(workload: str, batch: int, seq: int) -> int:
        spec = {"workload": workload, "batch": batch, "seq": seq, "search": "batch", "capacity_factor": 1.0,
                "reserve": None}
        return workload_peak(compiled, model, train if workload == "train" else None, spec, None, "plan").peak

    assert peak("train", m["max_batch"], 2048) + m["reserve"] <= 141 * 2**30 < peak("train", m["max_batch"] + 1, 2048)\
        + m["reserve"]
    assert peak("train", 2, 2048) == m["peak_per_rank"]
    serve = memory(*MIXTRAL, "--serve", "--batch", "4", "--seq", "4096")
    assert serve["kv_cache"] == {"full attention": 4 * 4096 * 2 * 128 * 2}  # one layer, one KV head of 128 per rank
    rc, text, _ = explain(*MIXTRAL, "--train", "--batch", "1", "--seq", "1024")
    assert rc == 0 and "peak memory per rank, training step (AdamW) at batch 1 x seq 1024" in text
    assert "fp32 logits and loss" in text and "EP routing:" in text
    auto = memory(*MIXTRAL, "--serve", "--seq", "auto", "--device-memory", "80GiB")
    assert auto["max_seq"] == 131072  # capped at max_position_embeddings


def test_checkpointing_lowers_the_predicted_activations(tmp_path):
    import yaml

    from planc.verification.memory import plan_data

    paths = {}
    for mode in ("replicate", "checkpoint"):
        paths[mode] = tmp_path / f"{mode}.yaml"
        paths[mode].write_text(yaml.safe_dump(plan_data("mixtral", mode, root=str(REPO))))
    args = ("--set", "num_hidden_layers=4", "--train", "--batch", "8", "--seq", "4096")
    plain = memory(str(paths["replicate"]), *args)
    ckpt = memory(str(paths["checkpoint"]), *args)
    assert ckpt["activation_checkpointing"] == "full"
    assert ckpt["breakdown"]["activations kept for backward"] < plain["breakdown"]["activations kept for backward"] / 4


def test_fsdp_prices_the_units_planc_wraps(tmp_path):
    """DeepSeek-V3 under fsdp (the grid's two layers: one dense, one MoE): a dense layer is one FSDP unit; the MoE
    layer is three (the layer over dp, its EP experts over efsdp, the fp32 router kept in its own dtype; two with
    transformers 5.23, whose router is bf16), and backward's transient counts the largest unit (the experts) three
    times, not the whole layer (the grid's DeepSeek-V3 fsdp points, docs/memory.md)."""
    import yaml

    from tests.fp32_routers import routers_kept_fp32
    from planc.verification.memory import plan_data

    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(plan_data("deepseek_v3", "fsdp", dp=2, root=str(REPO))))
    rc, out, err = explain(str(path), "--set", "num_hidden_layers=2", "--set", "first_k_dense_replace=1",
                           "--set", "n_routed_experts=16", "--train", "--batch", "2", "--seq", "128", "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    train, m = data["train"], data["memory"]
    units = train["gathered_units"]
    router = {"model.layers.1.mlp.gate"} if routers_kept_fp32("deepseek_v3") else set()
    assert set(units) == {"model.layers.0", "model.layers.1", "model.layers.1.mlp.experts"} | router
    if router:
        assert units["model.layers.1.mlp.gate"] == 16 * 7168 * 4  # the router stays fp32 [experts, hidden], whole
    experts = units["model.layers.1.mlp.experts"]  # 2 local experts (16 / ep 8), gate_up and down, bf16, TP-whole
    assert experts == 2 * 3 * 2048 * 7168 * 2 == train["gathered_unit"]
    assert train["gathered_layer"] == sum(n for u, n in units.items() if u.startswith("model.layers.1"))
    rest = train["gathered_layer"] - experts
    backward = m["transients"]["FSDP backward: root, the largest unit gathered, its gradients and a reduce-scatter, "
                               "the rest of its layer"]
    assert backward == train["gathered_root"] + 3 * experts + rest
    assert m["peak_per_rank"] == sum(m["breakdown"].values()) == max(m["moments"].values())


@pytest.mark.parametrize("args, message", [
    (("--train", "--serve"), "--serve and --train ask for different peaks"),
    (("--train", "--batch", "0"), "--batch '0': write a positive integer"),
    (("--serve", "--seq", "-3"), "--seq '-3': write a positive integer"),
    (("--serve", "--seq", "lots"), "--seq 'lots': write a positive integer"),
    (("--batch", "2"), "add --train (a training step) or --serve"),
    (("--serve", "--seq", "auto"), "--seq auto searches the longest sequence that fits: give --device-memory"),
    (("--serve", "--capacity-factor", "0.5"), "--capacity-factor '0.5': write a number >= 1.0"),
])
def test_bad_workload_is_a_usage_error(args, message):
    rc, _, err = explain(*MIXTRAL, *args)
    assert rc == 2 and message in err and "Traceback" not in err, err


def test_long_sequence_warns_and_small_device_is_a_verdict():
    rc, _, err = explain(*MIXTRAL, "--serve", "--seq", "200000")
    assert rc == 0 and "beyond the model's max_position_embeddings 131072" in err
    rc, _, err = explain(*MIXTRAL, "--train", "--seq", "1024", "--device-memory", "1GiB")
    assert rc == 1 and "PLC660" in err and "Traceback" not in err, err
    assert "not even one sequence fits" in err


def test_activation_checkpointing_lints(tmp_path):
    from planc.lint.runner import lint_paths

    base = (REPO / "plans" / "mixtral.yaml").read_text()
    for value, codes in (("full", []), ("none", []), ("selective", ["PLC103"])):
        path = tmp_path / f"{value}.yaml"
        path.write_text(base + f"training: {{activation_checkpointing: {value}}}\n")
        found = [d.code for d in lint_paths([str(path)]) if d.severity == "error"]
        assert found == codes, (value, found)


def test_what_is_not_priced_is_said_on_the_verdict_line_and_in_json():
    """DeepSeek-V4's compressed sparse attention layers are priced from the code, not measured: the verdict says so
    and JSON lists them; its heavily compressed layers (the grid's) and a family the grid measured (Mixtral) have
    nothing flagged."""
    v4 = (str(REPO / "plans" / "deepseek_v4_allreduce.yaml"), "--set", "num_hidden_layers=4", "--serve",
          "--batch", "1", "--seq", "1024", "--device-memory", "141GiB")
    rc, text, err = explain(*v4)
    assert rc == 0, err
    verdict = next(line for line in text.splitlines() if "(CUDA context, NCCL):" in line)
    assert verdict.endswith("[not priced: 1 item(s) below; the peak errs high]"), verdict
    assert text.count("  not priced: ") == 1
    unpriced = memory(*v4)["unpriced"]
    assert len(unpriced) == 1 and "compressed sparse attention" in unpriced[0]
    hca = (str(REPO / "plans" / "deepseek_v4_allreduce.yaml"), "--set", "num_hidden_layers=2", "--train",
           "--batch", "1", "--seq", "512")
    assert memory(*hca)["unpriced"] == []
    assert memory(*MIXTRAL, "--serve", "--device-memory", "80GiB")["unpriced"] == []


GRANITE = """\
version: 1
model: {type: granitemoe}
parallel: {tp_size: 8, ep_size: 8}
tp_plan:
  model.embed_tokens: embedding_rowwise
  model.layers.*.self_attn.{q,k,v}_proj: colwise
  model.layers.*.self_attn.o_proj: rowwise
  lm_head: colwise_gather_output
ep_plan:
  model.layers.*.block_sparse_moe.experts.{gate_up_proj,down_proj}: grouped_gemm
  model.layers.*.block_sparse_moe.experts: ep_dispatch_experts
"""


def test_a_family_the_grid_has_not_measured_gets_no_verdict(tmp_path, monkeypatch):
    """A family without a row of the grid's families (planc.compiler.family_memory; Granite MoE with its row taken
    out stands for any model type planc does not know): explain prints its peak but no verdict (no fits, no largest
    batch, exit 0 however small the device), and says why: unmeasured families were found 11-74% under before their
    layers were priced."""
    from planc.compiler.family_memory import FAMILIES

    monkeypatch.delitem(FAMILIES, "granitemoe")
    path = tmp_path / "granitemoe.yaml"
    path.write_text(GRANITE)
    plan = (str(path), "--set", "num_hidden_layers=2", "--serve", "--batch", "1", "--seq", "1024",
            "--device-memory", "80GiB")
    rc, text, err = explain(*plan)
    assert rc == 0, err
    verdict = next(line for line in text.splitlines() if "(CUDA context, NCCL):" in line)
    assert "no verdict [not validated: the memory grid has not measured this family" in verdict, verdict
    assert verdict.endswith("the peak above may be low]") and "fits" not in verdict, verdict
    assert "largest micro-batch" not in text
    m = memory(*plan)
    assert m["validated"] is False and m["unpriced"] and m["fits"] is None and m["max_batch"] is None
    tiny = (*plan[:-1], "1GiB")  # a device the peak does not fit: still no verdict, no PLC660, exit 0
    rc, text, err = explain(*tiny)
    assert rc == 0 and "PLC660" not in err and "does NOT fit" not in text, (text, err)
    assert memory(*MIXTRAL, "--serve", "--device-memory", "80GiB")["validated"] is True


def test_megamoe_buffer_is_priced_at_the_capacity_the_runtime_allocates(tmp_path):
    from planc.compiler.megamoe_buffers import (capacity, deepgemm_symmetric_bytes, reference_buffer_bytes,
                                                triton_fp8_layout_bytes)

    # DeepGEMM's sizing rule at 8 ranks, 256 experts, top-6, hidden 4096, intermediate 2048, FP8
    sizes = [deepgemm_symmetric_bytes(8, 256, t, 6, 4096, 2048) / 2**30 for t in (512, 4096, 8192)]
    assert [round(x, 2) for x in sizes] == [0.47, 2.09, 4.08]
    assert capacity(100, 512) == 512 and capacity(600, 512) == 1024 and capacity(600, None) == 1024
    plan = (str(REPO / "plans" / "deepseek_v4_megamoe.yaml"), "--set", "num_hidden_layers=2", "--serve",
            "--batch", "1", "--seq", "4096")
    m = memory(*plan)
    buffer = m["breakdown"]["Mega MoE symmetric buffer"]
    # backend auto: the larger of deep_gemm's and triton's buffers for this rank's slice, 4096 / 8 tokens
    # (MegaMoeEP hands each rank of the EP group that shares the batch an equal slice); triton's with each of the
    # two layers' FP8-path layout of its 32 local experts (`math: auto`: Hopper makes it once a batch takes that path)
    fp8_layouts = 2 * triton_fp8_layout_bytes(32, 4096, 2048)
    assert fp8_layouts == 2 * (32 * 3 * 4096 * 2048 // 2 + 2 * 32 * 3 * 4096 * 2048 // 32)
    assert buffer == max(deepgemm_symmetric_bytes(8, 256, 512, 6, 4096, 2048),
                         reference_buffer_bytes(512, 6, 4096) + fp8_layouts)
    rc, text, err = explain(*plan)
    assert rc == 0 and "FP8-path layout" in text and "math: bf16" in text, (text, err)
    # `math: bf16`: BF16 MMAs at every batch, one layout: triton's buffer alone (smaller than deep_gemm's here)
    shutil.copytree(REPO / "plans", tmp_path / "plans")  # a parent plan lies next to or below its child
    bf16 = tmp_path / "plans" / "bf16.yaml"
    bf16.write_text("version: 1\nextends: deepseek_v4_megamoe.yaml\n"
                    "experts:\n  megamoe: {backend: auto, quantize: fp4, math: bf16}\n")
    one = memory(str(bf16), *plan[1:])
    assert one["breakdown"]["Mega MoE symmetric buffer"] == max(deepgemm_symmetric_bytes(8, 256, 512, 6, 4096, 2048),
                                                                 reference_buffer_bytes(512, 6, 4096))
    # the GPU backends' buffers are not measured (the grid runs the reference backend): flagged
    assert len(m["unpriced"]) == 1 and "deep_gemm and Triton" in m["unpriced"][0]
    # the experts are held as FP4 (`quantize: fp4`), not in the model dtype the compiled plan counts
    held = memory(*plan[:3], "--serve", "--batch", "1", "--seq", "128")["breakdown"]["parameters"]
    fp4 = (str(REPO / "plans" / "deepseek_v4_allreduce.yaml"), "--set", "num_hidden_layers=2", "--serve")
    bf16_experts = 2 * 32 * 3 * 4096 * 2048 * 2  # two layers, 32 local experts, gate_up and down
    assert memory(*fp4, "--batch", "1", "--seq", "128")["breakdown"]["parameters"] - held == \
        bf16_experts - bf16_experts // 2 // 2 - bf16_experts // 2 // 32


def test_cuda_prices_cublas_workspaces_per_handle_and_card():
    """torch's cuBLAS workspaces (planc.compiler.devices): 32 MiB + 1 MiB cuBLASLt per handle on compute capability
    9.0, 8.125 MiB + 1 MiB elsewhere; one handle serving, two training (autograd's backward thread); none on CPU."""
    mib, key = 2**20, "cuBLAS workspaces (CUDA)"
    serve = [*MIXTRAL, "--serve", "--batch", "1", "--seq", "512"]
    h100 = memory(*serve, "--device-memory", "H100")
    a100 = memory(*serve, "--device-memory", "A100-80GB")
    assert h100["breakdown"][key] == 33 * mib and a100["breakdown"][key] == 9 * mib + 128 * 1024
    assert memory(*serve)["breakdown"][key] == 33 * mib  # a plain size or none: the larger sm_90 rule
    cpu = memory(*serve, "--device-type", "cpu")
    assert key not in cpu["breakdown"] and cpu["peak_per_rank"] == h100["peak_per_rank"] - 33 * mib
    train = memory(*MIXTRAL, "--train", "--batch", "1", "--seq", "512", "--device-memory", "H100")
    assert train["breakdown"][key] == 66 * mib and train["adamw_step"] == "for-loop"
    assert memory(*MIXTRAL, "--train", "--batch", "1", "--seq", "512", "--device-type", "cpu")["adamw_step"] == "for-loop"


# ParaM2-MoE ties its embedding to lm_head (`tie_word_embeddings`); the plan `planc init` writes at tp 2, narrowed
PARAM2 = {"version": 1, "model": {"type": "param2moe"}, "parallel": {"tp_size": 2, "ep_size": 2, "dp_size": 1},
          "experts": {"implementation": "grouped_mm", "ep_implementation": "auto"},
          "tp_plan": {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
                      "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                      "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                      "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"},
          "ep_plan": {"model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
                      "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
                      "model.layers.*.mlp.experts": "ep_dispatch_experts"}}
PARAM2_NARROW = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
                 "vocab_size": 4096}


def test_the_harness_holds_tied_weights_once(tmp_path):
    """The harness materializes the model as `planc.load` does, so a tied embedding and lm_head stay one tensor and
    rank 0's measured parameters are the bytes `planc explain` counts, to the byte (`to_empty` split them: every
    tied family measured one more embedding a rank, up to 1.1 GiB)."""
    import yaml

    point = {"family": "param2moe", "mode": "serve", "batch": 1, "seq": 64, "overrides": PARAM2_NARROW, "dp": 1,
             "plan": PARAM2, "root": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "planc.verification.memory", json.dumps(point)], cwd=REPO,
                         env=checkout_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])["by_category"]["_MemRefType.PARAM"]
    path = tmp_path / "param2moe.yaml"
    path.write_text(yaml.safe_dump(PARAM2))
    sets = [a for k, v in PARAM2_NARROW.items() for a in ("--set", f"{k}={v}")]
    predicted = memory(str(path), *sets, "--serve", "--batch", "1", "--seq", "64")["breakdown"]["parameters"]
    assert measured == predicted, (measured, predicted)


def test_sdpa_repeats_kv_only_where_it_gets_a_mask():
    """transformers hands sdpa K and V repeated to every query head where it passes a mask: a sliding layer from its
    window on, not a full-attention layer, not below the window, not without grouped heads."""
    from dataclasses import replace

    from planc.compiler.attention_memory import sdpa_repeated_kv
    from planc.compiler.peak_memory import LayerShape

    sliding = LayerShape(attention="gqa", mlp="moe", q=6144, k=512, v=512, heads=48, cache=2048,
                         cache_kind="sliding window", window=513, kv_heads=4, head_dim=128)
    assert sdpa_repeated_kv(sliding, 1, 512, 2) == 0
    assert sdpa_repeated_kv(sliding, 2, 513, 2) == 2 * 2 * 513 * 48 * 128 * 2
    assert sdpa_repeated_kv(replace(sliding, cache_kind="full attention", window=None), 1, 4096, 2) == 0
    assert sdpa_repeated_kv(replace(sliding, kv_heads=48), 1, 4096, 2) == 0
    assert sdpa_repeated_kv(replace(sliding, attn_impl="eager"), 1, 4096, 2) == 0


@pytest.mark.parametrize("model_type, overrides, width", [
    ("openai_privacy_filter", {}, 33),  # a token classifier: `score` over config.num_labels classes
    ("inkling2_text", {"unpadded_vocab_size": 120}, 120),  # lm_head narrower than the embedding's 128 rows
    ("olmoe", {}, 128),  # lm_head over the vocabulary: labels are the tokens
])
def test_labels_and_logits_follow_the_models_head(model_type, overrides, width):
    """The memory harness's and `planc verify`'s training step labels every token within the head's width (a token
    id past it stopped the step: an IndexError on CPU, a device-side assert or a cuBLAS error on CUDA), and the
    memory model prices the logits at that width, read off the walk."""
    import torch

    from planc.compiler.peak_memory import head_width
    from planc.compiler.walk import walk_model
    from planc.models.build import build_tiny_model
    from planc.verification.stages import training_labels

    model = build_tiny_model(model_type, **overrides).train()
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = training_labels(model, ids)
    assert 0 <= int(labels.min()) and int(labels.max()) < width
    if width == model.config.get_text_config().vocab_size:
        assert torch.equal(labels, ids)
    loss = model(ids, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    walk = walk_model(model)
    assert head_width(walk, walk.config.get_text_config().to_dict()) == width
