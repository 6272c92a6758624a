"""The on-disk format of a stored row, and how LMDB's errors read. A record (``record_dtype``) is the row's key
(its id as a big-endian integer offset by 2**63, so byte order is numeric order), metadata, weights, optimizer
state and a CRC-32 of the rest: an LMDB ``RowStore`` (snapshots) keeps the key apart and the rest as the value; a
``SpillFile`` keeps whole records by slot. ``encode_records`` / ``records_batch`` convert a batch either way."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lmdb
import numpy as np

from tigana.embeddings._checksum import crc32_rows
from tigana.embeddings.rows import RowBatch

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


def encode_records(batch: RowBatch, dtype: np.dtype) -> np.ndarray:
    """(n,) records of ``dtype`` (``record_dtype``) holding ``batch``, each stamped with its CRC-32."""
    n = len(batch)
    rec = np.empty(n, dtype)
    rec["key"] = ids_to_keys(np.asarray(batch.ids, np.int64))
    rec["update_count"] = batch.update_count
    rec["last_step"] = batch.last_step
    rec["last_time"] = batch.last_time
    rec["weights"] = batch.weights
    rec["state"] = np.asarray(batch.state).reshape(rec["state"].shape)
    rec["crc"] = crc32_rows(record_bytes(rec)[:, :-4])
    return rec


def record_bytes(rec: np.ndarray) -> np.ndarray:
    """(n, itemsize) uint8 view of (n,) records."""
    return rec.view(np.uint8).reshape(rec.shape[0], rec.dtype.itemsize)


def bad_crc(rec: np.ndarray) -> np.ndarray:
    """(n,) bool: the records whose CRC-32 does not match their bytes."""
    return crc32_rows(record_bytes(rec)[:, :-4]) != rec["crc"]


def records_batch(rec: np.ndarray, state_width: int) -> RowBatch:
    """The rows of (n,) checked records."""
    n = rec.shape[0]
    return RowBatch(ids=keys_to_ids(rec["key"]), weights=np.ascontiguousarray(rec["weights"], np.float32),
                    state=np.ascontiguousarray(rec["state"], np.float32).reshape(n, state_width),
                    update_count=rec["update_count"].astype(np.int64), last_step=rec["last_step"].astype(np.int64),
                    last_time=rec["last_time"].astype(np.float64))


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
