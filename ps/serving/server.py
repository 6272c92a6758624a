"""``tigana serve --from DIR``: a read-only embedding lookup server for inference, fed by the export log.

``start_serving(ServeConfig(source=DIR, port=P))`` binds the gRPC port and serves health (NOT_SERVING) and
reflection at once; a follower thread polls ``DIR/manifest.json`` (``tigana.ps.serving.exportlog``), loads the full
export it names, then applies each new delta in ``seq`` order. Health turns SERVING once the first full export
is loaded; ``tigana.v1.Serving/Lookup`` answers UNAVAILABLE before that.

Design:

- **The table** is numpy arrays: a sorted id array with its rows (the base) and a small sorted overlay of the
  rows changed since (the newest wins). A lookup is two ``np.searchsorted`` calls, vectorized over the
  request. A delta merges into the overlay (O(overlay + delta)); when the overlay passes 1/16 of the base
  (at least 65,536 rows) it is folded into a new base (O(rows)), so a delta never copies the whole table.
- **Atomic swap.** A ``TableState`` is never changed once built: the follower builds the next one beside it
  and replaces one attribute; a lookup reads that attribute once, so it sees the state before a delta or after
  it, never half of one. Deltas found in one poll are applied together and swapped once.
- **Compaction and restarts of the log.** A manifest whose base (or ``log_id``) differs from the loaded one is
  loaded in full in the background (lookups keep the old state meanwhile), then swapped. An entry deleted
  under the reader by a compaction makes the poll re-read the manifest.
- **Unknown ids** get the default row (``--default``): ``zeros`` (the default), ``mean`` (the mean of the
  rows, as of the last full load or fold) or a number (every element). ``found`` says which ids were known.
- **Bad input** (ids not a multiple of 8 bytes, too many ids, another table's name, a request that does not
  parse) answers INVALID_ARGUMENT naming the field; the server lives on.
- **Security and metrics** as on a shard server: TLS (``security.tls_cert``/``tls_key``, mutual with
  ``require_client_cert``), bearer tokens (``auth_token_file``/``admin_token_file``: either may look up), health
  open to all; with ``metrics_port`` a Prometheus endpoint (lookups, latency, ids found, log position, freshness).
- ``close()`` (SIGTERM in ``tigana serve``): health NOT_SERVING, stop the follower, drain RPCs in flight.

Example::

    handle = start_serving(ServeConfig(source="exp-log/", port=0))
    handle.wait_ready(30)
    with ServingClient(handle.address) as serving:
        rows, found = serving.lookup(np.array([1, 2, 3]))
    handle.close()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2

from tigana.proto import serving_pb2 as pb
from tigana.proto import serving_pb2_grpc
from tigana.ps import rpc
from tigana.ps.errors import (
    DataLoss,
    InvalidArgument,
    Unavailable,
    from_rpc_error,
)
from tigana.ps.metrics import ServingMetrics
from tigana.ps.security import NONE, Security, SecuritySettings
from tigana.ps.serving import exportlog
from tigana.ps.settings import load as load_settings

log = logging.getLogger("tigana.ps.serving")

SERVICE_NAME = "tigana.v1.Serving"
_FOLD_MIN_ROWS = 65536


@dataclass(frozen=True, kw_only=True)
class ServeConfig(SecuritySettings):
    """Settings of ``tigana serve``. ``source``: the export log folder; ``poll_s``: seconds between manifest
    polls; ``default``: the row of an unknown id (``zeros``, ``mean`` or a number); ``max_ids``: ids per
    lookup; ``verify``: check every entry's sha256 before using it; TLS and tokens as on a shard server
    (``SecuritySettings``; none: plain); ``metrics_port``: Prometheus HTTP port (0 off, -1 a free one)."""

    source: str
    host: str = "127.0.0.1"
    port: int = 0
    poll_s: float = 0.1
    default: str = "zeros"
    max_ids: int = 1_000_000
    max_message_bytes: int = 64 << 20
    max_workers: int = 8
    verify: bool = True
    drain_grace_s: float = 5.0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        default_policy(self.default)  # raises InvalidArgument for a bad one
        if self.poll_s <= 0:
            raise InvalidArgument(f"serve: --poll must be > 0 seconds, got {self.poll_s}")
        if self.max_ids < 1:
            raise InvalidArgument(f"serve: --max-ids must be >= 1, got {self.max_ids}")
        if not -1 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"serve: --metrics-port must be 'auto', 0 (off) or a port, got {self.metrics_port}")


# The fields ``tigana serve`` reads from ``TIGANA_<FIELD>`` when no flag gives them: the ones it shares with
# the shard server (TLS, tokens, metrics), so one environment configures both daemons the same way.
ENV_FIELDS = tuple(f.name for f in dataclasses.fields(SecuritySettings)) + ("metrics_port", "metrics_host")


def load_serve_config(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ServeConfig:
    """``ServeConfig`` from ``flags`` (field -> value; None: not given) > ``TIGANA_<FIELD>`` of ``ENV_FIELDS``
    in ``env`` (``os.environ`` when None) > defaults, through the loader every command uses."""
    return load_serve_config_sources(flags, env).config


def load_serve_config_sources(flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Any:
    """``load_serve_config`` with where each value came from (a ``settings.Loaded``: ``tigana config show``)."""
    from tigana.ps.config import PARSERS  # the server's parsers: "auto" metrics port

    env = os.environ if env is None else env
    own = {f"TIGANA_{n.upper()}": env[f"TIGANA_{n.upper()}"] for n in ENV_FIELDS if f"TIGANA_{n.upper()}" in env}
    return load_settings(ServeConfig, flags=flags, env=own, parsers={"metrics_port": PARSERS["metrics_port"]})


def default_policy(text: str) -> str | float:
    """``zeros``/``mean``, or the float every element of an unknown id's row takes."""
    if text in ("zeros", "mean"):
        return text
    try:
        return float(text)
    except ValueError:
        raise InvalidArgument(f"serve: --default must be 'zeros', 'mean' or a number, got {text!r}") from None


@dataclass(frozen=True, eq=False)
class TableState:
    """One immutable version of the served table (see the module doc). ``seq``: the newest log entry in it."""

    table: str
    dim: int
    ids: np.ndarray          # (n,) int64, sorted, unique: the base
    rows: np.ndarray         # (n, dim) float32
    over_ids: np.ndarray     # (m,) int64, sorted, unique: rows changed since the base was built (they win)
    over_rows: np.ndarray    # (m, dim) float32
    default_row: np.ndarray  # (dim,) float32
    size: int                # distinct ids held
    seq: int
    base_seq: int
    log_id: str
    data_time: float         # the cluster cut the state is complete up to
    loaded_time: float       # this server's clock when it was built

    @classmethod
    def build(cls, table: str, ids: np.ndarray, rows: np.ndarray, policy: str | float, **meta: Any) -> TableState:
        """A state with no overlay (a full load or a fold), its default row computed from ``rows``."""
        dim = rows.shape[1]
        if policy == "mean":
            default = rows.mean(axis=0, dtype=np.float64).astype(np.float32) if len(rows) else np.zeros(dim, np.float32)
        else:
            default = np.full(dim, 0.0 if policy == "zeros" else float(policy), np.float32)
        return cls(table=table, dim=dim, ids=ids, rows=rows, over_ids=ids[:0], over_rows=rows[:0],
                   default_row=default, size=int(ids.size), loaded_time=time.time(), **meta)

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n,) int64 -> ((n, dim) float32 rows, (n,) bool found); unknown ids get the default row."""
        out = np.empty((ids.size, self.dim), np.float32)
        found_over = _find(self.over_ids, ids)
        found_base = _find(self.ids, ids)
        in_over = found_over >= 0
        in_base = (found_base >= 0) & ~in_over
        out[in_over] = self.over_rows[found_over[in_over]]
        out[in_base] = self.rows[found_base[in_base]]
        found = in_over | in_base
        out[~found] = self.default_row
        return out, found

    def with_delta(self, ids: np.ndarray, rows: np.ndarray, policy: str | float, **meta: Any) -> TableState:
        """A new state with a delta's rows (sorted unique ids) applied; folds the overlay into the base when it
        has grown past 1/16 of it."""
        over_ids, over_rows = exportlog.merge(self.over_ids, self.over_rows, ids, rows)
        fresh = int((_find(self.ids, over_ids) < 0).sum())
        if over_ids.size >= max(_FOLD_MIN_ROWS, self.ids.size // 16):
            base_ids, base_rows = exportlog.merge(self.ids, self.rows, over_ids, over_rows)
            return TableState.build(self.table, base_ids, base_rows, policy, base_seq=self.base_seq,
                                    log_id=self.log_id, **meta)
        return dataclasses.replace(self, over_ids=over_ids, over_rows=over_rows, size=int(self.ids.size) + fresh,
                                   loaded_time=time.time(), **meta)


def _find(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Index of each of ``ids`` in ``sorted_ids``, -1 where absent."""
    if not sorted_ids.size:
        return np.full(ids.size, -1, np.int64)
    pos = np.searchsorted(sorted_ids, ids)
    np.minimum(pos, sorted_ids.size - 1, out=pos)
    return np.where(sorted_ids[pos] == ids, pos, -1)


class LogFollower:
    """Keeps ``state`` (a ``TableState`` or None) up to date with the export log in ``source``. ``poll()`` does
    one round (tests call it directly); ``start()`` runs it every ``poll_s`` in a thread."""

    def __init__(self, source: str | Path, policy: str | float, *, verify: bool = True,
                 on_swap: Any = None) -> None:
        self.source, self.policy, self.verify, self.on_swap = Path(source), policy, verify, on_swap
        self.state: TableState | None = None
        self.deltas_applied = 0
        self.rows_applied = 0
        self.apply_seconds = 0.0
        self.error: str = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> bool:
        """Read the manifest and apply what is new; True when the state changed. Raises what reading raised
        (the state is unchanged then)."""
        m = exportlog.read_manifest(self.source)
        cur = self.state
        if m is None or (cur is not None and m["log_id"] == cur.log_id and m["seq"] == cur.seq
                         and float(m["time"]) <= cur.data_time):
            return False
        meta = {"seq": int(m["seq"]), "data_time": float(m["time"])}
        if cur is None or m["log_id"] != cur.log_id or int(m["base"]["seq"]) != cur.base_seq:
            started = time.monotonic()
            ids, rows = exportlog.load_entry(self.source, m["base"], verify=self.verify)
            new = TableState.build(m["table"], ids, rows, self.policy, base_seq=int(m["base"]["seq"]),
                                   log_id=m["log_id"], seq=int(m["base"]["seq"]), data_time=float(m["base"]["time"]))
            log.info("loaded %s (%d rows) of table %r in %.2fs", m["base"]["path"], ids.size, m["table"],
                     time.monotonic() - started)
            pending = m["deltas"]
        else:
            new = cur
            pending = [e for e in m["deltas"] if int(e["seq"]) > cur.seq]
        for entry in pending:
            started = time.monotonic()
            ids, rows = exportlog.load_entry(self.source, entry, verify=self.verify)
            new = new.with_delta(ids, rows, self.policy, seq=int(entry["seq"]), data_time=float(entry["time"]))
            self.deltas_applied += 1
            self.rows_applied += int(ids.size)
            self.apply_seconds += time.monotonic() - started
        if (new.seq, new.data_time) != (meta["seq"], meta["data_time"]):  # empty deltas advance the time
            new = dataclasses.replace(new, **meta)
        self.state = new  # the swap: one attribute, read once per lookup
        if self.on_swap is not None:
            self.on_swap(new)
        return True

    def start(self, poll_s: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(poll_s,), name="tigana-serve-follow", daemon=True)
        self._thread.start()

    def _run(self, poll_s: float) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
                self.error = ""
            except FileNotFoundError as exc:  # an entry pruned under us by a compaction: read the manifest again
                log.info("export log entry gone (%s); re-reading the manifest", exc)
            except Exception as exc:  # noqa: BLE001 - a bad entry must not stop serving the state we have
                message = f"{type(exc).__name__}: {exc}"
                if message != self.error:
                    log.error("following %s failed (serving seq %s meanwhile): %s", self.source,
                              self.state.seq if self.state else None, message)
                self.error = message
            self._stop.wait(poll_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class ServingService:
    """The ``tigana.v1.Serving`` handlers over a ``LogFollower``'s state."""

    def __init__(self, follower: LogFollower, config: ServeConfig, metrics: ServingMetrics) -> None:
        self.follower, self.config, self.metrics = follower, config, metrics

    def _count_failure(self, method: str, code: str, seconds: float) -> None:
        if code != "OK":  # an answered lookup is counted with its ids by ``Lookup``
            self.metrics.observe(code, seconds)

    @rpc.guard("Lookup", log, observe=_count_failure)
    def Lookup(self, request: pb.ServingLookupRequest, context: grpc.ServicerContext) -> pb.ServingLookupResponse:
        start = time.perf_counter()
        state = self.follower.state
        if state is None:
            raise Unavailable(f"Lookup: no full export loaded yet from {str(self.config.source)!r}")
        if request.table and request.table != state.table:
            raise InvalidArgument(f"Lookup: field 'table' is {request.table!r}, this server serves "
                                  f"{state.table!r}")
        raw = request.ids
        if len(raw) % 8:
            raise InvalidArgument(f"Lookup: field 'ids' holds {len(raw)} bytes, not packed int64 (a multiple "
                                  "of 8)")
        n = len(raw) // 8
        limit = min(self.config.max_ids, (self.config.max_message_bytes - 4096) // (4 * state.dim + 1))
        if n > limit:
            raise InvalidArgument(f"Lookup: field 'ids' holds {n} ids, at most {limit} per request")
        rows, found = state.lookup(np.frombuffer(raw, "<i8"))
        hits = int(np.count_nonzero(found))
        self.metrics.observe("OK", time.perf_counter() - start, hits, n - hits)
        return pb.ServingLookupResponse(rows=rows.astype("<f4", copy=False).tobytes(),
                                        found=found.view(np.uint8).tobytes(), dim=state.dim, seq=state.seq)

    def Info(self, request: pb.ServingInfoRequest, context: grpc.ServicerContext) -> pb.ServingInfoResponse:
        if isinstance(request, rpc.Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))
        f, state = self.follower, self.follower.state
        out = pb.ServingInfoResponse(default_row=self.config.default, deltas_applied=f.deltas_applied,
                                     rows_applied=f.rows_applied, apply_seconds=f.apply_seconds)
        if state is not None:
            out.table, out.dim, out.rows, out.seq, out.base_seq = (state.table, state.dim, state.size, state.seq,
                                                                   state.base_seq)
            out.data_time, out.loaded_time = state.data_time, state.loaded_time
        return out


class ServingHandle:
    """A running ``tigana serve``: ``address`` as bound; ``wait_ready`` until the first full export is loaded;
    ``close`` is idempotent."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._ready = threading.Event()
        self.follower = LogFollower(config.source, default_policy(config.default), verify=config.verify,
                                    on_swap=self._swapped)
        self.security = config.security()
        self.metrics = ServingMetrics(self._figures)
        self.metrics_port: int | None = None
        self.service = ServingService(self.follower, config, self.metrics)
        options = [("grpc.max_send_message_length", config.max_message_bytes),
                   ("grpc.max_receive_message_length", config.max_message_bytes), ("grpc.so_reuseport", 0)]
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                              thread_name_prefix="tigana-serve"), options=options,
                                   interceptors=self.security.interceptors(self.metrics.count_auth_rejection))
        rpc.register(self._server, pb.DESCRIPTOR.services_by_name["Serving"], self.service)
        rpc.add_health_and_reflection(self._server, self.health, (SERVICE_NAME,))
        target = f"{config.host}:{config.port}"
        try:
            port = self.security.add_port(self._server, target)
        except RuntimeError as exc:
            raise OSError(f"serve: cannot bind {target} (port in use or address not local)") from exc
        if not port:
            raise OSError(f"serve: cannot bind {target} (port in use or address not local)")
        self.port = port
        host = "127.0.0.1" if config.host in ("", "0.0.0.0", "::", "[::]") else config.host
        self.address = f"{host}:{port}"
        self._closed = False
        self._lock = threading.Lock()

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def _swapped(self, state: TableState) -> None:
        if not self._ready.is_set():
            log.info("serving table %r (%d rows, dim %d, seq %d) on %s", state.table, state.size, state.dim,
                     state.seq, self.address)
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self._ready.set()

    def _figures(self) -> dict[str, float]:
        """The gauges of the metrics endpoint, read at scrape time."""
        f, state = self.follower, self.follower.state
        out = {"ready": float(state is not None), "deltas_applied": f.deltas_applied, "rows_applied": f.rows_applied,
               "apply_seconds": f.apply_seconds}
        if state is not None:
            out.update(rows=state.size, dim=state.dim, seq=state.seq, base_seq=state.base_seq,
                       data_age_seconds=max(0.0, time.time() - state.data_time))
        return out

    def start(self) -> ServingHandle:
        self._server.start()
        if self.config.metrics_port:
            try:
                self.metrics_port = self.metrics.serve_http(self.config.metrics_port, self.config.metrics_host)
            except OSError as exc:
                self._server.stop(0).wait()
                raise OSError(f"serve: cannot bind the metrics port {self.config.metrics_host}:"
                              f"{self.config.metrics_port} ({exc})") from exc
        self.follower.start(self.config.poll_s)
        return self

    @property
    def state(self) -> TableState | None:
        return self.follower.state

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the first full export is loaded (health SERVING); False on timeout."""
        return self._ready.wait(timeout)

    def close(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, stop following the log, let RPCs in flight finish, free the port."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.health.enter_graceful_shutdown()
        self.follower.stop()
        self._server.stop(self.config.drain_grace_s if grace is None else grace).wait()
        self.metrics.close()
        log.info("serve %s stopped", self.address)

    def __enter__(self) -> ServingHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_serving(config: ServeConfig) -> ServingHandle:
    """Bind and start ``tigana serve``; returns at once (``wait_ready`` for the first full export). Raises
    ``OSError`` when the port cannot be bound, ``InvalidArgument`` for bad settings."""
    return ServingHandle(config).start()


class ServingClient:
    """A small client of ``tigana.v1.Serving``: ``lookup(ids) -> (rows, found)``, ``info()``."""

    def __init__(self, address: str, *, timeout_s: float = 10.0, max_message_bytes: int = 64 << 20,
                 security: Security = NONE) -> None:
        self.address, self.timeout_s = address, timeout_s
        self.channel = security.channel(address, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)])
        self.stub = serving_pb2_grpc.ServingStub(self.channel)

    def lookup(self, ids: np.ndarray, table: str = "") -> tuple[np.ndarray, np.ndarray]:
        """(n,) int64 ids -> ((n, dim) float32, (n,) bool found)."""
        ids = np.ascontiguousarray(ids, "<i8")
        try:
            reply = self.stub.Lookup(pb.ServingLookupRequest(ids=ids.tobytes(), table=table), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from None
        rows = np.frombuffer(reply.rows, "<f4")
        if reply.dim == 0 or rows.size != ids.size * reply.dim:
            raise DataLoss(f"{self.address}: Lookup answered {rows.size} floats for {ids.size} ids of dim {reply.dim}")
        return rows.reshape(ids.size, reply.dim), np.frombuffer(reply.found, np.uint8).astype(bool)

    def info(self) -> pb.ServingInfoResponse:
        try:
            return self.stub.Info(pb.ServingInfoRequest(), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ServingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
