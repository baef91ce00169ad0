"""Checkpoints that lie: each refused on every rank before a tensor byte is read, within a bounded time,
as a PlancError naming the key or file and the fix, with nothing written or destroyed and no traceback text."""

import pytest

from tests.checkpoint.bad_workers import bad_world, dcp_world, write_damaged, write_good
from tests.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("planc_bad_checkpoints")]
WORLD_TIMEOUT = 240  # seconds: a hang fails the test instead of the CI job (the checks take ~30 s on 2 shared cores)


def _snapshot(root):
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*")) if not p.is_symlink()}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    write_good(root / "good")
    cases = write_damaged(root / "good", root)
    from tests.runtime.load_fp8_workers import write_fp8_checkpoint

    write_fp8_checkpoint("mixtral", root / "fp8")
    before = _snapshot(root)
    per_rank = run_distributed(bad_world, 2, cases, str(root / "fp8"), timeout=WORLD_TIMEOUT)
    return per_rank, cases, before, _snapshot(root)


@pytest.fixture(scope="module")
def dcp_cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    write_good(root / "hub")
    from planc.models.build import build_tiny_model

    build_tiny_model("mixtral", seed=0).save_pretrained(root / "model_layout", save_original_format=False)
    return run_distributed(dcp_world, 2, str(root / "hub"), str(root / "model_layout"), str(root / "out"),
                           timeout=WORLD_TIMEOUT)


def _refused(per_rank, name, needles, *, reads=True):
    """The same PlancError on every rank, naming each needle, no traceback, no tensor slice read."""
    messages = []
    for rank, res in enumerate(per_rank):
        out = res[name]
        assert out["error"] is not None, (rank, name, "loaded")
        assert out["planc"], (rank, name, out["error"])
        msg = out["error"]
        assert "Traceback" not in msg and 'File "' not in msg, (rank, name, msg)
        for needle in needles:
            assert needle in msg, (rank, name, needle, msg)
        if reads:
            assert out["reads"] == 0, (rank, name, out["reads"], msg)
        messages.append(msg)
    assert len(set(messages)) == 1, messages  # every rank raises the same error


W1 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
FIX = "use the config saved with these weights"


def test_expert_with_another_dtype_of_the_same_length_is_refused(damaged):
    # I32 where F32 is expected: the same bytes per element, so only the header tells; it used to load (logits 0.61 off)
    _refused(damaged[0], "expert_i32", [W1, "I32", GATE_UP, ".safetensors", "quantization_config"])


def test_missing_expert_is_named_before_reading(damaged):
    _refused(damaged[0], "expert_missing", [W1, "is missing", GATE_UP, "merges 8 experts", "indices [0]"])


def test_extra_expert_is_named_before_reading(damaged):
    _refused(damaged[0], "expert_extra", ["experts.8.w1.weight", "expert index 8", "8", GATE_UP, FIX])


def test_one_expert_with_another_shape_is_named_before_reading(damaged):
    _refused(damaged[0], "expert_shape", [W1, "shape [31, 64]", "[32, 64]", ".safetensors"])


def test_dangling_model_safetensors_link_says_the_target_is_missing(damaged):
    _refused(damaged[0], "dangling_link", ["model.safetensors is a symbolic link to", "gone.safetensors",
                                           "does not exist"])


def test_interrupted_swap_says_where_the_previous_checkpoint_is(damaged):
    _refused(damaged[0], "swap_interrupted", [".swap_interrupted.planc-old", "mv ", "interrupted"])


def test_header_dtype_that_disagrees_with_its_bytes_names_the_tensor(damaged):
    _refused(damaged[0], "header_dtype_vs_length", ["`model.norm.weight`", "F16", "Re-copy"])


def test_refusals_write_and_destroy_nothing(damaged):
    _, _, before, after = damaged
    assert after == before


def test_missing_or_truncated_distcp_is_refused_before_dcp_reads(dcp_cases):
    _refused(dcp_cases, "distcp_missing", ["__1_0.distcp", "missing", "copy the whole directory"], reads=False)
    _refused(dcp_cases, "distcp_truncated", ["__1_0.distcp", "truncated", ".metadata reads up to byte"], reads=False)


def test_damaged_marker_says_damaged_not_missing_weights(dcp_cases):
    _refused(dcp_cases, "damaged_marker", ["planc.json", "damaged planc.save checkpoint", "Save it again"])
    assert "no model.safetensors" not in dcp_cases[0]["damaged_marker"]["error"]


def test_ranks_that_take_different_routes_fail_together_instead_of_hanging(dcp_cases):
    _refused(dcp_cases, "route_disagrees", [
        "`checkpoint route`", "rank 0: checkpoint route: safetensors", "rank 1: checkpoint route: planc.save",
        "would enter different collectives",
    ])


def test_ranks_that_choose_another_quantization_fail_together(damaged):
    _refused(damaged[0], "quantization_disagrees", ["`quantization`", "rank 0: quantization: kept",
                                                    "rank 1: quantization: dequantized"])


def test_a_plan_that_fails_to_load_on_one_rank_raises_the_same_error_on_every_rank(damaged):
    _refused(damaged[0], "plan_invalid_on_rank1", ["planc.load: nothing was installed", "rank 1: PlanError: ",
                                                   "mixtral.yaml:22:12: PLC310", "colwise_gather_output`?"])


def test_ranks_that_see_different_checkpoints_fail_together(dcp_cases):
    _refused(dcp_cases, "checkpoint_disagrees", ["`checkpoint`", "rank 0: checkpoint:", "rank 1: checkpoint:"])


def test_save_failing_with_efbig_is_a_checkpoint_error_and_cleans_up(dcp_cases):
    for rank, res in enumerate(dcp_cases):
        out = res["save_efbig"]
        assert out["planc"], (rank, out["error"])
        assert out["error"].startswith("CheckpointError"), (rank, out["error"])
        # torch's stream writer reports the short write (`unexpected pos`), not the errno: planc names the cause
        assert "rank 1:" in out["error"] and "file size limit (`ulimit -f`)" in out["error"], out["error"]
        assert "Traceback" not in out["error"], out["error"]
        assert out["intact"], rank  # the previous checkpoint is untouched
        assert out["left"] == [], (rank, out["left"])  # no .saved.planc-partial left behind
        assert res["reloaded_same"] is True, rank


def test_random_header_damage_never_hangs_crashes_or_lies(tmp_path):
    # 2 CPU cores in CI: a few dozen examples (each a full planc.load on 2 ranks), derandomized so both ranks draw
    # the same damage and stay in step
    from tests.checkpoint.bad_workers import property_world

    write_good(tmp_path / "good")
    per_rank = run_distributed(property_world, 2, str(tmp_path / "good"), str(tmp_path / "scratch"), 30,
                               timeout=WORLD_TIMEOUT)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0]["refused"] > 0, per_rank


def test_a_conversion_that_still_fails_is_summarized_without_its_traceback(tmp_path):
    # transformers' loader records a failing conversion as the whole traceback text; planc names the model key, the
    # checkpoint keys that fed it and the last line of the cause. The failure here is a real torch.stack of experts of
    # two shapes, recorded by transformers' own log_conversion_errors.
    import torch
    from transformers.core_model_loading import (
        MergeModulelist,
        SkipParameters,
        log_conversion_errors,
    )
    from transformers.utils.loading_report import LoadStateDictInfo

    from planc.checkpoint.files import CheckpointFiles
    from planc.checkpoint.keys import loading_problems
    from planc.checkpoint.load import _config, _meta_model

    write_good(tmp_path / "good")
    info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(), mismatched_keys=set(), error_msgs=[],
                             conversion_errors={}, skipped_pp_keys=set())
    op = MergeModulelist(dim=0)
    with pytest.raises(SkipParameters):
        with log_conversion_errors(GATE_UP, info, (2, GATE_UP), op):
            op.convert({"w1": [torch.zeros(32, 64), torch.zeros(31, 64)]}, ["w1"], [GATE_UP])
    assert "Traceback" in info.conversion_errors[GATE_UP]  # what transformers keeps
    model = _meta_model(_config(tmp_path / "good", None), None)
    files = CheckpointFiles.open(tmp_path / "good")
    try:
        (problem,) = loading_problems(model, info, files)
    finally:
        files.close()
    assert "Traceback" not in problem and 'File "' not in problem, problem
    assert f"converting the model's `{GATE_UP}` from 16 checkpoint tensor(s)" in problem, problem
    assert W1 in problem and "RuntimeError: stack expects each tensor to be equal size" in problem, problem
