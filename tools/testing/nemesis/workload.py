"""The nemesis's workload: ledger tables (one ``sync``, one ``async``), each written by several clients, and
the audit that turns what they were told into exact ``lost`` and ``doubled`` counts.

Every client is its own ``ps.Client`` (its own client id and exactly-once sequence) driving a
``tigana.tools.bench.ledger.PushLoop`` on a background thread: an acknowledged push adds exactly 1 to every
element of its ids' rows. The clients of one table push overlapping ids; the audit sums their counts per id.
The longest stall is measured from the clients' side: the longest time any client went without an
acknowledgement while it was pushing, from its first acknowledgement to its stop. The wait for that first
acknowledgement (start-up) is reported apart, as ``first_ack_s``.

Beside the writers, ``readers_per_table`` readers per table pull the first ``watched_ids`` ids (read only)
back to back; with every push's ids and times kept, ``history`` checks the whole record as a per-id counter
history (``tigana.tools.testing.nemesis.history``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tigana import ps
from tigana.tools.bench.ledger import PushLoop, create_ledger_table
from tigana.tools.testing.nemesis.history import Increment, PullReader, check_counters

DURABILITIES = ("sync", "async")


@dataclass
class LedgerClient:
    """One client of one ledger table, with when its loop started and stopped (monotonic seconds)."""

    durability: str
    client: ps.Client
    loop: PushLoop
    started_at: float
    stopped_at: float | None = None


@dataclass
class Ledgers:
    """``clients_per_table`` ledger clients on each of a sync and an async table of ``num_ids`` ids.

    Thread-safety: ``start``/``stop``/``audit`` from one thread; the loops run on their own threads and the
    ledger counts are read under their locks."""

    scheduler: str
    clients_per_table: int = 2
    num_ids: int = 20_000
    ids_per_push: int = 500
    in_flight: int = 4
    pause_s: float = 0.005
    seed: int = 0
    readers_per_table: int = 1
    watched_ids: int = 1000
    read_pause_s: float = 0.05
    clients: list[LedgerClient] = field(default_factory=list)
    readers: dict[str, list[PullReader]] = field(default_factory=dict)

    @staticmethod
    def table(durability: str) -> str:
        return f"ledger-{durability}"

    def create_tables(self, client: ps.Client) -> None:
        for durability in DURABILITIES:
            create_ledger_table(client, self.table(durability), durability=durability)

    def start(self) -> None:
        """One ``ps.connect`` per client, each with its push loop started, and one per reader."""
        watched = np.arange(min(self.watched_ids, self.num_ids), dtype=np.int64)
        for durability in DURABILITIES:
            for k in range(self.clients_per_table):
                client = ps.connect(scheduler=self.scheduler)
                loop = PushLoop(client, table=self.table(durability), num_ids=self.num_ids,
                                ids_per_push=self.ids_per_push, in_flight=self.in_flight, pause_s=self.pause_s,
                                seed=self.seed * 1000 + 10 * k + (durability == "async"), keep_ids=True)
                self.clients.append(LedgerClient(durability, client, loop, time.monotonic()))
                loop.start()
            self.readers[durability] = [
                PullReader(ps.connect(scheduler=self.scheduler), self.table(durability), watched, reader=k,
                           pause_s=self.read_pause_s).start()
                for k in range(self.readers_per_table)]

    def loops(self, durability: str) -> list[PushLoop]:
        return [c.loop for c in self.clients if c.durability == durability]

    def stop(self) -> None:
        """Stop every loop (waiting for its pushes in flight) and reader, and close their clients; never
        raises."""
        for reader in (r for rs in self.readers.values() for r in rs):
            with contextlib.suppress(Exception):
                reader.stop()
        for c in self.clients:
            c.loop._stop.set()  # all at once: the loops finish their windows in parallel
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.loop.stop()
            c.stopped_at = time.monotonic()
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.client.close()

    def acked_pushes(self, durability: str | None = None) -> int:
        return sum(c.loop.acked_count() for c in self.clients if durability in (None, c.durability))

    def count_acked(self, durability: str, sent_before: float, acked_from: float) -> int:
        """Pushes of ``durability``'s clients sent before ``sent_before`` and acknowledged at or after
        ``acked_from`` (see ``PushLoop.count_acked``)."""
        return sum(loop.count_acked(sent_before, acked_from) for loop in self.loops(durability))

    def first_ack_s(self) -> float | None:
        """The longest any client waited from its start for its first acknowledgement (start-up: the first
        placement, table creation, a cold JIT cache), None when one never got any."""
        waits = []
        for c in self.clients:
            with c.loop._lock:
                first = min((done for _, done in c.loop.events), default=None)
            if first is None:
                return None
            waits.append(first - c.started_at)
        return max(waits, default=None)

    def max_stall(self, until: float | None = None) -> tuple[float, float, str]:
        """(seconds, when it began, the client's durability) of the longest time a client went without an
        acknowledgement while pushing, from its first acknowledgement (start-up is ``first_ack_s``) to its
        stop, or a single push's latency; a client never acknowledged stalled from its start."""
        worst = (0.0, 0.0, "")
        for c in self.clients:
            end = c.stopped_at or until or time.monotonic()
            with c.loop._lock:
                events = list(c.loop.events)
            acks = sorted(done for _, done in events)
            marks = np.array([*(acks or [c.started_at]), end])
            gaps = np.diff(marks)
            k = int(gaps.argmax())
            if gaps[k] > worst[0]:
                worst = (float(gaps[k]), float(marks[k]), c.durability)
            for sent, done in events:
                if done - sent > worst[0] and sent >= acks[0]:
                    worst = (done - sent, sent, c.durability)
        return worst

    def history(self, durability: str) -> dict[str, Any]:
        """The readers' pulls of ``durability``'s table checked against every push its clients sent
        (``check_counters``), plus ``read_errors``. Call once every loop and reader stopped."""
        increments = []
        for loop in self.loops(durability):
            increments += [Increment(ids, sent, done) for (sent, done), ids in
                           zip(loop.events, loop.acked_ids, strict=True)]
            increments += [Increment(ids, sent, None) for sent, ids in loop.failed]
        readers = self.readers.get(durability, [])
        reads = [read for r in readers for read in r.reads]
        watched = np.arange(min(self.watched_ids, self.num_ids), dtype=np.int64)
        return {**check_counters(watched, increments, reads, self.num_ids),
                "read_errors": sum(len(r.errors) for r in readers)}

    def lost_so_far(self, client: ps.Client, durability: str) -> int:
        """Updates acknowledged before this call that a pull (read only) does not see, while the clients go
        on pushing: an acknowledged push is applied on its primary, so any later pull must see it. (Doubled
        updates need the clients stopped: see ``audit``.)"""
        acked = np.sum([loop.snapshot_counts() for loop in self.loops(durability)], axis=0)
        rows = client.pull(self.table(durability), np.arange(self.num_ids, dtype=np.int64), insert=False)
        return int(np.maximum(acked - np.rint(rows[:, 0]).astype(np.int64), 0).sum())

    def audit(self, client: ps.Client, durability: str) -> dict[str, Any]:
        """Pull every id of ``durability``'s table (read only) and compare with the clients' ledgers:
        {lost, doubled, acked_updates, acked_pushes, failed_pushes, unknown_updates, lost_ids, doubled_ids}."""
        loops = self.loops(durability)
        expected = np.sum([loop.acked for loop in loops], axis=0)
        unknown = np.sum([loop.unknown for loop in loops], axis=0)
        ids = np.arange(self.num_ids, dtype=np.int64)
        rows = client.pull(self.table(durability), ids, insert=False)
        torn = int((rows != rows[:, :1]).any(axis=1).sum())  # a row whose elements differ: a torn update
        actual = np.rint(rows[:, 0]).astype(np.int64)
        short = np.maximum(expected - actual, 0)
        over = np.maximum(actual - expected - unknown, 0)  # a push that failed may have applied, once
        return {"lost": int(short.sum()), "doubled": int(over.sum()), "acked_updates": int(expected.sum()),
                "acked_pushes": sum(len(loop.events) for loop in loops),
                "failed_pushes": sum(len(loop.errors) for loop in loops), "unknown_updates": int(unknown.sum()),
                "lost_ids": int((short > 0).sum()), "doubled_ids": np.flatnonzero(over)[:5].tolist(),
                "torn_rows": torn, "errors": _error_kinds(loops)}


def _error_kinds(loops: list[PushLoop]) -> dict[str, int]:
    """Push errors by exception type (what the clients were told instead of an acknowledgement)."""
    kinds: dict[str, int] = {}
    for loop in loops:
        for e in list(loop.errors):
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    return kinds
