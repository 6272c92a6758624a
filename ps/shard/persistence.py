"""Persistence of one shard server's tables (``Persistence``, beside the registry ``HostedTables``): snapshots
of every table (with its exactly-once window and log positions), restore from them, loading the data dir at
start, quarantine of a store found corrupt.

A snapshot's cut is opened under the table's write lock and written after it (copy-on-write); restore and
load run under the registry lock. Snapshots and restores block on the disk, never on the network.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from tigana.embeddings import CorruptStore, SnapshotNotFound, TableConfig
from tigana.ps.errors import InvalidArgument
from tigana.ps.routing import TableDef, parse_slots
from tigana.ps.shard.catalog import Catalog
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.hosted import HostedTables, _Hosted
from tigana.ps.shard.view import Holdings

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server


class Persistence:
    """Snapshots, restore and loading at start of the tables in ``tables`` (``catalog``: the data dir's; None
    without one). ``corrupt_stores`` counts the stores found corrupt at start and quarantined."""

    def __init__(self, config: ServerConfig, tables: HostedTables, holdings: Holdings, catalog: Catalog | None,
                 *, clustered: bool) -> None:
        self.config, self.tables, self.holdings, self.catalog = config, tables, holdings, catalog
        self.clustered, self.num_slots = clustered, config.num_slots
        self.data_dir = Path(config.data_dir) if config.data_dir else None
        self.corrupt_stores = 0

    def need_catalog(self, what: str) -> Catalog:
        """The data dir's catalog; ``InvalidArgument`` naming ``what`` when the server has none."""
        if self.catalog is None:
            raise InvalidArgument(f"{what}: this server has no data dir (start it with --data-dir)")
        return self.catalog

    def snapshot_all(self, *, incremental: bool = False) -> tuple[list[Path], int]:
        """Snapshot every table with its exactly-once window and log positions; (paths, rows). Blocks on the
        disk; each table's write lock is held only while its cut opens."""
        catalog = self.need_catalog("Snapshot")
        paths: list[Path] = []
        rows = 0
        with self.tables.lock:
            hosted_tables = self.tables.items()
            self.tables.save_registry()
        for name, hosted in hosted_tables:
            # The cut is opened under the write lock with the window and positions (one moment), and written
            # after it is released: pushes go on while the rows are read (copy-on-write, ``Cut``).
            with hosted.table.snapshot_turn():  # a snapshot of this table in progress: waited for without the lock
                with hosted.lock:
                    if self.tables.find(name) is not hosted:  # dropped or replaced meanwhile
                        continue
                    pending = catalog.begin_snapshot(hosted.table, hosted.dedup, hosted.log, incremental=incremental,
                                                     complete=self.holdings.view.complete_slots())
                    rows += len(hosted.table)
                try:
                    path = pending.write()
                except Exception:
                    if self.tables.find(name) is not hosted:  # dropped while it was written
                        continue
                    raise
            paths.append(path)
            if not incremental:
                catalog.prune(name, self.config.keep_snapshots)
        log.info("snapshot (%s) of %d table(s), %d rows", "incremental" if incremental else "full",
                 len(paths), rows)
        return paths, rows

    def _restore_one(self, path: Path, spec: TableDef | None) -> _Hosted:
        catalog = self.catalog or Catalog(path)

        def configure(stored: TableConfig) -> TableConfig:  # this daemon's memory settings, not the writer's
            own = spec.config if spec is not None else None
            return self.tables.effective(dataclasses.replace(
                stored, memory_budget=own.memory_budget if own else None, spill_dir=own.spill_dir if own else None,
                spill_max_bytes=own.spill_max_bytes if own else None))

        restored = catalog.restore(path, num_slots=self.num_slots, dedup_size=self.config.dedup_window,
                                   configure=configure)
        if spec is None:
            spec = TableDef(dataclasses.replace(restored.table.config, spill_dir=None))
        return self.tables.new_hosted(spec, restored.table, restored.dedup, restored.log)

    def restore(self, path: str | os.PathLike | None = None) -> int:
        """Static mode: replace tables by snapshots: ``path`` None restores every registered table from its
        newest snapshot chain in the data dir; a path restores the one table snapshot there. Rows restored."""
        with self.tables.lock:
            fresh: dict[str, _Hosted] = {}
            try:
                if path is None:
                    catalog = self.need_catalog("Restore")
                    for name, hosted in self.tables.items():
                        latest = catalog.latest(name)
                        if latest is not None:
                            fresh[name] = self._restore_one(latest, hosted.spec)
                else:
                    restored = self._restore_one(Path(path), None)
                    old = self.tables.find(restored.spec.config.name)
                    if old is not None:
                        restored.spec = old.spec
                    fresh[restored.spec.config.name] = restored
            except BaseException:
                for hosted in fresh.values():  # all or nothing: the served tables stay as they were
                    hosted.table.close()
                raise
            replaced = {name: self.tables.put(name, hosted) for name, hosted in fresh.items()}
            self.tables.save_registry()
            for old in replaced.values():
                if old is not None:
                    with old.lock:
                        old.table.close()
        rows = sum(len(h.table) for h in fresh.values())
        log.info("restored %d table(s), %d rows", len(fresh), rows)
        return rows

    def load(self) -> None:
        """At start: re-create every table of the catalog from its newest snapshot chain when there is one.

        The catalog's ``num_slots`` (and, for a static shard list, its slots) must match the config: a server
        must never answer for slots whose rows it does not have."""
        if self.catalog is None:
            return
        try:
            tables, num_slots, slots = self.catalog.load_tables()
        except CorruptStore as exc:
            if not self.clustered:
                raise
            self._quarantine(None, exc)  # the scheduler's map names the tables again
            tables, num_slots, slots = [], None, None
        if num_slots is not None and int(num_slots) != self.num_slots:
            raise InvalidArgument(f"data dir {str(self.data_dir)!r} holds tables of {num_slots} slots; the server "
                                  f"was started with --num-slots {self.num_slots}")
        if tables and not self.clustered and slots is not None and not self._same_slots(slots):
            raise InvalidArgument(f"data dir {str(self.data_dir)!r} holds the rows of slots {slots!r}; the server "
                                  f"was started with --slots {self.config.slots!r} and would answer for slots it "
                                  "has no rows of (move slots with a scheduler instead)")
        for spec in tables:
            name = spec.config.name
            latest = self.catalog.latest(name)
            shutil.rmtree(self.catalog.dir("spill", name), ignore_errors=True)  # a dead process's spill tier
            hosted = None
            if latest is not None:
                try:
                    hosted = self._restore_one(latest, spec)
                    log.info("restored table %r from %s (%d rows)", name, latest, len(hosted.table))
                except (CorruptStore, SnapshotNotFound) as exc:
                    if not self.clustered:  # no replica to rebuild from: the operator decides
                        raise
                    self._quarantine(name, exc)
            if hosted is None:
                hosted = self.tables.new_hosted(spec)
                log.info("re-created table %r (no snapshot)", name)
            self.tables.put(name, hosted)
        self.tables.rebudget()
        self.tables.save_registry()

    def _quarantine(self, table: str | None, exc: Exception) -> None:
        """A clustered server that finds a store corrupt at start moves it aside and starts that table empty.

        Safe because a restarted server never serves its old rows: the scheduler demotes every copy of a new
        boot and rebuilds it from the slot's primary, and an empty table has no log positions, so it can
        never win an election over a copy that has rows."""
        where = self.catalog.quarantine(table)
        self.corrupt_stores += 1
        log.error("%s: %s; moved to %s; starting %s empty, to be rebuilt from replicas",
                  "table registry" if table is None else f"table {table!r}", exc, where,
                  "with no tables" if table is None else "it")

    def _same_slots(self, saved: str) -> bool:
        try:
            return bool(np.array_equal(parse_slots(saved, self.num_slots), self.config.owned_slots()))
        except ValueError:
            return False
