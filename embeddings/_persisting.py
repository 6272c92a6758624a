"""Snapshots of a table, taken through a cut: the cut is opened under the table's lock (O(1)) and written while
writes go on, so a snapshot of any size holds the lock only per chunk. Restore builds a table from a snapshot
chain.

Incremental chains: every row carries the snapshot mark current when it last changed (``Slab.dirty``; 0 for
never). A tracked snapshot opens its cut and moves the table to the next mark in the same O(1) step, so the next
increment holds the rows changed after this cut (marked anew) and the ids removed after it. A snapshot that
fails gives its marks and removed ids back (``_pending_marks``, ``_deleted``) and the chain goes on from the
previous snapshot. Marks cycle through 1..255: a row unchanged for 255 tracked snapshots may be written again by
an increment, which is harmless.

``begin_snapshot`` then ``PendingSnapshot.write`` (on the same thread) lets a caller open the cut under its own
lock, together with state of its own that must match the rows (``extra_files``), and write outside that lock.
Tracked snapshots of one table take turns (``snapshot_turn``); a caller holding a lock of its own should wait
for its turn first, outside that lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tigana.embeddings import snapshot as _snapshot
from tigana.embeddings._fields import TableFields
from tigana.embeddings.changes import sorted_unique
from tigana.embeddings.config import TableConfig
from tigana.embeddings.cut import Cut
from tigana.embeddings.errors import InvalidArgument, SnapshotNotFound

if TYPE_CHECKING:
    from tigana.embeddings.table import EmbeddingTable

_LOCAL_SETTINGS = ("memory_budget", "spill_dir", "spill_max_bytes", "backend")


def next_mark(mark: int) -> int:
    """The snapshot mark after ``mark`` (1..255; 0 means never changed)."""
    return mark % 255 + 1


class PendingSnapshot:
    """A snapshot whose cut is taken and whose rows are not written yet; ``write`` it, or ``close`` it."""

    def __init__(self, table: TableFields, root: Path, cut: Cut, *, incremental: bool, deleted: list[np.ndarray],
                 common: dict[str, Any], track: bool, previous: Path | None) -> None:
        self._table, self._root, self._cut = table, root, cut
        self.incremental = incremental
        self._deleted, self._common, self._track, self._previous = deleted, common, track, previous
        self._done = False

    def write(self) -> Path:
        """Write the snapshot (without the table's lock, beyond one chunk at a time); returns its path. On the
        thread that began it. A failure leaves no snapshot, and the table's next increment holds its rows."""
        if self._done:
            raise InvalidArgument(f"table {self._table.name!r}: snapshot already written or closed")
        path: Path | None = None
        try:
            deleted = sorted_unique(np.concatenate(self._deleted)) if self._deleted else np.empty(0, np.int64)
            rows = self._cut.batches(dirty_only=self.incremental, in_order=True)  # LMDB writes sorted keys fastest
            path = _snapshot.write_snapshot(self._root, rows=rows, deleted_ids=deleted if self.incremental else None,
                                            incremental=self.incremental, **self._common)
            return path
        finally:
            self._finish(path)

    def close(self) -> None:
        """Drop the snapshot unwritten (idempotent); the table's next increment holds its rows."""
        if not self._done:
            self._finish(None)

    def _finish(self, path: Path | None) -> None:
        self._done = True
        self._cut.close()
        if self._track:
            table = self._table
            with table._lock:
                if path is not None:
                    table._last_snapshot = path
                else:  # give back what this snapshot took: the next increment of the chain holds it
                    table._last_snapshot = self._previous
                    table._pending_marks = tuple(dict.fromkeys(self._cut.marks + table._pending_marks))
                    table._deleted = self._deleted + table._deleted if self._previous is not None else []
            table._snapshot_turn.release()

    def __enter__(self) -> PendingSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Persisting(TableFields):
    """Snapshot and restore; see the module docstring."""

    def snapshot(self, directory: str | Path, *, incremental: bool = False,
                 extra_files: dict[str, bytes] | None = None, track: bool = True) -> Path:
        """Write a snapshot under ``directory`` atomically; returns its path.

        Full: every row (resident and spilled), optimizer state, metadata, the config and the step.
        Incremental: the rows changed and the ids deleted since this table's previous snapshot, which must
        be the latest one in ``directory``; otherwise a full snapshot is written instead. ``extra_files``
        ({name: bytes}) are stored in the snapshot (``snapshot.read_extra``), atomically with its rows.
        ``track=False`` (a one-off copy, e.g. a checkpoint cut) leaves the incremental chain as it was.
        The rows are those of one point in the write order; the table's lock is held per chunk only."""
        return self.begin_snapshot(directory, incremental=incremental, extra_files=extra_files, track=track).write()

    @contextlib.contextmanager
    def snapshot_turn(self) -> Iterator[None]:
        """Wait for this table's tracked snapshot in progress, if any, and hold the turn (re-entrant)."""
        with self._snapshot_turn:
            yield

    def begin_snapshot(self, directory: str | Path, *, incremental: bool = False,
                       extra_files: dict[str, bytes] | None = None, track: bool = True) -> PendingSnapshot:
        """Open the snapshot's cut now (O(1) under the table's lock; see ``snapshot`` for the arguments) and
        return it to be written by ``PendingSnapshot.write`` on this thread. A tracked one waits for the turn."""
        root = Path(directory)
        if track:
            self._snapshot_turn.acquire()
        try:
            latest = _snapshot.latest_snapshot(root) if incremental else None
            with self._lock:
                self._check_open()
                previous = self._last_snapshot
                chained = incremental and previous is not None and latest == previous
                cut = self.cut()
                deleted = list(self._deleted) if chained or track else []
                common = {"table": self.name, "config": _snapshot.config_to_dict(self.config),
                          "meta": {"step": self._step}, "state_width": self._width,
                          "extra_files": dict(extra_files or {})}
                if track:  # rows changed from here on are the next increment's
                    self._slab.mark = next_mark(self._slab.mark)
                    self._pending_marks = ()
                    self._deleted = []
                    self._last_snapshot = root / ".pending"  # not None: removals are recorded meanwhile
        except BaseException:
            if track:
                self._snapshot_turn.release()
            raise
        return PendingSnapshot(self, root, cut, incremental=chained, deleted=deleted, common=common, track=track,
                               previous=previous)

    def _mark_clean(self, path: Path) -> None:
        self._slab.mark = next_mark(self._slab.mark)
        self._pending_marks = ()
        self._deleted = []
        self._last_snapshot = path

    @classmethod
    def restore(cls, path: str | Path, *, configure: Callable[[TableConfig], TableConfig] | None = None
                ) -> EmbeddingTable:
        """A new table from the snapshot at ``path`` (or the latest one under the root ``path``), with its
        chain of increments applied, its config, and its step. The table's next incremental snapshot
        chains onto it. ``configure`` maps the stored config to the one to run with: it may change only the
        settings of this process (memory budget, spill tier, backend), not what defines the rows."""
        snap = Path(path)
        if not (snap / _snapshot.MANIFEST).is_file():
            latest = _snapshot.latest_snapshot(snap)
            if latest is None:
                raise SnapshotNotFound(f"no snapshot at {snap}")
            snap = latest
        manifest = _snapshot.read_manifest(snap)
        config = _snapshot.config_from_dict(manifest["config"])
        if configure is not None:
            local = configure(config)
            if dataclasses.replace(local, **{f: getattr(config, f) for f in _LOCAL_SETTINGS}) != config:
                raise InvalidArgument(f"table {config.name!r}: restoring may change only {list(_LOCAL_SETTINGS)}")
            config = local
        table: EmbeddingTable = cls(config)  # type: ignore[call-arg,assignment]
        try:
            for batch in _snapshot.iter_snapshot_rows(snap):
                table.import_rows(batch)
        except BaseException:
            table.close()
            raise
        with table._lock:
            table._step = int(manifest.get("meta", {}).get("step", 0))
            table._mark_clean(snap)
        return table
