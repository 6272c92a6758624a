"""Cluster cuts on one shard server (``Cuts``): ``PrepareCut``, ``CommitCut``, ``ReleaseCut`` and the cut's side
of ``ExportRows`` (``tigana admin checkpoint``; the coordinator is ``tigana.ps.client.checkpoint.cutround``); and
``rows_chunk``, an ``ExportRowsChunk`` of rows (shared with ``export``).

The protocol, on this server:

1. ``PrepareCut(cut, tables)``: take the write locks of the named tables, in name order as a map install does
   (each wait bounded by the hold, so a lock cycle cannot form), and answer. From here no write applies to those
   tables here: pushes, pulls that insert, imports and replicated changes wait for the lock.
2. ``CommitCut(cut, since)``: under those locks, per table: open a copy-on-write cut of every row (O(1)), or,
   for an incremental cut (``since``, this server's own clock at the base) of a table whose led slots each kept
   their base log position or were led here alone since the base (``_since_holds``), whose rows are all
   resident and whose tombstones reach back to ``since``, copy the rows updated since then and the ids removed
   since then (O(rows changed) plus one vectorized pass over the update times). Record the led slots, their log positions, the epoch and the step.
   Release the locks. A copy-on-write cut is then read by ``ExportRows(cut=...)`` while writes go on.
3. ``ReleaseCut``: drop what is left (the coordinator calls it when done or failed).

Why the cut is consistent across servers: the coordinator sends ``CommitCut`` only after every server answered
``PrepareCut``. A write acknowledged before some server's prepare answered was applied where it went before
that server locked, and every server's cut is taken after every prepare answered, so the write is in the
cut; a write is never half in: it applies under one table's lock, before or after the cut there. So if the cut
holds a write, it holds every write acknowledged before that write was sent (a trainer's earlier steps).

Bounded: locks held past ``hold_ms`` without a commit are released and the commit refused (the coordinator
starts again); a committed cut not read within ``keep_ms`` is dropped (its copy-on-write state freed).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from tigana.embeddings import RowBatch
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import InvalidArgument, Unavailable
from tigana.ps.routing import slot_of
from tigana.ps.shard.hosted import HostedTables, _Hosted
from tigana.ps.shard.view import Holdings
from tigana.ps.wire import cluster as cluster_wire

MAX_HOLD_MS = 10_000  # the longest a coordinator may ask writes to wait
DEFAULT_KEEP_MS = 600_000


@dataclasses.dataclass
class _TableCut:
    """One table's part of a committed cut: a copy-on-write cut to read (``cut``), or the changed rows copied
    (``rows``); ``since`` filters a copy-on-write cut's rows; ``deleted``: tombstones of an incremental part."""

    cut: object | None
    rows: RowBatch | None
    since: float
    deleted: np.ndarray | None
    step: int
    positions: np.ndarray | None = None  # the led slots' log positions of this table at the cut


@dataclasses.dataclass
class _Cut:
    """A cut on this server: holding (locks held), committed (parts to read), or over."""

    name: str
    hosted: list[tuple[str, _Hosted]]
    state: str = "holding"
    timer: threading.Timer | None = None
    parts: dict[str, _TableCut] = dataclasses.field(default_factory=dict)
    want: np.ndarray | None = None  # the slots this server led at the cut
    release_wanted: bool = False  # ReleaseCut came while the commit ran: the commit ends it


def rows_chunk(batches: list, weights_only: bool, step: int, server_time: float) -> pb.ExportRowsChunk:
    """One ``ExportRowsChunk`` of ``batches`` (``RowBatch``es; none: an empty chunk), optimizer state left out
    with ``weights_only``."""
    out = pb.ExportRowsChunk(step=step, server_time=server_time)
    if batches:
        rows = RowBatch.concat(batches) if len(batches) > 1 else batches[0]
        if weights_only:
            rows = RowBatch(rows.ids, rows.weights, np.zeros((len(rows), 0), np.float32), rows.update_count,
                            rows.last_step, rows.last_time)
        out.rows.CopyFrom(cluster_wire.rows_to_pb(rows))
    return out


class Cuts:
    """The cluster cuts open on one shard server; see the module docstring for the protocol.

    Dependencies: ``tables`` (the tables a cut locks and reads), ``holdings`` (the slots led at the cut) and
    ``wall_clock`` (a cut's ``server_time``). Thread-safety: any thread; the cut registry has a lock of its own,
    and a prepared cut holds its tables' write locks across calls (released by the commit, a release or the
    hold's timer). Blocking: ``prepare`` waits up to the hold for the tables' locks; the others do not wait."""

    def __init__(self, tables: HostedTables, holdings: Holdings, wall_clock: Callable[[], float]) -> None:
        self.tables, self.holdings, self.wall_clock = tables, holdings, wall_clock
        self.num_slots = tables.num_slots
        self._cuts: dict[str, _Cut] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Cuts held or committed and not yet read or released."""
        return len(self._cuts)

    def prepare(self, request: pb.PrepareCutRequest) -> pb.PrepareCutResponse:
        """Step 1: hold writes to the named tables (their write locks, in name order, within ``hold_ms``)."""
        cuts, lock = self._cuts, self._lock
        if not request.cut:
            raise InvalidArgument("PrepareCut: field 'cut' is empty")
        hold_s = min(int(request.hold_ms) or 2000, MAX_HOLD_MS) / 1000.0
        hosted = [(name, self.tables.get(name)) for name in sorted(set(request.tables))]  # TableNotFound names it
        with lock:
            if request.cut in cuts:
                raise InvalidArgument(f"PrepareCut: field 'cut': cut {request.cut!r} exists on this server")
            entry = cuts[request.cut] = _Cut(request.cut, [], state="preparing")
        deadline = time.monotonic() + hold_s
        error = None
        for name, h in hosted:
            if not h.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                error = f"table {name!r}: its write lock was not free within the hold"
                break
            entry.hosted.append((name, h))
        with lock:
            if error is None and entry.state != "preparing":
                error = f"cut {request.cut!r} was released meanwhile"
            if error is None:
                entry.state = "holding"
                entry.timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire_cut, (entry,))
                entry.timer.daemon = True
                entry.timer.start()
                return pb.PrepareCutResponse(epoch=self.holdings.epoch)
            entry.state = "holding"  # so that ending it releases what it took
        self._end_cut(entry, "failed")
        raise Unavailable(f"PrepareCut: {error}; the cut starts again")

    def commit(self, request: pb.CommitCutRequest) -> pb.CommitCutResponse:
        """Step 2: cut every held table (copy-on-write, or the rows changed since the base), then release the
        locks; the parts wait for ``chunks``."""
        cuts, lock = self._cuts, self._lock
        with lock:
            entry = cuts.get(request.cut)
            if entry is None or entry.state != "holding":
                state = "unknown" if entry is None else entry.state
                raise Unavailable(f"CommitCut: cut {request.cut!r} is {state} on this server (held past its hold "
                                  "or released); the cut starts again")
            entry.state = "committing"
            if entry.timer is not None:
                entry.timer.cancel()
        out = pb.CommitCutResponse()
        try:
            view = self.holdings.view
            entry.want = view.leads.copy()
            slots = np.flatnonzero(entry.want)
            in_led = self._in_led(entry.want)
            out.server_time = self.wall_clock()
            out.epoch = view.epoch
            out.slots = slots.astype("<i4").tobytes()
            for name, h in entry.hosted:
                since = float(request.since.get(name, 0.0))
                if since and not self._since_holds(request, name, h, view, slots):
                    since = 0.0  # a slot written since the base by another primary: this part is full
                entry.parts[name] = part = self._table_cut(h, since, in_led)
                part.positions = h.log.positions[slots].copy()
                out.tables.add(table=name, step=part.step, full=part.deleted is None,
                               positions_epochs=part.positions[:, 0].astype("<u8").tobytes(),
                               positions_indexes=part.positions[:, 1].astype("<u8").tobytes())
        except BaseException:
            with lock:
                entry.state = "holding"  # so that ending it releases the locks
            self._end_cut(entry, "failed")
            raise
        with lock:
            entry.state = "committed"  # from here ending the cut leaves the locks to the release below
            keep_s = (int(request.keep_ms) or DEFAULT_KEEP_MS) / 1000.0
            entry.timer = threading.Timer(keep_s, self._expire_cut, (entry,))
            entry.timer.daemon = True
            entry.timer.start()
        for _, h in reversed(entry.hosted):  # writes go on
            h.lock.release()
        if entry.release_wanted:
            self._end_cut(entry, "released")
        return out

    def release(self, cut: str) -> None:
        """Step 3: end cut ``cut`` (its locks released, its unread parts closed); no-op when unknown."""
        with self._lock:
            entry = self._cuts.get(cut)
        if entry is not None:
            self._end_cut(entry, "released")

    def _since_holds(self, request: pb.CommitCutRequest, name: str, hosted: _Hosted, view, slots: np.ndarray
                     ) -> bool:
        """Whether the rows of ``slots`` (led here) changed since the base are those updated at or after the
        request's ``since`` (this server's clock at the base): each slot kept the log position it had in the base
        (nothing written since), or this server led it since the base (its copies unchanged since the base's
        epoch, so every write since was applied here first and stamped by this clock). A slot another primary
        wrote since the base holds rows stamped by that primary's clock, which may be behind this one. No base
        positions (an older coordinator): False, the part is full. A server without a scheduler (static slots,
        no other primary): True."""
        raw = request.base_positions.get(name)
        if raw is None:
            return False
        if view.map is None:
            return True
        base = cluster_wire.array(raw, "<u8", field=f"base_positions[{name!r}]",
                                  count=2 * self.num_slots).reshape(self.num_slots, 2)
        kept = (hosted.log.positions[slots] == base[slots]).all(axis=1)
        led_since = (view.map.slot_epochs[slots] <= np.uint64(request.base_epoch)) & (request.base_epoch > 0)
        return bool((kept | led_since).all())

    def _table_cut(self, hosted: _Hosted, since: float, in_led) -> _TableCut:
        """One table's part, under its write lock (see the module docstring, step 2)."""
        table = hosted.table
        step = int(table.step)
        if since:
            deleted, complete = table.removed_since(since, in_led)
            if complete and not table.rows_spilled:
                return _TableCut(None, table.export_rows(in_led, since=since), since, deleted, step)
            if complete:  # spilled rows' update times live in the store: read from a cut, filtered by time
                return _TableCut(table.cut(), None, since, deleted, step)
        return _TableCut(table.cut(), None, 0.0, None, step)

    def _in_led(self, want: np.ndarray):
        return lambda ids: want[slot_of(ids, self.num_slots)]

    def chunks(self, request: pb.ExportRowsRequest) -> Iterator[pb.ExportRowsChunk]:
        """``ExportRows(cut=...)``: stream one table's part of a committed cut (consumed: read it once; no lock
        held while it is read)."""
        cuts, lock = self._cuts, self._lock
        name = request.table
        with lock:
            entry = cuts.get(request.cut)
            part = entry.parts.pop(name, None) if entry is not None and entry.state == "committed" else None
        if part is None:
            raise Unavailable(f"ExportRows: table {name!r}: no part of cut {request.cut!r} to read on this server "
                           "(not committed, read already, released or expired)")
        chunk = int(request.chunk_rows) or 65536
        try:
            yield from self._part_chunks(entry, part, chunk, request.weights_only)
        finally:
            if part.cut is not None:
                part.cut.close()

    def _part_chunks(self, entry: _Cut, part: _TableCut, chunk: int, weights_only: bool
                     ) -> Iterator[pb.ExportRowsChunk]:
        def rows() -> Iterator[RowBatch]:
            if part.rows is not None:
                for lo in range(0, len(part.rows), chunk):
                    yield part.rows.take(slice(lo, lo + chunk))
                return
            for batch in part.cut.batches():
                keep = entry.want[slot_of(batch.ids, self.num_slots)]
                if part.since:
                    keep &= batch.last_time >= part.since
                if not keep.all():
                    batch = batch.take(keep)
                if len(batch):
                    yield batch

        buffered, count = [], 0
        for batch in rows():
            buffered.append(batch)
            count += len(batch)
            if count >= chunk:
                yield rows_chunk(buffered, weights_only, part.step, 0.0)
                buffered, count = [], 0
        out = rows_chunk(buffered, weights_only, part.step, 0.0)
        if part.deleted is not None:
            out.deleted_ids = np.ascontiguousarray(part.deleted, "<i8").tobytes()
            out.deleted_complete = True
        slots = np.flatnonzero(entry.want)
        out.slots = slots.astype("<i4").tobytes()
        out.positions_epochs = part.positions[:, 0].astype("<u8").tobytes()
        out.positions_indexes = part.positions[:, 1].astype("<u8").tobytes()
        yield out

    def _expire_cut(self, entry: _Cut) -> None:
        self._end_cut(entry, "expired")

    def _end_cut(self, entry: _Cut, state: str) -> None:
        """Over: release the locks if still held, close the unread parts, forget the cut (idempotent)."""
        cuts, lock = self._cuts, self._lock
        with lock:
            previous = entry.state
            if previous == "preparing":  # PrepareCut releases what it took, and sees the new state
                entry.state = state
                return
            if previous == "committing":  # CommitCut releases the locks, then ends the cut
                entry.release_wanted = True
                return
            if entry.timer is not None:
                entry.timer.cancel()
            entry.state = state
            parts, entry.parts = entry.parts, {}
            if cuts.get(entry.name) is entry:
                del cuts[entry.name]
            locked = previous == "holding"
        if locked:
            for _, h in reversed(entry.hosted):
                h.lock.release()
        for part in parts.values():
            if part.cut is not None:
                part.cut.close()
