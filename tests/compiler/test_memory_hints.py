"""Memory hints read what the plan and the flags set: nothing the plan has, nothing that cannot help, no training
setting for --serve, one FP8 sentence, and the parameters-held line says when it applies under fsdp."""

from __future__ import annotations

import pytest

from planc.cli import main
from planc.commands.explain import _meta_model_at
from planc.compiler.memory_hints import Situation, hint_line, peak_hint
from planc.compiler.resolve import compile_plan
from planc.lint.plan_loader import load_plan
from tests.checkout_env import REPO

SMALL = ["--set", "num_hidden_layers=2"]
GIB = 2**30


def _plan(tmp_path, training: str) -> str:
    (tmp_path / "mixtral.yaml").write_text((REPO / "plans" / "mixtral.yaml").read_text())
    path = tmp_path / "trained.yaml"
    path.write_text(f"version: 1\nextends: mixtral.yaml\nparallel: {{tp_size: 8, ep_size: 8, dp_size: 2}}\n"
                    f"training: {training}\n")
    return str(path)


def test_train_hints_never_suggest_what_the_plan_sets(tmp_path, capsys):
    """fsdp and full activation checkpointing declared, --batch and --seq given: the peak does not fit."""
    plan = _plan(tmp_path, "{data_parallel: fsdp, activation_checkpointing: full}")
    assert main(["explain", plan, *SMALL, "--train", "--batch", "1", "--seq", "4096", "--device-memory", "2.2GiB"]) == 1
    captured = capsys.readouterr()
    hint = captured.err.split("PLC660 the peak per rank", 1)[1]
    assert "data_parallel: fsdp" not in hint and "activation_checkpointing: full" not in hint, hint
    assert "a larger dp_size than 2 (fsdp shards parameters, gradients and AdamW state over it)" in hint, hint
    assert "activations are not counted" not in captured.out  # --batch and --seq were given


def test_serve_gets_no_training_hints(capsys):
    plan = str(REPO / "plans" / "mixtral.yaml")
    assert main(["explain", plan, *SMALL, "--serve", "--seq", "4096", "--device-memory", "3.5GiB"]) == 1
    err = capsys.readouterr().err
    hint = err.split("PLC660 the peak per rank", 1)[1]
    assert "training:" not in hint and "fsdp" not in hint and "dp_size" not in hint, hint
    assert "a shorter --seq" in hint and "more ranks (a larger tp_size/ep_size than 8/8)" in hint, hint


@pytest.fixture(scope="module")
def compiled_pair(tmp_path_factory):
    """The same model under a replicate plan and under an fsdp + full checkpointing plan."""
    model = _meta_model_at("mixtral", {"num_hidden_layers": 2}, "config")
    tmp = tmp_path_factory.mktemp("hints")
    return (compile_plan(model, load_plan(str(REPO / "plans" / "mixtral.yaml"))),
            compile_plan(model, load_plan(_plan(tmp, "{data_parallel: fsdp, activation_checkpointing: full}"))))


def test_hint_rules_read_the_plan_and_the_room(compiled_pair):
    plain, fsdp = compiled_pair
    room = 4 * GIB
    # the workload can shrink: every training way out the plan does not already take
    text = peak_hint(Situation(plain, "train", static=3 * GIB, room=room, train_flag=True), 0, None)
    assert "`training: {data_parallel: fsdp}`" in text and "`training: {activation_checkpointing: full}`" in text
    assert "a shorter --seq" in text and "FP8" not in text, text
    text = peak_hint(Situation(fsdp, "train", static=3 * GIB, room=room, batch=4, train_flag=True), 0, None)
    assert "data_parallel: fsdp" not in text and "activation_checkpointing" not in text, text
    assert "a shorter --seq or a smaller --batch" in text, text
    # parameters + gradients + AdamW alone exceed the device: no shorter sequence, no checkpointing
    text = peak_hint(Situation(plain, "train", static=5 * GIB, room=room, train_flag=True), 0, None)
    assert "alone take 5.00 GiB per rank, more than the 4.00 GiB" in text, text
    assert "--seq" not in text and "activation_checkpointing" not in text, text
    # a largest batch or sequence that fits is the answer
    assert peak_hint(Situation(plain, "serve", static=GIB, room=room), 3, None) == \
        "the largest micro-batch that fits is 3"
    # the parameters held while loading: FP8 weights said once, plainly; not when the weights will be trained
    load = hint_line(Situation(plain, None, static=plain.bytes_per_rank, room=GIB))
    assert ("a checkpoint with FP8 weights (`quantization_config: fp8`): its 16-bit weights take half the bytes, "
            "about 377.3 MiB per rank instead of 754.7 MiB") in load, load
    assert "FP8" not in hint_line(Situation(plain, None, static=plain.bytes_per_rank, room=GIB, train_flag=True))


def test_the_parameters_held_line_says_when_it_applies_under_fsdp(compiled_pair):
    from planc.compiler.memory import budget_problems

    plain, fsdp = compiled_pair
    (problem,) = budget_problems(fsdp, GIB // 4, where="p.yaml", train=True)
    assert ("this is while loading, before fsdp shards them over dp_size=2 (planc.load and planc.apply hold each "
            "rank's TP/EP shard first); the training table below counts them after") in problem.message
    (problem,) = budget_problems(plain, GIB // 4, where="p.yaml")
    assert "while loading" not in problem.message


def test_fused_adamw_is_suggested_only_where_the_step_sets_the_peak(tmp_path, capsys):
    """replicate over dp 2: every parameter a DTensor, so CUDA's foreach step, whose copy of exp_avg_sq is the peak at
    a short sequence; priced fused, the step no longer sets it and the hint is gone."""
    plan = _plan(tmp_path, "{data_parallel: replicate}")
    args = ["explain", plan, *SMALL, "--train", "--batch", "1", "--seq", "128", "--device-memory", "5.5GiB"]
    assert main(args) == 1
    hint = capsys.readouterr().err.split("PLC660 the peak per rank", 1)[1]
    assert "at optimizer step" in hint and "the fused AdamW step" in hint and "the foreach step's" in hint, hint
    main([*args, "--optimizer", "fused"])
    err = capsys.readouterr().err
    assert "fused AdamW" not in err and "at optimizer step" not in err, err
