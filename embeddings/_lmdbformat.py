"""The on-disk format of a ``RowStore`` record and key, and how LMDB's errors read: keys are big-endian ids
offset by 2**63 (so LMDB's byte order is the numeric id order); values are ``record_dtype`` without the key."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lmdb
import numpy as np

_SIGN = np.uint64(1 << 63)
KEY_BYTES = 8

# LMDB errors that mean the file's structure is damaged (as opposed to a full map/disk or misuse).
CORRUPTION_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(lmdb, name) for name in (
        "CorruptedError", "PageNotFoundError", "InvalidError", "VersionMismatchError", "PanicError",
        "BadChecksumError", "IncompatibleError",
    ) if hasattr(lmdb, name)
)


def record_dtype(dim: int, state_width: int) -> np.dtype:
    """The packed structured dtype of one stored row, key included (the key is not part of the LMDB value)."""
    return np.dtype([
        ("key", ">u8"),
        ("update_count", "<i8"),
        ("last_step", "<i8"),
        ("last_time", "<f8"),
        ("weights", "<f4", (dim,)),
        ("state", "<f4", (state_width,)),
        ("crc", "<u4"),
    ])


def ids_to_keys(ids: np.ndarray) -> np.ndarray:
    """(n,) int64 -> (n,) big-endian uint64 keys whose byte order is the numeric order of the ids."""
    return (ids.view(np.uint64) ^ _SIGN).astype(">u8")


def keys_to_ids(keys: np.ndarray) -> np.ndarray:
    """Inverse of ``ids_to_keys``: (n,) big-endian uint64 -> (n,) int64."""
    return (keys.astype(np.uint64) ^ _SIGN).view(np.int64)


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
