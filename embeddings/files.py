"""Durable-file helpers shared by the snapshot writer, checkpoints, the export log, the catalog, the scheduler's
state file, the daemons' ready files and the trainer's elastic state: fsync of a path (a directory's entries
too), the one atomic file replacement (``atomic_replace``/``atomic_write``), the one atomic folder publication
(``publish_folder``), the one read of a file checked against its manifest's sha256 (``read_checked``) and a
process-lifetime lock file."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a directory so that its renames and new entries survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_beside(path: str | os.PathLike) -> Path:
    """The temp file ``atomic_replace`` writes before renaming it over ``path``: hidden, in the same folder (so
    the rename is atomic), unique per process and thread (``.NAME.tmp-PID.TID``)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}.{threading.get_ident()}")


@contextlib.contextmanager
def atomic_replace(path: str | os.PathLike) -> Iterator[Path]:
    """Replace the file ``path`` with what the body writes to the yielded temp path: on a clean exit the temp
    file is fsynced, renamed over ``path`` and the folder fsynced, so a reader (or a crash at any point) sees the
    old file or the new one, never a part. On an error the temp file is removed, ``path`` stays as it was and
    the error propagates. The folder must exist. Blocking (fsyncs); thread-safe for distinct paths.

    Example::

        with atomic_replace(folder / "dense.pt") as tmp:
            torch.save(state, tmp)
    """
    path = Path(path)
    tmp = temp_beside(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_path(path.parent)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace the file ``path`` with ``data`` (a str is written as UTF-8) through ``atomic_replace``: the old
    content or the new one survives a crash, never a part. Raises ``OSError`` (the old file intact)."""
    with atomic_replace(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def publish_folder(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make the folder ``tmp`` durable (every file and folder in it fsynced, deepest first, then ``tmp``) and
    rename it to ``final`` (absent, or an empty folder), then fsync ``final``'s parent: a crash leaves the whole
    folder under ``final`` or none of it. Both must be in the same filesystem. Blocking (fsyncs)."""
    tmp = Path(tmp)
    for p in sorted(tmp.rglob("*"), reverse=True):
        fsync_path(p)
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(Path(final).parent)


def hold_lock(path: str | os.PathLike) -> tuple[IO[str] | None, str]:
    """Take an exclusive ``flock`` on ``path`` (created if missing) and write this process's pid in it: (the open
    file, which holds the lock until closed, ""), or (None, the holder's note) when another process holds it.
    The kernel drops the lock when the holder dies, so a crashed holder never leaves it stuck."""
    f = open(path, "a+")  # noqa: SIM115 - held until the caller closes it
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        owner = f.read().strip() or "unknown"
        f.close()
        return None, owner
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f, ""


class FileMismatch(Exception):
    """A file whose size or sha256 differs from what its manifest recorded (torn, corrupted, or another file)."""


def read_checked(path: str | os.PathLike, sha256: str, nbytes: int | None = None) -> bytes:
    """The bytes of ``path``, checked against the sha256 (and size, where recorded) that a manifest wrote for it.
    ``OSError`` when it cannot be read, ``FileMismatch`` when it differs; each caller names the file in its own
    error class (a snapshot's ``CorruptStore``, a checkpoint's or export's ``DataLoss``)."""
    data = Path(path).read_bytes()
    if (nbytes is not None and len(data) != nbytes) or hashlib.sha256(data).hexdigest() != sha256:
        raise FileMismatch(str(path))
    return data
