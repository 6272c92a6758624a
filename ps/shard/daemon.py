"""Start a shard server: the one function the CLI, tests and benchmarks use.

``start_server(config)`` binds the gRPC port, starts serving health (NOT_SERVING) and reflection at once, loads
the tables from ``data_dir`` in a background thread (the shard service answers UNAVAILABLE meanwhile), then turns
health to SERVING. The returned ``ServerHandle`` knows the bound address; ``close()`` stops accepting RPCs, drains
the ones in flight, snapshots every table (when there is a data dir) and frees the port.

Example::

    handle = start_server(ServerConfig(port=0, data_dir="/tmp/shard0"))
    handle.wait_ready(30)
    print(handle.address)        # "127.0.0.1:41234"
    handle.close()
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health, health_pb2

from tigana.embeddings.files import hold_lock
from tigana.ps import rpc
from tigana.ps.allocator import BUDGET_TRIM_EVERY_S, TRIM_EVERY_S, release_free_memory
from tigana.ps.membership import Agent
from tigana.ps.metrics import ServerMetrics
from tigana.ps.shard import SERVICE_NAME, ShardService, add_to_server
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.warmup import warm_kernels

log = logging.getLogger("tigana.ps.shard.daemon")

# Health of this server's copies: NOT_SERVING while any copy it holds is still catching up (slot copy).
COPIES_HEALTH_NAME = "tigana.v1.Shard.copies"


def grpc_server_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Channel arguments of the server: message limits, keepalive, and no silent port sharing."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", config.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),  # two servers on one port must fail, not split the traffic
    ]


class ServerHandle:
    """A running shard server. ``address`` is ``host:port`` as bound; thread-safe; ``close`` is idempotent."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.security = config.security()
        self.service = ShardService(config, security=self.security)
        self.metrics: ServerMetrics = self.service.metrics
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers + config.max_streams,
                                                              thread_name_prefix="tigana-shard"),
                                   options=grpc_server_options(config),
                                   interceptors=self.security.interceptors(self.metrics.count_auth_rejection),
                                   maximum_concurrent_rpcs=config.max_concurrent_requests)
        add_to_server(self.service, self._server)  # the generated registration, with raw data-path codecs
        rpc.add_health_and_reflection(self._server, self.health, (SERVICE_NAME,))
        target = f"{config.host}:{config.port}"
        try:
            port = self.security.add_port(self._server, target)
        except RuntimeError as exc:
            port, cause = 0, exc
        else:
            cause = None
        if not port:
            raise OSError(f"cannot bind {target} (port in use or address not local)") from cause
        self.port: int = port
        self.host: str = config.host
        self.address: str = f"{host_for_address(config.host)}:{port}"
        self.advertise: str = advertised(config.advertise, port) or self.address
        self.agent: Agent | None = None
        if config.scheduler:
            self.agent = Agent(self.service, config.scheduler, self.advertise,
                               heartbeat_interval_s=config.heartbeat_interval_s, lease_s=config.lease_s,
                               security=self.security, domain=config.failure_domain())
            self.service.agent = self.agent
            self.service.on_install = self._copies_health
        self.metrics_port: int | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self._loader: threading.Thread | None = None
        self._lock_file: IO[str] | None = None

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)
        self._copies_health()

    def _copies_health(self) -> None:
        """``tigana.v1.Shard.copies``: SERVING once every copy this server holds is in sync."""
        agent = getattr(self, "agent", None)
        serving = self.service.state == "serving" and (agent is None or agent.registered)
        ok = serving and self.service.catching_up() == 0
        self.health.set(COPIES_HEALTH_NAME, health_pb2.HealthCheckResponse.SERVING if ok
                        else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _start(self, autoload: bool) -> None:
        if self.config.data_dir:
            self._lock_file = lock_data_dir(Path(self.config.data_dir))
        self._server.start()
        if self.config.metrics_port:
            self.metrics_port = self.metrics.serve_http(self.config.metrics_port, self.config.metrics_host)
        if autoload:
            self.load_tables()

    def load_tables(self) -> None:
        """Start loading the tables from the data dir in a background thread (once); health turns SERVING
        when done. ``start_server`` calls it unless ``autoload=False``."""
        with self._close_lock:
            if self._loader is not None or self._closed:
                return
            self._loader = threading.Thread(target=self._load, name="tigana-shard-load", daemon=True)
            self._loader.start()

    def _load(self) -> None:
        try:
            self.service.load()
        except BaseException as exc:  # noqa: BLE001 - reported through wait_ready
            log.exception("loading the tables from %s failed", self.config.data_dir)
            self.error = exc
            self.service.state = "failed"
        else:
            if self.agent is not None:
                # Compile the kernels before the heartbeats start: numba holds the GIL while it compiles, and
                # a first pull compiling for seconds would starve the heartbeat thread (``ps.warmup``).
                warm_kernels(self.config.num_slots)
            self.service.state = "serving"
            if self.agent is not None:  # serve data only once the scheduler's map names this process
                self.agent.start()
                while not self.agent.registered and not self._closed:
                    time.sleep(0.05)
            self._set_health(health_pb2.HealthCheckResponse.SERVING)
            log.info("serving %d table(s) on %s", len(self.service.table_names()), self.address)
            threading.Thread(target=self._periodic, name="tigana-shard-periodic", daemon=True).start()
        finally:
            self._ready.set()

    def _periodic(self) -> None:
        """About once a second: the service's upkeep (rates, streams); every ``TRIM_EVERY_S`` (under a memory
        budget ``BUDGET_TRIM_EVERY_S``) the heap's free pages back to the kernel; with ``snapshot_every_s``, a
        snapshot of every table on schedule (incremental, a full one every ``full_snapshot_every``)."""
        taken = 0
        every = self.config.snapshot_every_s
        next_upkeep = next_snapshot = time.monotonic()
        trim_every = BUDGET_TRIM_EVERY_S if self.config.memory_budget else TRIM_EVERY_S
        next_trim = next_upkeep + trim_every
        next_snapshot += every
        while not self._stopping.wait(max(0.0, min(next_upkeep, next_snapshot if every else next_upkeep)
                                          - time.monotonic())):
            now = time.monotonic()
            if now >= next_upkeep:
                next_upkeep = now + 1.0
                try:
                    self.service.maintain()
                except Exception:  # noqa: BLE001 - upkeep must go on
                    log.exception("periodic upkeep failed")
                if now >= next_trim:
                    next_trim = now + trim_every
                    release_free_memory()
            if every and self.service.catalog is not None and now >= next_snapshot:
                next_snapshot = now + every  # the interval runs from each snapshot's start
                try:
                    self.service.snapshot_all(incremental=taken % self.config.full_snapshot_every != 0)
                    taken += 1
                except Exception:  # noqa: BLE001 - a full disk must not stop the server
                    log.exception("periodic snapshot failed")

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the tables are loaded and health says SERVING; False on timeout. Re-raises a load error."""
        if not self._ready.wait(timeout):
            return False
        if self.error is not None:
            raise self.error
        return True

    def close(self, grace: float | None = None) -> None:
        """Stop accepting RPCs, let the ones in flight finish (up to ``grace`` seconds, default from the config),
        snapshot every table into the data dir, close the tables and the metrics endpoint."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        grace = self.config.drain_grace_s if grace is None else grace
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        if self.agent is not None:
            self.agent.close()
        with self._close_lock:
            loader = self._loader
        if loader is not None:
            loader.join()
        loaded = self.error is None and self.service.state == "serving"
        self._server.stop(grace).wait()
        self.service.state = "closed"
        try:
            if loaded and self.config.data_dir and self.config.snapshot_on_shutdown and self.service.table_names():
                self.service.snapshot_all(incremental=False)
        finally:
            self.service.close_tables()
            self.metrics.close()
            self._unlock()
        log.info("server %s stopped", self.address)

    def _unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ServerHandle({self.address}, state={self.service.state})"


def lock_data_dir(data_dir: Path, *, workers: int = 1) -> IO[str]:
    """Hold an exclusive lock on ``data_dir`` for this server's life: two servers on one data dir would
    overwrite each other's snapshots. The kernel drops the lock when the process dies. A folder laid out for
    another number of ``workers`` (``tigana server --workers``: ``DIR/worker-i``) is refused, naming what it
    holds: starting on it would leave the other layout's tables behind."""
    data_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(int(p.name.split("-", 1)[1]) for p in data_dir.glob("worker-*") if p.name[7:].isdigit())
    extra = [k for k in found if k >= workers] if workers > 1 else found
    if extra:
        raise OSError(f"data dir {str(data_dir)!r} holds the folders of workers {extra} (tigana server --workers), "
                      f"more than this server's {workers}: start it with the workers it has, or drain those "
                      "servers (tigana admin drain) and remove their folders first")
    f, owner = hold_lock(data_dir / "LOCK")
    if f is None:
        raise OSError(f"data dir {str(data_dir)!r} is in use by another server ({owner})")
    return f


def advertised(advertise: str | None, port: int) -> str | None:
    """``advertise`` with a port of 0 (``HOST:0``) replaced by the bound ``port``: a daemon started with
    ``--port 0`` can name its host without knowing its port yet (SLURM jobs sharing a node)."""
    if advertise and advertise.endswith(":0"):
        return f"{advertise[:-2]}:{port}"
    return advertise


def host_for_address(host: str) -> str:
    """``host`` as a client reaches it: a wildcard bind is reached on loopback, an IPv6 address in brackets."""
    if host in ("", "0.0.0.0", "[::]", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def start_server(config: ServerConfig | None = None, *, autoload: bool = True) -> ServerHandle:
    """Bind and start a shard server; returns at once with its handle (call ``wait_ready`` before using it).

    With ``autoload=False`` the server answers health (NOT_SERVING) and reflection but no shard RPCs until
    ``handle.load_tables()``. Raises ``OSError`` when the port cannot be bound, ``InvalidArgument`` for a bad
    config."""
    handle = ServerHandle(config or ServerConfig())
    try:
        handle._start(autoload)
    except BaseException:
        handle._server.stop(0)
        handle.metrics.close()
        handle._unlock()
        raise
    return handle
