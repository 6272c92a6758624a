"""Cluster checkpoints, restores and serving exports, through the primaries of a live cluster.

A checkpoint is one consistent cut per table on each primary (``ExportRows``: the table snapshotted under
its write lock, every slot at one log position), streamed to the caller and written as::

    DIR/manifest.json                     format, time, epoch, num_slots, and per table: its spec, step, rows and
                                          parts (each with the slots it holds and its manifest's sha256)
    DIR/tables/<table>/part-<k>/          one part per primary: a storage-engine snapshot (LMDB rows with a
                                          CRC per row, checksummed manifest)

written into a temp folder and renamed into place, so a crash never leaves a checkpoint that loads. A restore
recreates every table and writes the rows through the primaries the cluster has now (``ImportRows``, which
replicate like pushes): any number of servers, and the rows and optimizer state come back identical.

An export is a table's ids and float32 rows (no optimizer state), for serving, as two ``.npy`` files and a
small JSON file; ``since`` takes an earlier export and writes only the rows updated (or inserted) after it::

    import json, numpy as np                      # the reader needs nothing but numpy
    ids = np.load("export/ids.npy")               # (n,) int64
    rows = np.load("export/rows.npy")             # (n, dim) float32, rows[i] is the row of ids[i]
    meta = json.load(open("export/export.json"))  # table, dim, rows, time, since
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import numpy as np
from google.protobuf import json_format

from tigana.embeddings import RowBatch, row_digests
from tigana.embeddings import snapshot as snap
from tigana.embeddings.files import publish_folder
from tigana.proto import shard_pb2 as pb
from tigana.ps import routing
from tigana.ps.errors import DataLoss, InvalidArgument, PSError, from_rpc_error
from tigana.ps.wire import cluster as cluster_wire

FORMAT = "tigana-checkpoint"
VERSION = 1
_MANIFEST = "manifest.json"


def _table_dir(name: str) -> str:
    return "tables/" + quote(name, safe="").replace(".", "%2E")


def _primaries(client: Any) -> list[tuple[Any, np.ndarray]]:
    """(server, slots it leads) for every primary of the client's current route."""
    route = client._route
    out = []
    for i, server in enumerate(route.servers):
        slots = np.flatnonzero(route.primary_of_slot == i)
        if slots.size and server is not None:
            out.append((server, slots))
    if (route.primary_of_slot < 0).any():
        raise DataLoss(f"checkpoint: {int((route.primary_of_slot < 0).sum())} slot(s) have no primary now")
    return out


def _export_stream(client: Any, server: Any, table: str, slots: np.ndarray | None, *, weights_only: bool = False,
                   since: float = 0.0) -> Iterator[pb.ExportRowsChunk]:
    request = pb.ExportRowsRequest(table=table, chunk_rows=65536, weights_only=weights_only, since_time=since,
                                   epoch=client.epoch)
    if slots is not None:
        request.slots = np.asarray(slots, "<i4").tobytes()
    try:
        yield from server.stub.ExportRows(request, timeout=client.config.admin_timeout_s)
    except grpc.RpcError as err:
        raise from_rpc_error(err, server.address) from None


def write_checkpoint(client: Any, directory: str | os.PathLike, tables: list[str] | None = None) -> dict[str, Any]:
    """Checkpoint ``tables`` (default: all) of the cluster behind ``client`` into ``directory`` (which must not
    exist, or be empty). Returns the manifest."""
    root = Path(directory)
    if root.exists() and any(root.iterdir()):
        raise InvalidArgument(f"checkpoint: {str(root)!r} exists and is not empty")
    client.flush()
    names = tables or client.list_tables()
    tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest: dict[str, Any] = {"format": FORMAT, "version": VERSION, "created": time.time(), "epoch": client.epoch,
                                "num_slots": client.config.num_slots, "tables": {}}
    try:
        for name in names:
            deadline = time.monotonic() + client.config.failover_timeout_s
            while True:
                try:
                    manifest["tables"][name] = _checkpoint_table(client, tmp, name)
                    break
                except PSError as error:
                    # A slot moved (or its primary failed over) while its part was read: the table's parts are
                    # one set covering every slot, so the table is read again by the newest map.
                    if time.monotonic() > deadline or not _retryable(error, client):
                        raise
                    shutil.rmtree(tmp / _table_dir(name), ignore_errors=True)
                    if client._maps is not None:
                        client._maps.refresh(client.epoch + 1)
                    time.sleep(0.1)
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _publish(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _checkpoint_table(client: Any, tmp: Path, name: str) -> dict[str, Any]:
    """One table's entry of a checkpoint: a part per primary of the client's current route."""
    info = client.describe_table(name)
    spec = client._spec_pb(name)
    parts, rows, step = [], 0, 0
    for k, (server, slots) in enumerate(_primaries(client)):
        part = f"{_table_dir(name)}/part-{k:04d}"
        tail: dict[str, Any] = {}

        def batches(server=server, slots=slots, tail=tail) -> Iterator[RowBatch]:
            for chunk in _export_stream(client, server, name, slots):
                if chunk.step:
                    tail["step"] = max(tail.get("step", 0), int(chunk.step))
                if chunk.slots:
                    tail["slots"] = cluster_wire.array(chunk.slots, "<i4", field="slots").tolist()
                    tail["positions"] = list(zip(
                        cluster_wire.array(chunk.positions_epochs, "<u8", field="positions").tolist(),
                        cluster_wire.array(chunk.positions_indexes, "<u8", field="positions").tolist(),
                        strict=True))
                if chunk.HasField("rows"):
                    yield cluster_wire.rows_from_pb(chunk.rows, dim=info.config.dim,
                                                    state_width=int(info.stats["state_width"]), table=name)

        path = snap.write_snapshot(tmp / part, table=name, config=snap.config_to_dict(info.config),
                                   rows=batches(), meta={"server": server.address},
                                   state_width=int(info.stats["state_width"]))
        m = snap.read_manifest(path)
        parts.append({"path": str(path.relative_to(tmp)), "server": server.address, "rows": m["rows"],
                      "slots": routing.format_slots(tail.get("slots", slots.tolist())),
                      "manifest_sha256": m["manifest_sha256"]})
        rows += m["rows"]
        step = max(step, tail.get("step", 0))
    return {"spec": json_format.MessageToDict(spec, preserving_proto_field_name=True), "rows": rows, "step": step,
            "parts": parts}


def _publish(tmp: Path, root: Path) -> None:
    """Make the folder ``tmp`` durable and rename it to ``root`` (absent or empty): all of it or nothing."""
    if root.exists():
        root.rmdir()
    publish_folder(tmp, root)


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's manifest after checking its format and every part's manifest checksum."""
    root = Path(directory)
    try:
        manifest = json.loads((root / _MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise DataLoss(f"checkpoint {str(root)!r}: no readable {_MANIFEST}: {exc}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DataLoss(f"checkpoint {str(root)!r}: unsupported format {manifest.get('format')!r} "
                       f"version {manifest.get('version')!r}")
    for name, t in manifest["tables"].items():
        for part in t["parts"]:
            m = snap.read_manifest(root / part["path"])
            if m["manifest_sha256"] != part["manifest_sha256"] or m["table"] != name:
                raise DataLoss(f"checkpoint {str(root)!r}: part {part['path']} does not match the manifest")
    return manifest


def restore_checkpoint(client: Any, directory: str | os.PathLike, tables: list[str] | None = None
                       ) -> dict[str, int]:
    """Recreate the checkpoint's tables (dropping tables of those names) and write their rows through the
    cluster's current primaries. Returns rows restored per table."""
    root = Path(directory)
    manifest = read_manifest(root)
    if int(manifest["num_slots"]) != client.config.num_slots:
        raise InvalidArgument(f"restore: the checkpoint has {manifest['num_slots']} slots, the cluster "
                              f"{client.config.num_slots}")
    out = {}
    for name, t in manifest["tables"].items():
        if tables is not None and name not in tables:
            continue
        spec = json_format.ParseDict(t["spec"], pb.TableSpec())
        client.drop_table(name)
        client._create_from_spec(spec)
        written = 0
        sums = np.zeros(client.config.num_slots, np.uint64)
        counts = np.zeros(client.config.num_slots, np.int64)
        for part in t["parts"]:
            for batch in snap.iter_snapshot_rows(root / part["path"]):
                written += _import(client, name, batch, int(t["step"]))
                slots = routing.slot_of(batch.ids, client.config.num_slots)
                with np.errstate(over="ignore"):
                    np.add.at(sums, slots, row_digests(batch))
                counts += np.bincount(slots, minlength=client.config.num_slots)
        if written != int(t["rows"]):
            raise DataLoss(f"restore: table {name!r}: wrote {written} rows, the checkpoint holds {t['rows']}")
        _verify_restored(client, name, sums, counts)
        out[name] = written
    return out


def _verify_restored(client: Any, name: str, sums: np.ndarray, counts: np.ndarray) -> None:
    """Compare every slot's rows at its primary now with the checkpoint's (order-independent digests and
    counts): a row a concurrent map change discarded, or one written twice, is found here, not in training.
    ``DataLoss`` naming the slots that differ. Assumes nothing else writes the table during the restore."""
    deadline = time.monotonic() + client.config.failover_timeout_s
    while True:
        route = client._route
        seen = np.zeros(sums.shape[0], bool)
        bad: list[int] = []
        moved = False
        for i, server in enumerate(route.servers):
            led = route.primary_of_slot == i
            if server is None or not led.any():
                continue
            try:
                reply = server.stub.SlotInfo(pb.SlotInfoRequest(table=name, checksums=True),
                                             timeout=client.config.admin_timeout_s)
            except grpc.RpcError as err:
                error = from_rpc_error(err, server.address)
                if time.monotonic() > deadline or not _retryable(error, client):
                    raise error from None
                moved = True
                break
            for info in reply.tables:
                slots = cluster_wire.array(info.slots, "<i4", field="slots").astype(np.int64)
                keep = led[slots]
                slots = slots[keep]
                got = cluster_wire.array(info.checksums, "<u8", field="checksums")[keep]
                rows = cluster_wire.array(info.rows, "<i8", field="rows")[keep]
                seen[slots] = True
                bad += slots[(got != sums[slots]) | (rows != counts[slots])].tolist()
        if not moved and seen[counts > 0].all():
            break
        if time.monotonic() > deadline:
            raise DataLoss(f"restore: table {name!r}: the slots' primaries could not be checked")
        if client._maps is not None:
            client._maps.refresh(client.epoch + 1)
        time.sleep(0.1)
    if bad:
        raise DataLoss(f"restore: table {name!r}: {len(bad)} slot(s) differ from the checkpoint after the restore "
                       f"(slots {routing.format_slots(bad[:50])}); run the restore again")


def _import(client: Any, name: str, batch: RowBatch, step: int) -> int:
    """Write complete rows through their primaries (chunked under the message limit), retrying on a map move."""
    deadline = time.monotonic() + client.config.failover_timeout_s
    pending = batch
    while True:
        route = client._route
        primary = route.primary_of_slot[routing.slot_of(pending.ids, route.num_slots)]
        failed = []
        row_bytes = 8 + 4 * (pending.weights.shape[1] + pending.state.shape[1]) + 24
        per = max(1, client.config.chunk_bytes // row_bytes)
        for o in np.unique(primary):
            idx = np.flatnonzero(primary == o)
            if o < 0:
                failed.append(idx)
                continue
            server = route.servers[int(o)]
            for lo in range(0, idx.size, per):
                part = pending.take(idx[lo:lo + per])
                request = pb.ImportRowsRequest(table=name, rows=cluster_wire.rows_to_pb(part), epoch=route.epoch,
                                               step=step)
                try:
                    server.stub.ImportRows(request, timeout=client.config.timeout_s)
                except grpc.RpcError as err:
                    error = from_rpc_error(err, server.address)
                    if time.monotonic() > deadline or not _retryable(error, client):
                        raise error from None
                    failed.append(idx[lo:lo + per])
        if not failed:
            return len(batch)
        pending = pending.take(np.concatenate(failed))
        if client._maps is not None:
            client._maps.refresh(client.epoch + 1)
        time.sleep(0.1)


def _retryable(error: Exception, client: Any) -> bool:
    from tigana.ps.client.inflight import retryable

    return retryable(error, client._maps is not None)


def export_table(client: Any, table: str, out: str | os.PathLike, since: str | os.PathLike | None = None,
                 *, since_time: float | None = None) -> dict[str, Any]:
    """Write ``table``'s ids and float32 rows (no optimizer state) to ``out`` (a folder: ids.npy, rows.npy,
    deleted.npy, export.json), or with ``since`` (an earlier export's folder) only the rows updated after it,
    and in ``deleted.npy`` the tombstones: the ids eviction removed since then (a reader forgets them;
    ``export.json``'s ``deleted_complete`` is false when a server's tombstones no longer reach back that far,
    and only a full export is then exact). ``since_time`` (a unix time on the servers' clocks) is the same
    cut given directly: the follow loop (``tigana.ps.serving.exportlog``) passes its previous cut minus an
    overlap."""
    root = Path(out)
    if root.exists() and any(root.iterdir()):
        raise InvalidArgument(f"export: {str(root)!r} exists and is not empty")
    if since is not None and since_time is not None:
        raise InvalidArgument("export: give since or since_time, not both")
    since_time = float(since_time or 0.0)
    if since is not None:
        try:
            since_time = float(json.loads((Path(since) / "export.json").read_text())["time"])
        except (OSError, ValueError, KeyError) as exc:
            raise InvalidArgument(f"export: --since {str(since)!r} is not an export folder: {exc}") from None
    client.flush()
    info = client.describe_table(table)
    ids_parts, rows_parts, cut_times, deleted_parts = [], [], [], []
    complete = True
    for server, slots in _primaries(client):
        for chunk in _export_stream(client, server, table, slots, weights_only=True, since=since_time):
            if chunk.server_time:
                cut_times.append(chunk.server_time)
            if since_time and chunk.slots:  # a slot set's last chunk
                deleted_parts.append(cluster_wire.array(chunk.deleted_ids, "<i8", field="deleted_ids"))
                complete &= chunk.deleted_complete
            if chunk.HasField("rows"):
                rows = cluster_wire.rows_from_pb(chunk.rows, dim=info.config.dim, state_width=0, table=table)
                ids_parts.append(rows.ids)
                rows_parts.append(rows.weights)
    ids = np.concatenate(ids_parts) if ids_parts else np.empty(0, np.int64)
    rows = np.concatenate(rows_parts) if rows_parts else np.empty((0, info.config.dim), np.float32)
    deleted = np.setdiff1d(np.concatenate(deleted_parts) if deleted_parts else np.empty(0, np.int64), ids)
    order = np.argsort(ids, kind="stable")
    tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        np.save(tmp / "ids.npy", np.ascontiguousarray(ids[order], "<i8"))
        np.save(tmp / "rows.npy", np.ascontiguousarray(rows[order], "<f4"))
        np.save(tmp / "deleted.npy", np.ascontiguousarray(deleted, "<i8"))
        meta = {"format": "tigana-export", "version": 1, "table": table, "dim": info.config.dim,
                "rows": int(ids.size), "deleted": int(deleted.size), "deleted_complete": bool(complete),
                "time": min(cut_times) if cut_times else time.time(), "since": since_time,
                "files": {f: hashlib.sha256((tmp / f).read_bytes()).hexdigest()
                          for f in ("ids.npy", "rows.npy", "deleted.npy")}}
        (tmp / "export.json").write_text(json.dumps(meta, indent=1))
        _publish(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta
