"""The ledger: a push loop whose every acknowledged update is a known amount, so "lost" and "doubled" are
exact numbers after any fault.

The ledger table uses SGD with lr 1, zero initial rows and gradient -1, so an acknowledged push adds exactly
1 to every element of the rows of its ids. ``PushLoop`` pushes a fresh random set of ids each step from a
background thread (several pushes in flight), and records each push when its future says acknowledged. At
the end ``audit`` pulls every id (read only) and compares: an id below its count lost updates, above it got
some twice. Used by the fault tests (``tests/faults``) and ``tigana bench failover``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent import futures as cf
from dataclasses import dataclass, field

import numpy as np

from tigana import ps

TABLE_DIM = 4


def create_ledger_table(client: ps.Client, name: str = "ledger", *, durability: str | None = None,
                        min_copies: int = 1) -> None:
    client.create_table(name, dim=TABLE_DIM, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(), staleness=None,
                        durability=durability, min_copies=min_copies)


@dataclass
class Audit:
    """The outcome: updates (id increments) acknowledged, lost and doubled; pushes failed (not acknowledged:
    may or may not have applied, excluded from the exact count but bounded)."""

    acked_pushes: int
    acked_updates: int
    lost: int
    doubled: int
    failed_pushes: int
    unknown_updates: int
    lost_ids: int = 0
    doubled_ids: list[int] = field(default_factory=list)  # a few of them, to look into

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class PushLoop:
    """Pushes ``ids_per_push`` distinct ids out of ``num_ids`` per step until stopped.

    ``acked``: per id, acknowledged increments; ``events``: (time sent, time acknowledged) of each acked push;
    errors are counted (a failed push's ids go to ``unknown``)."""

    client: ps.Client
    table: str = "ledger"
    num_ids: int = 20_000
    ids_per_push: int = 1000
    in_flight: int = 4
    seed: int = 0
    pause_s: float = 0.0
    keep_ids: bool = False  # remember each push's ids (``acked_ids``, aligned with ``events``; ``failed``)
    acked: np.ndarray = field(init=False)
    unknown: np.ndarray = field(init=False)
    events: list[tuple[float, float]] = field(default_factory=list)
    acked_ids: list[np.ndarray] = field(default_factory=list)
    failed: list[tuple[float, np.ndarray]] = field(default_factory=list)  # (time sent, ids) of failed pushes
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.acked = np.zeros(self.num_ids, np.int64)
        self.unknown = np.zeros(self.num_ids, np.int64)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = np.random.default_rng(self.seed)
        self.sent = 0

    def start(self) -> PushLoop:
        self._thread = threading.Thread(target=self._run, name="ledger-push-loop", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        grads = -np.ones((self.ids_per_push, TABLE_DIM), np.float32)
        window: list[cf.Future] = []
        while not self._stop.is_set():
            ids = self._rng.choice(self.num_ids, self.ids_per_push, replace=False).astype(np.int64)
            sent_at = time.monotonic()
            try:
                fut = self.client.push(self.table, ids, grads)
            except ps.PSError as exc:  # a stored error of an earlier push; this one was not sent
                with self._lock:
                    self.errors.append(exc)
                continue
            self.sent += 1
            fut.add_done_callback(self._recorder(ids, sent_at))
            window.append(fut)
            if len(window) >= self.in_flight:
                cf.wait(window, return_when=cf.FIRST_COMPLETED)
                window = [f for f in window if not f.done()]
            if self.pause_s:
                time.sleep(self.pause_s)
        cf.wait(window)

    def _recorder(self, ids: np.ndarray, sent_at: float) -> Callable[[cf.Future], None]:
        def record(fut: cf.Future) -> None:
            now = time.monotonic()
            with self._lock:
                if fut.exception() is None:
                    self.acked[ids] += 1
                    self.events.append((sent_at, now))
                    if self.keep_ids:
                        self.acked_ids.append(ids)
                else:
                    self.unknown[ids] += 1
                    self.errors.append(fut.exception())
                    if self.keep_ids:
                        self.failed.append((sent_at, ids))
        return record

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        # flush's error (if any) is already counted per push; drain the client's stored errors
        with contextlib.suppress(ps.PSError):
            self.client.flush()

    def acked_count(self) -> int:
        with self._lock:
            return len(self.events)

    def snapshot_counts(self) -> np.ndarray:
        with self._lock:
            return self.acked.copy()

    def counts_acked_between(self, t0: float, t1: float, *, sent_from: float = -np.inf,
                             sent_before: float = np.inf) -> np.ndarray:
        """Per id, the increments of the pushes acknowledged in [t0, t1) and sent in [sent_from, sent_before)
        (needs ``keep_ids``)."""
        out = np.zeros(self.num_ids, np.int64)
        with self._lock:
            for (sent, done), ids in zip(self.events, self.acked_ids, strict=True):
                if t0 <= done < t1 and sent_from <= sent < sent_before:
                    out[ids] += 1
        return out

    def count_acked(self, sent_before: float, acked_from: float) -> int:
        """Pushes sent before ``sent_before`` and acknowledged at or after ``acked_from`` (what a server killed
        at ``sent_before`` may have acknowledged since a lag sampled at ``acked_from``)."""
        with self._lock:
            return sum(1 for sent, done in self.events if sent < sent_before and done >= acked_from)

    def first_ack_sent_after(self, t: float) -> float | None:
        """The acknowledgement time of the first push sent at or after ``t`` (recovery after a fault at t)."""
        with self._lock:
            acks = [done for sent, done in self.events if sent >= t]
        return min(acks) if acks else None


def audit(client: ps.Client, loop: PushLoop, *, table: str | None = None) -> Audit:
    """Pull every id (read only) and compare with the ledger."""
    table = table or loop.table
    ids = np.arange(loop.num_ids, dtype=np.int64)
    rows = client.pull(table, ids, insert=False)
    actual = np.rint(rows[:, 0]).astype(np.int64)
    if not (rows == rows[:, :1]).all():
        raise AssertionError(f"ledger table {table!r}: the elements of a row differ (a torn update)")
    expected, unknown = loop.acked, loop.unknown
    short = np.maximum(expected - actual, 0)
    over = np.maximum(actual - expected - unknown, 0)  # an unacknowledged push may have applied, once
    return Audit(acked_pushes=len(loop.events), acked_updates=int(expected.sum()), lost=int(short.sum()),
                 doubled=int(over.sum()), failed_pushes=len(loop.errors), unknown_updates=int(unknown.sum()),
                 lost_ids=int((short > 0).sum()), doubled_ids=np.flatnonzero(over)[:10].tolist())
