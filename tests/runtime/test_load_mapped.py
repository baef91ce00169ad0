"""planc.load's mmap slices (files.py `slices`), the per-layer `unmap`, and the check that no parameter keeps a
view of the mapped file (load.py `_own_copies`).

Every key is read through mmap; anything a converter passes through as a view of the mapped file must be copied
before its layer is unmapped, or the whole mapped tensor (and the file) would stay alive in the model.
"""

import torch
from safetensors.torch import save_file
from torch import nn

from planc.checkpoint.files import CheckpointFiles, MappedSlice
from planc.checkpoint.fill import _own_copies


def _checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    tensors = {"a.weight": torch.arange(32.0).reshape(8, 4), "b.weight": torch.ones(4, 4)}
    save_file(tensors, tmp_path / "model.safetensors")
    return CheckpointFiles.open(tmp_path), tensors


def test_slices_are_mmap_views_that_record_their_storage_until_unmapped(tmp_path):
    files, tensors = _checkpoint(tmp_path)
    try:
        slices = files.slices(["a.weight"])
        assert set(slices) == {"a.weight"} and isinstance(slices["a.weight"], MappedSlice)
        assert slices["a.weight"].get_shape() == [8, 4] and slices["a.weight"].get_dtype() == "F32"
        rows = slices["a.weight"][2:4]
        assert torch.equal(rows, tensors["a.weight"][2:4])
        assert rows.untyped_storage().data_ptr() in files.mapped_storages
        assert rows.untyped_storage().nbytes() == tensors["a.weight"].nbytes  # a view of the whole mapped tensor
        assert files._mapped_handles  # the file is mapped ...
        files.unmap()
        assert not files.mapped_storages and not files._mapped_handles  # ... until its layer is done
        again = files.slices()["b.weight"][...]  # a later layer maps it again
        assert torch.equal(again, tensors["b.weight"])
    finally:
        files.close()
    assert not files.mapped_storages


def test_parameters_holding_a_mapped_view_get_their_own_copy(tmp_path):
    files, tensors = _checkpoint(tmp_path)
    try:
        slices = files.slices()
        model = nn.Module()
        model.a = nn.Linear(4, 2, bias=False)
        model.b = nn.Linear(4, 4, bias=False)
        view = slices["a.weight"][2:4]  # what a pass-through converter would hand the model
        model.a.weight = nn.Parameter(view, requires_grad=False)
        model.a.weight._is_hf_initialized = True
        model.a.register_buffer("mapped_buffer", slices["a.weight"][0:1])
        model.a.mapped_buffer._is_hf_initialized = True  # loaded: transformers' finalisation must leave it alone
        kept = model.b.weight
        _own_copies(model, files.mapped_storages)
        for t in (model.a.weight, model.a.mapped_buffer):
            assert t.untyped_storage().data_ptr() not in files.mapped_storages
            assert t.untyped_storage().nbytes() == t.nbytes  # its own memory, of its own size
        assert torch.equal(model.a.weight, tensors["a.weight"][2:4]) and torch.equal(model.a.mapped_buffer, tensors["a.weight"][0:1])
        assert isinstance(model.a.weight, nn.Parameter) and not model.a.weight.requires_grad
        assert model.a.weight._is_hf_initialized and model.a.mapped_buffer._is_hf_initialized
        assert model.b.weight is kept  # anything else untouched
    finally:
        files.close()
