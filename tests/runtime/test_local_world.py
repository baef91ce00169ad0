"""The gloo harness itself: results by rank, a rank's exception with its traceback, a clean exit, and no rank left
behind when the caller's wait is cut short."""

import os
import signal
import tempfile
import time
from pathlib import Path

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


def _sleep_after_writing_pid(rank, world_size, pid_dir):
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_an_interrupted_wait_leaves_no_rank_running(tmp_path):
    """Ctrl-C or a test's time limit (pytest-timeout raises in the waiting thread, as SIGALRM does here) while the
    ranks still run: every rank is killed and reaped before the exception leaves run_local_world."""

    class Interrupted(Exception):
        pass

    def interrupt_once_both_ranks_run(signum, frame):
        if len(list(tmp_path.glob("*.pid"))) == 2:
            raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt_once_both_ranks_run)
    signal.setitimer(signal.ITIMER_REAL, 0.5, 0.5)
    try:
        with pytest.raises(Interrupted):
            run_local_world(_sleep_after_writing_pid, 2, str(tmp_path))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    for pid in (int(p.read_text()) for p in tmp_path.glob("*.pid")):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, and reaped (a zombie would still take the signal)
