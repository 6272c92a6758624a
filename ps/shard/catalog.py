"""A shard server's on-disk catalog: its identity, its tables, their snapshots and spill tiers.

Layout under ``data_dir``::

    server-id                  this server's stable identity (created once; the scheduler knows it by it)
    tables.json                the hosted tables (specs with durability), num_slots and, for a static
                               shard list, the slots held; rewritten atomically on every change
    snapshots/<table>/...      the storage engine's snapshot chain of each table; every snapshot holds, as
                               extra files written atomically with its rows, the exactly-once window
                               (``dedup``) and the slots' log positions (``positions``)
    spill/<table>/             the spill files of tables with a memory budget (never restored: rows are)
    quarantine/<table>-<time>/ snapshots found corrupt at start (a clustered server moves them here and
                               rebuilds the table from its replicas)
    LOCK                       held by the running server

``<table>`` is the name percent-encoded, dots included, so every name maps to one folder inside data_dir.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
from google.protobuf import json_format

from tigana.embeddings import (
    CorruptStore,
    EmbeddingTable,
    PendingSnapshot,
    StorageError,
    StorageFull,
    TableConfig,
)
from tigana.embeddings import snapshot as snap
from tigana.embeddings.files import atomic_write
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import InvalidArgument
from tigana.ps.replication import SlotLog
from tigana.ps.routing import TableDef
from tigana.ps.shard.dedup import DedupWindow
from tigana.ps.wire import cluster as cluster_wire

DEDUP_FILE, POSITIONS_FILE = "dedup", "positions"


@dataclass(eq=False)
class Restored:
    """A table read back from its snapshot chain, with the state saved beside its rows."""

    table: EmbeddingTable
    dedup: DedupWindow
    log: SlotLog
    path: Path


def _id_check(server_id: str) -> str:
    return hashlib.sha256(server_id.encode()).hexdigest()[:16]


def _digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically (``files.atomic_write``), creating its folder; a full disk is
    ``StorageFull``, any other failure ``StorageError`` (the old file stays as it was)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFull(f"disk full writing {str(path)!r}: {exc.strerror}") from None
        raise StorageError(f"cannot write {str(path)!r}: {exc.strerror}") from None


class Catalog:
    """The files of one data dir (see the module docstring). Not thread-safe: the server serializes calls."""

    def __init__(self, data_dir: str | os.PathLike) -> None:
        self.root = Path(data_dir)

    def dir(self, kind: str, table: str) -> Path:
        """``data_dir/<kind>/<table>`` with the name percent-encoded."""
        return self.root / kind / quote(table, safe="").replace(".", "%2E")

    # --- identity ----------------------------------------------------------------------------------------
    def server_id(self, wanted: str | None = None) -> str:
        """This data dir's server id: ``wanted`` the first time (a new uuid when None), then as stored.
        A different ``wanted`` for a data dir that has one is refused (two identities for one set of rows)."""
        path = self.root / "server-id"
        if path.exists():
            stored, *check = path.read_text().split() or [""]
            if not stored or (check and check[0] != _id_check(stored)):
                raise CorruptStore(f"server id file {str(path)!r} is corrupt (checksum mismatch): restore it, or "
                                   "delete it to join the cluster as a new server")
            if wanted and wanted != stored:
                raise InvalidArgument(f"server id: data dir {str(self.root)!r} belongs to server {stored!r}, "
                                      f"not {wanted!r}")
            return stored
        sid = wanted or uuid.uuid4().hex[:12]
        write_atomic(path, f"{sid}\n{_id_check(sid)}\n")
        return sid

    # --- the table registry ------------------------------------------------------------------------------
    def save_tables(self, tables: list[TableDef], num_slots: int, slots: str | None) -> None:
        doc: dict[str, Any] = {
            "version": 2, "num_slots": num_slots, "slots": slots,
            "tables": [json_format.MessageToDict(cluster_wire.table_def_to_pb(t), preserving_proto_field_name=True)
                       for t in sorted(tables, key=lambda t: t.config.name)]}
        doc["sha256"] = _digest(doc)
        write_atomic(self.root / "tables.json", json.dumps(doc, indent=1, sort_keys=True))

    def load_tables(self) -> tuple[list[TableDef], int | None, str | None]:
        """(tables, num_slots, slots) as saved; ([], None, None) for a new data dir. ``CorruptStore`` naming
        the file when it does not parse or its checksum differs (a flipped digit must not change a table)."""
        path = self.root / "tables.json"
        if not path.exists():
            return [], None, None
        try:
            doc = json.loads(path.read_bytes())
            stored = doc.pop("sha256", None)
            if stored is not None and stored != _digest(doc):
                raise ValueError("checksum mismatch")
            tables = [cluster_wire.table_def_from_pb(json_format.ParseDict(e, pb.TableSpec()))
                      for e in doc.get("tables", [])]
        except (ValueError, TypeError, AttributeError, KeyError, json_format.ParseError) as exc:
            raise CorruptStore(f"table registry {str(path)!r} is corrupt: {exc}") from None
        return tables, doc.get("num_slots"), doc.get("slots")

    def quarantine(self, what: str | None) -> Path:
        """Move a table's snapshots (``what`` a table name) or the table registry (None) found corrupt out of
        the way, into ``quarantine/``; returns where they went (kept for a post-mortem, never read again)."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{uuid.uuid4().hex[:6]}"
        src = self.root / "tables.json" if what is None else self.dir("snapshots", what)
        dest = self.root / "quarantine" / (f"tables.json-{stamp}" if what is None else f"{src.name}-{stamp}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.exists():
            os.replace(src, dest)
        return dest

    def remove_table_files(self, name: str) -> None:
        for sub in ("snapshots", "spill", "dedup"):
            shutil.rmtree(self.dir(sub, name), ignore_errors=True)

    def spill_dir(self, name: str) -> str:
        return str(self.dir("spill", name))

    # --- snapshots --------------------------------------------------------------------------------------
    def snapshot(self, table: EmbeddingTable, dedup: DedupWindow, log: SlotLog, *, incremental: bool,
                 complete: np.ndarray | None = None) -> Path:
        """Snapshot ``table`` with its exactly-once window and log positions (the caller holds its write
        lock, so the three agree). Positions are kept only for ``complete`` slots (a copy still catching up
        has rows missing: it must never win an election by its position)."""
        return self.begin_snapshot(table, dedup, log, incremental=incremental, complete=complete).write()

    def begin_snapshot(self, table: EmbeddingTable, dedup: DedupWindow, log: SlotLog, *, incremental: bool,
                       complete: np.ndarray | None = None) -> PendingSnapshot:
        """Open the cut of ``snapshot`` now (O(1); the caller holds the table's write lock, so the rows, the
        window and the positions are of one moment) and return it, to be written after that lock is released
        (``PendingSnapshot.write``, on this thread). Wait for ``table.snapshot_turn()`` before taking the lock."""
        return table.begin_snapshot(self.dir("snapshots", table.name), incremental=incremental,
                                    extra_files={DEDUP_FILE: dedup.to_bytes(), POSITIONS_FILE: log.to_bytes(complete)})

    def prune(self, name: str, keep: int) -> None:
        """Delete the snapshots older than the newest ``keep`` full ones (0 keeps all)."""
        if keep <= 0:
            return
        snaps = snap.list_snapshots(self.dir("snapshots", name))
        fulls = [i for i, p in enumerate(snaps) if p.name.endswith("-full")]
        if len(fulls) <= keep:
            return
        for old in snaps[:fulls[-keep]]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self, name: str) -> Path | None:
        root = self.dir("snapshots", name)
        snap.cleanup_temp(root)
        return snap.latest_snapshot(root)

    def restore(self, path: Path, *, num_slots: int, dedup_size: int,
                configure: Callable[[TableConfig], TableConfig] | None = None) -> Restored:
        """The table at snapshot ``path`` (or the newest under it) with its window and positions (empty ones
        for snapshots written without them); ``configure``: see ``EmbeddingTable.restore``."""
        if not (path / snap.MANIFEST).is_file():
            path = snap.latest_snapshot(path) or path
        table = EmbeddingTable.restore(path, configure=configure)
        try:
            raw = snap.read_extra(path, DEDUP_FILE)
            dedup = (DedupWindow.from_bytes(raw, num_slots=num_slots, size=dedup_size) if raw is not None
                     else DedupWindow(num_slots, dedup_size))
            raw = snap.read_extra(path, POSITIONS_FILE)
            log = SlotLog.from_bytes(raw, num_slots) if raw is not None else SlotLog(num_slots)
        except (ValueError, KeyError) as exc:
            table.close()
            raise InvalidArgument(f"snapshot {path}: {exc}") from None
        except BaseException:
            table.close()
            raise
        return Restored(table, dedup, log, path)
