"""The primary side of replication on one server: a ``Stream`` per target, slot copies, and the
acknowledgements sync pushes wait for (the invariants are in ``tigana.ps.replication`` and
docs/replication.md)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from tigana.ps.logs import event, slots_text
from tigana.ps.replication.stream import (
    COPYING,
    FAILED,
    REPORTED,
    ROWS_SENT,
    SWITCHED,
    Mark,
    Session,
    Stream,
    restrict,
)
from tigana.ps.routing import CATCHING_UP, IN_SYNC, ShardMap, slot_of
from tigana.ps.wire.cluster import BARRIER, SNAPSHOT_BEGIN, SNAPSHOT_END, Item

log = logging.getLogger("tigana.ps.replication")


class Replicator:
    """The primary side of replication on one server.

    ``refresh_map(epoch)``, ``report_failure(target, slots, reason)`` and ``caught_up(target, slots,
    since_epoch) -> bool`` are the server's links to the scheduler (called from sender threads, never under
    the lock); ``caught_up`` answers False when the scheduler refused the report as stale (the copy was
    removed or demoted after this slot copy started), and the copy is then started again."""

    def __init__(self, server_id: str, boot: str, num_slots: int, *, max_message_bytes: int,
                 refresh_map: Callable[[int], None], report_failure: Callable[[str, np.ndarray, str], None],
                 caught_up: Callable[[str, np.ndarray, int], bool],
                 copy_rows: Callable[[Stream, Session], None],
                 failure_timeout_s: float = 2.0, send_timeout_s: float = 10.0, batch_bytes: int = 24 << 20,
                 max_queue_bytes: int = 512 << 20, copy_window_bytes: int = 16 << 20,
                 channel: Callable[[str, list], grpc.Channel] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[str, Callable[[], None]], None] | None = None) -> None:
        self.server_id, self.boot, self.num_slots = server_id, boot, num_slots
        self.max_message_bytes = max_message_bytes
        self.refresh_map, self.report_failure, self.caught_up = refresh_map, report_failure, caught_up
        self.copy_rows = copy_rows
        self.failure_timeout_s, self.send_timeout_s = failure_timeout_s, send_timeout_s
        self.batch_bytes = min(batch_bytes, max_message_bytes // 2)
        self.max_queue_bytes = max_queue_bytes
        self.copy_window_bytes = copy_window_bytes
        self.channel = channel or (lambda address, options: grpc.insecure_channel(address, options=options))
        # The adapter's seams: ``clock`` and ``spawn(name, fn)`` (run ``fn`` on a thread of its own). A
        # simulator passes its own clock and collects what is spawned to run it when it chooses.
        self.clock = clock
        self.threaded = spawn is None
        self.spawn = spawn or _thread
        self.cond = threading.Condition()
        self.streams: dict[str, Stream] = {}
        self.table_epochs: dict[str, int] = {}  # table -> created_epoch of the incarnation served
        self.switch_after_s = 1.0  # a slot copy's rows applied this long ago: it switches whatever the lag
        self.epoch = 0
        self._generation = int(time.time() * 1000) << 8
        self._closed = False

    def next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def slot_of(self, ids: np.ndarray) -> np.ndarray:
        return slot_of(ids, self.num_slots)

    # --- map changes (called by the server's install, holding every table's write lock) -----------------
    def on_map(self, m: ShardMap, me: int, tables: list[str], positions: Callable[[str, np.ndarray], np.ndarray],
               dedup_records: Callable[[str, np.ndarray], list]) -> None:
        """Bring the streams in line with map ``m``: open/close streams, start slot copies for new catching-up
        copies (SNAPSHOT_BEGIN enqueued now, under the caller's table locks, so it precedes every later write),
        send a BARRIER for slots this server newly leads (I4), and release writes whose copies the map took
        out of the in-sync set."""
        leads = m.leads(me) if me >= 0 else np.zeros(self.num_slots, bool)
        starts: list[tuple[Stream, Session]] = []
        with self.cond:
            self.epoch = m.epoch
            self.table_epochs = {name: spec.created_epoch for name, spec in m.tables.items()}
            seen = set()
            for t, server in enumerate(m.servers):
                if t == me or me < 0:
                    continue
                state = m.copy_state(t)
                held = leads & (state >= 0)
                if not held.any():
                    continue
                key = f"{server.id}@{server.address}"
                seen.add(key)
                s = self.streams.get(key)
                in_sync = leads & (state == IN_SYNC)
                catching = leads & (state == CATCHING_UP)
                pending = np.zeros(self.num_slots, bool)  # copies switched or reported, awaiting the map
                if s is not None:
                    for sess in s.sessions:
                        if sess.state in (SWITCHED, REPORTED):
                            pending[sess.slots] = True
                    pending &= catching
                    if (s.broken_since is not None or s.reported) and not (in_sync | pending).any():
                        # nothing acknowledged can depend on it any more: restart it from a clean slate
                        self._close(key)
                        s = None
                        pending[:] = False
                if s is None:
                    s = self.streams[key] = Stream(self, server.id, server.address, self.num_slots)
                    self.spawn(f"tigana-repl-{server.id[:8]}", s.run)
                was_in_sync = s.in_sync & s.held
                s.held, s.in_sync = held, in_sync
                s.required = in_sync | pending
                s.excluded &= held  # a copy no longer held is no longer refused
                # Sessions: keep the live ones, cut to their slots still catching up (a copy the map removed is
                # no reason to copy the others again: a new SNAPSHOT_BEGIN would empty copies that a report of
                # this session may already have put in the in-sync set of a newer map); start new copies.
                for x in s.sessions:
                    if x.state != FAILED and not catching[x.slots].all():
                        x.slots = x.slots[catching[x.slots]]
                s.sessions = [x for x in s.sessions if x.state != FAILED and x.slots.size]
                covered = np.zeros(self.num_slots, bool)
                for x in s.sessions:
                    covered[x.slots] = True
                new_copy = catching & ~covered
                if new_copy.any():
                    slots = np.flatnonzero(new_copy).astype(np.int32)
                    s.excluded[slots] = False  # SNAPSHOT_BEGIN starts the target's copy again from ours
                    sess = Session(slots, list(tables), epoch=m.epoch, started=self.clock())
                    for name in tables:
                        s.push(Item(SNAPSHOT_BEGIN, name, slots, prev=positions(name, slots),
                                    dedup=dedup_records(name, slots)))
                    s.sessions.append(sess)
                    starts.append((s, sess))
                # I4: in-sync copies of slots this server newly leads get a barrier before anything else.
                barrier = in_sync & ~was_in_sync & ~s.excluded
                if barrier.any():
                    slots = np.flatnonzero(barrier).astype(np.int32)
                    for name in tables:
                        s.push(Item(BARRIER, name, slots, prev=positions(name, slots)))
            for key in [k for k in self.streams if k not in seen]:
                self._close(key)
            self.cond.notify_all()
        for s, sess in starts:
            log.info("slot copy from %s to %s at epoch %d started (slots %s)", self.server_id, s.target_id, m.epoch,
                     slots_text(sess.slots), extra=event("slot_copy_started", slots=sess.slots, epoch=m.epoch,
                                                         server=s.target_id, source=self.server_id))
            self.spawn("tigana-slot-copy", lambda s=s, sess=sess: self._copy(s, sess))

    def _close(self, key: str) -> None:
        s = self.streams.pop(key)
        s.closed = True
        self.spawn("tigana-repl-close", s.channel.close)

    def _copy(self, s: Stream, sess: Session) -> None:
        """A slot copy's rows (by the server's ``copy_rows``), then SNAPSHOT_END."""
        try:
            self.copy_rows(s, sess)
        except Exception:  # noqa: BLE001 - retried: the server's upkeep restarts failed copies
            if self._closed or s.closed:
                return  # the server is stopping (its tables are closing): nothing to retry, nothing to report
            log.exception("slot copy from %s to %s at epoch %d failed (slots %s); it will be started again",
                          self.server_id, s.target_id, self.epoch, slots_text(sess.slots),
                          extra=event("slot_copy_failed", slots=sess.slots, epoch=self.epoch, server=s.target_id,
                                      source=self.server_id))
            with self.cond:
                sess.state = FAILED
            return
        with self.cond:
            if s.closed or sess not in s.sessions or sess.state != COPYING:
                return
            for name in sess.tables:
                sess.end_seq = s.push(Item(SNAPSHOT_END, name, sess.slots))
            sess.state = ROWS_SENT
            self.cond.notify_all()
        log.info("slot copy from %s to %s at epoch %d: %d slot(s) (slots %s), %d rows sent", self.server_id,
                 s.target_id, self.epoch, sess.slots.size, slots_text(sess.slots), sess.rows_sent,
                 extra=event("slot_copy_sent", slots=sess.slots, epoch=self.epoch, server=s.target_id,
                             source=self.server_id, rows=sess.rows_sent))
        # A copy of slots with no rows and no tables sends nothing: nothing will be acknowledged to move it on.
        self.progress(s)

    def session_active(self, s: Stream, sess: Session) -> bool:
        with self.cond:
            return not s.closed and sess in s.sessions and sess.state == COPYING

    def enqueue_rows(self, s: Stream, sess: Session, item: Item) -> bool:
        """A SNAPSHOT_ROWS item of ``sess`` (the caller holds the table's write lock). False: session over."""
        with self.cond:
            if s.closed or sess not in s.sessions or sess.state != COPYING:
                return False
            keep = s.sendable()[item.slots]
            if not keep.all():
                return False  # a slot of it was refused meanwhile: the copy starts again
            s.push(item)
            sess.rows_sent += 0 if item.rows is None else len(item.rows)
            self.cond.notify_all()
            return True

    def wait_for_room(self, s: Stream, timeout_s: float = 30.0) -> None:
        """Block while ``s`` holds more than ``copy_window_bytes`` unacknowledged: a slot copy's rows share the
        stream with the writes of in-sync copies, and a sync push waits for its item, so the copy keeps only a
        small window ahead of them (head-of-line delay stays a few MiB, not the whole copy)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not s.closed and s.queued_bytes > self.copy_window_bytes and time.monotonic() < deadline:
                self.cond.wait(0.05)

    def room(self, slots: np.ndarray | None, timeout_s: float) -> Stream | None:
        """Wait (up to ``timeout_s``) until every stream that a write of ``slots`` (None: any) goes to holds at
        most ``max_queue_bytes`` unacknowledged; the stream still over it, or None. Called before a write takes
        its table's lock: the queue is bounded by back-pressure on the writers, never by dropping items."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                full = [s for s in self.streams.values() if s.queued_bytes > self.max_queue_bytes
                        and (slots is None or s.sendable()[slots].any())]
                left = deadline - time.monotonic()
                if not full or left <= 0:
                    return full[0] if full else None
                self.cond.wait(min(left, 0.1))

    def progress(self, s: Stream) -> None:
        """After an acknowledgement (or a copy's last rows queued): move slot copies forward (I5)."""
        report = []
        with self.cond:
            if s.reported or s.closed:
                return
            now = self.clock()
            for sess in s.sessions:
                if sess.state == ROWS_SENT and s.acked >= sess.end_seq and sess.rows_acked_at is None:
                    sess.rows_acked_at = now
                # Switch once the rows are applied and the stream is nearly drained, or after a second at
                # most: writes faster than the target applies them would otherwise keep the copy catching up
                # for ever. Once switched, sync writes wait for the target, which slows them to its pace.
                if sess.state == ROWS_SENT and sess.rows_acked_at is not None and \
                        (s.lag <= 8 or now - sess.rows_acked_at >= self.switch_after_s):
                    # From here on sync writes to these slots wait for the target; everything enqueued
                    # before this point must be applied by it before it may join the in-sync set.
                    s.required[sess.slots] = True
                    sess.switch_seq = s.next_seq - 1
                    sess.state = SWITCHED
                if sess.state == SWITCHED and s.acked >= sess.switch_seq:
                    sess.state = REPORTED
                    report.append(sess)
        for sess in report:
            self._report_caught_up(s, sess)

    def _report_caught_up(self, s: Stream, sess: Session) -> None:
        if self.caught_up(s.target_id, sess.slots, sess.epoch) is False:
            log.info("slot copy from %s to %s (slots %s) refused as stale by the scheduler; starting it again",
                     self.server_id, s.target_id, slots_text(sess.slots))
            with self.cond:
                sess.state = FAILED
                s.required[sess.slots] = s.in_sync[sess.slots]

    def retry_reports(self) -> None:
        """Report again what the scheduler may have missed (it was down, or a call failed): copies caught
        up but still catching up in the map, broken streams, refused in-sync copies."""
        caught, failed = [], []
        with self.cond:
            for s in self.streams.values():
                if s.reported and s.broken_since is not None:
                    failed.append((s.target_id, np.flatnonzero(s.held).astype(np.int32), s.last_error))
                    continue
                refused = s.excluded & s.in_sync
                if refused.any():
                    failed.append((s.target_id, np.flatnonzero(refused).astype(np.int32), s.last_error))
                caught += [(s, sess) for sess in s.sessions if sess.state == REPORTED]
        for target, slots, reason in failed:
            self.report_failure(target, slots, reason)
        for s, sess in caught:
            self._report_caught_up(s, sess)

    def needs_restart(self) -> bool:
        """Whether a broken stream could restart (nothing acknowledged depends on it) or a slot copy must
        start again: the server then re-applies its map (``on_map``) under its table locks."""
        with self.cond:
            for s in self.streams.values():
                if (s.broken_since is not None or s.reported) and not (s.in_sync | s.reported_mask()).any():
                    return True
                if any(x.state == FAILED for x in s.sessions):
                    return True
        return False

    # --- writes ------------------------------------------------------------------------------------------
    def enqueue(self, item: Item) -> list[Mark]:
        """Send a write to every stream holding its slots (each gets only its slots' rows); returns the
        marks a sync write must wait for: the streams that must acknowledge it (I1)."""
        marks = []
        with self.cond:
            for s in self.streams.values():
                if not s.held[item.slots].any():
                    continue
                send = s.sendable()
                keep = send[item.slots]
                seq = 0
                if keep.any():
                    seq = s.push(item if keep.all() else restrict(item, send, self.slot_of))
                marks += s.marks_for(item.slots, seq)
            self.cond.notify_all()
        return marks

    def tail_marks(self, slots: np.ndarray) -> list[Mark]:
        """Marks at the current end of every stream that must acknowledge ``slots``: what a duplicate push
        waits for (its original may still be in flight, and a new primary's barrier comes first: I4), and what
        a primary handing its role over waits for before it reports (every write it made is on the copies)."""
        with self.cond:
            return [mk for s in self.streams.values() for mk in s.marks_for(slots, s.next_seq - 1)]

    def wait(self, marks: list[Mark], timeout_s: float) -> bool:
        """Wait until every mark is acknowledged, or its stream no longer needs to acknowledge its slots (the
        map took the copy out of the in-sync set: I1). False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                pending = [m for m in marks if not self._done(m)]
                if not pending:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self.cond.wait(min(left, 0.5))

    def _done(self, m: Mark) -> bool:
        s = m.stream
        if s.acked >= m.seq:
            return True
        live = self.streams.get(f"{s.target_id}@{s.address}")
        # a stream replaced or closed only when nothing acknowledged depends on it (on_map)
        return live is not s or not s.required[m.slots].any()

    # --- figures -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Lag of the outgoing streams: items and bytes queued, seconds since the oldest unacknowledged item
        was acknowledged... (max over streams), copies in progress."""
        now = self.clock()
        with self.cond:
            lag_items = max((s.lag for s in self.streams.values()), default=0)
            lag_bytes = max((s.queued_bytes for s in self.streams.values()), default=0)
            lag_s = max(((now - s.acked_time) if s.lag else 0.0 for s in self.streams.values()), default=0.0)
            copying = sum(len(s.sessions) for s in self.streams.values())
            live = [x for s in self.streams.values() for x in s.sessions if x.state in (COPYING, ROWS_SENT)]
            sent, total = sum(x.rows_sent for x in live), sum(x.rows_total for x in live)
            broken = sum(1 for s in self.streams.values() if s.broken_since is not None)
            refused = sum(int(s.excluded.sum()) for s in self.streams.values())
            return {"replication_lag_items": float(lag_items), "replication_lag_bytes": float(lag_bytes),
                    "replication_lag_s": float(lag_s), "replication_streams": float(len(self.streams)),
                    "slot_copies_in_progress": float(copying), "replication_streams_broken": float(broken),
                    "slot_copy_rows_sent": float(sent), "slot_copy_rows_total": float(total),
                    "replication_copies_refused": float(refused)}

    def close(self) -> None:
        with self.cond:
            self._closed = True
            keys = list(self.streams)
            self.cond.notify_all()
        for key in keys:
            with self.cond:
                s = self.streams.pop(key, None)
            if s is not None:
                s.close()



def _thread(name: str, fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name=name, daemon=True).start()
