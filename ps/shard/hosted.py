"""Tables as served: ``_Hosted`` (a table with its write lock, exactly-once window, log positions and request
counters), ``HostedTables`` (the registry of one shard server's tables: look-up, creation, drop, the daemon's
memory budget split over the tables, the registry file, figures for metrics and heartbeats), and
``checksum_value``.

Creation and drop run under the registry lock (``HostedTables.lock``); a table's rows change only under its
write lock (``_Hosted.lock``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable

import numpy as np

from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.ps.errors import InvalidArgument, TableExists, TableNotFound
from tigana.ps.replication import CopyIntake, SlotLog
from tigana.ps.routing import TableDef
from tigana.ps.shard.catalog import Catalog
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.dedup import DedupWindow
from tigana.ps.shard.tablelock import TableLock

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server
_TABLE_COUNTERS = ("rows_spilled", "admissions", "rejected_admissions", "evictions", "spills")
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f]")


def checksum_value(digest: str) -> float:
    """A table checksum (any string) as a float that survives a ``map<string, double>`` exactly (53 bits)."""
    h = hashlib.blake2b(digest.encode(), digest_size=8).digest()
    return float(int.from_bytes(h, "little") >> 11)


@dataclasses.dataclass(eq=False)
class _Hosted:
    """A table as served: its definition, the engine table, its write lock, exactly-once window, log positions,
    the slot copies it is receiving and per-slot request counters (decayed into rates)."""

    spec: TableDef
    table: EmbeddingTable
    dedup: DedupWindow
    log: SlotLog
    lock: TableLock = dataclasses.field(default_factory=TableLock)
    pulled: np.ndarray | None = None  # rows pulled per slot since the last decay
    pushed: np.ndarray | None = None
    pull_rate: np.ndarray | None = None
    push_rate: np.ndarray | None = None
    intake: CopyIntake | None = None  # the slot copies this table is receiving (``replication.intake``)

    def __post_init__(self) -> None:
        n = self.log.positions.shape[0]
        self.intake = CopyIntake(n)
        self.pulled, self.pushed = np.zeros(n), np.zeros(n)
        self.pull_rate, self.push_rate = np.zeros(n), np.zeros(n)


class HostedTables:
    """The tables of one shard server, by name, and the registry file that lists them (in ``catalog``).

    ``epoch`` reads the current map epoch (for errors); ``leads_ids`` says which ids this server leads (a
    clustered table evicts only rows it leads: copies apply their primary's evictions). Thread-safety: ``lock``
    (re-entrant) serializes creation, drop, restore and map installs; look-ups read the dict without it (a table
    may be dropped right after: holders check ``find(name) is hosted`` under the table's lock where it matters).
    Nothing here waits on the network."""

    def __init__(self, config: ServerConfig, catalog: Catalog | None, *, clustered: bool,
                 epoch: Callable[[], int], leads_ids: Callable[[np.ndarray], np.ndarray],
                 wall_clock: Callable[[], float] | None = None) -> None:
        self.config, self.catalog, self.clustered = config, catalog, clustered
        # the server's wall clock, handed to every table it makes (rows' update times and removals)
        self.wall_clock: Callable[[], float] = wall_clock or (lambda: time.time())
        self.num_slots = config.num_slots
        self.lock = threading.RLock()  # the registry lock
        self._epoch, self._leads_ids = epoch, leads_ids
        self._tables: dict[str, _Hosted] = {}

    # --- look-up -------------------------------------------------------------------------------------------
    def get(self, name: str) -> _Hosted:
        """The table served as ``name``; ``TableNotFound`` (with the epoch), ``InvalidArgument`` for no name."""
        hosted = self._tables.get(name)
        if hosted is None:
            if not name:
                raise InvalidArgument("request: field 'table' is empty")
            raise TableNotFound(f"table {name!r} not found on this server", epoch=self._epoch())
        return hosted

    def find(self, name: str) -> _Hosted | None:
        """The table served as ``name``, or None."""
        return self._tables.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def names(self) -> list[str]:
        """Every table's name, sorted."""
        return sorted(self._tables)

    def items(self) -> list[tuple[str, _Hosted]]:
        """(name, table) of every table, sorted by name (the order every multi-table lock is taken in)."""
        return sorted(self._tables.items())

    def put(self, name: str, hosted: _Hosted) -> _Hosted | None:
        """Serve ``hosted`` as ``name`` (the registry lock held: a restore or a load); the table replaced."""
        old = self._tables.get(name)
        self._tables[name] = hosted
        return old

    # --- creation and drop -----------------------------------------------------------------------------------
    def create_table(self, spec: TableDef, *, exist_ok: bool) -> tuple[TableDef, bool]:
        """``CreateTable`` on a static server: (the table's spec, created). An existing table of the same spec
        is accepted with ``exist_ok`` (``TableExists`` otherwise, naming the fields that differ); a clustered
        server creates tables from its map only (``InvalidArgument``). The registry file is written first: a
        full disk leaves no table."""
        name = spec.config.name
        if len(name) > 200 or _BAD_NAME.search(name):
            raise InvalidArgument(f"table {name!r}: field 'name' must be at most 200 characters without "
                                  "control characters")
        with self.lock:
            existing = self._tables.get(name)
            if existing is not None:
                if existing.spec != spec:
                    diff = [f.name for f in dataclasses.fields(spec.config)
                            if getattr(spec.config, f.name) != getattr(existing.spec.config, f.name)]
                    diff += [f for f in ("durability", "min_copies") if getattr(spec, f) != getattr(existing.spec, f)]
                    raise TableExists(f"table {name!r} already exists with a different spec "
                                      f"(field(s) {', '.join(diff)} differ)")
                if not exist_ok:
                    raise TableExists(f"table {name!r} already exists (pass exist_ok to accept it)")
                return existing.spec, False
            if self.clustered:
                raise InvalidArgument(f"table {name!r}: this server is part of a cluster; create tables through "
                                      f"its scheduler ({self.config.scheduler})")
            self.create(spec)
            try:
                self.save_registry()
            except BaseException:  # a full disk: the table was not created
                self.drop(name)
                raise
        log.info("created table %r (dim %d, %s)", name, spec.config.dim, spec.config.optimizer.kind)
        return spec, True

    def drop_table(self, name: str) -> bool:
        """``DropTable`` on a static server: True when it was there. The registry file is written first (a full
        disk leaves the table as it was); a clustered server drops tables from its map only."""
        if self.clustered:
            raise InvalidArgument(f"table {name!r}: this server is part of a cluster; drop tables "
                                  f"through its scheduler ({self.config.scheduler})")
        with self.lock:
            if name in self._tables:
                self.save_registry(without=name)
            dropped = self.drop(name)
        if dropped:
            log.info("dropped table %r", name)
        return dropped

    def create(self, spec: TableDef) -> _Hosted:
        """Create a table (the registry lock held); leftovers of an older table of the name are removed."""
        if self.catalog is not None:
            self.catalog.remove_table_files(spec.config.name)
        hosted = self.new_hosted(spec)
        self._tables[spec.config.name] = hosted
        self.rebudget()
        return hosted

    def drop(self, name: str) -> bool:
        """Drop a table (the registry lock held): closed under its write lock, its files removed."""
        hosted = self._tables.pop(name, None)
        if hosted is None:
            return False
        with hosted.lock:
            hosted.table.close()
        if self.catalog is not None:
            self.catalog.remove_table_files(name)
        self.rebudget()
        return True

    def new_hosted(self, spec: TableDef, table: EmbeddingTable | None = None, dedup: DedupWindow | None = None,
                   slot_log: SlotLog | None = None) -> _Hosted:
        """A ``_Hosted`` for ``spec`` (a new engine table with ``effective`` settings unless given), not served."""
        table = table or EmbeddingTable(self.effective(spec.config))
        table.wall_clock = self.wall_clock  # rows' update times and removals on the server's wall clock
        if self.clustered:  # only the primary of a row decides its eviction; copies apply it (replication)
            table.set_evictable(self._leads_ids)
        return _Hosted(spec, table, dedup or DedupWindow(self.num_slots, self.config.dedup_window),
                       slot_log or SlotLog(self.num_slots))

    def effective(self, spec: TableConfig) -> TableConfig:
        """The config a table runs with: with a daemon budget, a share of it when the spec sets none (re-split
        by ``rebudget``); spill under data_dir."""
        budget = spec.memory_budget or self.config.memory_budget or None
        spill = spec.spill_dir
        if budget and spill is None and self.catalog is not None:
            spill = self.catalog.spill_dir(spec.name)
        return dataclasses.replace(spec, memory_budget=budget, spill_dir=spill,
                                   spill_max_bytes=spec.spill_max_bytes or self.config.spill_max_bytes)

    def rebudget(self) -> None:
        """Split ``--memory-budget`` over the tables: it bounds the whole daemon, not each table. Tables with a
        budget of their own keep it (and it counts against the daemon's); the others share what is left."""
        total = self.config.memory_budget
        if not total:
            return
        tables = list(self._tables.values())
        own = sum(h.spec.config.memory_budget or 0 for h in tables)
        shared = [h for h in tables if not h.spec.config.memory_budget]
        if not shared:
            return
        # tables with budgets of their own may take it all: the shared ones still get a floor (1 MiB, or an
        # even share of the daemon's budget when that is smaller)
        each = max(min(1 << 20, total // len(tables)), (total - own) // len(shared), 1)
        for h in shared:
            try:
                h.table.set_memory_budget(each)
            except Exception:  # noqa: BLE001 - a table being closed
                log.debug("re-budgeting table %r failed", h.spec.config.name)

    def save_registry(self, without: str | None = None) -> None:
        """Persist the table registry (less ``without``); ``StorageFull`` when the disk is full. No-op without a
        data dir. Call under the registry lock."""
        if self.catalog is None:
            return
        self.catalog.save_tables([h.spec for n, h in self._tables.items() if n != without], self.num_slots,
                                 None if self.clustered else self.config.slots)

    def close_all(self) -> None:
        """Close every table (each under its write lock) and forget them: the server is shutting down."""
        with self.lock:
            for hosted in self._tables.values():
                with hosted.lock:
                    try:
                        hosted.table.close()
                    except Exception:  # noqa: BLE001 - close the others regardless
                        log.exception("closing table %r failed", hosted.spec.config.name)
            self._tables.clear()

    # --- figures -------------------------------------------------------------------------------------------
    def load_figures(self) -> dict[str, float]:
        """Rows, resident bytes and request rate (rows/s pulled + pushed, decayed) of every table here."""
        rows = nbytes = rate = 0.0
        for hosted in list(self._tables.values()):
            try:
                rows += len(hosted.table)
                nbytes += float(hosted.table.stats().get("bytes_resident", 0.0))
                rate += float(hosted.pull_rate.sum() + hosted.push_rate.sum())
            except Exception:  # noqa: BLE001 - a closing table must not break a heartbeat
                continue
        return {"rows": rows, "bytes": nbytes, "request_rate": rate}

    def sizes(self) -> dict[str, dict[str, float]]:
        """{table: {"rows", "bytes", "rows_spilled", "admissions", "rejected_admissions", "evictions", "spills"}}
        for the metrics endpoint (cheap: no checksum)."""
        out = {}
        for name, hosted in list(self._tables.items()):
            try:
                stats = hosted.table.stats()
                out[name] = {"rows": float(len(hosted.table)),
                             "bytes": float(stats.get("bytes_resident", stats.get("bytes", 0.0)))}
                out[name].update({k: float(stats[k]) for k in _TABLE_COUNTERS if k in stats})
            except Exception:  # noqa: BLE001 - a closing table must not break a scrape
                continue
        return out
