"""The ordered stream from one primary to one target server, and what writes wait for on it.

A ``Stream`` queues items (each with a stream seq) and one sender thread sends them in order, in batches,
with ``Shard/Replicate``; the target answers the last seq it applied. Items are enqueued under the table's
write lock (so stream order is write order); sends and waits happen outside it.

A target's refusal names the slots it is about (``ReplicateResponse.slots``). The stream then stops
sending those slots (``excluded``): their parts are cut out of every queued item and of every later one, and
the rest of the stream goes on. Only the refused slots are reported to the scheduler, and only while this
server still leads them with an in-sync copy on the target: a refusal about slots whose primary moved on
(the map changed while items were in flight) demotes nothing. A write that must be acknowledged by an
excluded copy waits until the map takes that copy out of the in-sync set (invariant I1): an
acknowledgement of the cut item never stands in for it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.ps.channels import channel_options
from tigana.ps.logs import event, slots_text
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire.cluster import Item

if TYPE_CHECKING:
    from tigana.ps.replication.primary import Replicator

log = logging.getLogger("tigana.ps.replication")

# Session states of a slot copy: rows being sent, rows sent (SNAPSHOT_END queued), switched (sync writes
# wait for the target), reported caught up, failed (to be started again).
COPYING, ROWS_SENT, SWITCHED, REPORTED, FAILED = 1, 2, 3, 4, 5
NEVER = 1 << 62  # the seq of a mark no acknowledgement satisfies (an excluded copy: only the map releases it)


@dataclass(eq=False)
class Queued:
    seq: int
    item: Item
    nbytes: int


@dataclass(eq=False)  # compared by identity (``sess in stream.sessions``), never by value
class Session:
    """A slot copy to one target: its slots, progress, the map epoch it started at, and the seqs that mark
    its steps."""

    slots: np.ndarray
    tables: list[str]
    epoch: int = 0
    state: int = COPYING
    end_seq: int = 0
    switch_seq: int = 0
    rows_sent: int = 0
    rows_total: int = 0
    rows_acked_at: float | None = None  # when the target had applied every row (SNAPSHOT_END acknowledged)
    started: float = 0.0


@dataclass(frozen=True, eq=False)
class Mark:
    """What a write waits for: the target stream, its generation, the seq to be acknowledged, the slots."""

    stream: Stream
    generation: int
    seq: int
    slots: np.ndarray


class Stream:
    """The ordered stream from this primary to one target server. Fields are guarded by the replicator's lock.

    held: slots this server leads and the target holds a copy of (items for them go to it);
    in_sync: held slots whose copy on the target the map has in the in-sync set;
    required: slots whose items the target must acknowledge before a sync push is (in sync, or switched);
    excluded: held slots the target refused; their items are no longer sent until a new slot copy starts."""

    def __init__(self, replicator: Replicator, target_id: str, address: str, num_slots: int) -> None:
        self.r = replicator
        self.target_id, self.address = target_id, address
        self.generation = replicator.next_generation()
        self.held = np.zeros(num_slots, bool)
        self.in_sync = np.zeros(num_slots, bool)
        self.required = np.zeros(num_slots, bool)
        self.excluded = np.zeros(num_slots, bool)
        self.queue: deque[Queued] = deque()
        self.queued_bytes = 0
        self.next_seq = 1
        self.acked = 0
        self.sessions: list[Session] = []
        self.broken_since: float | None = None
        self.reported = False
        self.closed = False
        self.last_error = ""
        self.acked_time = replicator.clock()
        self.channel = replicator.channel(address, channel_options(replicator.max_message_bytes, 30.0, 10.0, 0.1))
        self.replicate = self.channel.unary_unary(
            "/tigana.v1.Shard/Replicate", request_serializer=_identity,
            response_deserializer=pb.ReplicateResponse.FromString)

    # --- queue (under the replicator lock) ---
    def push(self, item: Item) -> int:
        seq = self.next_seq
        self.next_seq += 1
        item.table_epoch = self.r.table_epochs.get(item.table, item.table_epoch)
        nbytes = item.nbytes or _item_bytes(item)
        self.queue.append(Queued(seq, item, nbytes))
        self.queued_bytes += nbytes
        return seq

    @property
    def lag(self) -> int:
        return self.next_seq - 1 - self.acked

    def sendable(self) -> np.ndarray:
        """(num_slots,) bool: the slots whose items go to the target."""
        return self.held & ~self.excluded

    def marks_for(self, slots: np.ndarray, seq: int) -> list[Mark]:
        """The marks a write of ``slots`` at ``seq`` waits for on this stream: the required slots, those
        excluded at a seq no acknowledgement reaches."""
        req = slots[self.required[slots]]
        if not req.size:
            return []
        ex = self.excluded[req]
        out = [Mark(self, self.generation, seq, req[~ex])] if (~ex).any() else []
        if ex.any():
            out.append(Mark(self, self.generation, NEVER, req[ex]))
        return out

    def exclude(self, slots: np.ndarray) -> None:
        """Stop sending ``slots``: cut them out of every queued item; fail the slot copies that hold them."""
        self.excluded[slots] = True
        keep = ~self.excluded
        for q in self.queue:
            if self.excluded[q.item.slots].any():
                q.item = restrict(q.item, keep, self.r.slot_of)
        for sess in self.sessions:
            if sess.state != FAILED and self.excluded[sess.slots].any():
                sess.state = FAILED

    def reported_mask(self) -> np.ndarray:
        m = np.zeros(self.held.shape[0], bool)
        for sess in self.sessions:
            if sess.state == REPORTED:
                m[sess.slots] = True
        return m

    # --- sending (the thread adapter ``run``, or a simulator, drives these) ---
    def request(self) -> bytes | None:
        """The next batch, from the head of the queue, as a serialized ``ReplicateRequest`` (None: nothing
        queued or closed). The caller holds the replicator's lock."""
        if self.closed or not self.queue:
            return None
        batch, size = [], 0
        for q in self.queue:
            if batch and (size + q.nbytes > self.r.batch_bytes or len(batch) >= 256):
                break
            batch.append(q)
            size += q.nbytes
        return cluster_wire.encode_replicate_request(self.r.server_id, self.r.boot, self.generation, self.r.epoch,
                                                     batch[0].seq, [q.item for q in batch])

    def run(self) -> None:
        """The sender thread: send the queue's head, hand the answer (or the failure) to the stream."""
        backoff = 0.05
        try:
            while True:
                with self.r.cond:
                    while not self.closed and not self.queue:
                        self.r.cond.wait()
                    request = self.request()
                if request is None:
                    return
                try:
                    reply = self.replicate(request, timeout=self.r.send_timeout_s)
                except grpc.RpcError as err:
                    if self.closed:
                        return
                    self.failed(f"{err.code().name}: {err.details()}")
                    self._pause(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                backoff = 0.05
                self.answered(reply)
        except ValueError:  # the channel was closed under a call: the stream is closing
            return

    def _pause(self, seconds: float) -> None:
        if not self.r.threaded:
            return  # driven by a simulator: its clock, not a sleep, spaces the retries
        with self.r.cond:
            if not self.closed:
                self.r.cond.wait(seconds)

    def answered(self, reply: pb.ReplicateResponse) -> None:
        """The target's answer to a request: acknowledgements, then a refusal's consequences."""
        reject = reply.reject
        if reject != pb.REJECT_NONE and reply.epoch > self.r.epoch:
            # Our map may be the stale one: learn the newer map before anything else, so that an
            # acknowledgement below never counts for a copy the newer map moved (the push's own check).
            self.r.refresh_map(int(reply.epoch))
        with self.r.cond:
            if reply.applied_through > self.acked:
                self.acked = int(reply.applied_through)
                self.acked_time = self.r.clock()
                while self.queue and self.queue[0].seq <= self.acked:
                    self.queued_bytes -= self.queue.popleft().nbytes
                # Applying again: the stream is whole (in order, no gap), so a failure reported earlier no
                # longer stands in the way of its slot copies (a report the scheduler never acted on, lost
                # or about slots led elsewhere by then, used to freeze every copy toward this target).
                self.broken_since = None
                self.reported = False
                self.r.cond.notify_all()
        if reject == pb.REJECT_NONE:
            self.r.progress(self)
            return
        slots = cluster_wire.array(reply.slots, "<i4", field="ReplicateResponse.slots").astype(np.int64)
        reason = f"{pb.ReplicateReject.Name(reject)}: {reply.message}"
        self.last_error = reason
        if reject == pb.REJECT_BEHIND:
            self.failed(reason)  # the target cannot get our map: reported only past the failure timeout
            self._pause(0.05)
            return
        if reject in (pb.REJECT_STALE, pb.REJECT_DIVERGED) and slots.size:
            with self.r.cond:
                slots = slots[(slots >= 0) & (slots < self.held.shape[0])]
                self.exclude(slots)
                report = slots[self.in_sync[slots]]  # still ours and in sync on the target: a real failure
                epoch = self.r.epoch
                self.r.cond.notify_all()
            if report.size:
                log.warning("replication from %s to %s refused at epoch %d (slots %s): %s; reporting them",
                            self.r.server_id, self.target_id, epoch, slots_text(report), reason,
                            extra=event("replication_failing", slots=report, epoch=epoch, server=self.target_id,
                                        source=self.r.server_id, reason=reason))
                self.r.report_failure(self.target_id, report.astype(np.int32), reason)
            return
        self.failed(reason, report_now=True)
        self._pause(0.2)

    def failed(self, reason: str, *, report_now: bool = False) -> None:
        """Record a failed send; after ``failure_timeout_s`` (or at once for a rejection) report the target's
        in-sync copies to the scheduler, which takes them out of the in-sync set (I1: only the scheduler may)."""
        now = self.r.clock()
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
                if sess.state in (COPYING, ROWS_SENT, SWITCHED):
                    sess.state = FAILED
            self.required = self.in_sync | self.reported_mask()
            self.r.cond.notify_all()
            report = np.flatnonzero(self.held).astype(np.int32)
            epoch = self.r.epoch
        log.warning("replication from %s to %s (%s) failing at epoch %d: %s; reporting %d slot(s) to the scheduler "
                    "(slots %s)", self.r.server_id, self.target_id, self.address, epoch, reason, report.size,
                    slots_text(report), extra=event("replication_failing", slots=report, epoch=epoch,
                                                    server=self.target_id, source=self.r.server_id, reason=reason))
        self.r.report_failure(self.target_id, report, reason)

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


def restrict(item: Item, held: np.ndarray, slot_of_id: Callable[[np.ndarray], np.ndarray]) -> Item:
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
                rows, deletes, sightings, item.step, [d for d in dedup if d[2].size], table_epoch=item.table_epoch)
