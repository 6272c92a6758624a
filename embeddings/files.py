"""Durable-file helpers shared by the snapshot writer, checkpoints, the export log and the shard daemon:
fsync of a path (a directory's entries too) and a process-lifetime lock file."""

from __future__ import annotations

import fcntl
import os
from typing import IO


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a directory so that its renames and new entries survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
