"""The primary side of replication on one server, as a sans-IO core: events in, actions out.

``Primary`` holds a ``Stream`` per target server and the slot copies on them (``copy``). It has no lock,
thread, socket or clock: every event comes with the time it happened (``now``), and what must be done outside
it comes back as actions (``actions``): open or close a stream's transport, start a slot copy's export, report
to the scheduler, learn a newer map, pause a sender. The adapter (``tigana.ps.replication.replicator``) holds
one lock around every call and carries the actions out after releasing it; a simulator drives the same core
on its own clock.

The events:
- ``on_map``: a map installed (open/close streams, start slot copies, barriers for newly led slots, I4);
- ``enqueue``: a write applied (queued to every stream holding its slots; the marks a sync write waits for);
- ``enqueue_rows`` / ``rows_copied`` / ``copy_failed``: a slot copy's rows exported, or its export failed;
- ``answered`` / ``send_failed``: a target's answer to a batch, or a failed send (timer: the failure timeout);
- ``copy_answered`` / ``copy_send_failed``: the same on a stream's copy lane (a slot copy's rows, ``stream``);
- ``report_refused``: the scheduler refused a caught-up report as stale;
- ``retry``: the upkeep timer (what the scheduler may have missed is reported again).

The invariants are in docs/replication.md; the ones kept here: I1 (a sync write waits for every copy the map
has in sync, and only the scheduler takes a copy out), I4 (a new primary's barrier first), I5 (a copy joins
the in-sync set only once it has applied everything queued before its switch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from tigana.embeddings.masks import all_set, any_set
from tigana.proto import shard_pb2 as pb
from tigana.ps.logs import event, slots_text
from tigana.ps.replication.actions import (
    Action,
    CloseStream,
    OpenStream,
    Pause,
    RefreshMap,
    ReportCaughtUp,
    ReportFailure,
    StartCopy,
)
from tigana.ps.replication.copy import (
    COPYING,
    FAILED,
    REPORTED,
    ROWS_SENT,
    SWITCHED,
    Session,
    advance,
    cut_to_catching,
    pending_mask,
)
from tigana.ps.replication.stream import Mark, Stream, restrict, stream_key
from tigana.ps.routing import CATCHING_UP, IN_SYNC, ShardMap, slot_of
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire.cluster import BARRIER, SNAPSHOT_BEGIN, SNAPSHOT_END, Item

log = logging.getLogger("tigana.ps.replication")
COPY_BATCH_BYTES = 4 << 20  # a copy-lane batch: the target applies it under its tables' locks, a few ms at most


class Primary:
    """The primary side of replication on one server (not thread-safe: the adapter serializes every call).

    ``generation``: the first stream generation (a new stream takes the next; a restarted process must start
    above every generation its previous boot used, so the adapter seeds it from the wall clock)."""

    def __init__(self, server_id: str, boot: str, num_slots: int, *, generation: int, batch_bytes: int,
                 failure_timeout_s: float = 2.0, max_queue_bytes: int = 512 << 20,
                 copy_window_bytes: int = 16 << 20, switch_after_s: float = 1.0) -> None:
        self.server_id, self.boot, self.num_slots = server_id, boot, num_slots
        self.batch_bytes = batch_bytes
        self.failure_timeout_s = failure_timeout_s
        self.max_queue_bytes, self.copy_window_bytes = max_queue_bytes, copy_window_bytes
        self.switch_after_s = switch_after_s  # a slot copy's rows applied this long ago: it switches whatever the lag
        self.streams: dict[str, Stream] = {}
        self.table_epochs: dict[str, int] = {}  # table -> created_epoch of the incarnation served
        self.epoch = 0
        self.closed = False
        self._generation = generation

    def slot_of(self, ids: np.ndarray) -> np.ndarray:
        return slot_of(ids, self.num_slots)

    def _push(self, s: Stream, item: Item) -> int:
        # A write carries the incarnation of the table it was applied to (set by the writer); items this core
        # makes itself (slot copy steps, barriers) take the one of the map being installed.
        return s.push(item, item.table_epoch or self.table_epochs.get(item.table, 0))

    # --- event: a map installed (the server holds every table's write lock) -------------------------------
    def on_map(self, m: ShardMap, me: int, tables: list[str], positions: Callable[[str, np.ndarray], np.ndarray],
               dedup_records: Callable[[str, np.ndarray], list], now: float) -> list[Action]:
        """Bring the streams in line with map ``m``: open/close streams, start slot copies for new catching-up
        copies (SNAPSHOT_BEGIN queued now, so it precedes every later write), queue a BARRIER for slots this
        server newly leads (I4), release writes whose copies the map took out of the in-sync set.
        ``positions`` and ``dedup_records`` read the tables' log positions and exactly-once keys."""
        leads = m.leads(me) if me >= 0 else np.zeros(self.num_slots, bool)
        degraded = m.in_sync_count() < 1 + m.replicas  # a copy of these restores a missing replica: unpaced
        actions: list[Action] = []
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
            key = stream_key(server.id, server.address, server.boot)
            seen.add(key)
            s = self.streams.get(key)
            in_sync = leads & (state == IN_SYNC)
            catching = leads & (state == CATCHING_UP)
            pending = np.zeros(self.num_slots, bool)  # copies switched or reported, awaiting the map
            if s is not None:
                pending = pending_mask(s, catching)
                if (s.broken_since is not None or s.reported) and not (in_sync | pending).any():
                    # nothing acknowledged can depend on it any more: restart it from a clean slate
                    actions.append(self._close(key))
                    s = None
                    pending[:] = False
            if s is None:
                self._generation += 1
                s = self.streams[key] = Stream(server.id, server.address, self.num_slots, self._generation, now,
                                               server.boot)
                actions.append(OpenStream(s))
            was_in_sync = s.in_sync & s.held
            s.held, s.in_sync = held, in_sync
            s.required = in_sync | pending
            s.readmit(np.flatnonzero(~held))  # a copy no longer held is no longer refused
            emptied = _emptied(s, in_sync)
            if emptied.size:
                # A slot copy still sending rows over copies this map has in sync (an earlier copy's report went
                # in while this one restarted): its SNAPSHOT_BEGIN emptied them on the target, which may now lack
                # rows. They are refused and reported, and the scheduler has them built again (I1).
                actions += self._refuse(s, emptied, "a slot copy was started again over copies this map has in "
                                                    "sync: they may lack rows")
            new_copy = cut_to_catching(s, catching)
            if new_copy.any():
                slots = np.flatnonzero(new_copy).astype(np.int32)
                s.readmit(slots)  # SNAPSHOT_BEGIN starts the target's copy again from ours
                sess = Session(slots, list(tables), epoch=m.epoch, started=now, copy_id=s.next_seq,
                               paced=not degraded[slots].any())
                for name in tables:
                    self._push(s, Item(SNAPSHOT_BEGIN, name, slots, prev=positions(name, slots),
                                       dedup=dedup_records(name, slots), copy_id=sess.copy_id))
                s.sessions.append(sess)
                actions.append(StartCopy(s, sess))
                log.info("slot copy from %s to %s at epoch %d started (%s; slots %s)", self.server_id, s.target_id,
                         m.epoch, "a move, paced" if sess.paced else "restoring a replica, unpaced",
                         slots_text(slots), extra=event("slot_copy_started", slots=slots, epoch=m.epoch,
                                                                 server=s.target_id, source=self.server_id))
            # I4: in-sync copies of slots this server newly leads get a barrier before anything else.
            barrier = in_sync & ~was_in_sync & ~s.excluded
            if barrier.any():
                slots = np.flatnonzero(barrier).astype(np.int32)
                for name in tables:
                    self._push(s, Item(BARRIER, name, slots, prev=positions(name, slots)))
        actions += [self._close(key) for key in [k for k in self.streams if k not in seen]]
        return actions

    def _close(self, key: str) -> CloseStream:
        s = self.streams.pop(key)
        s.closed = True
        return CloseStream(s)

    # --- event: a write applied (under its table's write lock) --------------------------------------------
    def enqueue(self, item: Item) -> list[Mark]:
        """Queue a write to every stream holding its slots (each gets only its slots' rows); the marks a sync
        write must wait for: the streams that must acknowledge it (I1)."""
        marks = []
        for s in self.streams.values():
            if not any_set(s.held[item.slots]):
                continue
            send = s.sendable()
            keep = send[item.slots]
            seq = 0
            if any_set(keep):
                seq = self._push(s, item if all_set(keep) else restrict(item, send, self.slot_of))
            marks += s.marks_for(item.slots, seq)
        return marks

    def tail_marks(self, slots: np.ndarray) -> list[Mark]:
        """Marks at the current end of every stream that must acknowledge ``slots``: what a duplicate push
        waits for (its original may still be in flight, and a new primary's barrier comes first: I4), and what
        a primary handing its role over waits for before it reports (every write it made is on the copies)."""
        return [mk for s in self.streams.values() for mk in s.marks_for(slots, s.next_seq - 1)]

    def mark_done(self, m: Mark) -> bool:
        """Whether a write may stop waiting for ``m``: acknowledged, or its stream no longer needs to
        acknowledge its slots (the map took the copy out of the in-sync set: I1)."""
        s = m.stream
        if s.covers(m):
            return True
        live = self.streams.get(s.key)
        # a stream replaced or closed only when nothing acknowledged depends on it (on_map)
        return live is not s or not any_set(s.required[m.slots])

    def full_stream(self, slots: np.ndarray | None) -> Stream | None:
        """A stream a write of ``slots`` (None: any) goes to that holds more than ``max_queue_bytes``
        unacknowledged (writers wait for room before they take their table's lock), or None."""
        for s in self.streams.values():
            if s.queued_bytes > self.max_queue_bytes and (slots is None or s.sendable()[slots].any()):
                return s
        return None

    # --- events of a slot copy's export -------------------------------------------------------------------
    def session_active(self, s: Stream, sess: Session) -> bool:
        return not s.closed and sess in s.sessions and sess.state == COPYING

    def enqueue_rows(self, s: Stream, sess: Session, item: Item) -> bool:
        """A SNAPSHOT_ROWS item of ``sess`` (exported under the table's write lock), queued on the copy lane
        after every change-lane item queued so far (``after``). False: the session is over."""
        if not self.session_active(s, sess):
            return False  # over (a slot of it refused meanwhile fails it: the copy starts again)
        keep = np.zeros(self.num_slots, bool)
        keep[sess.slots] = True
        keep &= s.sendable()
        if not keep[item.slots].all():
            # Slots cut from the session meanwhile (the map no longer has them catching up on the target): their
            # rows are left out and the copy goes on. Stopping the export here instead, as it did, let the session
            # end with the rows of its later chunks never sent: an in-sync copy without them.
            item = restrict(item, keep, self.slot_of)
            if not item.slots.size:
                return True
        item.copy_id, item.after = sess.copy_id, s.next_seq - 1
        s.push(item, item.table_epoch or self.table_epochs.get(item.table, 0), lane=1)
        sess.rows_sent += 0 if item.rows is None else len(item.rows)
        return True

    def rows_copied(self, s: Stream, sess: Session, now: float) -> list[Action]:
        """Every row of ``sess`` queued: SNAPSHOT_END. A copy of slots with no rows and no tables sends
        nothing, so nothing would be acknowledged to move it on: it advances here too."""
        if not self.session_active(s, sess):
            return []
        for name in sess.tables:
            sess.end_seq = s.push(Item(SNAPSHOT_END, name, sess.slots, copy_id=sess.copy_id),
                                  self.table_epochs.get(name, 0), lane=1)
        sess.state = ROWS_SENT
        log.info("slot copy from %s to %s at epoch %d: %d slot(s) (slots %s), %d rows sent", self.server_id,
                 s.target_id, self.epoch, sess.slots.size, slots_text(sess.slots), sess.rows_sent,
                 extra=event("slot_copy_sent", slots=sess.slots, epoch=self.epoch, server=s.target_id,
                             source=self.server_id, rows=sess.rows_sent))
        return self._advance(s, now)

    def copy_failed(self, s: Stream, sess: Session) -> None:
        """The export failed: the server's upkeep starts the copy again (``needs_restart``)."""
        if not (self.closed or s.closed):
            log.warning("slot copy from %s to %s at epoch %d failed (slots %s); it will be started again",
                        self.server_id, s.target_id, self.epoch, slots_text(sess.slots),
                        extra=event("slot_copy_failed", slots=sess.slots, epoch=self.epoch, server=s.target_id,
                                    source=self.server_id))
        sess.fail()

    def _advance(self, s: Stream, now: float) -> list[Action]:
        if s.reported or s.closed:
            return []
        return [ReportCaughtUp(s, sess) for sess in advance(s, now, self.switch_after_s)]

    def report_refused(self, s: Stream, sess: Session) -> None:
        """The scheduler refused ``sess``'s caught-up report as stale (the copy was removed or demoted after
        the session started): it starts again."""
        log.info("slot copy from %s to %s (slots %s) refused as stale by the scheduler; starting it again",
                 self.server_id, s.target_id, slots_text(sess.slots))
        sess.fail()
        s.required[sess.slots] = s.in_sync[sess.slots]

    # --- events of the transport --------------------------------------------------------------------------
    def request(self, s: Stream, lane: int = 0) -> bytes | None:
        """The next batch for ``s`` on ``lane`` (0: changes, 1: copied rows; None: nothing queued, or closed)."""
        return s.request(self.server_id, self.boot, self.epoch,
                         min(self.batch_bytes, COPY_BATCH_BYTES) if lane else self.batch_bytes, lane)

    def newer_map(self, reply: pb.ReplicateResponse) -> list[Action]:
        """The first step of an answer: a refusal from a target with a newer map means ours may be the stale
        one. The adapter learns it before it hands the answer to ``answered``, so that an acknowledgement
        never counts for a copy the newer map moved (the push's own check)."""
        if reply.reject != pb.REJECT_NONE and reply.epoch > self.epoch:
            return [RefreshMap(int(reply.epoch))]
        return []

    def answered(self, s: Stream, reply: pb.ReplicateResponse, now: float) -> list[Action]:
        """A target's answer to a batch: acknowledgements, then a refusal's consequences."""
        reject = reply.reject
        s.acknowledge(int(reply.applied_through), now)
        if reject == pb.REJECT_NONE:
            return self._advance(s, now)
        slots = cluster_wire.array(reply.slots, "<i4", field="ReplicateResponse.slots").astype(np.int64)
        reason = f"{pb.ReplicateReject.Name(reject)}: {reply.message}"
        s.last_error = reason
        if reject == pb.REJECT_BEHIND:
            # the target cannot get our map yet: reported only past the failure timeout
            return [*self.send_failed(s, reason, now), Pause(0.05)]
        if reject in (pb.REJECT_STALE, pb.REJECT_DIVERGED) and slots.size:
            # A refusal names its slots: only those stop, and only those this server still leads with an
            # in-sync copy on the target are reported (a map change with items in flight demotes nothing).
            return self._refuse(s, slots[(slots >= 0) & (slots < s.held.shape[0])], reason)
        return [*self.send_failed(s, reason, now, report_now=True), Pause(0.2)]

    def copy_answered(self, s: Stream, reply: pb.ReplicateResponse, now: float) -> list[Action]:
        """A target's answer on ``s``'s copy lane. Waiting for the change lane (WAIT) or a newer map (BEHIND) is
        a pause, not a failure; a refusal of slots stops them as on the change lane; a gap (the target restarted)
        is the stream's failure."""
        reject = reply.reject
        s.acknowledge_copy(int(reply.applied_through))
        s.copy_broken_since = None  # any answer: the lane's transport works (``copy_send_failed`` counts none)
        if reject == pb.REJECT_NONE:
            return self._advance(s, now)
        reason = f"copy lane: {pb.ReplicateReject.Name(reject)}: {reply.message}"
        if reject == pb.REJECT_WAIT:
            return [Pause(0.01)]
        if reject == pb.REJECT_BEHIND:
            return [Pause(0.05)]
        slots = cluster_wire.array(reply.slots, "<i4", field="ReplicateResponse.slots").astype(np.int64)
        if reject in (pb.REJECT_STALE, pb.REJECT_DIVERGED) and slots.size:
            return self._refuse(s, slots[(slots >= 0) & (slots < s.held.shape[0])], reason)
        return [*self.send_failed(s, reason, now, report_now=True), Pause(0.2)]

    def copy_send_failed(self, s: Stream, reason: str, now: float) -> list[Action]:
        """A failed send on the copy lane: retried; past ``failure_timeout_s`` of failures the slot copies still
        sending rows fail (the upkeep starts them again). Never a report: the change lane, or the scheduler's
        heartbeats, tell a dead target, and a copy not yet switched holds nothing a write waits for."""
        s.last_error = f"copy lane: {reason}"
        if s.copy_broken_since is None:
            s.copy_broken_since = now
        if now - s.copy_broken_since >= self.failure_timeout_s:
            s.copy_broken_since = None
            for sess in s.sessions:
                if sess.state in (COPYING, ROWS_SENT):
                    self.copy_failed(s, sess)
        return []

    def _refuse(self, s: Stream, slots: np.ndarray, reason: str) -> list[Action]:
        """Stop replicating ``slots`` to ``s``'s target for ``reason``; those of them the map has in sync on it
        are reported to the scheduler, which builds them again (I1). A slot merely in flight stays quiet."""
        s.last_error = reason
        s.exclude(slots, self.slot_of)
        report = slots[s.in_sync[slots]]
        if not report.size:
            return []
        log.warning("replication from %s to %s refused at epoch %d (slots %s): %s; reporting them", self.server_id,
                    s.target_id, self.epoch, slots_text(report), reason,
                    extra=event("replication_failing", slots=report, epoch=self.epoch, server=s.target_id,
                                source=self.server_id, reason=reason))
        return [ReportFailure(s.target_id, report.astype(np.int32), reason, self.epoch)]

    def send_failed(self, s: Stream, reason: str, now: float, *, report_now: bool = False) -> list[Action]:
        """A failed send; after ``failure_timeout_s`` (or at once for a rejection) the target's copies are
        reported to the scheduler, which takes them out of the in-sync set (I1: only the scheduler may)."""
        s.last_error = reason
        if s.broken_since is None:
            s.broken_since = now
        due = report_now or now - s.broken_since >= self.failure_timeout_s
        if not due or s.reported or s.closed:
            return []
        s.reported = True
        # Copies switched to required but not yet reported caught up are not in the map's in-sync set: this
        # server alone required them, so it may stop (they restart from a new slot copy).
        for sess in s.sessions:
            if sess.state in (COPYING, ROWS_SENT, SWITCHED):
                sess.fail()
        s.required = s.in_sync | s.reported_mask()
        report = np.flatnonzero(s.held).astype(np.int32)
        log.warning("replication from %s to %s (%s) failing at epoch %d: %s; reporting %d slot(s) to the scheduler "
                    "(slots %s)", self.server_id, s.target_id, s.address, self.epoch, reason, report.size,
                    slots_text(report), extra=event("replication_failing", slots=report, epoch=self.epoch,
                                                    server=s.target_id, source=self.server_id, reason=reason))
        return [ReportFailure(s.target_id, report, reason, self.epoch)]

    # --- event: the upkeep timer --------------------------------------------------------------------------
    def retry(self) -> list[Action]:
        """Report again what the scheduler may have missed (it was down, or a call failed): copies caught up
        but still catching up in the map, broken streams, refused in-sync copies."""
        actions: list[Action] = []
        for s in self.streams.values():
            if s.reported and s.broken_since is not None:
                actions.append(ReportFailure(s.target_id, np.flatnonzero(s.held).astype(np.int32), s.last_error,
                                             self.epoch))
                continue
            refused = s.excluded & s.in_sync
            if refused.any():
                actions.append(ReportFailure(s.target_id, np.flatnonzero(refused).astype(np.int32), s.last_error,
                                             self.epoch))
            actions += [ReportCaughtUp(s, sess) for sess in s.sessions if sess.state == REPORTED]
        return actions

    def needs_restart(self) -> bool:
        """Whether a broken stream could restart (nothing acknowledged depends on it) or a slot copy must
        start again: the server then installs its map again (``on_map``) under its table locks."""
        for s in self.streams.values():
            if (s.broken_since is not None or s.reported) and not (s.in_sync | s.reported_mask()).any():
                return True
            if any(x.state == FAILED for x in s.sessions):
                return True
        return False

    def close(self) -> list[Action]:
        self.closed = True
        return [self._close(key) for key in list(self.streams)]

    # --- figures -----------------------------------------------------------------------------------------
    def stats(self, now: float) -> dict[str, float]:
        """Lag of the outgoing streams (max over streams), copies in progress."""
        streams = list(self.streams.values())
        live = [x for s in streams for x in s.sessions if x.state in (COPYING, ROWS_SENT)]
        return {"replication_lag_items": float(max((s.lag for s in streams), default=0)),
                "replication_lag_bytes": float(max((s.queued_bytes for s in streams), default=0)),
                "replication_lag_s": float(max(((now - s.acked_time) if s.lag else 0.0 for s in streams),
                                               default=0.0)),
                "slot_copy_queued_bytes": float(sum(s.copy_bytes for s in streams)),
                "replication_streams": float(len(streams)),
                "slot_copies_in_progress": float(sum(len(s.sessions) for s in streams)),
                "replication_streams_broken": float(sum(1 for s in streams if s.broken_since is not None)),
                "slot_copy_rows_sent": float(sum(x.rows_sent for x in live)),
                "slot_copy_rows_total": float(sum(x.rows_total for x in live)),
                "replication_copies_refused": float(sum(int(s.excluded.sum()) for s in streams))}


def _emptied(s: Stream, in_sync: np.ndarray) -> np.ndarray:
    """Slots of ``s``'s slot copies still sending rows (their SNAPSHOT_BEGIN emptied the target's copy) that the
    map has in sync."""
    out = np.zeros(in_sync.shape[0], bool)
    for sess in s.sessions:
        if sess.state in (COPYING, ROWS_SENT):
            out[sess.slots[in_sync[sess.slots]]] = True
    return np.flatnonzero(out)
