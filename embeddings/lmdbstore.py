"""RowStore: the LMDB store that holds complete rows of one table (a snapshot's rows).

Public API (all ids are ``(n,)`` int64 over the full signed range; duplicates allowed)::

    store = RowStore(path, table="user_id", dim=16, state_width=1)   # path: a directory (created)
    store.put(batch)                   # insert/overwrite a RowBatch in one write transaction; all or nothing
    found, rows = store.get(ids)       # (n,) bool mask aligned with ids; RowBatch of ids[found], in that order
    found, rows = store.pop(ids)       # as get, and deletes the found rows in the same transaction
    store.delete(ids) -> int           # rows deleted (distinct ids that were present)
    store.contains(ids) -> (n,) bool
    len(store); store.iter_ids(); store.iter_batches(batch_size)   # all rows, ascending id order
    rows, read, after = store.read_from(start_id, n)                # a window: <= n rows from start_id on
    store.clear(); store.sync(); store.stats(); store.close()      # also a context manager

Layout: an LMDB environment in the directory ``path`` (file ``data.mdb``) with two named databases. ``rows``
maps an 8-byte key, the big-endian id offset by 2**63 (so LMDB's byte order is the numeric id order), to a
fixed-size little-endian record::

    update_count i8 | last_step i8 | last_time f8 | weights f4[dim] | state f4[state_width] | crc32 u4

where the CRC-32 covers the key and every record byte before it. ``meta`` holds the layout (table, dim,
state width, format) so a store reopened with another layout is refused. Whole batches are encoded and
decoded at once through a numpy structured dtype; the only per-row Python work is handing the key/value
pairs to py-lmdb (``putmulti`` / ``getmulti``).

Errors: a record with a bad checksum or length raises ``CorruptStore`` naming the file and the id (before
any row is returned, and before a ``pop`` deletes anything); a data file LMDB cannot open, or one shorter
than its own metadata says, raises ``CorruptStore`` naming the file. A full map is grown by doubling up
to ``max_map_size`` (``None``: no cap) and the write retried; past the cap, or when the disk is full, the
write raises ``StorageFull`` naming the table and the file, and nothing of it is visible.

Thread-safety: every method takes the store's lock, so a store may be shared between threads; LMDB itself
allows one environment per file per process, so open a path once.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np

from tigana.embeddings._lmdbformat import CORRUPTION_ERRORS, is_disk_full, key_after, key_list
from tigana.embeddings._records import (
    KEY_BYTES,
    bad_crc,
    encode_records,
    ids_to_keys,
    keys_to_ids,
    record_bytes,
    record_dtype,
    records_batch,
)
from tigana.embeddings.changes import sorted_unique
from tigana.embeddings.errors import CorruptStore, InvalidArgument, StorageError, StorageFull
from tigana.embeddings.rows import RowBatch

__all__ = ["RowStore", "record_dtype"]

FORMAT_VERSION = 1
DATA_FILE = "data.mdb"
_T = TypeVar("_T")


class RowStore:
    """Rows of one table in an LMDB environment at ``path`` (a directory). See the module docstring.

    ``map_size``: initial map size in bytes (virtual; the file grows with use). ``max_map_size``: cap for
    automatic growth (``None``: grow until the disk is full). ``readonly``: open an existing store only for
    reading. ``lock``: use LMDB's lock file (turn off for single-process files such as snapshots).
    ``durable``: fsync on every commit (off for a spill tier, which a restart rebuilds anyway).
    """

    def __init__(self, path: str | Path, *, table: str, dim: int, state_width: int,
                 map_size: int = 1 << 30, max_map_size: int | None = None, readonly: bool = False,
                 lock: bool = True, durable: bool = False, readahead: bool = False) -> None:
        if int(dim) < 1:
            raise InvalidArgument(f"table {table!r}: field 'dim' must be >= 1, got {dim}")
        if int(state_width) < 0:
            raise InvalidArgument(f"table {table!r}: field 'state_width' must be >= 0, got {state_width}")
        if max_map_size is not None and max_map_size < map_size:
            map_size = int(max_map_size)
        self.table = table
        self.dim = int(dim)
        self.state_width = int(state_width)
        self.path = Path(path)
        self.file = self.path / DATA_FILE
        self.max_map_size = None if max_map_size is None else int(max_map_size)
        self._dtype = record_dtype(self.dim, self.state_width)
        self._value_bytes = self._dtype.itemsize - KEY_BYTES
        self._lock = threading.RLock()
        self._readonly = readonly
        self._env: Any = None

        if readonly and not self.file.is_file():
            raise StorageError(f"table {table!r}: no LMDB store at {self.file}")
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        if self.file.is_file() and self.file.stat().st_size < 2 * 4096:
            # LMDB writes both meta pages when it creates a file; anything shorter is a truncated file
            # (and an empty one would otherwise be silently re-initialized as a new store).
            raise CorruptStore(f"table {table!r}: LMDB file {self.file} is truncated "
                               f"({self.file.stat().st_size} bytes)")
        try:
            self._env = lmdb.open(
                str(self.path), map_size=int(map_size), subdir=True, readonly=readonly, lock=lock,
                sync=durable, metasync=durable, max_dbs=2, readahead=readahead, meminit=False,
                create=not readonly,
            )
        except CORRUPTION_ERRORS as exc:
            raise CorruptStore(f"table {table!r}: LMDB file {self.file} cannot be opened: {exc}") from exc
        except lmdb.Error as exc:
            if is_disk_full(exc, self.path, 0):
                raise StorageFull(f"table {table!r}: disk full creating {self.file}: {exc}") from exc
            raise StorageError(f"table {table!r}: cannot open LMDB store {self.file}: {exc}") from exc
        try:
            self._check_file_length()
            self._open_databases()
        except BaseException:
            self._env.close()
            self._env = None
            raise

    # --- opening ---------------------------------------------------------------------------------------
    def _check_file_length(self) -> None:
        info, psize = self._env.info(), self._env.stat()["psize"]
        need = (int(info["last_pgno"]) + 1) * int(psize)
        have = self.file.stat().st_size
        if have < need:
            raise CorruptStore(f"table {self.table!r}: LMDB file {self.file} is truncated "
                               f"({have} bytes, its metadata needs {need})")

    def _layout(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "table": self.table, "dim": self.dim,
                "state_width": self.state_width, "record_bytes": self._dtype.itemsize}

    def _open_databases(self) -> None:
        try:
            if self._readonly:
                self._meta_db = self._env.open_db(b"meta", create=False)
                self._rows_db = self._env.open_db(b"rows", create=False)
                with self._env.begin(db=self._meta_db) as txn:
                    raw = txn.get(b"layout")
            else:
                def create(txn: Any) -> Any:
                    self._meta_db = self._env.open_db(b"meta", txn=txn)
                    self._rows_db = self._env.open_db(b"rows", txn=txn)
                    found = txn.get(b"layout", db=self._meta_db)
                    if found is None:
                        found = json.dumps(self._layout()).encode()
                        txn.put(b"layout", found, db=self._meta_db)
                    return found
                raw = self._write(create)
        except lmdb.NotFoundError as exc:
            raise CorruptStore(f"table {self.table!r}: {self.file} is not a Tigana row store "
                               f"(missing database: {exc})") from exc
        except CORRUPTION_ERRORS as exc:
            raise CorruptStore(f"table {self.table!r}: LMDB file {self.file} is corrupt: {exc}") from exc
        if raw is None:
            raise CorruptStore(f"table {self.table!r}: {self.file} has no layout record")
        try:
            layout = json.loads(bytes(raw))
        except ValueError as exc:
            raise CorruptStore(f"table {self.table!r}: {self.file} has a corrupt layout record") from exc
        for field, want in self._layout().items():
            if layout.get(field) != want:
                raise InvalidArgument(
                    f"table {self.table!r}: store {self.file} was written with {field}={layout.get(field)!r}, "
                    f"opened with {field}={want!r}")

    # --- helpers ---------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._env is None:
            raise StorageError(f"table {self.table!r}: row store {self.file} is closed")

    def _ids(self, ids: np.ndarray, field: str = "ids") -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise InvalidArgument(f"table {self.table!r}: field {field!r} must be 1-D, got shape {arr.shape}")
        if arr.dtype != np.int64:
            if arr.size and not (arr.dtype.kind in "iu" and np.can_cast(arr.dtype, np.int64)):
                raise InvalidArgument(f"table {self.table!r}: field {field!r} must be int64, got {arr.dtype}")
            arr = arr.astype(np.int64)
        return np.ascontiguousarray(arr)

    def _validate(self, batch: RowBatch) -> RowBatch:
        ids = self._ids(batch.ids)
        n = ids.shape[0]
        shapes = {"weights": (n, self.dim), "state": (n, self.state_width), "update_count": (n,),
                  "last_step": (n,), "last_time": (n,)}
        out = {}
        for field, shape in shapes.items():
            arr = np.asarray(getattr(batch, field))
            if arr.shape != shape:
                raise InvalidArgument(f"table {self.table!r}: field {field!r} has shape {arr.shape}, "
                                      f"expected {shape}")
            if arr.size and arr.dtype.kind not in "iuf":
                raise InvalidArgument(f"table {self.table!r}: field {field!r} has dtype {arr.dtype}")
            out[field] = arr
        return RowBatch(ids, out["weights"], out["state"], out["update_count"], out["last_step"],
                        out["last_time"])

    def _encode(self, batch: RowBatch) -> tuple[list[bytes], list[bytes]]:
        raw = record_bytes(encode_records(batch, self._dtype))
        keys = np.ascontiguousarray(raw[:, :KEY_BYTES]).view("V8").ravel().tolist()
        values = np.ascontiguousarray(raw[:, KEY_BYTES:]).view(f"V{self._value_bytes}").ravel().tolist()
        return keys, values

    def _decode(self, keys: list[bytes], values: list[bytes], corrupt: list[int] | None = None) -> RowBatch:
        """Records (LMDB keys and values, aligned) -> RowBatch, after checking every length and CRC. A bad
        record raises ``CorruptStore``; with a ``corrupt`` list it is left out and its id appended there."""
        n = len(keys)
        if n == 0:
            return RowBatch.empty(self.dim, self.state_width)
        key_lens = np.fromiter(map(len, keys), np.int64, count=n)
        value_lens = np.fromiter(map(len, values), np.int64, count=n)
        bad = np.flatnonzero((key_lens != KEY_BYTES) | (value_lens != self._value_bytes))
        if bad.size and corrupt is not None:
            skip = set(bad.tolist())
            corrupt.extend(self._key_id(bytes(keys[i])) for i in bad.tolist() if len(keys[i]) == KEY_BYTES)
            good = [i for i in range(n) if i not in skip]
            return self._decode([keys[i] for i in good], [values[i] for i in good], corrupt)
        if bad.size:
            i = int(bad[0])
            key = bytes(keys[i])
            what = (f"id {self._key_id(key)}" if len(key) == KEY_BYTES else f"key {key.hex()}")
            raise CorruptStore(
                f"table {self.table!r}: corrupt record in {self.file}: {what} has a {len(values[i])}-byte "
                f"value (expected {self._value_bytes}); {bad.size} bad record(s) in this batch")
        raw = np.empty((n, self._dtype.itemsize), np.uint8)
        raw[:, :KEY_BYTES] = np.frombuffer(b"".join(keys), np.uint8).reshape(n, KEY_BYTES)
        raw[:, KEY_BYTES:] = np.frombuffer(b"".join(values), np.uint8).reshape(n, self._value_bytes)
        rec = raw.view(self._dtype).ravel()
        bad = np.flatnonzero(bad_crc(rec))
        if bad.size and corrupt is not None:
            corrupt.extend(self._key_id(bytes(keys[i])) for i in bad.tolist())
            keep = np.ones(n, bool)
            keep[bad] = False
            rec, n = rec[keep], int(keep.sum())
        elif bad.size:
            i = int(bad[0])
            raise CorruptStore(
                f"table {self.table!r}: corrupt record in {self.file}: id {self._key_id(bytes(keys[i]))} "
                f"(key {bytes(keys[i]).hex()}) failed its CRC-32 check; {bad.size} bad record(s) in this batch")
        return records_batch(rec, self.state_width)

    @staticmethod
    def _key_id(key: bytes) -> int:
        return int(keys_to_ids(np.frombuffer(key, ">u8"))[0])

    def _map_size(self) -> int:
        return int(self._env.info()["map_size"])

    def _write(self, body: Callable[[Any], _T], need: int = 0) -> _T:
        """Run ``body(txn)`` in one write transaction; grow the map and retry when it is full.

        ``need``: about how many bytes the transaction writes (to tell a full disk from other I/O errors)."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    return body(txn)
            except lmdb.MapFullError as exc:
                current = self._map_size()
                target = current * 2 if self.max_map_size is None else min(current * 2, self.max_map_size)
                if target <= current:
                    raise StorageFull(
                        f"table {self.table!r}: LMDB map full in {self.file} at {current} bytes "
                        f"(max_map_size={self.max_map_size}); the write was rolled back") from exc
                self._env.set_mapsize(target)
            except CORRUPTION_ERRORS as exc:
                raise CorruptStore(f"table {self.table!r}: LMDB file {self.file} is corrupt: {exc}") from exc
            except (lmdb.Error, OSError) as exc:
                if is_disk_full(exc, self.path, need):
                    raise StorageFull(f"table {self.table!r}: disk full writing {self.file}; "
                                      f"the write was rolled back: {exc}") from exc
                raise

    def _read(self, body: Callable[[Any], _T]) -> _T:
        try:
            with self._env.begin(db=self._rows_db) as txn:
                return body(txn)
        except CORRUPTION_ERRORS as exc:
            raise CorruptStore(f"table {self.table!r}: LMDB file {self.file} is corrupt: {exc}") from exc

    # --- public API ------------------------------------------------------------------------------------
    def put(self, batch: RowBatch) -> None:
        """Insert or overwrite rows (the last of duplicate ids wins); one transaction, all or nothing."""
        with self._lock:
            self._check_open()
            batch = self._validate(batch)
            if len(batch) == 0:
                return
            keys, values = self._encode(batch)
            self._write(lambda txn: txn.cursor(db=self._rows_db).putmulti(zip(keys, values, strict=True)),
                        need=len(keys) * 2 * self.record_bytes)

    def get(self, ids: np.ndarray, *, corrupt: list[int] | None = None) -> tuple[np.ndarray, RowBatch]:
        """-> (found (n,) bool aligned with ids, RowBatch of the rows of ids[found] in that order). A record
        failing its checks raises ``CorruptStore``; with a ``corrupt`` list it is left out of the batch (still
        ``found``) and its id appended there."""
        with self._lock:
            self._check_open()
            ids = self._ids(ids)
            keys = key_list(ids)
            values = self._read(lambda txn: list(map(txn.get, keys)))
            return self._found(keys, values, corrupt)

    def _found(self, keys: list[bytes], values: list[bytes | None], corrupt: list[int] | None = None
               ) -> tuple[np.ndarray, RowBatch]:
        found = np.fromiter((v is not None for v in values), bool, count=len(values))
        hit = np.flatnonzero(found).tolist()
        return found, self._decode([keys[i] for i in hit], [values[i] for i in hit], corrupt)

    def read_from(self, start_id: int | None, n: int, *, corrupt: list[int] | None = None
                  ) -> tuple[RowBatch, int, int | None]:
        """Up to ``n`` records with ids >= ``start_id`` (None: from the smallest), ascending, read in one short
        transaction: (their rows, records read, the id to go on from or None at the end). A window of the
        store for work that must stay bounded (eviction's scan of a spill tier); ``corrupt`` as for ``get``."""
        start = None if start_id is None else ids_to_keys(np.array([start_id], np.int64)).tobytes()
        chunk = self._chunk(start, n, values=True)
        if not chunk:
            return RowBatch.empty(self.dim, self.state_width), 0, None
        after = key_after(bytes(chunk[-1][0])) if len(chunk) == n else None
        rows = self._decode([kv[0] for kv in chunk], [kv[1] for kv in chunk], corrupt)
        return rows, len(chunk), None if after is None else int(keys_to_ids(np.frombuffer(after, ">u8"))[0])

    def pop(self, ids: np.ndarray) -> tuple[np.ndarray, RowBatch]:
        """As ``get``, and deletes the found rows in the same transaction (nothing is deleted on error)."""
        with self._lock:
            self._check_open()
            ids = self._ids(ids)
            keys = key_list(ids)

            def body(txn: Any) -> tuple[np.ndarray, RowBatch]:
                found, rows = self._found(keys, [txn.get(k, db=self._rows_db) for k in keys])
                for key in key_list(sorted_unique(rows.ids)):  # only after every record checked out
                    txn.delete(key, db=self._rows_db)
                return found, rows

            return self._write(body)

    def delete(self, ids: np.ndarray) -> int:
        """Delete the rows of ``ids``; returns how many distinct ids were present."""
        with self._lock:
            self._check_open()
            keys = key_list(sorted_unique(self._ids(ids)))
            if not keys:
                return 0
            return self._write(lambda txn: sum(txn.delete(k, db=self._rows_db) for k in keys))

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which ids have a stored row."""
        with self._lock:
            self._check_open()
            ids = self._ids(ids)
            keys = key_list(ids)
            return self._read(lambda txn: np.fromiter(map(txn.cursor().set_key, keys), bool, count=len(keys)))

    def __len__(self) -> int:
        with self._lock:
            self._check_open()
            return int(self._read(lambda txn: txn.stat(self._rows_db)["entries"]))

    def _chunk(self, start: bytes | None, n: int, values: bool) -> list[Any]:
        """Up to ``n`` cursor items from key ``start`` on (None: the first), in one short read transaction."""
        if n < 1:
            raise InvalidArgument(f"table {self.table!r}: field 'batch_size' must be >= 1, got {n}")
        with self._lock:
            self._check_open()

            def body(txn: Any) -> list[Any]:
                cursor = txn.cursor()
                if not (cursor.first() if start is None else cursor.set_range(start)):
                    return []
                return list(itertools.islice(cursor.iternext(keys=True, values=values), n))

            return self._read(body)

    def _scan(self, batch_size: int, values: bool) -> Iterator[list[Any]]:
        """Ascending chunks of cursor items; each chunk is read in its own short read transaction, so
        writes between chunks are allowed (rows changed behind the cursor are not revisited)."""
        start: bytes | None = None
        while True:
            chunk = self._chunk(start, batch_size, values)
            if not chunk:
                return
            yield chunk
            start = key_after(bytes(chunk[-1][0] if values else chunk[-1])) if len(chunk) == batch_size else None
            if start is None:
                return

    def iter_batches(self, batch_size: int = 65536) -> Iterator[RowBatch]:
        """All rows, ascending by id, as RowBatches of up to ``batch_size`` rows (checksums verified)."""
        for chunk in self._scan(batch_size, values=True):
            yield self._decode([kv[0] for kv in chunk], [kv[1] for kv in chunk])

    def iter_ids(self, batch_size: int = 65536) -> Iterator[np.ndarray]:
        """All stored ids, ascending, as (k,) int64 arrays of up to ``batch_size``."""
        for chunk in self._scan(batch_size, values=False):
            if any(len(k) != KEY_BYTES for k in chunk):
                raise CorruptStore(f"table {self.table!r}: corrupt key in {self.file}")
            yield keys_to_ids(np.frombuffer(b"".join(chunk), ">u8"))

    def clear(self) -> None:
        """Delete every row (one transaction)."""
        with self._lock:
            self._check_open()
            self._write(lambda txn: txn.drop(self._rows_db, delete=False))

    def sync(self) -> None:
        """Flush the data file to disk (fsync)."""
        with self._lock:
            self._check_open()
            try:
                self._env.sync(True)
            except lmdb.Error as exc:
                if is_disk_full(exc, self.path, 0):
                    raise StorageFull(f"table {self.table!r}: disk full syncing {self.file}: {exc}") from exc
                raise StorageError(f"table {self.table!r}: cannot sync {self.file}: {exc}") from exc

    @property
    def record_bytes(self) -> int:
        """Bytes of one stored record (key + value), before LMDB's per-entry overhead."""
        return int(self._dtype.itemsize)

    def stats(self) -> dict[str, float]:
        """rows, file_bytes (data file size), map_size, record_bytes."""
        with self._lock:
            self._check_open()
            return {"rows": float(len(self)), "file_bytes": float(os.path.getsize(self.file)),
                    "map_size": float(self._map_size()), "record_bytes": float(self.record_bytes)}

    def close(self) -> None:
        """Close the environment (idempotent)."""
        with self._lock:
            if self._env is not None:
                self._env.close()
                self._env = None

    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        env = getattr(self, "_env", None)
        if env is not None:
            env.close()
