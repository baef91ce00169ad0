"""The gloo harness itself: results by rank, a rank's exception with its traceback, and a clean exit."""

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from planc.runtime.local_world import run_local_world


def _report(rank, world_size, tag):
    return rank, world_size, dist.get_rank(), dist.get_world_size(), tag


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_results_come_back_by_rank():
    assert run_local_world(_report, 2, "x") == [(0, 2, 0, 2, "x"), (1, 2, 1, 2, "x")]


def test_an_exception_on_one_rank_is_raised_with_its_traceback():
    with pytest.raises(mp.ProcessRaisedException, match="rank one refuses"):
        run_local_world(_fail_on_rank_one, 2)
