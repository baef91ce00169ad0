"""Writing the CLI's output files: all or nothing, never a truncated plan, never a silent overwrite.

`planc migrate --write`, `planc init -o` and `planc schema -o` write through `write_file`: the bytes go
to a temporary file in the target's directory, are flushed to disk, get the mode the file had (or
the umask's default for a new file), and then replace the target in one `rename`. A full disk, a
file-size limit or a crash leaves the old file as it was. A symlink is written through: its target
is replaced and the link stays a link (the plan usually lives where the link points).
"""

from __future__ import annotations

import os
import stat
import tempfile

from planc.errors import PlancError


class OutputError(PlancError):
    """A file the CLI cannot or must not write; the message names the path and what to do."""


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _writable(path: str, mode: int) -> bool:
    """Writable for us, and not marked read-only (root may write anything: the mode bits still say no)."""
    return os.access(path, os.W_OK) and bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def check_target(path: str, *, overwrite: bool):
    """(resolved target, its stat or None, how to name it) or OutputError; cheap, so commands call it
    before doing the work whose result they would then fail to write."""
    target = os.path.realpath(path)
    directory = os.path.dirname(target) or "."
    shown = path if target == os.path.abspath(path) else f"{path} (-> {target})"
    if os.path.isdir(target):
        raise OutputError(f"{shown} is a directory; give a file path, e.g. {os.path.join(path, 'plan.yaml')}")
    if not os.path.isdir(directory):
        raise OutputError(f"cannot write {shown}: directory {directory} does not exist; create it first")
    if not _writable(directory, os.stat(directory).st_mode):
        raise OutputError(f"cannot write {shown}: directory {directory} is read-only")
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"cannot write {shown}: {e.strerror or e}") from None
    if st is not None:
        if not overwrite:
            raise OutputError(f"{shown} already exists; pass --force to overwrite it")
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(f"{shown} is not a regular file; write to a plan file instead")
        if not _writable(target, st.st_mode):
            raise OutputError(f"{shown} is read-only; make it writable (chmod u+w) to rewrite it")
    return target, st, shown


def write_file(path: str, data: bytes, *, overwrite: bool) -> str:
    """Atomically write `data` to `path` (through a symlink to its target); returns the path written.

    `overwrite=False` refuses an existing file. Raises OutputError with a one-line reason.
    """
    target, st, shown = check_target(path, overwrite=overwrite)
    directory = os.path.dirname(target) or "."
    mode = stat.S_IMODE(st.st_mode) if st is not None else _default_mode()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise OutputError(f"cannot write {shown}: {e.strerror or e} (directory {directory})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if overwrite:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)  # fails if the file appeared meanwhile: never clobbers
            os.unlink(tmp)
    except FileExistsError:
        _remove(tmp)
        raise OutputError(f"{shown} already exists; pass --force to overwrite it") from None
    except OSError as e:
        _remove(tmp)
        raise OutputError(f"cannot write {shown}: {e.strerror or e}; the file was left as it was") from None
    except BaseException:
        _remove(tmp)
        raise
    return target


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
