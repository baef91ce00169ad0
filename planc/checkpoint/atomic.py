"""Write a checkpoint directory beside its target and rename it into place only when every rank succeeded.

`atomic_directory(target, what, replaceable)` is a context manager all ranks enter together. Rank 0
prepares `.<name>.planc-partial` next to the target (removing a stale one an interrupted save left);
every rank writes into it; then one all-reduce of a status flag tells every rank whether all of them
succeeded. Only then does rank 0 move the new directory into place: an existing target is first
renamed to `.<name>.planc-old`, the new one renamed to the target, the old one removed. A failure on
any rank removes the partial directory, leaves the target untouched and raises the same
`CheckpointError` on every rank.

POSIX cannot rename a directory over a non-empty one, so the swap is two renames; should the process
die between them, the target is missing and `.<name>.planc-old` holds the previous complete
checkpoint: the next `atomic_directory` on that target renames it back first. Written by hand
because neither torch.distributed.checkpoint nor transformers writes a directory atomically (DCP
writes into its target in place; `save_pretrained` deletes stale shards as it goes).

All ranks must see the same filesystem (one host, or a shared filesystem): DCP needs it too, since
the coordinator writes the metadata every rank's files are described by.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from planc.errors import CheckpointError
from planc.runtime.mesh import rank_device

PARTIAL_SUFFIX = ".planc-partial"
OLD_SUFFIX = ".planc-old"


def agree(error: Optional[BaseException], what: str) -> None:
    """Raise the same CheckpointError on every rank if `error` is set on any rank (one all-reduce when all
    succeeded; the messages are gathered only on failure)."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=rank_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    lines = "\n".join(f"  rank {rank}: {m}" for rank, m in enumerate(messages) if m is not None)
    raise CheckpointError(f"{what} failed:\n{lines}") from error


def sibling(target: Path, suffix: str) -> Path:
    return target.parent / f".{target.name}{suffix}"


def _recover(target: Path) -> None:
    """A swap interrupted between its two renames left the previous checkpoint at `.<name>.planc-old`."""
    old = sibling(target, OLD_SUFFIX)
    if old.is_dir() and not target.exists():
        os.rename(old, target)
    elif old.exists():
        shutil.rmtree(old)


def _prepare(target: Path, what: str, replaceable: Callable[[Path], bool]) -> Path:
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{what}: {target} is a file; pass a directory path.")
    target.parent.mkdir(parents=True, exist_ok=True)
    _recover(target)
    if target.is_dir() and any(target.iterdir()) and not replaceable(target):
        raise CheckpointError(
            f"{what}: {target} exists and is not a checkpoint this call writes, so it would not replace it. "
            "Pass a new or empty directory, or remove that one first."
        )
    partial = sibling(target, PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)  # left by an interrupted save: never a complete checkpoint
    partial.mkdir()
    return partial


def _swap(partial: Path, target: Path) -> None:
    if target.exists():
        old = sibling(target, OLD_SUFFIX)
        os.rename(target, old)
        os.rename(partial, target)
        shutil.rmtree(old)
    else:
        os.rename(partial, target)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike[str], what: str, replaceable: Callable[[Path], bool]) -> Iterator[Path]:
    """Yield the partial directory to write into; on exit rename it to `target` if every rank succeeded.

    `replaceable(path)` says whether an existing non-empty `target` may be replaced (it is a checkpoint of
    the kind being written): planc never deletes a directory it did not write.
    """
    target = Path(target).absolute()
    partial = sibling(target, PARTIAL_SUFFIX)
    rank0 = dist.get_rank() == 0
    error: Optional[BaseException] = None
    if rank0:
        try:
            _prepare(target, what, replaceable)
        except Exception as e:  # noqa: BLE001 - reported on every rank by agree()
            error = e
    agree(error, what)
    try:
        yield partial
    except Exception as e:  # noqa: BLE001 - every rank learns of it before anything is renamed
        error = e
    try:
        agree(error, f"{what} (nothing was written to {target}; any previous checkpoint there is intact)")
    except CheckpointError:
        if rank0:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()  # no rank returns before the partial directory is gone
        raise
    if rank0:
        try:
            _swap(partial, target)
        except Exception as e:  # noqa: BLE001 - every rank learns of it through agree()
            error = e
    agree(error, f"{what}: renaming {partial} to {target}")


__all__ = ["atomic_directory", "agree", "PARTIAL_SUFFIX", "OLD_SUFFIX"]
