"""The copy's side of replication: a target applies a primary's stream in order (invariant I3).

``Inbound`` is the state of one incoming stream (per source server): its boot, generation and the last seq
applied, so a retried request is applied once and a gap is refused. ``apply_item`` applies one item:

- an item of a table this server no longer has, in an incarnation its map dropped, is moot: skipped;
- slots this server no longer holds while the source still leads them (the map removed the copy) are moot:
  skipped;
- slots whose primary, in its map, is not the source are refused (``REJECT_STALE``, nothing applied), held
  here or not: the source was deposed, and its late writes must neither land nor be acknowledged;
- CHANGES and BARRIER apply only where the slot's log position equals the item's ``prev`` (``REJECT_DIVERGED``
  naming the slots otherwise, nothing applied);
- a slot copy's rows and its end come on the copy lane, each once the change lane was applied through the seq
  the rows were read after (``REJECT_WAIT`` before), and land only where ``intake`` admits them.

A refusal names its slots; the primary stops sending those slots and reports only the ones it still leads
with an in-sync copy here (``stream``), so a map change with items in flight demotes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from tigana.embeddings.errors import EmbeddingError
from tigana.embeddings.masks import all_set, any_set
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import PSError
from tigana.ps.logs import event, slots_text
from tigana.ps.replication.actions import RefreshMap
from tigana.ps.replication.intake import copy_token
from tigana.ps.replication.stream import restrict
from tigana.ps.routing import IN_SYNC, format_slots, slot_of
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire.cluster import BARRIER, CHANGES, SNAPSHOT_BEGIN, SNAPSHOT_END, SNAPSHOT_ROWS

log = logging.getLogger("tigana.ps.replication")

Reject = tuple[int, str, "np.ndarray | None"]
DROP_CHUNK = 16384  # rows deleted per hold of a table's write lock (~2 ms)


class Inbound:
    """The state of one incoming stream (per source server): its boot, generation and last applied seq.
    Sans-IO: the adapter serializes the calls of one stream (the service holds a lock per source)."""

    def __init__(self, source: str = "") -> None:
        self.source = source  # the sending server's id
        self.boot = ""
        self.generation = 0
        self.applied = 0

    def receive(self, request: Any, server_id: str, view_of: Callable[[], Any],
                apply_one: Callable[[Any, int], Reject | None], *, may_refresh: bool = True
                ) -> pb.ReplicateResponse | RefreshMap:
        """Apply a ``ReplicateRequest`` (or its raw view) in order: the response (applied seq, or a refusal),
        or, when the source's map is newer than ours and ``may_refresh``, ``RefreshMap``: the adapter learns
        that map and hands the request in again (``may_refresh=False``: then it is refused as BEHIND)."""
        if request.source_boot != self.boot or request.generation != self.generation:
            if request.source_boot == self.boot and request.generation < self.generation:
                return self._reject(server_id, view_of(), pb.REJECT_GAP,
                                    f"stream generation {request.generation} is older than {self.generation}")
            if request.first_seq != 1:
                return self._reject(server_id, view_of(), pb.REJECT_GAP,
                                    f"a new stream must start at seq 1, got {request.first_seq}")
            self.boot, self.generation, self.applied = request.source_boot, request.generation, 0
        if request.epoch > view_of().epoch:
            if may_refresh:
                return RefreshMap(int(request.epoch))
            return self._reject(server_id, view_of(), pb.REJECT_BEHIND,
                                f"this server's map (epoch {view_of().epoch}) is older than the "
                                f"source's ({request.epoch})")
        if not view_of().valid:
            return self._reject(server_id, view_of(), pb.REJECT_BEHIND, "this server is not in the cluster's "
                                                                        "map yet")
        for i, msg in enumerate(request.items):
            seq = request.first_seq + i
            if seq <= self.applied:
                continue  # a retried request: applied already
            if seq != self.applied + 1:
                return self._reject(server_id, view_of(), pb.REJECT_GAP,
                                    f"expected seq {self.applied + 1}, got {seq}")
            try:
                reject = apply_one(msg, int(request.epoch))
            except Exception as exc:  # noqa: BLE001 - a malformed item breaks the stream, never the server
                reject = (pb.REJECT_DIVERGED, f"malformed replication item: {type(exc).__name__}: {exc}", None)
            if reject is not None:
                code, text, slots = reject
                return self._reject(server_id, view_of(), code, text, slots)
            self.applied = seq
        return pb.ReplicateResponse(applied_through=self.applied, epoch=view_of().epoch)

    def _reject(self, server_id: str, view: Any, code: int, message: str, slots: np.ndarray | None = None
                ) -> pb.ReplicateResponse:
        epoch, name = view.epoch, pb.ReplicateReject.Name(code)
        listed = np.empty(0, np.int64) if slots is None else np.asarray(slots)
        level = logging.DEBUG if code == pb.REJECT_WAIT else \
            logging.INFO if code in (pb.REJECT_BEHIND, pb.REJECT_STALE) else logging.WARNING
        log.log(level, "replication stream from %s to %s refused at epoch %d (slots %s): %s: %s", self.source,
                server_id, epoch, slots_text(listed), name, message,
                extra=event("replication_rejected", slots=listed, epoch=epoch, server=server_id, source=self.source,
                            reject=name))
        out = pb.ReplicateResponse(applied_through=self.applied, reject=code, message=message, epoch=epoch)
        if slots is not None:
            out.slots = np.asarray(slots, "<i4").tobytes()
        return out


def copy_lane_ready(change: Inbound, boot: str, generation: int) -> Callable[[int], Reject | None]:
    """For the copy lane of stream (``boot``, ``generation``): whether its change lane (``change``) was applied
    through a seq here (None), or the refusal that says to resend later (``REJECT_WAIT``). Read without the
    change lane's lock: its applied seq only grows within a stream, and a stream replaced meanwhile never
    matches."""
    def ready(after: int) -> Reject | None:
        if change.boot == boot and change.generation == generation and change.applied >= after:
            return None
        return (pb.REJECT_WAIT, f"the change lane is at seq {change.applied} (generation {change.generation}), "
                                f"the copied rows follow seq {after}", None)
    return ready


def apply_item(msg: Any, source: str, request_epoch: int, hosted_of: Callable[[str], Any], view_of: Callable[[], Any],
               num_slots: int, *, generation: int = 0, copy_ready: Callable[[int], Reject | None] | None = None
               ) -> Reject | None:
    """Apply one item (a view of the request or a protobuf message); a refusal (code, text, slots) or None.

    ``hosted_of(name)``: the table as served (``table``, ``dedup``, ``log``, ``lock``, ``spec``, ``intake``) or
    None; ``view_of()``: the server's current view of the map (``epoch``, ``map``, ``holds``, ``valid``).
    ``generation``: the stream's; ``copy_ready``: given for an item of the copy lane, the refusal (WAIT) while
    the change lane has not been applied through the seq it names, or None."""
    name, table_epoch = cluster_wire.item_header(msg)
    hosted = hosted_of(name)
    if hosted is None or hosted.spec.created_epoch != table_epoch:
        return _not_served(name, table_epoch, request_epoch, view_of(), "is not in this server's map yet")
    item = cluster_wire.decode_item(msg, dim=hosted.table.dim, state_width=hosted.table.state_width)
    slots = item.slots.astype(np.int64)
    # the ufuncs' own reduce: ``ndarray.min``/``max`` add numpy's Python wrappers (2 us each on a few slots)
    if slots.size and (np.minimum.reduce(slots) < 0 or np.maximum.reduce(slots) >= num_slots):
        return pb.REJECT_DIVERGED, f"table {name!r}: item slots out of range", None
    if (item.kind in (SNAPSHOT_ROWS, SNAPSHOT_END)) != (copy_ready is not None):
        lane = "copy" if copy_ready is not None else "change"
        return pb.REJECT_DIVERGED, f"table {name!r}: a {cluster_wire.KIND_NAMES.get(item.kind)} item on the {lane} " \
                                   "lane", None
    if copy_ready is not None and item.kind == SNAPSHOT_ROWS:
        wait = copy_ready(item.after)
        if wait is not None:
            return wait
    # a copy lane's rows after the change-lane items and pushes waiting for the lock (sync pushes wait on those)
    with hosted.lock if copy_ready is None else hosted.lock.yielding():
        if hosted.table.closed or hosted_of(name) is not hosted:
            # Dropped (or closed by a stopping server) while this item waited for the lock: moot once the map
            # that dropped it is installed, else resent later. Never DIVERGED: applying to the closed table
            # failed, and the primary demoted this copy for a planned drop (nemesis, under a loaded machine).
            return _not_served(name, table_epoch, request_epoch, view_of(), "was closed here before this item")
        view = view_of()
        m = view.map
        src = m.index_of(source) if m is not None else -1
        held = view.holds[slots]
        leads = (m.copies[slots, 0] == src) if m is not None else np.zeros(slots.shape[0], bool)
        # Whether held here or not: a slot the source does not lead in this map is refused. Skipping a slot this
        # server no longer holds is right only while the source still leads it (the map removed this copy);
        # from a deposed primary (paused, declared dead, back with writes still waiting for this copy) the
        # skip was acknowledged as if applied and released those writes (bench sim seed 244: S1 lost).
        if not all_set(leads):
            stale = ~leads
            return (pb.REJECT_STALE, f"table {name!r}: server {source} does not lead slot(s) "
                    f"{format_slots(slots[stale][:20])} at epoch {view.epoch}", slots[stale])
        if not all_set(held):  # copies the map removed from this server: moot, skipped
            keep = np.zeros(num_slots, bool)
            keep[slots[held]] = True
            item = restrict(item, keep, lambda ids: slot_of(ids, num_slots))
            slots = item.slots.astype(np.int64)
            if not slots.size:
                return None
        if item.kind == SNAPSHOT_BEGIN:
            # A slot copy starts only over a copy this server's map has catching up: one its map has in sync
            # (a newer map accepted an earlier copy's report) is never emptied by a stale new start.
            in_sync = m.copy_state(view.me)
            fresh = in_sync[slots] == IN_SYNC
            if any_set(fresh):
                return (pb.REJECT_STALE, f"table {name!r}: slot(s) {format_slots(slots[fresh][:20])} are in sync "
                        f"here at epoch {view.epoch}; a new slot copy would empty them", slots[fresh])
        if item.kind in (CHANGES, BARRIER):
            match = hosted.log.matches(slots, item.prev)
            if not all_set(match):
                return (pb.REJECT_DIVERGED, f"table {name!r}: slot(s) {format_slots(slots[~match][:20])} here are "
                        "not at the position the item follows", slots[~match])
        try:
            if item.kind == CHANGES:
                hosted.table.apply_changes(item.rows, item.deletes, item.sightings, item.step, check_values=False)
                hosted.dedup.merge(item.dedup)
                hosted.log.advance(slots, item.lsn)
                hosted.intake.removed(item.deletes)
            elif item.kind == SNAPSHOT_BEGIN:
                # The slots' old rows are deleted below, a chunk per lock hold; nothing can land in them
                # meanwhile: this stream's later items wait for this one, the new copy's rows wait for the change
                # lane to pass it (S11), and an older copy's rows are no longer admitted once this one began.
                # the copy's rows come from elsewhere: so do removals (on the table's clock, which stamps them)
                hosted.table.tombstones_unknown_before(hosted.table.wall_clock())
                hosted.dedup.forget_slots(slots)
                hosted.dedup.merge(item.dedup)
                hosted.log.reset(slots, item.prev)
                hosted.intake.begin(slots, copy_token(source, generation, item.copy_id))
            elif item.kind == SNAPSHOT_ROWS and item.rows is not None and len(item.rows):
                # Only rows no change wrote or removed since the copy began (``intake``): those are newer.
                rows = item.rows
                land = hosted.intake.admit(rows.ids, copy_token(source, generation, item.copy_id),
                                           hosted.table.contains(rows.ids))
                if land.any():
                    hosted.table.import_rows(rows if land.all() else rows.take(land))
            elif item.kind == SNAPSHOT_END:
                hosted.intake.end(slots, copy_token(source, generation, item.copy_id))
        except PSError as exc:
            return pb.REJECT_DIVERGED, f"table {name!r}: cannot apply item: {exc}", slots
        except Exception as exc:  # noqa: BLE001 - engine validation errors and bugs alike break the stream
            if not isinstance(exc, ValueError):
                log.exception("applying a replication item from %s at epoch %d failed (table %r, slots %s)",
                              source, view.epoch, name, slots_text(slots),
                              extra=event("replication_apply_failed", slots=slots, epoch=view.epoch, source=source,
                                          table=name))
            return pb.REJECT_DIVERGED, f"table {name!r}: cannot apply item: {exc}", slots
    if item.kind == SNAPSHOT_BEGIN and not drop_rows(hosted, slots, num_slots, lambda: hosted_of(name) is hosted):
        return _not_served(name, table_epoch, request_epoch, view_of(), "was closed here during this item")
    return None


def _not_served(name: str, table_epoch: int, request_epoch: int, view: Any, why: str) -> Reject | None:
    """An item of a table this server does not serve: moot (None) when the incarnation it belongs to was dropped
    at an epoch this map has seen; else a refusal to resend it later (BEHIND, no slots: nothing is reported), as
    the map that creates the table, or the one that dropped it, is not installed here yet."""
    spec = view.map.tables.get(name) if view.map is not None else None
    if view.epoch >= request_epoch and (spec is None or spec.created_epoch > table_epoch):
        return None
    return pb.REJECT_BEHIND, f"table {name!r} (created at epoch {table_epoch}) {why}", None


def drop_rows(hosted: Any, slots: np.ndarray, num_slots: int, served: Callable[[], bool]) -> bool:
    """Delete every row of ``slots`` from the table (a SNAPSHOT_BEGIN empties them before any row of the new copy
    lands): the ids found in one pass over the table's index, deleted a chunk per hold of its write lock
    (``delete_in_chunks``). The caller holds no lock. False: the table stopped being ``served`` (dropped or
    closed) before every chunk was deleted."""
    mask = np.zeros(num_slots, bool)
    mask[slots] = True
    try:
        gone = hosted.table.stored_ids_in_slots(num_slots, mask)
    except EmbeddingError:
        if hosted.table.closed:  # dropped, or the server stopping, since the item was applied: never DIVERGED (L4)
            return False
        raise
    stopped = False

    def keep(chunk: np.ndarray) -> np.ndarray | None:
        nonlocal stopped
        stopped = hosted.table.closed or not served()
        return None if stopped else chunk

    delete_in_chunks(hosted, gone, keep)
    return not stopped


def delete_in_chunks(hosted: Any, ids: np.ndarray, keep: Callable[[np.ndarray], np.ndarray | None]) -> int:
    """Delete ``ids`` from ``hosted.table`` in chunks of ``DROP_CHUNK``, each under one hold of its write lock
    entered through ``TableLock.yielding`` (after the pushes, pulls and change-lane items waiting for it), so a
    large delete never holds up the writes of the slots this server still leads. ``keep(chunk)``, called under
    the lock, gives the ids of the chunk still to delete, or None to stop. The rows deleted."""
    deleted = 0
    for lo in range(0, ids.size, DROP_CHUNK):
        with hosted.lock.yielding():
            chunk = keep(ids[lo:lo + DROP_CHUNK])
            if chunk is None:
                break
            if chunk.size:
                deleted += hosted.table.delete(chunk)
    return deleted
