"""Single-host gloo worlds: `planc demo`, the tests and the CPU benchmarks run several ranks this way.

`run_local_world(fn, world_size, *args)` starts `world_size` processes with
`torch.multiprocessing.spawn`, initialises a gloo process group in each on a free port (retrying when
another process grabbed the port first), calls `fn(rank, world_size, *args)` and returns the list of
per-rank return values (they must be picklable; `fn` must be a module-level function). The TP styles and EP
strategies registered in the launching process are registered in every rank before `fn` runs (by their rows and
their runtimes' import paths: planc.spec.extensions.snapshot). An exception on
any rank raises `torch.multiprocessing.ProcessRaisedException` with the traceback of the first rank to fail: that
rank, or a peer whose collective broke when the failing rank went away.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planc.spec.extensions import restore as restore_extensions, snapshot as extensions_snapshot


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (callers retry when it no longer is)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _worker(rank: int, world_size: int, port: int, result_dir: str, fn: Callable[..., Any],
            args: tuple[Any, ...], extensions: tuple[Any, ...] = ()) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # ranks share the host's cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        restore_extensions(extensions)  # the styles and strategies the launching process registered
        result = fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(result_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # The rank's work is done and its result is on disk: leave without the interpreter's teardown. A spawned child
    # otherwise ends in the interpreter's teardown, where a gloo worker thread still releasing a finished work can
    # abort the process ("terminate called without an active exception"; the cause and planc's exit drain for user
    # programs: planc.runtime.exit_drain.destroy_groups_at_exit). From here on nothing is left that such an abort could
    # lose. An exception in `fn` still propagates above, as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _port_taken(error: Exception) -> bool:
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _join(context: mp.ProcessContext, timeout: float | None) -> None:
    """Wait for every rank; past `timeout` seconds, kill them all and raise TimeoutError (a hang fails fast)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not context.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            _kill_alive(context)
            raise TimeoutError(f"the {len(context.processes)}-rank world did not finish within {timeout:g} s (killed)")


def _kill_alive(context: mp.ProcessContext) -> None:
    """Kill the ranks still running and reap them: after a timeout, or when the caller's wait was interrupted
    (Ctrl-C, a test's time limit), so no rank is left waiting in a collective for peers that are gone."""
    for p in context.processes:
        if p.is_alive():
            p.kill()
    for p in context.processes:
        p.join()


def _remove_error_files(context: mp.ProcessContext) -> None:
    """torch.multiprocessing writes a failing rank's traceback to a file in the temporary directory
    (`pytorch-errorfile-*.pickle`) and leaves it there once read; remove them."""
    for path in getattr(context, "error_files", ()):
        try:
            os.unlink(path)
        except (OSError, TypeError):
            pass


def run_local_world(fn: Callable[..., Any], world_size: int, *args: Any, retries: int = 5,
                    timeout: float | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks and return the results by rank.

    `timeout`: seconds before every rank is killed and TimeoutError raised (tests bound a world that could hang)."""
    last_error = None
    for _ in range(retries):
        with tempfile.TemporaryDirectory() as result_dir:
            context: mp.ProcessContext = mp.spawn(  # type: ignore[no-untyped-call]  # torch leaves spawn untyped
                _worker, args=(world_size, free_port(), result_dir, fn, args, extensions_snapshot()),
                nprocs=world_size, join=False)
            try:
                _join(context, timeout)
            except mp.ProcessRaisedException as e:
                if _port_taken(e):
                    last_error = e
                    continue
                raise
            finally:
                _kill_alive(context)  # none on success; every rank when the wait was cut short
                _remove_error_files(context)
            results: list[Any] = []
            for rank in range(world_size):
                with open(os.path.join(result_dir, f"{rank}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results
    raise RuntimeError(f"could not find a free port after {retries} tries") from last_error
