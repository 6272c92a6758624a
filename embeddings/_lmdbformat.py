"""How a ``RowStore``'s LMDB keys and errors read: the keys are ``_records.ids_to_keys`` of the ids (LMDB's byte
order is then the numeric id order), the values the rest of the record (``_records.record_dtype``)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lmdb
import numpy as np

from tigana.embeddings._records import KEY_BYTES, ids_to_keys

# LMDB errors that mean the file's structure is damaged (as opposed to a full map/disk or misuse).
CORRUPTION_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(lmdb, name) for name in (
        "CorruptedError", "PageNotFoundError", "InvalidError", "VersionMismatchError", "PanicError",
        "BadChecksumError", "IncompatibleError",
    ) if hasattr(lmdb, name)
)


def key_list(ids: np.ndarray) -> list[bytes]:
    return ids_to_keys(ids).view("V8").tolist()


def key_after(last: bytes) -> bytes | None:
    """The key just after ``last`` (None: ``last`` is not a row key, or the largest one)."""
    if len(last) != KEY_BYTES or last == b"\xff" * KEY_BYTES:
        return None
    return (int.from_bytes(last, "big") + 1).to_bytes(KEY_BYTES, "big")


def is_disk_full(exc: BaseException, directory: Path, need: int) -> bool:
    """Whether a failed write ran out of disk. LMDB reports a short write at commit (the usual way a
    full disk shows up) as EIO, not ENOSPC, so an I/O error with too little space left counts too."""
    if isinstance(exc, lmdb.DiskError) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
        return True
    text = str(exc)
    if "No space left on device" in text or "ENOSPC" in text:
        return True
    if "Input/output error" in text or (isinstance(exc, OSError) and exc.errno == errno.EIO):
        try:
            st = os.statvfs(directory)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < need + (1 << 20)
    return False
