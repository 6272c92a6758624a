"""The write path of one shard server (``WritePath``): pulls (which may insert), pushes (applied under the
table's lock, then acknowledged once the in-sync copies have them) and their replication to the slots' copies;
and ``copy_slot_rows``, the rows of a slot copy enqueued in the same order.

The write path of a cluster table (``Push``; pulls that insert take the same path without waiting): under
the table's write lock, check that this server leads every slot of the request in its current map
(``WrongShard`` otherwise, with the epoch; the leads check and the apply see the same map), check
``min_copies``, skip slots that already applied this (client id, seq), apply, record the key, stamp the
slots' log positions and enqueue the changed rows to every copy (``replication``). Then, for a sync table,
wait until every in-sync copy applied it (invariant I1 of ``replication``), and acknowledge only if the
slots' copies did not change meanwhile.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tigana.embeddings import Changes
from tigana.embeddings.changes import sorted_unique, unique
from tigana.embeddings.masks import all_set, any_set
from tigana.embeddings.unseen import Unseen
from tigana.proto import shard_pb2 as pb
from tigana.ps import _kernels
from tigana.ps.errors import InvalidArgument, NotEnoughReplicas, ResourceExhausted, Unavailable
from tigana.ps.metrics import ServerMetrics
from tigana.ps.replication import Replicator, Stream
from tigana.ps.routing import slot_of
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.hosted import HostedTables, _Hosted
from tigana.ps.shard.links import ServerLinks
from tigana.ps.shard.view import Holdings, View, check_unmoved
from tigana.ps.wire import data as wire
from tigana.ps.wire.cluster import CHANGES, SNAPSHOT_ROWS, Item

_CODECS = frozenset(pb.Codec.values())
COPY_CHUNK = 16384  # rows per SNAPSHOT_ROWS item of a slot copy


@dataclasses.dataclass(frozen=True, eq=False)
class _Pushed:
    """A push applied (or found a duplicate) under its table's lock, not yet acknowledged: the map it was
    applied under, its slots, and the replication marks a sync push waits for."""

    name: str
    view: View
    uslots: np.ndarray
    marks: list
    sync: bool
    applied: int
    duplicate: bool
    rows: int


class PullPlan:
    """A pull checked against its table (``WritePath.pull_check``), nothing read or inserted yet."""

    __slots__ = ("name", "hosted", "ids", "codec", "epoch", "read_only", "unseen", "reply_bytes")

    def __init__(self, name: str, hosted: _Hosted, ids: np.ndarray, codec: int, epoch: int, read_only: bool,
                 unseen: Unseen | None, reply_bytes: int) -> None:
        self.name, self.hosted, self.ids, self.codec, self.epoch = name, hosted, ids, codec, epoch
        self.read_only, self.unseen, self.reply_bytes = read_only, unseen, reply_bytes


class PushPlan:
    """A push checked against its table and decoded (``WritePath.push_check``), nothing applied yet."""

    __slots__ = ("name", "hosted", "ids", "grads", "epoch", "client_id", "seq")

    def __init__(self, name: str, hosted: _Hosted, ids: np.ndarray, grads: np.ndarray, epoch: int,
                 client_id: str, seq: int) -> None:
        self.name, self.hosted, self.ids, self.grads, self.epoch = name, hosted, ids, grads, epoch
        self.client_id, self.seq = client_id, seq


class WritePath:
    """Pulls and pushes on the tables of one shard server, and their replication to the slots' copies.

    Dependencies: ``tables`` (the registry), ``holdings`` (the view: the leads check), ``replicator`` (None on a
    static server), ``metrics`` and ``links`` (the primary lease). Requests are the protobuf messages (or the
    ``wire`` views of a push) the client sends. Thread-safety: any thread; a write holds its table's write lock
    for check-apply-record-enqueue and waits for its copies after releasing it. Blocking: ``pull``,
    ``push_apply`` and ``import_rows`` may wait for room in the replication queue (up to the request's
    deadline); ``push``, ``push_ack`` and ``import_rows`` wait for the in-sync copies (``ack_timeout_s``)."""

    def __init__(self, config: ServerConfig, tables: HostedTables, holdings: Holdings, replicator: Replicator | None,
                 metrics: ServerMetrics, links: ServerLinks, server_id: str) -> None:
        self.config, self.tables, self.holdings = config, tables, holdings
        self.replicator, self.metrics, self.links, self.server_id = replicator, metrics, links, server_id
        self.num_slots, self.clustered = config.num_slots, replicator is not None

    def check_leads(self, name: str, ids: np.ndarray, epoch: int) -> tuple[View, np.ndarray]:
        """``Holdings.check_leads`` for the table served as ``name`` now (under its write lock)."""
        hosted = self.tables.find(name)
        return self.holdings.check_leads(name, ids, epoch, None if hosted is None else hosted.spec.created_epoch)

    def pull(self, request: pb.PullRequest, timeout_s: float | None = None) -> tuple[str, np.ndarray, int]:
        """Validate a pull and read its rows: (table, (n, dim) float32 rows, reply codec). ``timeout_s``: what is
        left of the request's deadline (None: unknown). A pull that may insert waits for room in the replication
        queue first and enqueues the rows it inserted to the copies (it does not wait for them)."""
        plan = self.pull_check(request)
        if not plan.read_only:  # it may insert: its rows go to the copies
            self.wait_for_room(plan.name, timeout_s)
        return plan.name, self.pull_read(plan), plan.codec

    def pull_check(self, request: pb.PullRequest) -> PullPlan:
        """Check a pull against its table (``InvalidArgument``/``TableNotFound``/``ResourceExhausted`` naming
        table and field) without reading or inserting anything: a multi-table frame checks every part first."""
        name = request.table
        hosted = self.tables.get(name)
        raw_ids = request.ids  # protobuf copies a bytes field on every access: read it once
        ids = wire.decode_ids(raw_ids, table=name)
        self.check_rows(name, ids.size)
        codec = request.codec
        if codec not in _CODECS:
            raise InvalidArgument(f"table {name!r}: field 'codec' has unknown value {codec}")
        reply_bytes = wire.rows_nbytes(len(ids), hosted.table.config.dim, codec)
        if reply_bytes > self.config.max_message_bytes - 1024:  # refuse before pull inserts anything
            raise ResourceExhausted(f"table {name!r}: field 'ids' asks for {len(ids)} rows, {reply_bytes} bytes "
                                    f"as a reply, above the message limit of {self.config.max_message_bytes}; "
                                    "split the pull")
        unseen = None
        if request.read_only and request.unseen:  # empty: the initial rows (what clients before it asked)
            unseen = Unseen.parse(request.unseen, what=f"table {name!r}: field 'unseen'")
        return PullPlan(name, hosted, ids, codec, request.epoch, bool(request.read_only), unseen, reply_bytes)

    def pull_read(self, plan: PullPlan) -> np.ndarray:
        """Read a checked pull's rows under its table's lock (inserting, unless read-only; ``WrongShard`` when
        this server does not lead a slot of it now). The caller waited for room in the replication queue."""
        name, hosted, ids, unseen, reply_bytes = plan.name, plan.hosted, plan.ids, plan.unseen, plan.reply_bytes
        with hosted.lock:
            view, slots = self.check_leads(name, ids, plan.epoch)
            if plan.read_only:
                rows = hosted.table.pull(ids, insert=False, unseen=unseen)
            elif self.replicator is not None and self.replicator.streams:
                changes = Changes()
                rows = hosted.table.pull(ids, changes=changes)
                if changes:
                    self.replicate(hosted, view, changes, None, None)
            else:
                rows = hosted.table.pull(ids)
            _kernels.count_into(slots, hosted.pulled)
        self.metrics.labelled(self.metrics.rows_pulled, name).inc(len(ids))
        self.metrics.labelled(self.metrics.bytes_in, "Pull").inc(ids.nbytes)
        self.metrics.labelled(self.metrics.bytes_out, "Pull").inc(reply_bytes)
        self.metrics.labelled(self.metrics.row_bytes_raw, "Pull").inc(len(ids) * hosted.table.config.dim * 4)
        self.metrics.labelled(self.metrics.row_bytes_wire, "Pull").inc(reply_bytes)
        return rows

    def push(self, request: pb.PushRequest | wire.RawPush, timeout_s: float | None = None) -> pb.PushResponse:
        """A push: applied (or found a duplicate) under the table's lock, then, for a sync table, acknowledged
        once its in-sync copies have it (``push_apply`` then ``push_ack``; a simulator drives the two). Blocks
        up to ``ack_timeout_s`` for the copies."""
        return self.push_ack(self.push_apply(request, timeout_s), self.config.ack_timeout_s)

    def push_apply(self, request: pb.PushRequest | wire.RawPush, timeout_s: float | None = None) -> _Pushed:
        """Check and apply a push under its table's lock (``timeout_s``: what is left of its deadline, for the
        wait for room in the replication queue), exactly once per (client id, seq) and slot; the push is not
        acknowledged yet: answer it with ``push_ack`` (waits) or ``push_answer`` (once its marks are done)."""
        plan = self.push_check(request)
        self.wait_for_room(plan.name, timeout_s)
        return self.push_commit(plan)

    def push_check(self, request: pb.PushRequest | wire.RawPush, *, finite: bool = False) -> PushPlan:
        """Check a push against its table and decode its gradients (``InvalidArgument``/``TableNotFound``/
        ``ResourceExhausted`` naming table and field), applying nothing: a multi-table frame checks every part
        before it applies any. ``finite``: also refuse NaN/Inf gradients here when the table rejects them
        (the engine would refuse them at the apply, after the frame's earlier parts were applied)."""
        name = request.table
        hosted = self.tables.get(name)
        raw_ids = request.ids  # protobuf copies a bytes field on every access: read each once
        ids = wire.decode_ids(raw_ids, table=name)
        self.check_rows(name, ids.size)
        dim = hosted.table.config.dim
        g = request.grads
        codec, data, scales = g.codec, g.data, g.scales
        grads_rows = wire.RawRows(codec, g.dim, data, scales, 0)
        nbytes = memoryview(data).nbytes
        if codec in _CODECS and g.dim == dim:
            row_bytes = wire.rows_nbytes(1, dim, codec) - (4 if codec == pb.CODEC_INT8 else 0)
            if nbytes % row_bytes == 0 and nbytes // row_bytes != len(ids):
                raise InvalidArgument(f"table {name!r}: field 'grads' has {nbytes // row_bytes} rows, "
                                      f"field 'ids' has {len(ids)} ids")
        grads = wire.decode_rows(grads_rows, len(ids), dim, table=name, field="grads")
        if finite and hosted.table.config.nonfinite_grads == "reject" and grads.size:
            bad = int(_kernels.first_nonfinite_row(grads.view(np.uint32)))
            if bad >= 0:
                raise InvalidArgument(f"table {name!r}: field 'grads' has NaN/Inf (first in row {bad}, id "
                                      f"{int(ids[bad])}); nothing of the frame applied")
        self.metrics.labelled(self.metrics.bytes_in, "Push").inc(memoryview(raw_ids).nbytes + nbytes + memoryview(scales).nbytes)
        self.metrics.labelled(self.metrics.row_bytes_raw, "Push").inc(len(ids) * dim * 4)
        self.metrics.labelled(self.metrics.row_bytes_wire, "Push").inc(nbytes + memoryview(scales).nbytes)
        return PushPlan(name, hosted, ids, grads, getattr(request, "epoch", 0), request.client_id, request.seq)

    def push_commit(self, plan: PushPlan) -> _Pushed:
        """Apply a checked push under its table's lock, exactly once per (client id, seq) and slot (the caller
        waited for room in the replication queue); not acknowledged yet (``push_ack``/``push_answer``)."""
        name, hosted, ids, grads, epoch = plan.name, plan.hosted, plan.ids, plan.grads, plan.epoch
        cid, seq = plan.client_id, plan.seq
        with hosted.lock:
            view, slots = self.check_leads(name, ids, epoch)  # under the lock: the map the apply sees
            uslots = unique(slots)
            sync = hosted.spec.durability == "sync"
            if not sync and not self.links.lease_ok():
                raise Unavailable(f"table {name!r}: server {self.server_id} has not reached the scheduler for "
                                  f"{self.config.lease_s}s; async pushes wait until it has (primary lease)",
                                  epoch=view.epoch)
            if sync and self.clustered:
                short = view.in_sync[uslots] < hosted.spec.min_copies
                if any_set(short):
                    s = int(uslots[short][0])
                    raise NotEnoughReplicas(
                        f"table {name!r}: slot {s} has {int(view.in_sync[s])} in-sync cop(ies), the table's "
                        f"min_copies is {hosted.spec.min_copies}; push rejected, nothing applied", epoch=view.epoch)
            done = hosted.dedup.applied(cid, seq, uslots)
            part = uslots  # every slot of the part: the acknowledgement is for all of them
            if all_set(done):
                applied, duplicate = 0, True
                marks = self.replicator.tail_marks(uslots) if self.replicator is not None and sync else []
            else:
                # A retried push split differently: apply only the slots not applied yet, and wait for the
                # copies of the others too (their first attempt may still be on its way to a copy).
                earlier: list = []
                if any_set(done):
                    if self.replicator is not None and sync:
                        earlier = self.replicator.tail_marks(uslots[done])
                    keep = ~np.isin(slots, uslots[done])
                    ids, grads, slots, uslots = ids[keep], grads[keep], slots[keep], uslots[~done]
                changes = Changes() if self.replicator is not None and self.replicator.streams else None
                applied = hosted.table.push(ids, grads, changes=changes)
                hosted.dedup.record(cid, seq, uslots)
                marks = earlier + self.replicate(hosted, view, changes, uslots, (cid, seq, uslots))
                duplicate = False
            _kernels.count_into(slots, hosted.pushed)
        return _Pushed(name, view, part, marks if sync else [], sync, int(applied), duplicate, len(ids))

    def push_ack(self, p: _Pushed, timeout_s: float) -> pb.PushResponse:
        """Wait (up to ``timeout_s``; no lock held) until the copies the push waits for have it (I1), then
        answer (``push_answer``)."""
        done = not p.marks or self.replicator is None or self.replicator.wait(p.marks, timeout_s)
        return self.push_answer(p, done)

    def push_answer(self, p: _Pushed, done: bool) -> pb.PushResponse:
        """The answer to push ``p`` once its wait for its copies ended: ``done`` when every copy it waited for
        has it (I1), else ``Unavailable`` (applied here, so a retry applies nothing twice)."""
        name, view, uslots, marks, sync = p.name, p.view, p.uslots, p.marks, p.sync
        if marks:
            if not done:
                late = sorted({m.stream.target_id for m in marks})
                raise Unavailable(f"table {name!r}: push applied here but not yet by the in-sync copies on {late} "
                                  f"within {self.config.ack_timeout_s}s; retry it (it is applied once)",
                                  epoch=self.holdings.epoch)
            check_unmoved(name, view, self.holdings.view, uslots)
        if p.duplicate:
            self.metrics.labelled(self.metrics.duplicate_pushes, name).inc()
        else:
            self.metrics.labelled(self.metrics.rows_pushed, name).inc(p.rows)
        applied, duplicate = p.applied, p.duplicate
        now = self.holdings.view
        # Not silent: a sync push acknowledged while a slot of it has fewer in-sync copies than the cluster
        # keeps says so (the client counts and logs it; ``min_copies`` refuses it instead).
        under = bool(sync and self.clustered and any_set(now.in_sync[uslots] < now.want))
        if under:
            self.metrics.labelled(self.metrics.under_replicated_pushes, name).inc()
        return pb.PushResponse(applied_rows=int(applied), duplicate=duplicate, epoch=now.epoch,
                               under_replicated=under)

    def wait_for_room(self, table: str, timeout_s: float | None = None) -> None:
        """Back-pressure on every writer that enqueues to the copies (pushes, pulls that may insert,
        ``ImportRows``): wait, up to ``timeout_s`` (the request's deadline; at most ``ack_timeout_s``), while a
        replication stream holds more than ``max_queue_bytes`` unacknowledged, before the table's lock is
        taken; ``Unavailable`` (retryable, nothing applied) when it stays so. Nothing queues past the bound
        without having waited for room."""
        if self.replicator is None or not self.replicator.streams:
            return
        wait = self.config.ack_timeout_s if timeout_s is None else max(0.0, min(timeout_s, self.config.ack_timeout_s))
        full = self.replicator.room(None, wait)
        if full is not None:
            raise Unavailable(f"table {table!r}: replication to {full.target_id} is {full.queued_bytes} bytes "
                              f"behind (more than max_queue_bytes); nothing applied, retry", epoch=self.holdings.epoch)

    def check_rows(self, table: str, n: int) -> None:
        """``ResourceExhausted`` naming ``table`` when a request carries more than ``max_rows_per_request`` ids."""
        if n > self.config.max_rows_per_request:
            raise ResourceExhausted(f"table {table!r}: field 'ids' has {n} ids, above the server's limit of "
                                    f"{self.config.max_rows_per_request} per request; split it")

    def replicate(self, hosted: _Hosted, view: View, changes: Changes | None, slots: np.ndarray | None,
                  key: tuple[str, int, np.ndarray] | None) -> list:
        """Stamp the write's slots (``slots``, or those ``changes`` touch) with their next log positions and
        enqueue its changes to the copies, with the exactly-once ``key`` (client id, seq, slots); the marks a
        sync write waits for. The caller holds ``hosted``'s write lock; never blocks."""
        if changes is None or self.replicator is None:
            if slots is not None:
                hosted.log.stamp(slots, view.epoch)
            return []
        table = hosted.table
        rows = changes.written_rows(table.rows_of)  # a push's own export, or read back (absent ids skipped)
        deleted = changes.deleted_ids()
        if deleted.size:
            deleted = deleted[~table.contains(deleted)]
        sightings = changes.sighting_arrays()
        # A push's written rows lie in its own slots; a pull's inserts, removals and sightings name theirs.
        touched = [deleted, sightings[0]] + ([rows.ids] if rows is not None and slots is None else [])
        extra = np.concatenate(touched)
        islots = slots if slots is not None else np.empty(0, np.int64)
        if extra.size:
            islots = unique(np.concatenate([islots, slot_of(extra, self.num_slots)]))
        if islots.size == 0:
            return []
        islots = islots.astype(np.int32)
        lsn, prev = hosted.log.stamp(islots, view.epoch)
        dedup = [(key[0], key[1], key[2].astype(np.int32))] if key is not None and key[0] else []
        item = Item(CHANGES, hosted.spec.config.name, islots, lsn, prev, rows, deleted,
                    sightings if sightings[0].size else None, table.step, dedup,
                    table_epoch=hosted.spec.created_epoch)  # the incarnation written, whatever map the stream has
        return self.replicator.enqueue(item)


def copy_slot_rows(replicator: Replicator, tables: HostedTables, stream: Stream, sess: Any) -> None:
    """The rows of a slot copy (``Replicator``'s ``copy_rows``, on its copy thread): each chunk exported and
    enqueued on the copy lane under the table's write lock, so it names the last change-lane item it reflects
    (the target applies it after that one, and under every later write: S11). Blocks while the copy lane is
    over its window and to keep the server's copy rate."""
    num_slots = tables.num_slots
    want = np.zeros(num_slots, bool)
    want[sess.slots] = True
    for name in sess.tables:
        hosted = tables.find(name)
        if hosted is None:
            continue
        # The copy's ids, in one pass over the table's index under its lock (no list of every id: a listing
        # of the whole table held the lock for 0.6 s in a profiled move, the pushes waiting). Sorted by id,
        # not in bucket order: a target inserting ids in the bucket order of a table hashed the same way piles
        # them into long probe runs (its lookups ran for minutes). Unique: an id removed and stored again
        # during the listing may be listed twice.
        ids = sorted_unique(hosted.table.stored_ids_in_slots(num_slots, want))
        sess.rows_total += int(ids.size)  # progress of the copy (heartbeats carry it to the scheduler)
        for start in range(0, ids.shape[0], COPY_CHUNK):
            if not replicator.wait_for_room(stream, sess):
                raise Unavailable(f"table {name!r}: slot copy to {stream.target_id}: its copy lane stayed over "
                                  f"the window for {replicator.copy_stall_s}s (the target applies nothing); "
                                  "the copy is started again")
            chunk = ids[start:start + COPY_CHUNK]
            with hosted.lock.yielding():  # after the pushes waiting for the lock
                rows = hosted.table.rows_of(chunk)  # the chunk is sorted and unique: no second sort
                if not len(rows):
                    continue
                item = Item(SNAPSHOT_ROWS, name, sorted_unique(slot_of(rows.ids, num_slots)).astype(np.int32),
                            rows=rows, table_epoch=hosted.spec.created_epoch)
                if not replicator.enqueue_rows(stream, sess, item):
                    return
            replicator.pace(sess, item)  # a planned move's copy keeps to the server's copy rate
