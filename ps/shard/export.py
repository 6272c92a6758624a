"""Whole-table reads and writes of one shard server (``Exports``): ``ExportRows`` (a consistent cut of the slots this
server leads, streamed; or the rows changed since a time), ``ImportRows`` (a restore, written through the
primary and replicated like a push), ``SlotInfo`` (per slot rows, checksums, log positions and request
rates) and ``Stats``.

None of them holds a table's write lock for O(table) time: the cut is opened under the lock and read after it.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tigana.embeddings import Changes
from tigana.embeddings.changes import unique
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import InvalidArgument, Unavailable, WrongShard
from tigana.ps.replication import Replicator
from tigana.ps.routing import slot_of
from tigana.ps.shard.cuts import Cuts, rows_chunk
from tigana.ps.shard.hosted import HostedTables, _Hosted, checksum_value
from tigana.ps.shard.links import ServerLinks
from tigana.ps.shard.view import Holdings, View, check_unmoved
from tigana.ps.shard.writes import WritePath
from tigana.ps.wire import cluster as cluster_wire

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server


class Exports:
    """Exports, imports, slot information and table statistics of the tables of one shard server.

    Dependencies: ``tables``, ``holdings`` (the view an export reads under), ``writes`` (an import is written
    like a push), ``cuts`` (an export of a cluster cut), ``replicator`` (None on a static server; its figures)
    and ``links`` (the agent, asked for a newer map). Thread-safety: any thread; no table's write lock is held
    for O(table) time: a cut is opened under the lock and read after it. Blocking: exports write a temporary
    snapshot to disk; ``import_rows`` waits for room in the replication queue and for the in-sync copies."""

    def __init__(self, tables: HostedTables, holdings: Holdings, writes: WritePath, cuts: Cuts,
                 replicator: Replicator | None, links: ServerLinks, *, server_id: str, data_dir: Path | None,
                 ack_timeout_s: float) -> None:
        self.tables, self.holdings, self.writes, self.cuts = tables, holdings, writes, cuts
        self.replicator, self.links, self.server_id, self.data_dir = replicator, links, server_id, data_dir
        self.num_slots, self.clustered, self.ack_timeout_s = tables.num_slots, tables.clustered, ack_timeout_s

    def _named(self, table: str) -> list[tuple[str, _Hosted]]:
        """(name, table) of ``table`` (``TableNotFound`` when absent), or of every table when it is empty."""
        if table:
            return [(table, self.tables.get(table))]
        return [(n, h) for n, h in ((n, self.tables.find(n)) for n in self.tables.names()) if h is not None]

    def stats(self, table: str = "") -> list[pb.TableStats]:
        """``Stats``: the figures of ``table`` (every table when empty), each with its checksum (a pass over a
        copy-on-write cut, the table's lock held per chunk)."""
        return [pb.TableStats(table=name, values=self.values(name, hosted, checksum=True))
                for name, hosted in self._named(table)]

    def slot_infos(self, table: str = "", *, checksums: bool) -> pb.SlotInfoResponse:
        """``SlotInfo``: per held slot of ``table`` (every table when empty) rows, checksums, log positions and
        request rates, with this server's epoch and replication figures."""
        out = [self.slot_info(name, hosted, checksums=checksums) for name, hosted in self._named(table)]
        stats = self.replicator.stats() if self.replicator is not None else {}
        return pb.SlotInfoResponse(epoch=self.holdings.epoch, tables=out, server_id=self.server_id, replication=stats)

    def slot_info(self, name: str, hosted: _Hosted, *, checksums: bool, slots: np.ndarray | None = None
                  ) -> pb.SlotTableInfo:
        """Per held slot (or ``slots``): rows, checksums, log positions and request rates of one table."""
        view = self.holdings.view
        held = np.flatnonzero(view.holds).astype(np.int32) if slots is None else np.asarray(slots, np.int32)
        with hosted.lock:  # the checksums' cut and the positions of one moment; the cut is read after the lock
            positions = hosted.log.positions[held].copy()
            cut = hosted.table.cut() if checksums else None
            per_row = hosted.table.stats().get("row_bytes", 0.0)
        sums, counts = None, None
        if cut is not None:
            sums, counts = cut.checksums_by(lambda ids: slot_of(ids, self.num_slots), self.num_slots)
        if counts is None:
            counts = hosted.table.rows_per_slot(self.num_slots)
        msg = pb.SlotTableInfo(table=name, slots=held.astype("<i4").tobytes(),
                               rows=counts[held].astype("<i8").tobytes(),
                               lsn_epochs=positions[:, 0].astype("<u8").tobytes(),
                               lsn_indexes=positions[:, 1].astype("<u8").tobytes(),
                               pull_rates=hosted.pull_rate[held].astype("<f8").tobytes(),
                               push_rates=hosted.push_rate[held].astype("<f8").tobytes(),
                               bytes=(counts[held] * per_row).astype("<i8").tobytes())
        if sums is not None:
            msg.checksums = sums[held].astype("<u8").tobytes()
        return msg

    def export_rows(self, request: pb.ExportRowsRequest) -> Iterator[pb.ExportRowsChunk]:
        """Stream the rows of the slots this server leads, as one consistent cut of the table: the cut is opened
        under its write lock (with every slot's log position; O(1)), written to a temporary snapshot while
        writes go on (copy-on-write, ``tigana.embeddings.Cut``), then streamed from that snapshot. With
        ``since_time``, the rows changed since then; with ``cut``, a part of a cluster cut (``Cuts.chunks``)."""
        from tigana.embeddings import snapshot as snap

        if request.cut:  # a part of a cluster cut (``cuts``)
            yield from self.cuts.chunks(request)
            return
        name = request.table
        hosted = self.tables.get(name)
        view = self._export_view(name, hosted, int(request.epoch))
        if request.slots:
            slots = cluster_wire.array(request.slots, "<i4", field="slots").astype(np.int64)
            if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
                raise InvalidArgument(f"table {name!r}: field 'slots' is out of range [0, {self.num_slots})")
            if not view.leads[slots].all():
                raise WrongShard(f"table {name!r}: field 'slots' names slots this server does not lead at epoch "
                                 f"{view.epoch}", epoch=view.epoch)
        else:
            slots = np.flatnonzero(view.leads)
        want = np.zeros(self.num_slots, bool)
        want[slots] = True
        chunk = int(request.chunk_rows) or 65536
        since = float(request.since_time)
        base = self.data_dir / "export-tmp" if self.data_dir is not None else None
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        if since and not hosted.table.rows_spilled:
            # resident rows only: one vectorized pass over their update times under the lock. With a spill tier
            # the spilled rows' times live in the store, so the delta is read from a cut (below) instead.
            yield from self._export_since(name, hosted, slots, want, since, chunk, request.weights_only)
            return
        tmp = Path(tempfile.mkdtemp(prefix="cut-", dir=base))
        try:
            with hosted.lock:  # the cut: rows, positions and step at one moment (O(1): copy-on-write)
                self._check_hosted(name, hosted)
                cut_time = time.time()
                table = hosted.table
                pending = table.begin_snapshot(tmp, incremental=False, track=False)
                positions = hosted.log.positions[slots].copy()
                step = table.step
                deleted = table.removed_since(since, self._in(want)) if since else None
            path = pending.write()  # the rows as of the cut, read while pushes go on
            first = True
            buffered: list = []
            count = 0
            for batch in snap.iter_snapshot_rows(path, batch_size=chunk):
                keep = want[slot_of(batch.ids, self.num_slots)]
                if since:
                    keep &= batch.last_time >= since
                if not keep.all():
                    batch = batch.take(keep)
                if not len(batch):
                    continue
                buffered.append(batch)
                count += len(batch)
                if count >= chunk:
                    yield rows_chunk(buffered, request.weights_only, step, cut_time if first else 0.0)
                    first, buffered, count = False, [], 0
            out = rows_chunk(buffered, request.weights_only, step, cut_time if first else 0.0)
            self._tombstones(out, deleted)
            out.slots = slots.astype("<i4").tobytes()
            out.positions_epochs = positions[:, 0].astype("<u8").tobytes()
            out.positions_indexes = positions[:, 1].astype("<u8").tobytes()
            yield out
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _export_view(self, name: str, hosted: _Hosted, epoch: int) -> View:
        """The view an export (not a cluster cut) reads under: this server has installed the request's map
        (``epoch``, 0: not said) and serves the incarnation of the table that map names. A server behind the
        request, or holding an incarnation the request's map does not know (dropped and created again), would
        export another incarnation's rows: Unavailable, retried by a newer map."""
        view = self.holdings.view
        if not view.valid:
            raise Unavailable(f"table {name!r}: server {self.server_id} is not in the cluster yet")
        if epoch > view.epoch:
            self.links.refresh_soon(epoch)
            raise Unavailable(f"table {name!r}: server {self.server_id} is at map epoch {view.epoch}, behind the "
                              f"export's (epoch {epoch}); retry", epoch=view.epoch)
        created = hosted.spec.created_epoch
        if created > view.epoch or (epoch and created > epoch):
            raise Unavailable(f"table {name!r}: server {self.server_id} holds the table as created at epoch "
                              f"{created}, newer than the export's map (epoch {epoch or view.epoch}); retry by a "
                              "newer map", epoch=view.epoch)
        return view

    def _check_hosted(self, name: str, hosted: _Hosted) -> None:
        """Under ``hosted``'s lock: it is still the table served as ``name`` (not dropped or created again)."""
        if self.tables.find(name) is not hosted:
            raise Unavailable(f"table {name!r} was dropped or created again on server {self.server_id} while "
                              "the export started; retry", epoch=self.holdings.epoch)

    def _export_since(self, name: str, hosted: _Hosted, slots: np.ndarray, want: np.ndarray, since: float,
                      chunk: int, weights_only: bool):
        """ExportRows with ``since_time`` (serving deltas, ``tigana admin export --since/--follow``): the rows
        updated at or after ``since`` are copied in memory under the lock (the same cut as a snapshot: rows,
        positions, step and time at one moment), then streamed; its cost follows the rows changed, not the
        table's size, and no snapshot is written."""
        with hosted.lock:
            self._check_hosted(name, hosted)
            cut_time = time.time()
            rows = hosted.table.export_rows(self._in(want), since=since)
            deleted = hosted.table.removed_since(since, self._in(want))
            positions = hosted.log.positions[slots].copy()
            step = hosted.table.step
        starts = range(0, len(rows), chunk) if len(rows) else range(1)
        for k, lo in enumerate(starts):
            part = [rows.take(slice(lo, lo + chunk))] if len(rows) else []
            out = rows_chunk(part, weights_only, step, cut_time if k == 0 else 0.0)
            if lo + chunk >= len(rows):
                self._tombstones(out, deleted)
                out.slots = slots.astype("<i4").tobytes()
                out.positions_epochs = positions[:, 0].astype("<u8").tobytes()
                out.positions_indexes = positions[:, 1].astype("<u8").tobytes()
            yield out

    def _in(self, want: np.ndarray):
        """The predicate of ids in the slots ``want`` marks."""
        return lambda ids: want[slot_of(ids, self.num_slots)]

    @staticmethod
    def _tombstones(out: pb.ExportRowsChunk, deleted: tuple[np.ndarray, bool] | None) -> None:
        """A delta's last chunk carries its tombstones (``removed_since``) and whether they are complete."""
        if deleted is not None:
            out.deleted_ids = np.ascontiguousarray(deleted[0], "<i8").tobytes()
            out.deleted_complete = bool(deleted[1])

    def import_rows(self, request: pb.ImportRowsRequest, timeout_s: float | None = None) -> pb.ImportRowsResponse:
        """``ImportRows``: write complete rows (a restore) through this primary, replicated to the slots' copies
        like a push and answered once the in-sync copies have them (``timeout_s``: what is left of its deadline,
        for the wait for room in the replication queue)."""
        name = request.table
        hosted = self.tables.get(name)
        rows = cluster_wire.rows_from_pb(request.rows, dim=hosted.table.dim, state_width=hosted.table.state_width,
                                         table=name)
        self.writes.check_rows(name, len(rows))
        self.writes.wait_for_room(name, timeout_s)
        with hosted.lock:
            view, slots = self.writes.check_leads(name, rows.ids, request.epoch)
            uslots = unique(slots)
            changes = Changes() if self.replicator is not None and self.replicator.streams else None
            hosted.table.import_rows(rows)
            if request.step:
                hosted.table.apply_changes(step=int(request.step))
            if changes is not None:
                changes.wrote(rows.ids)
            marks = self.writes.replicate(hosted, view, changes, uslots, None)
        if marks and self.replicator is not None and not self.replicator.wait(marks, self.ack_timeout_s):
            raise Unavailable(f"table {name!r}: rows written here but not yet by the in-sync copies; retry",
                              epoch=self.holdings.epoch)
        check_unmoved(name, view, self.holdings.view, uslots)
        return pb.ImportRowsResponse(rows=len(rows))

    def values(self, name: str, hosted: _Hosted, *, checksum: bool) -> dict[str, float]:
        """The figures of one table (``Stats``, ``DescribeTable``): the engine's stats, rows led, the
        exactly-once window's size, cuts open, the epoch; with ``checksum``, its digest (a pass over a cut)."""
        values: dict[str, float] = {}
        for key, value in hosted.table.stats().items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                continue
        values["rows"] = float(len(hosted.table))
        values["dim"] = float(hosted.table.config.dim)
        values["state_width"] = float(hosted.table.state_width)
        leads = self.holdings.view.leads
        if checksum:  # one pass over a cut (the table's lock is held per chunk only): digest and rows per slot
            cut = hosted.table.cut()
            _, counts = cut.checksums_by(lambda ids: slot_of(ids, self.num_slots), self.num_slots)
            values["checksum"] = checksum_value(cut.checksum())
            if self.clustered:  # rows counted once cluster-wide: at their primary
                values["rows_led"] = float(counts[leads].sum())
        elif self.clustered:  # one pass over the index, the lock held per range of buckets (no list of every id)
            values["rows_led"] = float(hosted.table.rows_per_slot(self.num_slots)[leads].sum())
        values["dedup_keys"] = float(len(hosted.dedup))
        values["cuts_open"] = float(len(self.cuts))  # cluster cuts held or unread (``cuts``)
        values["epoch"] = float(self.holdings.epoch)
        if self.replicator is not None:
            values.update(self.replicator.stats())
        return values
