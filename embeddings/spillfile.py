"""``SpillFile``: the spill tier's rows on disk, as fixed-size records in one file, addressed by slot.

Why not the LMDB ``RowStore`` the snapshots use: a spill tier needs no order, no transactions and no crash
safety (a restart rebuilds it), and the table already keeps the spilled ids in a RAM index, so that index can
hold each row's slot. A B-tree paid for what the tier does not need: random ids filled its leaf pages to about
two thirds, each write transaction copied every page it touched (a spill of millions of rows touched most of
the file), and py-lmdb took records one Python object at a time; the tier cost 366 disk bytes a 96-byte record
and inserted at 0.065 M rows/s (docs/benchmarks.md). Here a record costs its own bytes: a spill is one
vectorized write of the batch into freed slots and the file's end, a read is a gather by slot.

Layout: record ``i`` at byte ``i * record_bytes``, the stored-row format (``_records.record_dtype``:
the id as its key, metadata, weights, optimizer state, a CRC-32 of the rest). A read checks every record's CRC
and that its key is the id asked for, so a damaged or misplaced record raises ``CorruptStore`` naming the file
and the id. Freed slots are reused before the file grows; the file keeps its high-water mark.

Running out of space: the file grows by ``posix_fallocate`` before a record is written, so a full disk (or the
``max_bytes`` cap) fails the write with ``StorageFull`` before anything changed, never as a SIGBUS on a page of
the mapping.

Reading rows back is a gather from the mapping: one page fault per record not in the page cache, and a fault
waits for its read. A large gather is split over ``READERS`` threads of one pool per process (numpy's gather
runs without the GIL), so that many reads are in flight at once: 2-3.5x the records per second with 16 against
one, read cold from a 4 GB file on this machine's disk. Not thread-safe: the table holds its lock around every
call.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent import futures as cf
from pathlib import Path

import numpy as np

from tigana.embeddings._records import bad_crc, encode_records, ids_to_keys, record_dtype, records_batch
from tigana.embeddings.changes import sorted_unique
from tigana.embeddings.errors import CorruptStore, InvalidArgument, StorageError, StorageFull
from tigana.embeddings.rows import RowBatch

FILE_NAME = "records"
_MIN_GROW = 64 << 20  # bytes: the file grows by at least this much (or half its size) at a time
MAX_RECORDS = 2**31 - 1  # the table keeps each spilled row's slot in its HashIndex, whose values are int32
READERS = 16  # threads a large gather is split over (they wait on the disk, not on a core)
_SPLIT_AT = 8192  # records: a smaller gather is read on the caller's thread


_READERS: list[cf.ThreadPoolExecutor] = []  # one pool for every spill file of the process, made at first use
_READERS_LOCK = threading.Lock()


def _readers() -> cf.ThreadPoolExecutor:
    with _READERS_LOCK:
        if not _READERS:
            _READERS.append(cf.ThreadPoolExecutor(READERS, thread_name_prefix="tigana-spill-read"))
        return _READERS[0]


class SpillFile:
    """Fixed-size row records in one file, written into free slots (``write`` returns them), read by slot
    (``read``), freed (``free``). See the module docstring."""

    def __init__(self, directory: str | Path, *, table: str, dim: int, state_width: int,
                 max_bytes: int | None = None) -> None:
        if int(dim) < 1:
            raise InvalidArgument(f"table {table!r}: field 'dim' must be >= 1, got {dim}")
        self.table = table
        self.dim, self.state_width = int(dim), int(state_width)
        self._dtype = record_dtype(self.dim, self.state_width)
        self.record_bytes = int(self._dtype.itemsize)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.file = Path(directory) / FILE_NAME
        try:
            self._fd: int | None = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise StorageError(f"table {table!r}: cannot create spill file {self.file}: {exc}") from exc
        self._map: mmap.mmap | None = None
        self._records: np.ndarray = np.empty(0, self._dtype)  # the mapping, as records
        self._capacity = 0   # records the file has room for
        self._nbytes = 0     # the file's length
        self._high = 0       # records ever written (slots below it are live or free)
        self._free = np.empty(0, np.int64)  # a stack of freed slots
        self._nfree = 0

    def __len__(self) -> int:
        return self._high - self._nfree

    # --- writing ---------------------------------------------------------------------------------------------
    def write(self, batch: RowBatch) -> np.ndarray:
        """Store the rows of ``batch`` (distinct ids); -> (n,) int64 slot of each row, in batch order. Raises
        ``StorageFull`` when the file cannot grow (full disk, ``max_bytes``): then nothing changed."""
        self._check_open()
        n = len(batch)
        if n == 0:
            return np.empty(0, np.int64)
        reuse = min(n, self._nfree)
        fresh = n - reuse
        if self._high + fresh > MAX_RECORDS:
            raise StorageFull(f"table {self.table!r}: spill file {self.file} holds at most {MAX_RECORDS} records; "
                              "nothing was spilled (raise the memory budget, or add servers)")
        if self._high + fresh > self._capacity:
            self._grow(self._high + fresh)
        slots = np.empty(n, np.int64)
        slots[:reuse] = self._free[self._nfree - reuse:self._nfree]
        slots[reuse:] = np.arange(self._high, self._high + fresh, dtype=np.int64)
        self._records[slots] = encode_records(batch, self._dtype)
        self._nfree -= reuse
        self._high += fresh
        return slots

    def free(self, slots: np.ndarray) -> None:
        """The records at ``slots`` are no longer needed; their slots are written again before the file grows."""
        self._check_open()
        slots = sorted_unique(np.asarray(slots, np.int64))
        if slots.size and (slots[0] < 0 or slots[-1] >= self._high):
            raise InvalidArgument(f"table {self.table!r}: spill slots out of range [0, {self._high}): "
                                  f"{slots[(slots < 0) | (slots >= self._high)][:5].tolist()}")
        need = self._nfree + slots.shape[0]
        if need > self._free.shape[0]:
            grown = np.empty(max(need, 2 * self._free.shape[0], 1024), np.int64)
            grown[:self._nfree] = self._free[:self._nfree]
            self._free = grown
        self._free[self._nfree:need] = slots
        self._nfree = need

    def _grow(self, records: int) -> None:
        old = self._nbytes
        want = max(records * self.record_bytes, old + max(_MIN_GROW, old // 2))
        want = -(-want // mmap.PAGESIZE) * mmap.PAGESIZE
        if self.max_bytes is not None:
            want = min(want, self.max_bytes)
        if want < records * self.record_bytes:
            raise StorageFull(f"table {self.table!r}: spill file {self.file} would need "
                              f"{records * self.record_bytes} bytes, above its cap (spill_max_bytes="
                              f"{self.max_bytes}); nothing was spilled")
        assert self._fd is not None
        try:
            os.posix_fallocate(self._fd, old, want - old)
        except OSError as exc:
            os.ftruncate(self._fd, old)  # give back what a partial allocation took
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFull(f"table {self.table!r}: disk full growing spill file {self.file} to {want} "
                                  f"bytes; nothing was spilled: {exc}") from exc
            raise StorageError(f"table {self.table!r}: cannot grow spill file {self.file}: {exc}") from exc
        self._remap(want)

    def _remap(self, nbytes: int) -> None:
        self._records = np.empty(0, self._dtype)  # drop the view before its mapping closes
        if self._map is not None:
            self._map.close()
        assert self._fd is not None
        self._map = mmap.mmap(self._fd, nbytes)
        self._nbytes = nbytes
        self._map.madvise(mmap.MADV_RANDOM)  # reads are gathers by slot: no readahead around each
        self._capacity = nbytes // self.record_bytes
        self._records = np.frombuffer(self._map, self._dtype, count=self._capacity)

    # --- reading ---------------------------------------------------------------------------------------------
    def read(self, slots: np.ndarray, ids: np.ndarray, *, corrupt: list[int] | None = None) -> RowBatch:
        """The rows of ``ids`` stored at ``slots`` (aligned), in that order. A record that fails its CRC or holds
        another id raises ``CorruptStore``; with a ``corrupt`` list it is left out and its id appended there."""
        self._check_open()
        slots = np.asarray(slots, np.int64)
        ids = np.asarray(ids, np.int64)
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= self._high):
            raise CorruptStore(f"table {self.table!r}: spill slots outside {self.file} for ids "
                               f"{ids[(slots < 0) | (slots >= self._high)][:5].tolist()}")
        rec = self._gather(slots)
        bad = bad_crc(rec) | (rec["key"] != ids_to_keys(ids))
        if bad.any():
            if corrupt is None:
                first = np.flatnonzero(bad)
                raise CorruptStore(f"table {self.table!r}: corrupt record in {self.file}: id {int(ids[first[0]])} "
                                   f"(slot {int(slots[first[0]])}) failed its CRC-32 or key check; {first.size} bad "
                                   "record(s) in this read")
            corrupt.extend(ids[bad].tolist())
            rec = rec[~bad]
        return records_batch(rec, self.state_width)

    def read_slots(self, slots: np.ndarray) -> RowBatch:
        """The rows stored at ``slots`` (in that order), their ids from the records' keys: for a reader that holds
        slots, not ids (a cut's parked rows, ``SlotPins``). A record that fails its CRC raises ``CorruptStore``."""
        self._check_open()
        slots = np.asarray(slots, np.int64)
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= self._high):
            raise CorruptStore(f"table {self.table!r}: spill slots outside {self.file}: "
                               f"{slots[(slots < 0) | (slots >= self._high)][:5].tolist()}")
        rec = self._gather(slots)
        bad = bad_crc(rec)
        if bad.any():
            first = np.flatnonzero(bad)
            raise CorruptStore(f"table {self.table!r}: corrupt record in {self.file} at slot {int(slots[first[0]])}: "
                               f"failed its CRC-32 check; {first.size} bad record(s) in this read")
        return records_batch(rec, self.state_width)

    def _gather(self, slots: np.ndarray) -> np.ndarray:
        """Copies of the records at ``slots``, a large gather split over the reader threads (the caller holds
        the table's lock, so the mapping is not replaced meanwhile)."""
        if slots.shape[0] < _SPLIT_AT:
            return self._records[slots]
        readers = _readers()
        out = np.empty(slots.shape[0], self._dtype)
        records = self._records
        bounds = np.linspace(0, slots.shape[0], READERS + 1).astype(np.int64)

        def part(i: int) -> None:
            lo, hi = bounds[i], bounds[i + 1]
            np.take(records, slots[lo:hi], out=out[lo:hi])

        for done in [readers.submit(part, i) for i in range(READERS)]:
            done.result()
        return out

    def stats(self) -> dict[str, float]:
        """rows (live records), free_slots, file_bytes (the file's length), record_bytes."""
        return {"rows": float(len(self)), "free_slots": float(self._nfree),
                "file_bytes": float(self._nbytes), "record_bytes": float(self.record_bytes)}

    # --- lifecycle -------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._fd is None:
            raise StorageError(f"table {self.table!r}: spill file {self.file} is closed")

    def close(self) -> None:
        """Unmap and close the file (idempotent); the caller removes it."""
        if self._fd is None:
            return
        self._records = np.empty(0, self._dtype)
        if self._map is not None:
            self._map.close()
            self._map = None
        os.close(self._fd)
        self._fd = None
