"""``tigana serve``: a read-only server for inference, fed by training.

``--from DIR`` serves one table's export log (``tigana admin export TABLE --follow --out DIR``); ``--model DIR``
serves a published model (``tigana.ps.serving.modeldir``: every table's export log and the dense weights the
trainer publishes) and answers ``Predict`` too: raw feature rows in, click probabilities out, each answer
carrying the model version that made it (``tigana.ps.serving.model``).

``start_serving(ServeConfig(source=DIR, port=P))`` binds the gRPC port and serves health (NOT_SERVING) and
reflection at once; a follower thread polls ``DIR/manifest.json`` (``tigana.ps.serving.exportlog``), loads the full
export it names, then applies each new delta in ``seq`` order. Health turns SERVING once the first full export
is loaded (with ``--model``: every table's, and a dense version); the data calls answer UNAVAILABLE before that.

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
- **Unknown ids** read as ``--unseen`` says (``tigana.embeddings.unseen``, the policy the trainer's
  evaluation shares): ``zeros``, a number (every element), ``initial`` (the row the table's initializer gives
  the id; ``--model`` only, from ``model.json``), or with ``--from`` also ``mean`` (the mean of the rows, as of
  the last full load or fold). Default: the model's own (``model.json``'s ``unseen``, the trainer's
  setting), else ``zeros``. ``found`` says which ids were known.
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

    handle = start_serving(ServeConfig(model="published/", port=0), loader=load_scorer)  # tigana.trainer.predict
    with ServingClient(handle.address) as serving:
        probabilities, version = serving.predict(dense, categorical)
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
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2

from tigana.embeddings.unseen import Unseen
from tigana.proto import serving_pb2 as pb
from tigana.ps import rpc
from tigana.ps.errors import InvalidArgument, Unavailable
from tigana.ps.metrics import ServingMetrics
from tigana.ps.security import SecuritySettings
from tigana.ps.serving.model import Loader, ModelFollower, ModelState
from tigana.ps.serving.tables import Follower, LogFollower, TableState, default_policy
from tigana.ps.settings import load as load_settings
from tigana.ps.settings import parse_metrics_port

log = logging.getLogger("tigana.ps.serving")

SERVICE_NAME = "tigana.v1.Serving"


@dataclass(frozen=True, kw_only=True)
class ServeConfig(SecuritySettings):
    """Settings of ``tigana serve``. ``source``: one table's export log folder, or ``model``: a published
    model's folder (exactly one of the two); ``poll_s``: seconds between manifest polls; ``unseen``: the row of
    an unknown id (``zeros``, ``initial``, a number, or ``mean`` with ``source``; empty: the model's, else
    zeros); ``max_ids``: ids per lookup; ``max_rows``: feature rows
    per prediction; ``canary``: a labelled file each new model version is scored on before it goes live (refused
    below the served version's AUC by more than ``max_auc_drop``); ``keep_versions``: model versions held for
    an instant rollback; ``verify``: check every entry's sha256 before using it; TLS and tokens as on a shard server
    (``SecuritySettings``; none: plain); ``metrics_port``: Prometheus HTTP port (0 off, -1 a free one)."""

    source: str = ""
    model: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    poll_s: float = 0.1
    unseen: str = ""
    max_ids: int = 1_000_000
    max_rows: int = 65_536
    canary: str = ""
    max_auc_drop: float = 0.01
    keep_versions: int = 10
    max_message_bytes: int = 64 << 20
    max_workers: int = 8
    verify: bool = True
    drain_grace_s: float = 5.0
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if bool(self.source) == bool(self.model):
            raise InvalidArgument("serve: give exactly one of --from DIR (one table's export log) and --model DIR "
                                  "(a published model)")
        if self.unseen:
            policy = default_policy(self.unseen)  # raises InvalidArgument for a bad one
            if policy == "mean" and self.model:
                raise InvalidArgument("serve: --unseen mean is for --from: a model's evaluation cannot read a mean "
                                      "row, so its predictions would differ from the trainer's; use zeros, "
                                      "initial or a number")
            if isinstance(policy, Unseen) and policy.value is None and not self.model:
                raise InvalidArgument("serve: --unseen initial needs --model (its model.json names the tables' "
                                      "initializers)")
        if self.poll_s <= 0:
            raise InvalidArgument(f"serve: --poll must be > 0 seconds, got {self.poll_s}")
        if self.max_ids < 1:
            raise InvalidArgument(f"serve: --max-ids must be >= 1, got {self.max_ids}")
        if self.max_rows < 1:
            raise InvalidArgument(f"serve: --max-rows must be >= 1, got {self.max_rows}")
        if self.keep_versions < 1:
            raise InvalidArgument(f"serve: --keep-versions must be >= 1, got {self.keep_versions}")
        if not self.max_auc_drop >= 0:
            raise InvalidArgument(f"serve: --max-auc-drop must be >= 0, got {self.max_auc_drop}")
        if self.canary and not self.model:
            raise InvalidArgument("serve: --canary scores a model's versions; it needs --model")
        if self.canary and not os.path.isfile(self.canary):
            raise InvalidArgument(f"serve: --canary {self.canary!r} is not a file")
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
    env = os.environ if env is None else env
    own = {f"TIGANA_{n.upper()}": env[f"TIGANA_{n.upper()}"] for n in ENV_FIELDS if f"TIGANA_{n.upper()}" in env}
    return load_settings(ServeConfig, flags=flags, env=own, parsers={"metrics_port": parse_metrics_port})


class ServingService:
    """The ``tigana.v1.Serving`` handlers over a follower's state: a ``LogFollower``'s one table, or a
    ``ModelFollower``'s model."""

    def __init__(self, follower: Follower, config: ServeConfig, metrics: ServingMetrics) -> None:
        self.follower, self.config, self.metrics = follower, config, metrics

    def tables(self) -> dict[str, TableState]:
        """The tables served now (read once per call: one state)."""
        state = self.follower.state
        if state is None:
            return {}
        return state.tables if isinstance(state, ModelState) else {state.table: state}

    def _count_failure(self, method: str, code: str, seconds: float) -> None:
        if code == "OK":  # an answered call is counted with its ids or rows by the handler
            return
        if method == "Predict":
            self.metrics.observe_predict(code, seconds)
        else:
            self.metrics.observe(code, seconds)

    @rpc.guard("Lookup", log, observe=_count_failure)
    def Lookup(self, request: pb.ServingLookupRequest, context: grpc.ServicerContext) -> pb.ServingLookupResponse:
        start = time.perf_counter()
        tables = self.tables()
        if not tables:
            raise Unavailable(f"Lookup: nothing loaded yet from {self._source()!r}")
        if request.table:
            state = tables.get(request.table)
            if state is None:
                served = next(iter(tables)) if len(tables) == 1 else sorted(tables)
                raise InvalidArgument(f"Lookup: field 'table' is {request.table!r}, this server serves {served!r}")
        elif len(tables) == 1:
            state = next(iter(tables.values()))
        else:
            raise InvalidArgument(f"Lookup: field 'table' is empty; this server serves {sorted(tables)}: name one")
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

    @rpc.guard("Predict", log, observe=_count_failure)
    def Predict(self, request: pb.PredictRequest, context: grpc.ServicerContext) -> pb.PredictResponse:
        start = time.perf_counter()
        if not self.config.model:
            raise InvalidArgument(f"Predict: this server serves one table's export log ({self.config.source!r}), "
                                  "not a model; start it with --model DIR")
        state = self.follower.state
        if state is None:
            raise Unavailable(f"Predict: no model version loaded yet from {self.config.model!r}")
        n = request.rows
        if n > self.config.max_rows:
            raise InvalidArgument(f"Predict: field 'rows' is {n}, at most {self.config.max_rows} per request")
        nd, ns = state.scorer.num_dense, state.scorer.num_sparse
        dense, cat = request.dense, request.categorical  # protobuf copies a bytes field on every access
        if len(dense) != 4 * n * nd:
            raise InvalidArgument(f"Predict: field 'dense' holds {len(dense)} bytes; {n} rows of {nd} float32 "
                                  f"values are {4 * n * nd}")
        if len(cat) != 8 * n * ns:
            raise InvalidArgument(f"Predict: field 'categorical' holds {len(cat)} bytes; {n} rows of {ns} uint64 "
                                  f"values are {8 * n * ns}")
        probabilities = state.predict(np.frombuffer(dense, "<f4").reshape(n, nd),
                                      np.frombuffer(cat, "<u8").reshape(n, ns))
        self.metrics.observe_predict("OK", time.perf_counter() - start, n)
        return pb.PredictResponse(probabilities=np.asarray(probabilities, "<f4").tobytes(), version=state.version,
                                  model=state.model)

    def Info(self, request: pb.ServingInfoRequest, context: grpc.ServicerContext) -> pb.ServingInfoResponse:
        if isinstance(request, rpc.Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))
        f, state, tables = self.follower, self.follower.state, self.tables()
        out = pb.ServingInfoResponse(default_row="" if f.policy is None else str(f.policy), deltas_applied=f.deltas_applied,
                                     rows_applied=f.rows_applied, apply_seconds=f.apply_seconds)
        out.tables.extend(sorted(tables))
        if isinstance(state, ModelState):
            out.model, out.version, out.version_time = state.model, state.version, state.version_time
            out.step, out.pinned, out.versions_refused = state.step, f.pinned, len(f.refused)
            out.canary_auc = state.canary_auc if state.canary_auc == state.canary_auc else 0.0
            out.num_dense, out.num_sparse = state.scorer.num_dense, state.scorer.num_sparse
            out.rows = sum(t.size for t in tables.values())
            out.data_time = min(t.data_time for t in tables.values())
            out.loaded_time = state.loaded_time
        elif isinstance(state, TableState):
            out.table, out.dim, out.rows, out.seq, out.base_seq = (state.table, state.dim, state.size, state.seq,
                                                                   state.base_seq)
            out.data_time, out.loaded_time = state.data_time, state.loaded_time
        return out

    def _source(self) -> str:
        return self.config.model or self.config.source


class ServingHandle:
    """A running ``tigana serve``: ``address`` as bound; ``wait_ready`` until the first full export is loaded
    (a model: every table's, and a dense version); ``close`` is idempotent. ``loader`` builds a model's scorer
    (required with ``config.model``)."""

    def __init__(self, config: ServeConfig, loader: Loader | None = None) -> None:
        self.config = config
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._ready = threading.Event()
        self.follower: Follower
        if config.model:
            if loader is None:
                raise InvalidArgument("serve: --model needs a scorer loader (tigana.trainer.predict.load_scorer)")
            policy = default_policy(config.unseen) if config.unseen else None  # None: model.json's
            self.follower = ModelFollower(config.model, policy, loader, verify=config.verify, on_swap=self._swapped,
                                          canary=config.canary, max_auc_drop=config.max_auc_drop,
                                          keep=config.keep_versions)
        else:
            self.follower = LogFollower(config.source, default_policy(config.unseen or "zeros"), verify=config.verify,
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

    def _swapped(self, state: TableState | ModelState) -> None:
        if not self._ready.is_set():
            if isinstance(state, ModelState):
                log.info("serving model %r version %d (tables %s) on %s", state.model, state.version,
                         sorted(state.tables), self.address)
            else:
                log.info("serving table %r (%d rows, dim %d, seq %d) on %s", state.table, state.size, state.dim,
                         state.seq, self.address)
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self._ready.set()

    def _figures(self) -> dict[str, float]:
        """The gauges of the metrics endpoint, read at scrape time."""
        f, state, tables = self.follower, self.follower.state, self.service.tables()
        out = {"ready": float(state is not None), "deltas_applied": f.deltas_applied, "rows_applied": f.rows_applied,
               "apply_seconds": f.apply_seconds}
        if isinstance(state, ModelState):
            out.update(rows=sum(t.size for t in tables.values()), version=state.version, step=state.step,
                       versions_refused=len(f.refused), pinned=float(f.pinned),
                       data_age_seconds=max(0.0, time.time() - min(t.data_time for t in tables.values())),
                       version_age_seconds=max(0.0, time.time() - state.version_time))
        elif isinstance(state, TableState):
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
    def state(self) -> TableState | ModelState | None:
        return self.follower.state

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until what is served is loaded (health SERVING); False on timeout."""
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


def start_serving(config: ServeConfig, loader: Loader | None = None) -> ServingHandle:
    """Bind and start ``tigana serve``; returns at once (``wait_ready`` for the first state). ``loader``: the
    scorer loader a ``config.model`` needs. Raises ``OSError`` when the port cannot be bound,
    ``InvalidArgument`` for bad settings."""
    return ServingHandle(config, loader).start()
