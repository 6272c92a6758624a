"""The shard service: a thin gRPC adapter over the storage engine's ``EmbeddingTable``s.

Each handler decodes the request with ``tigana.ps.wire``, checks it against the table and the owned slots, calls
the table, and encodes the answer. ``add_to_server`` registers the service with the data path's own codecs: a
Push request is parsed into zero-copy views and a Pull reply is written as serialized bytes in one copy (the
messages of proto/shard.proto either way; the generated registration works too, with protobuf objects). Every exception a handler raises becomes a gRPC status in one place (``_rpc``,
through ``errors.to_status``); a bug answers INTERNAL and the server keeps serving. Validation happens before
anything changes, so a rejected request leaves every table as it was.

Persistence under ``data_dir``::

    tables.json                          specs of the hosted tables (rewritten on create/drop/snapshot)
    snapshots/<table>/...                the storage engine's snapshot chain of each table
    dedup/<table>/<snapshot name>.json   the exactly-once window as of that snapshot
    spill/<table>/                       the LMDB tier of tables with a memory budget

(``<table>`` is the name percent-encoded, dots included, so every name maps to one folder inside data_dir.)

Thread-safety: handlers run on gRPC's thread pool. Tables lock themselves; a per-table lock makes the
dedup check, the apply and the record of a push atomic and keeps a snapshot consistent with its dedup window;
a registry lock serializes create/drop/restore.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import numpy as np
from google.protobuf import json_format

from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps import _kernels, wire
from tigana.ps.config import ServerConfig
from tigana.ps.dedup import DedupWindow
from tigana.ps.errors import (
    InvalidArgument,
    ResourceExhausted,
    TableExists,
    TableNotFound,
    Unavailable,
    WrongShard,
    to_status,
)
from tigana.ps.metrics import ServerMetrics
from tigana.ps.routing import slot_of

log = logging.getLogger("tigana.ps.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Shard"].full_name  # "tigana.v1.Shard"
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f]")
_CODECS = frozenset(pb.Codec.values())
_STATES = {"loading": "is loading its tables", "failed": "failed to load its tables (see its log)",
           "closed": "is shut down"}


def checksum_value(digest: str) -> float:
    """A table checksum (any string) as a float that survives a ``map<string, double>`` exactly (53 bits)."""
    h = hashlib.blake2b(digest.encode(), digest_size=8).digest()
    return float(int.from_bytes(h, "little") >> 11)


@dataclasses.dataclass
class _Hosted:
    """A table as served: the engine table, the spec it was created with, its push lock and dedup window."""

    spec: TableConfig  # as requested over the wire; what exist_ok compares
    table: EmbeddingTable
    dedup: DedupWindow
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def _rpc(method: str) -> Callable:
    """Wrap a handler: refuse while not serving, time it, count it, turn any exception into a status."""

    def wrap(handler: Callable) -> Callable:
        @functools.wraps(handler)
        def wrapper(self: ShardService, request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            status: grpc.StatusCode | None = None
            try:
                if self.state != "serving":
                    raise Unavailable(f"{method}: server {_STATES.get(self.state, self.state)}")
                return handler(self, request, context)
            except Exception as exc:  # noqa: BLE001 - a request never takes the daemon down
                status, message = to_status(exc)
                if status == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed with a bug", method)
            finally:
                self.metrics.observe(method, status.name if status else "OK", time.perf_counter() - start)
            context.abort(status, message)

        return wrapper

    return wrap


class ShardService(shard_pb2_grpc.ShardServicer):
    """The tables of one shard server. ``state`` is loading -> serving -> closed."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ServerMetrics(self.table_sizes)
        self.state = "loading"
        self.data_dir = Path(config.data_dir) if config.data_dir else None
        self._tables: dict[str, _Hosted] = {}
        self._registry_lock = threading.RLock()
        self.set_owned_slots(config.owned_slots())

    # --- ownership ----------------------------------------------------------------------------------------
    def set_owned_slots(self, mask: np.ndarray) -> None:
        """Replace the owned slot set ((num_slots,) bool). Requests already past the check are not affected."""
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (self.config.num_slots,):
            raise InvalidArgument(f"owned slots: expected a mask of {self.config.num_slots} slots, got {mask.shape}")
        self._ownership = (mask.copy(), bool(mask.all()))  # one attribute: readers see both or neither

    def owned_slots(self) -> np.ndarray:
        return self._ownership[0].copy()

    def _check_owned(self, table: str, ids: np.ndarray) -> None:
        owned, owns_all = self._ownership
        if owns_all or len(ids) == 0:
            return
        count, first = _kernels.first_foreign(ids, owned)
        if count:
            example = int(ids[first])
            raise WrongShard(f"table {table!r}: field 'ids' has {count} id(s) in slots this server does not own "
                             f"(e.g. id {example}, slot {int(slot_of(np.array([example]), self.config.num_slots)[0])})")

    # --- tables ---------------------------------------------------------------------------------------------
    def _get(self, name: str) -> _Hosted:
        hosted = self._tables.get(name)
        if hosted is None:
            if not name:
                raise InvalidArgument("request: field 'table' is empty")
            raise TableNotFound(f"table {name!r} not found on this server")
        return hosted

    def _effective(self, spec: TableConfig) -> TableConfig:
        """The config a table runs with: the server's memory budget when the spec sets none; spill under data_dir."""
        budget = spec.memory_budget or self.config.memory_budget or None
        spill = spec.spill_dir
        if budget and spill is None and self.data_dir is not None:
            spill = str(self._dir("spill", spec.name))
        return dataclasses.replace(spec, memory_budget=budget, spill_dir=spill)

    def table_names(self) -> list[str]:
        return sorted(self._tables)

    def table_sizes(self) -> dict[str, dict[str, float]]:
        """{table: {"rows", "bytes"}} for the metrics endpoint (cheap: no checksum)."""
        out = {}
        for name, hosted in list(self._tables.items()):
            try:
                stats = hosted.table.stats()
                out[name] = {"rows": float(len(hosted.table)),
                             "bytes": float(stats.get("bytes_resident", stats.get("bytes", 0.0)))}
            except Exception:  # noqa: BLE001 - a closing table must not break a scrape
                continue
        return out

    def _values(self, name: str, hosted: _Hosted, *, checksum: bool) -> dict[str, float]:
        values: dict[str, float] = {}
        for key, value in hosted.table.stats().items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                continue
        values["rows"] = float(len(hosted.table))
        values["dim"] = float(hosted.table.config.dim)
        values["dedup_keys"] = float(len(hosted.dedup))
        if checksum:
            values["checksum"] = checksum_value(hosted.table.checksum())
        return values

    # --- RPCs ------------------------------------------------------------------------------------------------
    @_rpc("CreateTable")
    def CreateTable(self, request: pb.CreateTableRequest, context: grpc.ServicerContext) -> pb.CreateTableResponse:
        spec = wire.spec_from_pb(request.spec)
        if len(spec.name) > 200 or _BAD_NAME.search(spec.name):
            raise InvalidArgument(f"table {spec.name!r}: field 'name' must be at most 200 characters without "
                                  "control characters")
        with self._registry_lock:
            existing = self._tables.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    diff = [f.name for f in dataclasses.fields(spec)
                            if getattr(spec, f.name) != getattr(existing.spec, f.name)]
                    raise TableExists(f"table {spec.name!r} already exists with a different spec "
                                      f"(field(s) {', '.join(diff)} differ)")
                if not request.exist_ok:
                    raise TableExists(f"table {spec.name!r} already exists (pass exist_ok to accept it)")
                return pb.CreateTableResponse(spec=wire.spec_to_pb(existing.spec), created=False)
            self._remove_files(spec.name)  # leftovers of an older table of this name must never be restored
            table = EmbeddingTable(self._effective(spec))
            self._tables[spec.name] = _Hosted(spec, table, DedupWindow(self.config.dedup_window))
            self._save_registry()
        log.info("created table %r (dim %d, %s)", spec.name, spec.dim, spec.optimizer.kind)
        return pb.CreateTableResponse(spec=wire.spec_to_pb(spec), created=True)

    @_rpc("DescribeTable")
    def DescribeTable(self, request: pb.DescribeTableRequest, context: grpc.ServicerContext
                      ) -> pb.DescribeTableResponse:
        hosted = self._get(request.table)
        stats = pb.TableStats(table=request.table, values=self._values(request.table, hosted, checksum=False))
        return pb.DescribeTableResponse(spec=wire.spec_to_pb(hosted.spec), stats=stats)

    @_rpc("DropTable")
    def DropTable(self, request: pb.DropTableRequest, context: grpc.ServicerContext) -> pb.DropTableResponse:
        with self._registry_lock:
            hosted = self._tables.pop(request.table, None)
            if hosted is None:
                return pb.DropTableResponse(dropped=False)
            self._save_registry()
            with hosted.lock:
                hosted.table.close()
            self._remove_files(request.table)
        log.info("dropped table %r", request.table)
        return pb.DropTableResponse(dropped=True)

    @_rpc("ListTables")
    def ListTables(self, request: pb.ListTablesRequest, context: grpc.ServicerContext) -> pb.ListTablesResponse:
        hosted = [self._tables.get(n) for n in self.table_names()]
        return pb.ListTablesResponse(tables=[wire.spec_to_pb(h.spec) for h in hosted if h is not None])

    def _pull(self, request: pb.PullRequest) -> tuple[str, np.ndarray, int]:
        """Validate a pull and read its rows: (table, (n, dim) float32 rows, reply codec)."""
        name = request.table
        hosted = self._get(name)
        raw_ids = request.ids  # protobuf copies a bytes field on every access: read it once
        ids = wire.decode_ids(raw_ids, table=name)
        codec = request.codec
        if codec not in _CODECS:
            raise InvalidArgument(f"table {name!r}: field 'codec' has unknown value {codec}")
        reply_bytes = wire.rows_nbytes(len(ids), hosted.table.config.dim, codec)
        if reply_bytes > self.config.max_message_bytes - 1024:  # refuse before pull inserts anything
            raise ResourceExhausted(f"table {name!r}: field 'ids' asks for {len(ids)} rows, {reply_bytes} bytes "
                                    f"as a reply, above the message limit of {self.config.max_message_bytes}; "
                                    "split the pull")
        self._check_owned(name, ids)
        rows = hosted.table.pull(ids)
        self.metrics.rows_pulled.labels(name).inc(len(ids))
        self.metrics.bytes_in.labels("Pull").inc(len(raw_ids))
        self.metrics.bytes_out.labels("Pull").inc(reply_bytes)
        return name, rows, codec

    @_rpc("Pull")
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullResponse:
        _, rows, codec = self._pull(request)
        return pb.PullResponse(rows=wire.encode_rows(rows, codec))

    @_rpc("Pull")
    def pull_serialized(self, request: pb.PullRequest, context: grpc.ServicerContext) -> bytes:
        """``Pull`` answering the serialized ``PullResponse`` (written in one copy by ``wire``), for the
        bytes response serializer ``add_to_server`` registers."""
        _, rows, codec = self._pull(request)
        return wire.encode_pull_response(rows, codec)

    @_rpc("Push")
    def Push(self, request: pb.PushRequest | wire.RawPush, context: grpc.ServicerContext) -> pb.PushResponse:
        """Apply a gradient block; ``request`` is the protobuf message or ``wire.decode_push_request``'s views."""
        name = request.table
        hosted = self._get(name)
        raw_ids = request.ids  # protobuf copies a bytes field on every access: read each once
        ids = wire.decode_ids(raw_ids, table=name)
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
        self._check_owned(name, ids)
        self.metrics.bytes_in.labels("Push").inc(memoryview(raw_ids).nbytes + nbytes + memoryview(scales).nbytes)
        with hosted.lock:
            if hosted.dedup.seen(request.client_id, request.seq, request.part):
                self.metrics.duplicate_pushes.labels(name).inc()
                return pb.PushResponse(applied_rows=0, duplicate=True)
            applied = hosted.table.push(ids, grads)
            hosted.dedup.record(request.client_id, request.seq, request.part, int(applied))
        self.metrics.rows_pushed.labels(name).inc(len(ids))
        return pb.PushResponse(applied_rows=int(applied), duplicate=False)

    @_rpc("Snapshot")
    def Snapshot(self, request: pb.SnapshotRequest, context: grpc.ServicerContext) -> pb.SnapshotResponse:
        paths, rows = self.snapshot_all(incremental=request.incremental)
        return pb.SnapshotResponse(paths=[str(p) for p in paths], rows=rows)

    @_rpc("Restore")
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreResponse:
        return pb.RestoreResponse(rows=self.restore(request.path or None))

    @_rpc("Stats")
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        names = [request.table] if request.table else self.table_names()
        out = []
        for name in names:
            hosted = self._get(name) if request.table else self._tables.get(name)
            if hosted is not None:
                out.append(pb.TableStats(table=name, values=self._values(name, hosted, checksum=True)))
        return pb.StatsResponse(tables=out)

    # --- persistence ----------------------------------------------------------------------------------------
    def _need_data_dir(self, what: str) -> Path:
        if self.data_dir is None:
            raise InvalidArgument(f"{what}: this server has no data dir (start it with --data-dir)")
        return self.data_dir

    def _dir(self, kind: str, table: str) -> Path:
        """``data_dir/<kind>/<table>`` with the name percent-encoded, so any table name is one safe folder."""
        assert self.data_dir is not None
        return self.data_dir / kind / quote(table, safe="").replace(".", "%2E")

    def _registry_path(self) -> Path | None:
        return self.data_dir / "tables.json" if self.data_dir is not None else None

    def _save_registry(self) -> None:
        path = self._registry_path()
        if path is None:
            return
        doc = {"version": 1, "tables": [json_format.MessageToDict(wire.spec_to_pb(h.spec),
                                                                  preserving_proto_field_name=True)
                                        for _, h in sorted(self._tables.items())]}
        _write_atomic(path, json.dumps(doc, indent=1, sort_keys=True))

    def _remove_files(self, name: str) -> None:
        if self.data_dir is None:
            return
        for sub in ("snapshots", "dedup", "spill"):
            shutil.rmtree(self._dir(sub, name), ignore_errors=True)

    def snapshot_all(self, *, incremental: bool = False) -> tuple[list[Path], int]:
        """Snapshot every table under ``data_dir/snapshots/<table>`` with its dedup window; (paths, rows)."""
        self._need_data_dir("Snapshot")
        paths: list[Path] = []
        rows = 0
        with self._registry_lock:
            hosted_tables = sorted(self._tables.items())
            self._save_registry()
        for name, hosted in hosted_tables:
            with hosted.lock:
                if self._tables.get(name) is not hosted:  # dropped or replaced meanwhile
                    continue
                path = Path(hosted.table.snapshot(self._dir("snapshots", name), incremental=incremental))
                _write_atomic(self._dir("dedup", name) / f"{path.name}.json", json.dumps(hosted.dedup.to_state()))
                rows += len(hosted.table)
            paths.append(path)
            if not incremental and self.config.keep_snapshots:
                self._prune(name)
        log.info("snapshot (%s) of %d table(s), %d rows", "incremental" if incremental else "full",
                 len(paths), rows)
        return paths, rows

    def _prune(self, name: str) -> None:
        """Delete the snapshots (and their dedup windows) older than the newest ``keep_snapshots`` full ones."""
        from tigana.embeddings.snapshot import list_snapshots

        snaps = list_snapshots(self._dir("snapshots", name))
        fulls = [i for i, p in enumerate(snaps) if p.name.endswith("-full")]
        if len(fulls) <= self.config.keep_snapshots:
            return
        for old in snaps[:fulls[-self.config.keep_snapshots]]:
            shutil.rmtree(old, ignore_errors=True)
            (self._dir("dedup", name) / f"{old.name}.json").unlink(missing_ok=True)

    def _restore_one(self, path: Path, spec: TableConfig | None) -> _Hosted:
        from tigana.embeddings.snapshot import MANIFEST, latest_snapshot

        if not (path / MANIFEST).is_file():  # a root of snapshots: its newest one (the engine does the same)
            path = latest_snapshot(path) or path
        table = EmbeddingTable.restore(path)
        dedup_file = (self._dir("dedup", table.config.name) / f"{path.name}.json"
                      if self.data_dir is not None else None)
        if dedup_file is not None and dedup_file.exists():
            dedup = DedupWindow.from_state(json.loads(dedup_file.read_text()), self.config.dedup_window)
        else:
            dedup = DedupWindow(self.config.dedup_window)
        if spec is None:
            spec = dataclasses.replace(table.config, spill_dir=None)
        return _Hosted(spec, table, dedup)

    def restore(self, path: str | os.PathLike | None = None) -> int:
        """Replace tables by snapshots: ``path`` None restores every registered table from its newest snapshot
        chain in the data dir; a path restores the one table snapshot there. Returns the rows restored."""
        from tigana.embeddings.snapshot import latest_snapshot

        with self._registry_lock:
            fresh: dict[str, _Hosted] = {}
            try:
                if path is None:
                    self._need_data_dir("Restore")
                    for name, hosted in self._tables.items():
                        latest = latest_snapshot(self._dir("snapshots", name))
                        if latest is not None:
                            fresh[name] = self._restore_one(Path(latest), hosted.spec)
                else:
                    restored = self._restore_one(Path(path), None)
                    old = self._tables.get(restored.spec.name)
                    if old is not None:
                        restored.spec = old.spec
                    fresh[restored.spec.name] = restored
            except BaseException:
                for hosted in fresh.values():  # all or nothing: the served tables stay as they were
                    hosted.table.close()
                raise
            replaced = {name: self._tables.get(name) for name in fresh}
            self._tables.update(fresh)
            self._save_registry()
            for old in replaced.values():
                if old is not None:
                    with old.lock:
                        old.table.close()
        rows = sum(len(h.table) for h in fresh.values())
        log.info("restored %d table(s), %d rows", len(fresh), rows)
        return rows

    def load(self) -> None:
        """At start: re-create every table in ``tables.json``, from its newest snapshot chain when there is one."""
        path = self._registry_path()
        if path is None or not path.exists():
            return
        from tigana.embeddings.snapshot import cleanup_temp, latest_snapshot

        doc = json.loads(path.read_text())
        for entry in doc.get("tables", []):
            spec = wire.spec_from_pb(json_format.ParseDict(entry, pb.TableSpec()))
            cleanup_temp(self._dir("snapshots", spec.name))
            shutil.rmtree(self._dir("spill", spec.name), ignore_errors=True)  # a dead process's spill tier
            latest = latest_snapshot(self._dir("snapshots", spec.name))
            if latest is not None:
                hosted = self._restore_one(Path(latest), spec)
                log.info("restored table %r from %s (%d rows)", spec.name, latest, len(hosted.table))
            else:
                hosted = _Hosted(spec, EmbeddingTable(self._effective(spec)), DedupWindow(self.config.dedup_window))
                log.info("re-created table %r (no snapshot)", spec.name)
            self._tables[spec.name] = hosted

    def close_tables(self) -> None:
        with self._registry_lock:
            for hosted in self._tables.values():
                with hosted.lock:
                    try:
                        hosted.table.close()
                    except Exception:  # noqa: BLE001 - close the others regardless
                        log.exception("closing table %r failed", hosted.spec.name)
            self._tables.clear()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def add_to_server(service: ShardService, server: grpc.Server) -> None:
    """Register ``service`` on ``server`` as ``shard_pb2_grpc.add_ShardServicer_to_server`` does, but with the
    data path's own (de)serializers: Push requests parsed into zero-copy views (``wire.decode_push_request``)
    and Pull replies written as bytes in one copy (``ShardService.pull_serialized``). The wire format is
    exactly the one in proto/shard.proto."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(service, name),
            request_deserializer=getattr(pb, f"{name}Request").FromString,
            response_serializer=getattr(pb, f"{name}Response").SerializeToString)
        for name in pb.DESCRIPTOR.services_by_name["Shard"].methods_by_name}
    handlers["Pull"] = grpc.unary_unary_rpc_method_handler(
        service.pull_serialized, request_deserializer=pb.PullRequest.FromString, response_serializer=wire.identity)
    handlers["Push"] = grpc.unary_unary_rpc_method_handler(
        service.Push, request_deserializer=wire.decode_push_request,
        response_serializer=pb.PushResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
