"""A history checker for the ledger tables, after Porcupine and Knossos: every push and pull with its start and
end, checked per id as a counter.

A ledger push adds exactly 1 to each of its ids' rows, so each id is a counter with two operations: an
increment (the push: invoked when sent, completed when acknowledged; a push that failed may or may not have
applied, so it stays open forever) and a read (the pull: invoked when sent, completed with the value it
returned). A history of such a counter is linearizable only if every read could take effect at one instant
between its start and its end, in one total order with the increments. For increment-only counters that
comes down to three per-id checks, each vectorized over a whole history:

- **stale read**: a pull that starts after a push was acknowledged reflects it (value >= the increments
  completed before the read started);
- **phantom read**: no pull reflects a push that was never sent (value <= the increments invoked before the
  read ended, failed ones included);
- **backwards read**: the value never runs backwards in real time: a pull that starts after another pull
  ended returns at least that pull's value (for one reader, whose pulls follow each other, this is "never runs
  backwards for any one client"; ``backwards_reads_same_reader`` counts those apart).

``PullReader`` records the reads: a background loop pulling a fixed set of watched ids (read only) from its
own client. The increments come from ``tigana.tools.bench.ledger.PushLoop`` with ``keep_ids``.
Async tables are checked against their documented bound: acknowledged async pushes may be lost with a killed
primary, up to the replication lag it reported (the nemesis's ``async_loss_bound``), so a stale async read is a
violation only when no primary was killed or when the updates one read lacks exceed the bound.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tigana import ps


@dataclass
class Read:
    """One pull: ``reader`` (which client), when it was sent and answered (monotonic seconds) and the counts
    it returned, one per watched id."""

    reader: int
    start: float
    end: float
    values: np.ndarray


@dataclass
class Increment:
    """One push: its ids, when it was sent, and when it was acknowledged (None: it failed, so it may or may
    not have applied, at any time after it was sent)."""

    ids: np.ndarray
    sent: float
    done: float | None


@dataclass
class PullReader:
    """Pulls ``watched`` ids of ``table`` (read only) every ``pause_s`` until stopped, recording each read.

    Thread-safety: ``start``/``stop`` from one thread; ``reads`` is complete once ``stop`` returned."""

    client: ps.Client
    table: str
    watched: np.ndarray
    reader: int = 0
    pause_s: float = 0.05
    reads: list[Read] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PullReader:
        self._thread = threading.Thread(target=self._run, name="nemesis-pull-reader", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                rows = self.client.pull(self.table, self.watched, insert=False)
            except ps.PSError as exc:  # a read that failed tells nothing: not part of the history
                self.errors.append(exc)
            else:
                self.reads.append(Read(self.reader, start, time.monotonic(),
                                       np.rint(rows[:, 0]).astype(np.int64)))
            self._stop.wait(self.pause_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with contextlib.suppress(ps.PSError):
            self.client.close()


def check_counters(watched: np.ndarray, increments: list[Increment], reads: list[Read],
                   num_ids: int) -> dict[str, Any]:
    """Check a counter history per watched id (see the module docstring).

    ``watched``: (W,) int64 ids every read returned, in order; ``increments``: every push (acknowledged or
    failed) with its ids in [0, num_ids); ``reads``: every completed pull. Returns ``reads`` (pulls checked),
    ``checked`` (pull x id pairs), ``stale_reads``, ``phantom_reads``, ``backwards_reads``,
    ``backwards_reads_same_reader`` (pull x id pairs), ``linearizability_violations`` (pairs failing any
    check), ``max_read_deficit`` (the most acknowledged updates one read lacked, summed over its ids) and
    ``examples`` (a few violations: id, kind, value, bound, seconds into the history)."""
    watched = np.asarray(watched, np.int64)
    n_w = watched.shape[0]
    empty = {"reads": len(reads), "checked": 0, "stale_reads": 0, "phantom_reads": 0, "backwards_reads": 0,
             "backwards_reads_same_reader": 0, "linearizability_violations": 0, "max_read_deficit": 0,
             "examples": []}
    if not reads or n_w == 0:
        return empty
    position = np.full(num_ids, -1, np.int64)
    position[watched] = np.arange(n_w)
    starts = np.array([r.start for r in reads])
    ends = np.array([r.end for r in reads])
    values = np.stack([np.asarray(r.values, np.int64) for r in reads])  # (R, W)
    readers = np.array([r.reader for r in reads])
    t0 = min(starts.min(), min((i.sent for i in increments), default=starts.min()))

    # lower[r]: increments acknowledged before read r started; upper[r]: increments sent before it ended
    acked = [i for i in increments if i.done is not None]
    lower = _counts_before(starts, [i.done for i in acked], [i.ids for i in acked], position, n_w)
    upper = _counts_before(ends, [i.sent for i in increments], [i.ids for i in increments], position, n_w)
    stale = values < lower
    phantom = values > upper

    # backwards: the running maximum of the reads that ended before read r started
    by_end = np.argsort(ends, kind="stable")
    running_max = np.maximum.accumulate(values[by_end], axis=0)
    k = np.searchsorted(ends[by_end], starts, side="left") - 1  # the last read that ended before r started
    has_before = k >= 0
    floor = np.zeros_like(values)
    floor[has_before] = running_max[k[has_before]]
    backwards = values < floor
    # one reader: its previous read (reads of one reader never overlap)
    same = np.zeros_like(backwards)
    order = np.lexsort((starts, readers))
    prev, cur = order[:-1], order[1:]
    follows = readers[prev] == readers[cur]
    same[cur[follows]] = values[cur[follows]] < values[prev[follows]]

    bad = stale | phantom | backwards
    deficit = np.maximum(lower - values, 0).sum(axis=1)
    examples = []
    for kind, mask, bound in (("stale", stale, lower), ("phantom", phantom, upper), ("backwards", backwards, floor)):
        for r, w in zip(*np.nonzero(mask), strict=True):
            if len(examples) >= 6:
                break
            examples.append({"id": int(watched[w]), "kind": kind, "value": int(values[r, w]),
                             "bound": int(bound[r, w]), "at_s": round(float(starts[r] - t0), 3),
                             "reader": int(readers[r])})
    return {"reads": len(reads), "checked": int(values.size), "stale_reads": int(stale.sum()),
            "phantom_reads": int(phantom.sum()), "backwards_reads": int(backwards.sum()),
            "backwards_reads_same_reader": int(same.sum()), "linearizability_violations": int(bad.sum()),
            "max_read_deficit": int(deficit.max()), "examples": examples}


def _counts_before(times: np.ndarray, at: list[float], ids: list[np.ndarray], position: np.ndarray,
                   n_w: int) -> np.ndarray:
    """(len(times), n_w) int64: per query time, per watched id, how many of the operations (``at[j]``,
    ``ids[j]``) happened strictly before it. One pass in time order: a cumulative count per operation."""
    out = np.zeros((times.shape[0], n_w), np.int64)
    if not at:
        return out
    order = np.argsort(np.asarray(at), kind="stable")
    op_times = np.asarray(at)[order]
    # column j of the sparse (ops x W) incidence: the watched positions each operation touches
    cols = [position[ids[j]] for j in order]
    lens = np.array([int((c >= 0).sum()) for c in cols])
    flat = np.concatenate([c[c >= 0] for c in cols]) if lens.sum() else np.zeros(0, np.int64)
    op_of = np.repeat(np.arange(len(cols)), lens)
    # counts after each prefix of operations, only at the prefixes the queries ask for
    cut = np.searchsorted(op_times, times, side="left")  # ops strictly before each query time
    q_order = np.argsort(cut, kind="stable")
    counts = np.zeros(n_w, np.int64)
    done = 0  # operations folded into counts
    start = 0  # index into flat of the first element not folded
    for q in q_order:
        c = int(cut[q])
        if c > done:
            stop = int(np.searchsorted(op_of, c, side="left"))
            np.add.at(counts, flat[start:stop], 1)
            start, done = stop, c
        out[q] = counts
    return out
