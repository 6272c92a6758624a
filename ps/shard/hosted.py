"""Tables as served: ``_Hosted`` (a table with its write lock, exactly-once window, log positions and request
counters), the ``Hosting`` room of ``ShardService`` (look-up, creation, drop, the daemon's memory budget split
over the tables, figures for metrics and heartbeats), and ``checksum_value``.

Creation and drop run under the registry lock; a table's rows change only under its write lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import numpy as np

from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.ps.dedup import DedupWindow
from tigana.ps.errors import InvalidArgument, TableNotFound
from tigana.ps.replication import CopyIntake, SlotLog
from tigana.ps.routing import TableDef, slot_of
from tigana.ps.shard._fields import ShardFields
from tigana.ps.shard.tablelock import TableLock

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server
_TABLE_COUNTERS = ("rows_spilled", "admissions", "rejected_admissions", "evictions", "spills")


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


class Hosting(ShardFields):
    """The tables of one shard server (a room of ``ShardService``)."""

    def _get(self, name: str) -> _Hosted:
        hosted = self._tables.get(name)
        if hosted is None:
            if not name:
                raise InvalidArgument("request: field 'table' is empty")
            raise TableNotFound(f"table {name!r} not found on this server", epoch=self._view.epoch)
        return hosted

    def _effective(self, spec: TableConfig) -> TableConfig:
        """The config a table runs with: with a daemon budget, a share of it when the spec sets none (re-split
        by ``_rebudget``); spill under data_dir."""
        budget = spec.memory_budget or self.config.memory_budget or None
        spill = spec.spill_dir
        if budget and spill is None and self.catalog is not None:
            spill = self.catalog.spill_dir(spec.name)
        return dataclasses.replace(spec, memory_budget=budget, spill_dir=spill,
                                   spill_max_bytes=spec.spill_max_bytes or self.config.spill_max_bytes)

    def _new_hosted(self, spec: TableDef, table: EmbeddingTable | None = None, dedup: DedupWindow | None = None,
                    slot_log: SlotLog | None = None) -> _Hosted:
        table = table or EmbeddingTable(self._effective(spec.config))
        table.wall_clock = self.wall_clock  # rows' update times and removals on the server's wall clock
        if self.clustered:  # only the primary of a row decides its eviction; copies apply it (replication)
            table.set_evictable(self._leads_ids)
        return _Hosted(spec, table, dedup or DedupWindow(self.num_slots, self.config.dedup_window),
                       slot_log or SlotLog(self.num_slots))

    def _leads_ids(self, ids: np.ndarray) -> np.ndarray:
        return self._view.leads[slot_of(ids, self.num_slots)]

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

    def table_names(self) -> list[str]:
        return sorted(self._tables)

    def table_sizes(self) -> dict[str, dict[str, float]]:
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

    def _create_local(self, spec: TableDef) -> _Hosted:
        """Create a table (the registry lock is held); leftovers of an older table of the name are removed."""
        if self.catalog is not None:
            self.catalog.remove_table_files(spec.config.name)
        hosted = self._new_hosted(spec)
        self._tables[spec.config.name] = hosted
        self._rebudget()
        return hosted

    def _rebudget(self) -> None:
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

    def _drop_local(self, name: str) -> bool:
        hosted = self._tables.pop(name, None)
        if hosted is None:
            return False
        with hosted.lock:
            hosted.table.close()
        if self.catalog is not None:
            self.catalog.remove_table_files(name)
        self._rebudget()
        return True
