"""The format of a stored row, shared by the LMDB ``RowStore`` (snapshots) and the ``SpillFile`` (the spill tier).

A record (``record_dtype``) is the row's key (its id as a big-endian integer offset by 2**63, so byte order is
numeric order), metadata, weights, optimizer state and a CRC-32 of the rest: a ``RowStore`` keeps the key apart as
the LMDB key and the rest as the value; a ``SpillFile`` keeps whole records by slot. ``encode_records`` and
``records_batch`` convert a batch either way; ``bad_crc`` checks records.
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings._checksum import crc32_rows
from tigana.embeddings.rows import RowBatch

_SIGN = np.uint64(1 << 63)
KEY_BYTES = 8


def record_dtype(dim: int, state_width: int) -> np.dtype:
    """The packed structured dtype of one stored row, key included."""
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
