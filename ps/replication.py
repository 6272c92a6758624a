"""Replication: a primary streams every state change of its slots, in order, to the other copies.

One ordered stream runs from a primary to each server holding copies of slots it leads. Items (see
``ReplicationItem`` in proto/shard.proto) carry rows and optimizer state as written, removals, admission
sightings and the exactly-once keys, never gradients; the target applies them in stream order. The slot copy
is the same stream: ``SNAPSHOT_BEGIN`` (the slots' starting log positions and exactly-once keys), then
``SNAPSHOT_ROWS`` chunks, each exported under the table's write lock and so ordered with the writes around
it, then ``SNAPSHOT_END``. Replica creation after a failure and slot moves both use it.

Log positions. Per table and slot every server keeps the position (epoch, index) of the last write it holds.
A primary stamps each write with (its map epoch, next index) and sends, per slot, the position the target
must be at (``prev``). A target applies an item only when its positions equal ``prev`` for every slot, so a
gap or a divergence (a write the new primary never had) is detected, never silently applied or lost.

The invariants that make "no acknowledged update is lost" true (each checked where stated):

I1  A copy leaves the in-sync set only through the scheduler, by a persisted map change. Until its map says
    so, a primary does not acknowledge a sync push before every in-sync copy of the push's slots has
    applied it (``Replicator.marks``/``wait``; a broken stream keeps its waiters waiting and is reported).
I2  Only an in-sync copy is promoted (``placement.repair``): it has applied every acknowledged push.
I3  A target applies an item only if, in its own map, the source leads the item's slots and its positions
    equal the item's ``prev`` (``apply_item``). A deposed primary therefore gets no acknowledgement from the
    copy that replaced it, and cannot acknowledge a sync write (it needs that copy's ack by I1).
I4  A new primary sends a ``BARRIER`` to every in-sync copy before anything else; a push (or a duplicate of
    one) is acknowledged only after the stream tail at that moment is applied, so a copy that missed a write
    the new primary holds is found (DIVERGED) and demoted before anything is acknowledged on its behalf.
I5  A catching-up copy joins the in-sync set only after it applied every item enqueued before the primary
    started requiring its acks (``switch``), so every write acknowledged without it is on it too.

Thread-safety: ``Replicator`` state is guarded by one lock; items are enqueued under the table's write lock
(so stream order is write order); sends and waits happen outside both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.ps import cluster_wire
from tigana.ps.channels import channel_options
from tigana.ps.cluster_wire import BARRIER, CHANGES, SNAPSHOT_BEGIN, SNAPSHOT_END, SNAPSHOT_ROWS, Item
from tigana.ps.logs import event, slots_text
from tigana.ps.routing import CATCHING_UP, IN_SYNC, ShardMap

log = logging.getLogger("tigana.ps.replication")

NO_POSITION = np.iinfo(np.uint64).max  # a slot this server holds no copy of: matches no prev


class SlotLog:
    """Log positions of one table on one server: (num_slots, 2) uint64 (epoch, index) and the index counter.
    Not thread-safe: used under the table's write lock."""

    def __init__(self, num_slots: int) -> None:
        self.positions = np.zeros((num_slots, 2), np.uint64)
        self.counter = 0

    def stamp(self, slots: np.ndarray, epoch: int) -> tuple[tuple[int, int], np.ndarray]:
        """A primary's write touching ``slots``: its position and the slots' previous positions."""
        self.counter += 1
        prev = self.positions[slots].copy()
        self.positions[slots, 0] = epoch
        self.positions[slots, 1] = self.counter
        return (epoch, self.counter), prev

    def advance(self, slots: np.ndarray, lsn: tuple[int, int]) -> None:
        """A target applied a write at ``lsn`` touching ``slots``."""
        self.positions[slots, 0] = lsn[0]
        self.positions[slots, 1] = lsn[1]
        self.counter = max(self.counter, int(lsn[1]))

    def matches(self, slots: np.ndarray, prev: np.ndarray) -> np.ndarray:
        """(k,) bool: the slots whose position equals ``prev`` ((k, 2))."""
        return (self.positions[slots] == prev).all(axis=1)

    def reset(self, slots: np.ndarray, positions: np.ndarray | None = None) -> None:
        """Slots dropped (no position) or starting a copy at ``positions``."""
        if positions is None:
            self.positions[slots] = NO_POSITION
        else:
            self.positions[slots] = positions
            if positions.size:
                self.counter = max(self.counter, int(positions[:, 1][positions[:, 1] != NO_POSITION].max(
                    initial=0)))

    def to_bytes(self, keep: np.ndarray | None = None) -> bytes:
        """The positions (those outside the bool mask ``keep`` as 0: unknown) and the counter."""
        positions = self.positions if keep is None else np.where(keep[:, None], self.positions, 0)
        return np.concatenate([positions.reshape(-1), np.array([self.counter], np.uint64)]).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, num_slots: int) -> SlotLog:
        a = np.frombuffer(data, np.uint64)
        if a.shape[0] != num_slots * 2 + 1:
            raise ValueError(f"slot log of {(a.shape[0] - 1) // 2} slots, the server has {num_slots}")
        out = cls(num_slots)
        out.positions = a[:-1].reshape(num_slots, 2).copy()
        out.counter = int(a[-1])
        return out


# --- the primary side -------------------------------------------------------------------------------------
_COPYING, _ROWS_SENT, _SWITCHED, _REPORTED, _FAILED = 1, 2, 3, 4, 5


@dataclass(eq=False)
class _Queued:
    seq: int
    item: Item
    nbytes: int


@dataclass(eq=False)  # compared by identity (``sess in stream.sessions``), never by value
class _Session:
    """A slot copy to one target: its slots, progress, and the seqs that mark its steps."""

    slots: np.ndarray
    tables: list[str]
    state: int = _COPYING
    end_seq: int = 0
    switch_seq: int = 0
    rows_sent: int = 0
    rows_total: int = 0
    started: float = field(default_factory=time.monotonic)


class Stream:
    """The ordered stream from this primary to one target server. Fields are guarded by the replicator's lock.

    held: slots this server leads and the target holds a copy of (items for them go to it);
    in_sync: held slots whose copy on the target the map has in the in-sync set;
    required: slots whose items the target must acknowledge before a sync push is (in sync, or switched)."""

    def __init__(self, replicator: Replicator, target_id: str, address: str, num_slots: int) -> None:
        self.r = replicator
        self.target_id, self.address = target_id, address
        self.generation = replicator.next_generation()
        self.held = np.zeros(num_slots, bool)
        self.in_sync = np.zeros(num_slots, bool)
        self.required = np.zeros(num_slots, bool)
        self.queue: deque[_Queued] = deque()
        self.queued_bytes = 0
        self.next_seq = 1
        self.acked = 0
        self.sessions: list[_Session] = []
        self.broken_since: float | None = None
        self.reported = False
        self.closed = False
        self.last_error = ""
        self.acked_time = time.monotonic()
        self.channel = replicator.channel(address, channel_options(replicator.max_message_bytes, 30.0, 10.0, 0.1))
        self.replicate = self.channel.unary_unary(
            "/tigana.v1.Shard/Replicate", request_serializer=_identity,
            response_deserializer=pb.ReplicateResponse.FromString)
        self.thread = threading.Thread(target=self._run, name=f"tigana-repl-{target_id[:8]}", daemon=True)

    # --- queue (under the replicator lock) ---
    def push(self, item: Item) -> int:
        seq = self.next_seq
        self.next_seq += 1
        nbytes = item.nbytes or _item_bytes(item)
        self.queue.append(_Queued(seq, item, nbytes))
        self.queued_bytes += nbytes
        return seq

    @property
    def lag(self) -> int:
        return self.next_seq - 1 - self.acked

    # --- sender thread ---
    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self.r.cond:
                while not self.closed and not self.queue:
                    self.r.cond.wait()
                if self.closed:
                    return
                batch, size = [], 0
                for q in self.queue:
                    if batch and (size + q.nbytes > self.r.batch_bytes or len(batch) >= 256):
                        break
                    batch.append(q)
                    size += q.nbytes
                generation, epoch = self.generation, self.r.epoch
            request = cluster_wire.encode_replicate_request(self.r.server_id, self.r.boot, generation, epoch,
                                                            batch[0].seq, [q.item for q in batch])
            try:
                reply = self.replicate(request, timeout=self.r.send_timeout_s)
            except grpc.RpcError as err:
                self._failed(f"{err.code().name}: {err.details()}")
                time.sleep(backoff)
                backoff = min(1.0, backoff * 2)
                continue
            except ValueError:  # channel closed
                return
            backoff = 0.05
            self._answered(batch, reply)

    def _answered(self, batch: list[_Queued], reply: pb.ReplicateResponse) -> None:
        with self.r.cond:
            if reply.applied_through > self.acked:
                self.acked = int(reply.applied_through)
                self.acked_time = time.monotonic()
                while self.queue and self.queue[0].seq <= self.acked:
                    self.queued_bytes -= self.queue.popleft().nbytes
                self.broken_since = None
                self.r.cond.notify_all()
            reject = reply.reject
        if reject == pb.REJECT_NONE:
            self.r.progress(self)
            return
        slots = cluster_wire.array(reply.slots, "<i4", field="ReplicateResponse.slots")
        reason = f"{pb.ReplicateReject.Name(reject)}: {reply.message}"
        self.last_error = reason
        if reject == pb.REJECT_BEHIND or (reject == pb.REJECT_STALE and reply.epoch > self.r.epoch):
            self.r.refresh_map(reply.epoch)  # our map may be the stale one: learn the newer map first
            time.sleep(0.05)
            return
        self._failed(reason, slots if slots.size else None, report_now=True)
        time.sleep(0.2)

    def _failed(self, reason: str, slots: np.ndarray | None = None, *, report_now: bool = False) -> None:
        """Record a failed send; after ``failure_timeout_s`` (or at once for a rejection) report the target's
        copies to the scheduler, which takes them out of the in-sync set (I1: only the scheduler may)."""
        now = time.monotonic()
        with self.r.cond:
            self.last_error = reason
            if self.broken_since is None:
                self.broken_since = now
            due = report_now or now - self.broken_since >= self.r.failure_timeout_s
            if not due or self.reported or self.closed:
                return
            self.reported = True
            # Copies switched to required but not yet reported caught up are not in the map's in-sync set:
            # this server alone required them, so it may stop (they restart from a new slot copy).
            for sess in self.sessions:
                if sess.state in (_COPYING, _ROWS_SENT, _SWITCHED):
                    sess.state = _FAILED
            self.required = self.in_sync | self._reported_mask()
            self.r.cond.notify_all()
            held = np.flatnonzero(self.held).astype(np.int32)
            epoch = self.r.epoch
        report = held if slots is None else np.union1d(slots, held).astype(np.int32)
        log.warning("replication from %s to %s (%s) failing at epoch %d: %s; reporting %d slot(s) to the scheduler "
                    "(slots %s)", self.r.server_id, self.target_id, self.address, epoch, reason, report.size,
                    slots_text(report), extra=event("replication_failing", slots=report, epoch=epoch,
                                                    server=self.target_id, source=self.r.server_id, reason=reason))
        self.r.report_failure(self.target_id, report, reason)

    def _reported_mask(self) -> np.ndarray:
        m = np.zeros(self.held.shape[0], bool)
        for sess in self.sessions:
            if sess.state == _REPORTED:
                m[sess.slots] = True
        return m

    def close(self) -> None:
        with self.r.cond:
            self.closed = True
            self.r.cond.notify_all()
        self.channel.close()


def _identity(raw: bytes) -> bytes:
    return raw


def _item_bytes(item: Item) -> int:
    n = 64 + item.slots.nbytes * 3 + item.deletes.nbytes
    if item.rows is not None:
        n += sum(getattr(item.rows, f).nbytes for f in ("ids", "weights", "state", "update_count", "last_step",
                                                         "last_time"))
    return n


@dataclass(frozen=True, eq=False)
class Mark:
    """What a write waits for: the target stream, its generation, the seq to be acknowledged, the slots."""

    stream: Stream
    generation: int
    seq: int
    slots: np.ndarray


class Replicator:
    """The primary side of replication on one server: a ``Stream`` per target, slot-copy sessions, and the
    acknowledgements sync pushes wait for.

    ``refresh_map(epoch)``, ``report_failure(target, slots, reason)`` and ``caught_up(target, slots)`` are the
    server's links to the scheduler (called from sender threads, never under the lock)."""

    def __init__(self, server_id: str, boot: str, num_slots: int, *, max_message_bytes: int,
                 refresh_map: Callable[[int], None], report_failure: Callable[[str, np.ndarray, str], None],
                 caught_up: Callable[[str, np.ndarray], None], copy_rows: Callable[[Stream, _Session], None],
                 failure_timeout_s: float = 2.0, send_timeout_s: float = 10.0, batch_bytes: int = 24 << 20,
                 max_queue_bytes: int = 512 << 20, copy_window_bytes: int = 16 << 20,
                 channel: Callable[[str, list], grpc.Channel] | None = None) -> None:
        self.server_id, self.boot, self.num_slots = server_id, boot, num_slots
        self.max_message_bytes = max_message_bytes
        self.refresh_map, self.report_failure, self.caught_up = refresh_map, report_failure, caught_up
        self.copy_rows = copy_rows
        self.failure_timeout_s, self.send_timeout_s = failure_timeout_s, send_timeout_s
        self.batch_bytes = min(batch_bytes, max_message_bytes // 2)
        self.max_queue_bytes = max_queue_bytes
        self.copy_window_bytes = copy_window_bytes
        self.channel = channel or (lambda address, options: grpc.insecure_channel(address, options=options))
        self.cond = threading.Condition()
        self.streams: dict[str, Stream] = {}
        self.epoch = 0
        self._generation = int(time.time() * 1000) << 8
        self._closed = False

    def next_generation(self) -> int:
        self._generation += 1
        return self._generation

    # --- map changes (called by the server's install, holding every table's write lock) -----------------
    def on_map(self, m: ShardMap, me: int, tables: list[str], positions: Callable[[str, np.ndarray], np.ndarray],
               dedup_records: Callable[[str, np.ndarray], list]) -> None:
        """Bring the streams in line with map ``m``: open/close streams, start slot copies for new catching-up
        copies (SNAPSHOT_BEGIN enqueued now, under the caller's table locks, so it precedes every later write),
        send a BARRIER for slots this server newly leads (I4), and release writes whose copies the map took
        out of the in-sync set."""
        leads = m.leads(me)
        starts: list[tuple[Stream, _Session]] = []
        with self.cond:
            self.epoch = m.epoch
            seen = set()
            for t, server in enumerate(m.servers):
                if t == me:
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
                        if sess.state in (_SWITCHED, _REPORTED):
                            pending[sess.slots] = True
                    pending &= catching
                    if (s.broken_since is not None or s.reported) and not (in_sync | pending).any():
                        # nothing acknowledged can depend on it any more: restart it from a clean slate
                        self._close(key)
                        s = None
                        pending[:] = False
                fresh = s is None
                if fresh:
                    s = self.streams[key] = Stream(self, server.id, server.address, self.num_slots)
                    s.thread.start()
                was_in_sync = s.in_sync & s.held
                s.held, s.in_sync = held, in_sync
                s.required = in_sync | pending
                # Sessions: keep the live ones whose slots are all still catching up; start new copies.
                s.sessions = [x for x in s.sessions if x.state != _FAILED and catching[x.slots].all()]
                covered = np.zeros(self.num_slots, bool)
                for x in s.sessions:
                    covered[x.slots] = True
                new_copy = catching & ~covered
                if new_copy.any():
                    slots = np.flatnonzero(new_copy).astype(np.int32)
                    sess = _Session(slots, list(tables))
                    for name in tables:
                        s.push(Item(SNAPSHOT_BEGIN, name, slots, prev=positions(name, slots),
                                    dedup=dedup_records(name, slots)))
                    s.sessions.append(sess)
                    starts.append((s, sess))
                # I4: in-sync copies of slots this server newly leads get a barrier before anything else.
                barrier = in_sync & ~was_in_sync
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
            threading.Thread(target=self._copy, args=(s, sess), name="tigana-slot-copy", daemon=True).start()

    def _close(self, key: str) -> None:
        s = self.streams.pop(key)
        s.closed = True
        threading.Thread(target=s.channel.close, daemon=True).start()

    def _copy(self, s: Stream, sess: _Session) -> None:
        """A slot copy's rows (by the server's ``copy_rows``), then SNAPSHOT_END."""
        try:
            self.copy_rows(s, sess)
        except Exception:  # noqa: BLE001 - retried: the server's upkeep restarts failed copies
            log.exception("slot copy from %s to %s at epoch %d failed (slots %s); it will be started again",
                          self.server_id, s.target_id, self.epoch, slots_text(sess.slots),
                          extra=event("slot_copy_failed", slots=sess.slots, epoch=self.epoch, server=s.target_id,
                                      source=self.server_id))
            with self.cond:
                sess.state = _FAILED
            return
        with self.cond:
            if s.closed or sess not in s.sessions:
                return
            for name in sess.tables:
                sess.end_seq = s.push(Item(SNAPSHOT_END, name, sess.slots))
            sess.state = _ROWS_SENT
            self.cond.notify_all()
        log.info("slot copy from %s to %s at epoch %d: %d slot(s) (slots %s), %d rows sent", self.server_id,
                 s.target_id, self.epoch, sess.slots.size, slots_text(sess.slots), sess.rows_sent,
                 extra=event("slot_copy_sent", slots=sess.slots, epoch=self.epoch, server=s.target_id,
                             source=self.server_id, rows=sess.rows_sent))

    def session_active(self, s: Stream, sess: _Session) -> bool:
        with self.cond:
            return not s.closed and sess in s.sessions

    def enqueue_rows(self, s: Stream, sess: _Session, item: Item) -> bool:
        """A SNAPSHOT_ROWS item of ``sess`` (the caller holds the table's write lock). False: session over."""
        with self.cond:
            if s.closed or sess not in s.sessions:
                return False
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

    def progress(self, s: Stream) -> None:
        """After an acknowledgement: move slot copies forward (I5)."""
        report = []
        with self.cond:
            if s.reported:
                return
            for sess in s.sessions:
                if sess.state == _ROWS_SENT and s.acked >= sess.end_seq and s.lag <= 8:
                    # From here on sync writes to these slots wait for the target; everything enqueued
                    # before this point must be applied by it before it may join the in-sync set.
                    s.required[sess.slots] = True
                    sess.switch_seq = s.next_seq - 1
                    sess.state = _SWITCHED
                if sess.state == _SWITCHED and s.acked >= sess.switch_seq:
                    sess.state = _REPORTED
                    report.append(sess.slots)
        for slots in report:
            self.caught_up(s.target_id, slots)

    def retry_reports(self) -> None:
        """Report again copies that caught up but are still catching up in the map (the scheduler was down)."""
        caught, failed = [], []
        with self.cond:
            for s in self.streams.values():
                if s.reported and s.broken_since is not None:
                    failed.append((s.target_id, np.flatnonzero(s.held).astype(np.int32), s.last_error))
                    continue
                for sess in s.sessions:
                    if sess.state == _REPORTED:
                        caught.append((s.target_id, sess.slots))
        for target, slots, reason in failed:
            self.report_failure(target, slots, reason)
        for target, slots in caught:
            self.caught_up(target, slots)

    def needs_restart(self) -> bool:
        """Whether a broken stream could restart (nothing acknowledged depends on it): the server then
        re-applies its map (``on_map``) under its table locks."""
        with self.cond:
            for s in self.streams.values():
                if (s.broken_since is not None or s.reported) and not (s.in_sync | s._reported_mask()).any():
                    return True
                if any(x.state == _FAILED for x in s.sessions):  # a copy to start again
                    return True
        return False

    # --- writes ------------------------------------------------------------------------------------------
    def targets(self, slots: np.ndarray) -> list[Stream]:
        """Streams holding a copy of any of ``slots`` (callers hold the table's write lock)."""
        with self.cond:
            return [s for s in self.streams.values() if s.held[slots].any()]

    def enqueue(self, item: Item, slot_of_id: Callable[[np.ndarray], np.ndarray]) -> list[Mark]:
        """Send a write to every stream holding its slots (each gets only its slots' rows); returns the
        marks a sync write must wait for: the streams that must acknowledge it (I1)."""
        marks = []
        with self.cond:
            for s in self.streams.values():
                held = s.held[item.slots]
                if not held.any():
                    continue
                sub = item if held.all() else _restrict(item, s.held, slot_of_id)
                seq = s.push(sub)
                req = s.required[sub.slots]
                if req.any():
                    marks.append(Mark(s, s.generation, seq, sub.slots[req]))
            self.cond.notify_all()
        return marks

    def tail_marks(self, slots: np.ndarray) -> list[Mark]:
        """Marks at the current end of every stream that must acknowledge ``slots``: what a duplicate push
        waits for (its original may still be in flight, and a new primary's barrier comes first: I4)."""
        with self.cond:
            return [Mark(s, s.generation, s.next_seq - 1, slots[s.required[slots]])
                    for s in self.streams.values() if s.required[slots].any() and s.next_seq > 1]

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
                if left <= 0:
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
        now = time.monotonic()
        with self.cond:
            lag_items = max((s.lag for s in self.streams.values()), default=0)
            lag_bytes = max((s.queued_bytes for s in self.streams.values()), default=0)
            lag_s = max(((now - s.acked_time) if s.lag else 0.0 for s in self.streams.values()), default=0.0)
            copying = sum(len(s.sessions) for s in self.streams.values())
            live = [x for s in self.streams.values() for x in s.sessions if x.state in (_COPYING, _ROWS_SENT)]
            sent, total = sum(x.rows_sent for x in live), sum(x.rows_total for x in live)
            broken = sum(1 for s in self.streams.values() if s.broken_since is not None)
            return {"replication_lag_items": float(lag_items), "replication_lag_bytes": float(lag_bytes),
                    "replication_lag_s": float(lag_s), "replication_streams": float(len(self.streams)),
                    "slot_copies_in_progress": float(copying), "replication_streams_broken": float(broken),
                    "slot_copy_rows_sent": float(sent), "slot_copy_rows_total": float(total)}

    def close(self) -> None:
        with self.cond:
            keys = list(self.streams)
        for key in keys:
            with self.cond:
                s = self.streams.pop(key, None)
            if s is not None:
                s.close()


def _restrict(item: Item, held: np.ndarray, slot_of_id: Callable[[np.ndarray], np.ndarray]) -> Item:
    """``item`` restricted to the ``held`` slots: its slots, prev, rows, removals, sightings and keys."""
    keep = held[item.slots]
    rows = item.rows
    if rows is not None and len(rows):
        rows = rows.take(held[slot_of_id(rows.ids)])
    deletes = item.deletes[held[slot_of_id(item.deletes)]] if item.deletes.size else item.deletes
    sightings = item.sightings
    if sightings is not None and sightings[0].size:
        m = held[slot_of_id(sightings[0])]
        sightings = (sightings[0][m], sightings[1][m])
    dedup = [(cid, seq, sl[held[sl]]) for cid, seq, sl in item.dedup]
    return Item(item.kind, item.table, item.slots[keep], item.lsn, item.prev[keep] if item.prev.size else item.prev,
                rows, deletes, sightings, item.step, [d for d in dedup if d[2].size])


__all__ = ["BARRIER", "CHANGES", "Mark", "NO_POSITION", "Replicator", "SNAPSHOT_BEGIN", "SNAPSHOT_END",
           "SNAPSHOT_ROWS", "SlotLog", "Stream"]
