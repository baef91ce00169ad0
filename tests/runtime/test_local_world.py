"""The gloo harness itself: results by rank, a rank's exception with its traceback, and a clean exit."""

import os
import tempfile

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from planc.runtime.local_world import run_local_world


def _report(rank, world_size, tag):
    return rank, world_size, dist.get_rank(), dist.get_world_size(), tag


def _fail_on_every_rank(rank, world_size):
    raise ValueError(f"rank {rank} refuses")


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_results_come_back_by_rank():
    assert run_local_world(_report, 2, "x") == [(0, 2, 0, 2, "x"), (1, 2, 1, 2, "x")]


def test_a_rank_exception_is_raised_with_its_traceback_and_leaves_no_file(tmp_path, monkeypatch):
    """torch.multiprocessing leaves each failed rank's `pytorch-errorfile-*.pickle` in the temporary directory;
    the harness removes them (and its results directory)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(mp.ProcessRaisedException, match=r"ValueError: rank [01] refuses"):
        run_local_world(_fail_on_every_rank, 2)
    assert sorted(os.listdir(tmp_path)) == []


def test_one_failing_rank_fails_the_world():
    """The first rank to exit with an error is reported: the failing rank, or its peer whose closing barrier broke
    when the failing rank's connection went away (a gloo transport error; both happen)."""
    with pytest.raises(mp.ProcessRaisedException, match=r"rank one refuses|gloo/transport"):
        run_local_world(_fail_on_rank_one, 2)
