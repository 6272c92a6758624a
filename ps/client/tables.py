"""The tables of ``Client``: create, describe, drop and list them; this client's per-table settings
(staleness bound, wire codecs); checkpoints and exports of them (``tigana.ps.client.checkpoint``, through
the ``CheckpointPort`` that ``checkpoint_port`` gives).

With a scheduler, table changes go through it (it puts them in the map, and every server creates or drops
the table when it installs the map); with a static shard list, to every shard. ``TableInfo`` is what
``describe_table`` returns.

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import time
from concurrent import futures as cf
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from tigana.embeddings import RowBatch
from tigana.embeddings import config as cfg
from tigana.embeddings.errors import InvalidArgument as StorageInvalidArgument
from tigana.embeddings.optimizers import initial_state
from tigana.proto import shard_pb2 as pb
from tigana.ps.client._fields import ClientFields
from tigana.ps.client.checkpoint import export_table, import_rows, restore_checkpoint, write_checkpoint
from tigana.ps.client.checkpoint.port import CheckpointPort
from tigana.ps.client.config import ClientConfig, Compression
from tigana.ps.client.inflight import retryable
from tigana.ps.client.routes import Route
from tigana.ps.client.tablestate import TableState, check_staleness
from tigana.ps.errors import InvalidArgument, PSError, TableNotFound, Unavailable, from_rpc_error
from tigana.ps.settings import parse_bytes
from tigana.ps.wire import data as wire

# describe_table sums shard stats except these (kept per shard in TableInfo.shards / taken from one shard).
_PER_SHARD_ONLY = frozenset({"checksum"})
_SAME_ON_EVERY_SHARD = frozenset({"dim", "state_width"})


@dataclass(frozen=True)
class TableInfo:
    """What ``describe_table`` returns: the table's config, its stats summed over shards (counts such as rows
    and bytes; a checksum only per shard), and every shard's own stats by address."""

    config: cfg.TableConfig
    stats: dict[str, float]
    shards: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.stats.get("rows", 0))


class Tables(ClientFields):
    """Table management (see the module docstring)."""

    def create_table(self, name: str, dim: int, optimizer: cfg.Optimizer | None = None,
                     initializer: cfg.Initializer | None = None, *, seed: int = 0, dtype: str = "float32",
                     admission: cfg.Admission | None = None, eviction: cfg.Eviction | None = None,
                     memory_budget: int | None = None, staleness: int | None = 0,
                     compression: Any = None, exist_ok: bool = True, durability: str | None = None,
                     min_copies: int = 1) -> cfg.TableConfig:
        """Create ``name`` on every shard (an identical existing table is fine when ``exist_ok``).

        ``memory_budget`` is per shard (bytes of resident rows, or a size such as ``"1GiB"``). ``staleness``:
        k = a pull waits until this client's pushes older than its last k are applied (0: read your writes;
        None: fully asynchronous).
        ``compression``: a codec name for both directions, ``{"pull": .., "push": ..}`` or ``Compression``.
        ``durability`` (with a scheduler): "sync" (the default when the cluster has replicas: a push is
        acknowledged once every in-sync copy has it) or "async" (acknowledged at once; replicas follow, the
        lag is in ``server_stats``). ``min_copies``: with sync, pushes to a slot with fewer in-sync copies
        are rejected with ``NotEnoughReplicas`` (never silently weakened). Returns the config the servers hold."""
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"create_table: field 'name' must be a non-empty string, got {name!r}")
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise InvalidArgument(f"table {name!r}: field 'dim' must be an integer >= 1, got {dim!r}")
        optimizer = cfg.SGD() if optimizer is None else optimizer
        initializer = cfg.Normal() if initializer is None else initializer
        if not isinstance(optimizer, tuple(cfg.OPTIMIZERS.values())):
            raise InvalidArgument(f"table {name!r}: field 'optimizer' must be one of "
                                  f"{sorted(c.__name__ for c in cfg.OPTIMIZERS.values())}, got {optimizer!r}")
        if not isinstance(initializer, tuple(cfg.INITIALIZERS.values())):
            raise InvalidArgument(f"table {name!r}: field 'initializer' must be one of "
                                  f"{sorted(c.__name__ for c in cfg.INITIALIZERS.values())}, got {initializer!r}")
        check_staleness(name, staleness)
        comp = Compression.of(compression, table=name)
        if durability not in (None, "sync", "async"):
            raise InvalidArgument(f"table {name!r}: field 'durability' must be 'sync' or 'async', got {durability!r}")
        if isinstance(min_copies, bool) or not isinstance(min_copies, (int, np.integer)) or min_copies < 1:
            raise InvalidArgument(f"table {name!r}: field 'min_copies' must be an integer >= 1, got {min_copies!r}")
        if memory_budget is not None:  # bytes or a size such as "8GiB"; 0 is no budget
            memory_budget = parse_bytes(memory_budget, field=f"table {name!r}: field 'memory_budget'") or None
        if not 0 <= int(seed) < 1 << 64:
            raise InvalidArgument(f"table {name!r}: field 'seed' must be in [0, 2**64), got {seed}")
        try:
            config = cfg.TableConfig(name=name, dim=int(dim), optimizer=optimizer, initializer=initializer,
                                     seed=int(seed), dtype=dtype,  # type: ignore[arg-type]
                                     admission=admission or cfg.Admission(), eviction=eviction or cfg.Eviction(),
                                     memory_budget=memory_budget)
        except StorageInvalidArgument as exc:
            raise InvalidArgument(str(exc)) from None
        spec = wire.spec_to_pb(config)
        wire.spec_from_pb(spec)  # validates kinds, dtype, policy here, naming the field
        spec.durability = {None: pb.DURABILITY_DEFAULT, "sync": pb.DURABILITY_SYNC,
                           "async": pb.DURABILITY_ASYNC}[durability]
        spec.min_copies = int(min_copies)
        request = pb.CreateTableRequest(spec=spec, exist_ok=exist_ok)
        if self._maps is not None:
            reply = self._scheduler_call("CreateTable", request)
            held = wire.spec_from_pb(reply.spec)
            self._await_table(name)
        else:
            replies = self._call_all("CreateTable", lambda _: request, retry=exist_ok)
            held = wire.spec_from_pb(replies[0].spec) if replies[0].HasField("spec") else config
        with self._tables_lock:
            self._tables[name] = TableState(name, held.dim, comp, staleness)
        return held

    def _await_table(self, name: str, timeout_s: float = 30.0) -> None:
        """Wait until every server of the map serves ``name`` (they create it when they install the map)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._call_all("DescribeTable", lambda _: pb.DescribeTableRequest(table=name), retry=True)
                return
            except (TableNotFound, Unavailable):
                if time.monotonic() >= deadline:
                    raise
                self._maps.refresh()  # type: ignore[union-attr]
                time.sleep(0.05)

    def _scheduler_call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        assert self._maps is not None
        deadline = time.monotonic() + (timeout_s or self.config.timeout_s)
        while True:
            try:
                return getattr(self._maps.stub, method)(request, timeout=max(0.5, deadline - time.monotonic()))
            except grpc.RpcError as err:
                error = from_rpc_error(err, self._maps.address)
                if not isinstance(error, Unavailable) or time.monotonic() >= deadline:
                    raise error from None
                self._maps._failover()
                self._note_retry()
                time.sleep(0.1)

    def _spec_pb(self, name: str) -> pb.TableSpec:
        """The table's spec as the servers hold it (with durability and min_copies)."""
        if self._maps is not None:
            for t in self._scheduler_call("ListTables", pb.ListTablesRequest()).tables:
                if t.name == name:
                    return t
            raise TableNotFound(f"table {name!r} not found")
        reply = self._call_all("DescribeTable", lambda _: pb.DescribeTableRequest(table=name), retry=True)[0]
        return reply.spec

    def _create_from_spec(self, spec: pb.TableSpec) -> None:
        request = pb.CreateTableRequest(spec=spec, exist_ok=False)
        if self._maps is not None:
            self._scheduler_call("CreateTable", request)
            self._await_table(spec.name)
        else:
            self._call_all("CreateTable", lambda _: request, retry=False)
        with self._tables_lock:
            self._tables.pop(spec.name, None)

    def checkpoint(self, directory: str, tables: list[str] | None = None, *, incremental: bool = False,
                   base: str | None = None, quantize: str = "none", quantize_state: bool = False) -> dict[str, Any]:
        """Write a consistent checkpoint of ``tables`` (default: all) into ``directory``: every table cut at one
        point of the cluster's history, rows and optimizer state, with a manifest and checksums
        (``tigana.ps.client.checkpoint``). ``incremental``: only the rows changed since ``base`` (default: the newest
        checkpoint beside ``directory``); ``quantize``: ``fp16`` or ``int8`` weights (the optimizer state stays
        exact unless ``quantize_state``). Flushes this client's pushes first. Returns the manifest."""
        return write_checkpoint(self.checkpoint_port(), directory, tables, incremental=incremental, base=base, quantize=quantize,
                                quantize_state=quantize_state)

    def restore_checkpoint(self, directory: str, tables: list[str] | None = None) -> dict[str, int]:
        """Recreate the checkpoint's tables and load their rows and optimizer state onto the servers the
        cluster has now (any number); an incremental checkpoint with its chain of bases. Returns rows restored
        per table."""
        return restore_checkpoint(self.checkpoint_port(), directory, tables)

    def export(self, table: str, out: str, since: str | None = None) -> dict[str, Any]:
        """Write ``table``'s ids and float32 rows (no optimizer state) as ``out/ids.npy``, ``out/rows.npy`` and
        ``out/export.json``; with ``since`` (an earlier export) only the rows updated after it."""
        return export_table(self.checkpoint_port(), table, out, since)

    def write_rows(self, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
        """Write ``rows`` (n, dim) float32 as the whole rows of int64 ``ids`` (n,) of ``table``, replacing what
        the table holds for them: what loading weights needs (a push carries gradients, which the optimizer turns
        into an update). The rows go through each slot's primary as a checkpoint restore writes them
        (``ImportRows``, replicated like pushes, retried on a map move), with the optimizer state a fresh row
        starts with and no updates counted. Flushes this client's pushes first, so none lands on the written
        rows after them; blocks until every row is acknowledged; returns n. ``InvalidArgument`` naming the table
        for rows that do not fit it, repeated ids or non-finite values, with nothing written."""
        info = self.describe_table(table)
        dim = int(info.config.dim)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if ids.ndim != 1 or rows.shape != (ids.shape[0], dim):
            raise InvalidArgument(f"table {table!r}: rows of shape {rows.shape} for {ids.shape[0]} ids, expected "
                                  f"({ids.shape[0]}, {dim})")
        if np.unique(ids).shape[0] != ids.shape[0]:
            raise InvalidArgument(f"table {table!r}: the ids to write repeat")
        if not np.isfinite(rows).all():
            raise InvalidArgument(f"table {table!r}: the rows to write hold NaN or Inf")
        n = ids.shape[0]
        if not n:
            return 0
        self.flush()
        batch = RowBatch(ids=ids, weights=rows, state=initial_state(info.config.optimizer, n, dim),
                         update_count=np.zeros(n, np.int64), last_step=np.zeros(n, np.int64),
                         last_time=np.full(n, time.time(), np.float64))
        return import_rows(self.checkpoint_port(), table, batch, 0)

    def checkpoint_port(self) -> CheckpointPort:
        """This client as the functions of ``tigana.ps.client.checkpoint`` take it."""
        return _CheckpointPort(self)

    def describe_table(self, name: str) -> TableInfo:
        """The table's config and stats (summed over shards; ``shards`` per address). With replicas, ``rows``
        counts each row once (at its primary)."""
        if self._ports.describe_table is not None:
            return self._ports.describe_table(name)
        replies = self._call_all("DescribeTable", lambda _: pb.DescribeTableRequest(table=name), retry=True)
        config = wire.spec_from_pb(replies[0].spec)
        shards = {s.address: dict(r.stats.values) for s, r in zip(self._servers, replies, strict=True)}
        total: dict[str, float] = {}
        for values in shards.values():
            for k, v in values.items():
                if k in _PER_SHARD_ONLY:
                    continue
                total[k] = v if k in _SAME_ON_EVERY_SHARD else total.get(k, 0.0) + v
        if "rows_led" in total:
            total["rows"] = total["rows_led"]
        return TableInfo(config, total, shards)

    def drop_table(self, name: str) -> bool:
        """Drop ``name`` on every shard after this client's pushes to it finish; True if any shard had it."""
        st = self._tables.get(name)
        if st is not None:
            with st.lock:
                pending = list(st.pending.values())
            cf.wait(pending)
        if self._maps is not None:
            dropped = bool(self._scheduler_call("DropTable", pb.DropTableRequest(table=name)).dropped)
        else:
            replies = self._call_all("DropTable", lambda _: pb.DropTableRequest(table=name), retry=False)
            dropped = any(r.dropped for r in replies)
        with self._tables_lock:
            self._tables.pop(name, None)
        return dropped

    def list_tables(self) -> list[str]:
        """Names of the tables on any shard, sorted."""
        if self._maps is not None:
            reply = self._scheduler_call("ListTables", pb.ListTablesRequest())
            return sorted(t.name for t in reply.tables)
        replies = self._call_all("ListTables", lambda _: pb.ListTablesRequest(), retry=True)
        return sorted({t.name for r in replies for t in r.tables})

    def set_staleness(self, table: str, staleness: int | None) -> None:
        """Change the table's staleness bound for this client (see ``create_table``)."""
        check_staleness(table, staleness)
        self._state(table).staleness = staleness

    def set_compression(self, table: str, compression: Any) -> None:
        """Change the table's wire codecs for this client (see ``Compression.of``)."""
        comp = Compression.of(compression, table=table)
        st = self._state(table)
        st.pull_codec, st.push_codec = wire.codec_of(comp.pull), wire.codec_of(comp.push)

    def _state(self, table: str) -> TableState:
        st = self._tables.get(table)
        if st is not None:
            return st
        if not isinstance(table, str) or not table:
            raise InvalidArgument(f"field 'table' must be a non-empty string, got {table!r}")
        info = self.describe_table(table)  # TableNotFound names the table
        with self._tables_lock:
            return self._tables.setdefault(table, TableState(table, info.config.dim, Compression(), 0))


class _CheckpointPort:
    """``CheckpointPort`` over a client: its current route, its map follower, its table calls."""

    def __init__(self, client: Tables) -> None:
        self._client = client

    @property
    def config(self) -> ClientConfig:
        return self._client.config

    def route(self) -> Route:
        return self._client._route

    def retryable(self, error: PSError) -> bool:
        return retryable(error, self._client._maps is not None)

    def follow_map(self) -> None:
        maps = self._client._maps
        if maps is not None:
            maps.refresh(self._client.epoch + 1)

    def flush(self) -> None:
        self._client.flush()

    def list_tables(self) -> list[str]:
        return self._client.list_tables()

    def describe_table(self, name: str) -> TableInfo:
        return self._client.describe_table(name)

    def drop_table(self, name: str) -> bool:
        return self._client.drop_table(name)

    def table_spec(self, name: str) -> pb.TableSpec:
        return self._client._spec_pb(name)

    def create_from_spec(self, spec: pb.TableSpec) -> None:
        self._client._create_from_spec(spec)
