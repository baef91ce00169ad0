"""planc's pickle reader (planc/checkpoint/safe_pickle.py, dcp_reader.py) on its own, without ranks: what torch DCP
really writes reads back equal to pickle's own reading, and each way a pickle runs code or takes unbounded memory
is refused by name."""

import io
import pickle
import pickletools

import pytest
import torch
import torch.distributed.checkpoint as dcp

from planc.checkpoint.dcp_reader import CheckedReader, METADATA, planner_for, read_metadata, read_plain_item
from planc.checkpoint.safe_pickle import PLAIN_DATA, UnsafePickle, check_plain, loads
from planc.errors import CheckpointError

HYPERPARAMETERS = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                   "foreach": None, "name": "adamw", "inf": float("inf"), "list": [1, 2.5, None]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A DCP checkpoint as torch writes it: bf16 and fp32 tensors, a scalar tensor, and non-tensor values."""
    d = tmp_path_factory.mktemp("dcp")
    state = {"w": torch.randn(4, 6, dtype=torch.bfloat16), "v": torch.randn(3), "step": torch.tensor(2.0),
             **{f"param_groups.p.{k}": v for k, v in HYPERPARAMETERS.items()}}
    dcp.save(state, checkpoint_id=str(d), no_dist=True)
    return d, state


def _globals(data: bytes) -> set:
    """Every (module, name) a pickle names, as pickle resolves it."""
    names = set()

    class Spy(pickle.Unpickler):
        def find_class(self, module, name):
            names.add((module, name))
            return super().find_class(module, name)

    Spy(io.BytesIO(data)).load()
    return names


def test_real_metadata_reads_equal_and_names_only_allowed_globals(saved):
    d, _ = saved
    data = (d / ".metadata").read_bytes()
    names = _globals(data)
    assert names <= set(METADATA.globals), names - set(METADATA.globals)
    ours, theirs = read_metadata(d / ".metadata"), pickle.loads(data)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data


def test_dcp_loads_through_the_reader_and_planner(saved):
    d, state = saved
    reader = CheckedReader(d)
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}
    dcp.load(target, storage_reader=reader, planner=planner_for(reader), no_dist=True)
    for k, v in state.items():
        assert (torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v), k
    items = reader.read_items(k for k in state if k.startswith("param_groups."))
    assert items == {f"param_groups.p.{k}": v for k, v in HYPERPARAMETERS.items()}


def _handmade(*ops: bytes) -> bytes:
    return b"".join(ops)


@pytest.mark.parametrize("name,data", [
    ("INST", b"(ios\nsystem\nS'true'\no."),  # the protocol 0 class opcode (find_class is never reached)
    ("OBJ", b"\x80\x02(K\x01o."),
    ("EXT1", b"\x80\x02\x82\x01."),
    ("BINPERSID", b"\x80\x02X\x01\x00\x00\x00xQ."),
    ("NEXT_BUFFER", b"\x80\x05\x97."),
    ("BYTEARRAY8", b"\x80\x05\x96" + (2**40).to_bytes(8, "little") + b"."),
    ("EMPTY_SET", b"\x80\x04\x8f."),
    ("NEWOBJ_EX", b"\x80\x04\x92."),
    ("STRING", b"S'x'\n."),
])
def test_opcodes_that_never_appear_are_refused_by_name(name, data):
    with pytest.raises(UnsafePickle, match=name):
        loads(data, PLAIN_DATA, limit=1 << 20)


@pytest.mark.parametrize("data,needle", [
    (pickle.dumps(bytearray(8), protocol=2), "bytearray`"),
    (b"\x80\x02]q\x00(K\x01e" , "truncated"),
    (pickle.dumps([1], protocol=2) + b"junk", "after the pickle's STOP"),
    (b"\x80\x02K\x01h\x07.", "damaged pickle"),  # BINGET of a memo slot never set
])
def test_plain_data_refusals(data, needle):
    with pytest.raises(UnsafePickle, match=needle):
        loads(data, PLAIN_DATA, limit=1 << 20)


def test_long_binput_with_a_huge_index_takes_no_memory():
    data = b"\x80\x02K\x01r\xff\xff\xff\xff."  # memo[2**32 - 1] = 1: pickle's C unpickler would size an array
    assert loads(data, PLAIN_DATA, limit=1 << 20) == 1


def test_size_bound_is_checked_before_reading(tmp_path):
    with pytest.raises(UnsafePickle, match="more than the 10"):
        loads(pickle.dumps(list(range(100))), PLAIN_DATA, limit=10)
    fifo = tmp_path / ".metadata"
    import os

    os.mkfifo(fifo)  # opening it would block: refused on its type
    with pytest.raises(CheckpointError, match="no regular file"):
        read_metadata(fifo)


def test_plain_values_are_bounded_in_depth_and_size():
    check_plain({**HYPERPARAMETERS, "nested": {"a": [1, (2.5, b"x")]}})
    deep: list = []
    for _ in range(20):
        deep = [deep]
    with pytest.raises(UnsafePickle, match="nested more than 16 deep"):
        check_plain(deep)
    with pytest.raises(UnsafePickle, match="more than 100000 values"):
        check_plain(list(range(200_000)))
    with pytest.raises(UnsafePickle, match="a dict key of type int"):
        check_plain({1: 2})


def test_a_non_plain_item_names_its_key():
    buf = io.BytesIO()
    torch.save(torch.nn.Linear(1, 1), buf)
    with pytest.raises(CheckpointError, match=r"the item `param_groups\.p\.lr` refused, it holds .*trust_checkpoint_code"):
        read_plain_item(buf.getvalue(), "param_groups.p.lr", "x.distcp")


def test_protocol_and_opcode_lists_hold_for_every_protocol_dcp_and_torch_write():
    # .metadata: the saving Python's default protocol (4 through 3.13); byte items: torch.save's protocol 2
    assert pickle.DEFAULT_PROTOCOL in (4, 5)
    ops = {op.name for op, _, _ in pickletools.genops(pickle.dumps(HYPERPARAMETERS, protocol=2))}
    assert loads(pickle.dumps(HYPERPARAMETERS, protocol=2), PLAIN_DATA, limit=1 << 20) == HYPERPARAMETERS, ops
