"""Hostile planc.save checkpoints (tests/checkpoint/hostile.py): pickle gadgets in the model's `.metadata`, in
`optimizer/.metadata` and in an optimizer hyperparameter (a DCP byte item). Each is refused by planc.load /
planc.load_optimizer on 1 and 2 gloo ranks (one CheckpointError, the same on every rank, naming the file or key and
what it held; no optimizer state restored) and by `planc explain --checkpoint`, and no gadget ever ran: its marker
file never appears. The genuine checkpoint still loads and resumes; the opt-in reads what planc cannot, and warns."""

import pytest

from planc.checkpoint.dcp_reader import UnsafeCheckpointWarning
from tests.checkpoint.hostile import LR, LR_KEY, hostile_world
from tests.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("planc_hostile_checkpoints")]
WORLD_TIMEOUT = 300  # seconds: a hang fails the test instead of the CI job
PLAN, SIZES = "plans/mixtral.yaml", "tp_size=2,ep_size=2"
# what each refusal must name: the thing the pickle held
HELD = {
    "os_system": "`posix.system`", "builtins_eval": "eval`", "builtins_exec_protocol0": "`builtins.exec`",
    "subprocess_popen": "Popen`", "allowed_module_os": "`torch.distributed.checkpoint.filesystem.os.system`",
    "allowed_module_load": "`torch.serialization.load`",
    "allowed_class_globals": "`torch.distributed.checkpoint.metadata.Metadata.__init__.__globals__`",
    "allowed_class_called": "a call of `torch.distributed.checkpoint.metadata.StorageMeta`",
    "allowed_class_build": "the key '__setstate__', not one of its fields",
    "protocol5_gadget": "pickle protocol 5", "protocol5_buffer": "pickle protocol 5",
    "protocol5_genuine": "pickle protocol 5", "protocol5": "pickle protocol 5",
    "truncated": "a truncated pickle", "trailing_pickle": "after the pickle's STOP opcode", "oversized": "more than the",
    "embedded_in_metadata": "`posix.system`", "path_traversal": "not a file name inside the checkpoint directory",
    "stream_transform": "stream transform(s) ['zstd']", "rank_file_only": ".metadata: missing",
    "weights_only_bytearray": "`__builtin__.bytearray`", "tensor_storage": "tensor storage",
    "memo_dag": "nested more than 16 deep", "extra_item": "1 non-tensor item(s) (`extra`)",
}
ITEM_TRUNCATED = "no torch.save archive"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    two = run_distributed(hostile_world, 2, str(root), True, timeout=WORLD_TIMEOUT)
    one = run_distributed(hostile_world, 1, str(root), False, timeout=WORLD_TIMEOUT)
    return root, {1: one, 2: two}


def _cases(per_rank):
    return sorted(c for c in per_rank[0] if "/" in c)


def test_the_corpus_attacks_every_pickle_planc_reads(worlds):
    cases = _cases(worlds[1][2])
    for where in ("model", "optimizer", "item"):
        names = {c.split("/")[1] for c in cases if c.startswith(f"{where}/")}
        assert {"os_system", "builtins_eval", "subprocess_popen", "truncated", "oversized"} <= names, (where, names)
        assert any(n.startswith("allowed_") or n == "weights_only_bytearray" for n in names), (where, names)
        assert any(n.startswith("protocol5") for n in names), (where, names)
    assert len(cases) == 48


@pytest.mark.parametrize("world", [1, 2])
def test_every_hostile_checkpoint_is_refused_the_same_on_every_rank(worlds, world):
    root, results = worlds
    per_rank = results[world]
    for case in _cases(per_rank):
        where, name = case.split("/")
        messages = {res[case]["error"] for res in per_rank}
        assert len(messages) == 1, (case, messages)  # the same refusal on every rank
        (msg,) = messages
        assert msg is not None, (case, "loaded")
        assert msg.startswith("CheckpointError: planc.load"), (case, msg)
        assert all(f"rank {r}: CheckpointError: " in msg for r in range(world)), (case, msg)
        assert "Traceback" not in msg and 'File "' not in msg, (case, msg)
        named = f"{LR_KEY}" if where == "item" else ("optimizer/.metadata" if where == "optimizer" else "/.metadata")
        assert named in msg and str(root / "corpus" / case.replace("/", "-")) in msg, (case, msg)
        held = ITEM_TRUNCATED if case == "item/truncated" else HELD[name]
        assert held in msg, (case, held, msg)
        if where != "model":
            assert all(res[case]["restored"] == 0 for res in per_rank), case  # no state restored


def test_no_gadget_ran(worlds):
    root, _ = worlds
    assert list((root / "corpus" / "markers").iterdir()) == []


def test_the_genuine_checkpoint_still_resumes(worlds):
    for per_rank in worlds[1].values():
        for res in per_rank:
            assert res["good"] == {"error": None, "lr": LR}, res["good"]


def test_the_opt_in_reads_what_planc_cannot_and_warns(worlds):
    for per_rank in worlds[1].values():
        for res in per_rank:
            assert res["trusted"]["error"] is None, res["trusted"]
            assert res["trusted"]["lr"] == "Fraction(1, 100)", res["trusted"]
            assert any(w.startswith("UnsafeCheckpointWarning: planc.load_optimizer: trust_checkpoint_code=True")
                       for w in res["trusted"]["warnings"]), res["trusted"]["warnings"]
            # without it, the same checkpoint is refused, naming the opt-in
            assert "`fractions.Fraction`" in res["untrusted"]["error"], res["untrusted"]
            assert "trust_checkpoint_code=True" in res["untrusted"]["error"], res["untrusted"]


def test_explain_refuses_every_hostile_checkpoint(worlds, capsys):
    from planc.cli import main

    root, results = worlds
    # every kind of attack on each pickle explain reads (the 1- and 2-rank runs above take every case)
    kinds = ("os_system", "builtins_eval", "subprocess_popen", "allowed_module_os", "weights_only_bytearray",
             "protocol5_gadget", "protocol5", "truncated", "oversized", "path_traversal", "extra_item")
    for case in [c for c in _cases(results[2]) if c.split("/")[1] in kinds]:
        d = root / "corpus" / case.replace("/", "-")
        assert main(["explain", PLAN, "--parallel", SIZES, "--checkpoint", str(d)]) == 1, case
        err = capsys.readouterr().err
        assert "would refuse" in err and str(d) in err and "Traceback" not in err, (case, err)
        name = case.split("/")[1]
        assert (ITEM_TRUNCATED if case == "item/truncated" else HELD[name]) in err, (case, err)
    assert main(["explain", PLAN, "--parallel", SIZES, "--checkpoint", str(root / "good")]) == 0
    assert main(["explain", PLAN, "--parallel", SIZES, "--checkpoint", str(root / "trusted_fraction")]) == 1
    with pytest.warns(UnsafeCheckpointWarning, match="trust_checkpoint_code=True: reading"):
        assert main(["explain", PLAN, "--parallel", SIZES, "--checkpoint", str(root / "trusted_fraction"),
                     "--trust-checkpoint-code"]) == 0
    assert list((root / "corpus" / "markers").iterdir()) == []
