"""The ordered stream from one primary to one target server: its state and the decisions made on it.

Pure state (no lock, thread, socket or clock): the ``Primary`` core owns its streams and is driven by an
adapter (``tigana.ps.replication.replicator``, or a simulator) that holds one lock around every call.

A stream queues items, each with a stream seq; the adapter sends the queue's head in batches (``request``)
with ``Shard/Replicate``, and the target answers the last seq it applied. Items are enqueued under the
table's write lock (so stream order is write order); sends and waits happen outside it.

A stream has two lanes, each with seqs of its own and its own sender: the change lane (writes, a slot copy's
``SNAPSHOT_BEGIN``, barriers) and the copy lane (a slot copy's rows and its ``SNAPSHOT_END``), so that writes,
and the sync pushes waiting for them, never queue behind copied rows. A copy-lane item names the change-lane seq
its rows were read after (``Item.after``); the target applies it once its change lane got there, and only to
rows no change since the copy's ``SNAPSHOT_BEGIN`` wrote or removed (``replication.intake``): a change always
carries the whole row as written, so a row it wrote is newer than any copied one.

A target's refusal names the slots it is about (``ReplicateResponse.slots``). The stream then stops sending
those slots (``exclude``): their parts are cut out of every queued item and of every later one, and the rest
of the stream goes on. A write that must be acknowledged by an excluded copy waits until the map takes that
copy out of the in-sync set (invariant I1): an acknowledgement of the cut item never stands in for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tigana.embeddings.masks import all_set, any_set
from tigana.ps.replication.copy import REPORTED, Session
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire.cluster import Item

NEVER = 1 << 62  # the seq of a mark no acknowledgement satisfies (an excluded copy: only the map releases it)


@dataclass(eq=False)
class Queued:
    seq: int
    item: Item
    nbytes: int


@dataclass(frozen=True, eq=False)
class Mark:
    """What a write waits for: the target stream, its generation, the seq to be acknowledged, the slots."""

    stream: Stream
    generation: int
    seq: int
    slots: np.ndarray


def stream_key(target_id: str, address: str, target_boot: str) -> str:
    """A stream is to one process of its target: a target restarted (a new boot, its rows and its incoming
    streams' state gone) gets a new stream, and every copy into it starts again (a copy into the old process
    never reports, or reports stale)."""
    return f"{target_id}@{address}#{target_boot}"


class Stream:
    """The ordered stream from this primary to one target server.

    held: slots this server leads and the target holds a copy of (items for them go to it);
    in_sync: held slots whose copy on the target the map has in the in-sync set;
    required: slots whose items the target must acknowledge before a sync push is (in sync, or switched);
    excluded: held slots the target refused; their items are no longer sent until a new slot copy starts;
    cut_after: per slot, the last seq whose items reached the target whole (the acknowledged seq when the slot
    was excluded; NEVER while it is not): items after it lost the slot's part, so their acknowledgement says
    nothing of the slot's writes."""

    def __init__(self, target_id: str, address: str, num_slots: int, generation: int, now: float,
                 target_boot: str = "") -> None:
        self.target_id, self.address = target_id, address
        self.key = stream_key(target_id, address, target_boot)
        self.generation = generation
        self.held = np.zeros(num_slots, bool)
        self.in_sync = np.zeros(num_slots, bool)
        self.required = np.zeros(num_slots, bool)
        self.excluded = np.zeros(num_slots, bool)
        self.cut_after = np.full(num_slots, NEVER, np.int64)
        self.queue: deque[Queued] = deque()
        self.queued_bytes = 0
        self.next_seq = 1
        self.acked = 0
        self.sessions: list[Session] = []
        self.broken_since: float | None = None
        self.reported = False
        self.closed = False
        self.last_error = ""
        self.acked_time = now
        self.copies: deque[Queued] = deque()  # the copy lane
        self.copy_bytes = 0
        self.copy_next_seq = 1
        self.copy_acked = 0
        self.copy_broken_since: float | None = None  # the copy lane's sends fail since (``copy_send_failed``)

    def push(self, item: Item, table_epoch: int | None = None, lane: int = 0) -> int:
        """Queue ``item`` on ``lane`` (0: changes, 1: copied rows); its seq on that lane. ``table_epoch``: the
        incarnation of its table this primary serves."""
        if table_epoch is not None:
            item.table_epoch = table_epoch
        nbytes = item.nbytes or item_bytes(item)
        if lane:
            seq, self.copy_next_seq = self.copy_next_seq, self.copy_next_seq + 1
            self.copies.append(Queued(seq, item, nbytes))
            self.copy_bytes += nbytes
        else:
            seq, self.next_seq = self.next_seq, self.next_seq + 1
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
        if not any_set(ex):  # the usual case: no slot of it excluded
            return [Mark(self, self.generation, seq, req)]
        out = [] if all_set(ex) else [Mark(self, self.generation, seq, req[~ex])]
        out.append(Mark(self, self.generation, NEVER, req[ex]))
        return out

    def exclude(self, slots: np.ndarray, slot_of: Callable[[np.ndarray], np.ndarray]) -> None:
        """Stop sending ``slots``: cut them out of every queued item; fail the slot copies that hold them. A
        write waiting on an item after the acknowledged seq no longer gets its acknowledgement (``covers``)."""
        self.cut_after[slots] = np.minimum(self.cut_after[slots], self.acked)
        self.excluded[slots] = True
        keep = ~self.excluded
        for q in (*self.queue, *self.copies):
            if self.excluded[q.item.slots].any():
                q.item = restrict(q.item, keep, slot_of)
        for sess in self.sessions:
            if self.excluded[sess.slots].any():
                sess.fail()

    def readmit(self, slots: np.ndarray) -> None:
        """Send ``slots`` again (a new slot copy starts them over, or the target no longer holds them)."""
        self.excluded[slots] = False
        self.cut_after[slots] = NEVER

    def covers(self, m: Mark) -> bool:
        """Whether the target acknowledged mark ``m``'s item with every slot of the mark still in it: an item cut
        by ``exclude`` before it was acknowledged never stands in for the writes it lost (I1)."""
        return self.acked >= m.seq and all_set(self.cut_after[m.slots] >= m.seq)

    def acknowledge(self, applied_through: int, now: float) -> bool:
        """The target applied everything through ``applied_through``: drop it from the queue. True when that
        moved the stream on. Applying again means the stream is whole (in order, no gap), so a failure reported
        earlier no longer stands in the way of its slot copies (a report the scheduler never acted on, lost or
        about slots led elsewhere by then, used to freeze every copy toward this target)."""
        if applied_through <= self.acked:
            return False
        self.acked = int(applied_through)
        self.acked_time = now
        while self.queue and self.queue[0].seq <= self.acked:
            self.queued_bytes -= self.queue.popleft().nbytes
        self.broken_since = None
        self.reported = False
        return True

    def acknowledge_copy(self, applied_through: int) -> bool:
        """The target applied the copy lane through ``applied_through``. True when that moved it on."""
        if applied_through <= self.copy_acked:
            return False
        self.copy_acked = int(applied_through)
        while self.copies and self.copies[0].seq <= self.copy_acked:
            self.copy_bytes -= self.copies.popleft().nbytes
        return True

    def reported_mask(self) -> np.ndarray:
        m = np.zeros(self.held.shape[0], bool)
        for sess in self.sessions:
            if sess.state == REPORTED:
                m[sess.slots] = True
        return m

    def batch(self, batch_bytes: int, lane: int = 0) -> list[Queued]:
        """The next batch from the head of a lane: at most ``batch_bytes`` (one item at least), 256 items. On
        the copy lane, only items whose change-lane seq (``after``) the target has acknowledged: it would
        answer WAIT to the others."""
        batch, size = [], 0
        for q in (self.copies if lane else self.queue):
            if lane and q.item.after > self.acked:
                break
            if batch and (size + q.nbytes > batch_bytes or len(batch) >= 256):
                break
            batch.append(q)
            size += q.nbytes
        return batch

    def copy_ready(self) -> bool:
        """Whether the copy lane has an item to send now (its ``after`` acknowledged on the change lane)."""
        return bool(self.copies) and self.copies[0].item.after <= self.acked

    def has_batch(self, lane: int = 0) -> bool:
        """Whether ``request`` would send something on ``lane`` now (open, and an item ready): what a lane's
        sender waits for, checked without encoding anything."""
        return not self.closed and bool(self.copy_ready() if lane else self.queue)

    def request(self, source: str, boot: str, epoch: int, batch_bytes: int, lane: int = 0) -> bytes | None:
        """The next batch of a lane as a serialized ``ReplicateRequest`` (None: nothing to send, or closed)."""
        if not self.has_batch(lane):
            return None
        batch = self.batch(batch_bytes, lane)
        return cluster_wire.encode_replicate_request(source, boot, self.generation, epoch, batch[0].seq,
                                                     [q.item for q in batch], lane)


def item_bytes(item: Item) -> int:
    """Bytes an item takes in memory (about what it takes on the wire): the queues' and the pacer's measure."""
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
                rows, deletes, sightings, item.step, [d for d in dedup if d[2].size], table_epoch=item.table_epoch,
                copy_id=item.copy_id, after=item.after)
