"""Serving exports of a table (``export_table``), and the helpers checkpoints share: the primaries of a route,
an ``ExportRows`` stream, publishing a folder whole.

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

from tigana.embeddings.files import publish_folder
from tigana.proto import shard_pb2 as pb
from tigana.ps.client.checkpoint.port import CheckpointPort
from tigana.ps.client.routes import Server
from tigana.ps.errors import DataLoss, InvalidArgument, PSError, from_rpc_error
from tigana.ps.wire import cluster as cluster_wire

FORMAT = "tigana-checkpoint"
VERSION = 1
_MANIFEST = "manifest.json"


def _table_dir(name: str) -> str:
    return "tables/" + quote(name, safe="").replace(".", "%2E")


def _primaries(port: CheckpointPort) -> list[tuple[Server, np.ndarray]]:
    """(server, slots it leads) for every primary of the client's current route."""
    route = port.route()
    out = []
    for i, server in enumerate(route.servers):
        slots = np.flatnonzero(route.primary_of_slot == i)
        if slots.size and server is not None:
            out.append((server, slots))
    if (route.primary_of_slot < 0).any():
        raise DataLoss(f"checkpoint: {int((route.primary_of_slot < 0).sum())} slot(s) have no primary now")
    return out


def _export_stream(port: CheckpointPort, server: Server, table: str, slots: np.ndarray | None, *, weights_only: bool = False,
                   since: float = 0.0) -> Iterator[pb.ExportRowsChunk]:
    request = pb.ExportRowsRequest(table=table, chunk_rows=65536, weights_only=weights_only, since_time=since,
                                   epoch=port.route().epoch)
    if slots is not None:
        request.slots = np.asarray(slots, "<i4").tobytes()
    try:
        yield from server.stub.ExportRows(request, timeout=port.config.admin_timeout_s)
    except grpc.RpcError as err:
        raise from_rpc_error(err, server.address) from None


def _publish(tmp: Path, root: Path) -> None:
    """Make the folder ``tmp`` durable and rename it to ``root`` (absent or empty): all of it or nothing."""
    if root.exists():
        root.rmdir()
    publish_folder(tmp, root)


def _retryable(error: Exception, port: CheckpointPort) -> bool:
    from tigana.ps.port.inflight import retryable

    return retryable(error, port._maps is not None)


def _read_export(port: CheckpointPort, table: str, dim: int, since_time: float) -> tuple[list, list, list, list, bool]:
    """Every primary's rows of ``table`` (weights only), its cut times and its tombstones: one export pass."""
    ids_parts, rows_parts, cut_times, deleted_parts = [], [], [], []
    complete = True
    for server, slots in _primaries(port):
        for chunk in _export_stream(port, server, table, slots, weights_only=True, since=since_time):
            if chunk.server_time:
                cut_times.append(chunk.server_time)
            if since_time and chunk.slots:  # a slot set's last chunk
                deleted_parts.append(cluster_wire.array(chunk.deleted_ids, "<i8", field="deleted_ids"))
                complete &= chunk.deleted_complete
            if chunk.HasField("rows"):
                rows = cluster_wire.rows_from_pb(chunk.rows, dim=dim, state_width=0, table=table)
                ids_parts.append(rows.ids)
                rows_parts.append(rows.weights)
    return ids_parts, rows_parts, cut_times, deleted_parts, complete


def export_table(port: CheckpointPort, table: str, out: str | os.PathLike, since: str | os.PathLike | None = None,
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
    port.flush()
    info = port.describe_table(table)
    deadline = time.monotonic() + port.config.failover_timeout_s
    while True:
        try:
            ids_parts, rows_parts, cut_times, deleted_parts, complete = _read_export(port, table, info.config.dim,
                                                                                     since_time)
            break
        except PSError as error:
            # a server behind the map the export was routed by, or a primary moved: read again by the newest map
            if time.monotonic() > deadline or not port.retryable(error):
                raise
            port.follow_map()
            time.sleep(0.1)
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
