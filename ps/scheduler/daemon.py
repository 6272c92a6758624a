"""Running a scheduler: ``start_scheduler(config) -> SchedulerHandle``, the one way the CLI, the tests and the
benchmarks start it.

The handle binds the gRPC server (the ``SchedulerService``, health and reflection), runs the tick thread
(failure detection and placement, a few times a second) and, with an electing store (etcd), the election
thread; it publishes the health of the scheduler service (SERVING on the leader only) and of the data's
protection (``REPLICATION_HEALTH_NAME``: every slot has its copies; ``DOMAINS_HEALTH_NAME``: no slot's in-sync
copies share a failure domain), and serves the Prometheus metrics when asked.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2

from tigana.proto import scheduler_pb2 as spb
from tigana.ps import rpc
from tigana.ps.errors import PSError, Unavailable
from tigana.ps.health import check_health
from tigana.ps.metrics import SchedulerMetrics
from tigana.ps.scheduler.announcer import Announcer
from tigana.ps.scheduler.config import SchedulerConfig
from tigana.ps.scheduler.driver import SchedulerDriver
from tigana.ps.scheduler.liveness import stalled_between
from tigana.ps.scheduler.service import SERVICE_NAME, SchedulerService
from tigana.ps.scheduler.stores.file import FileMapStore, MapStore
from tigana.ps.security import NONE, Security

log = logging.getLogger("tigana.ps.scheduler")  # one logger for the whole scheduler

# Health of the data's protection: NOT_SERVING while some slot has fewer than 1 + replicas in-sync copies.
REPLICATION_HEALTH_NAME = "tigana.v1.Scheduler.replication"
DOMAINS_HEALTH_NAME = "tigana.v1.Scheduler.domains"


def probe_closed(address: str, timeout_s: float = 0.5, security: Security = NONE) -> bool | None:
    """True when nothing listens at ``address`` (connection refused), False when a health check answered,
    None when it timed out (a paused or partitioned server: the heartbeat timeout decides)."""
    found = check_health(address, timeout_s=timeout_s, security=security,
                         options=[("grpc.initial_reconnect_backoff_ms", 50)])
    if found.answered:
        return False
    return True if found.code == grpc.StatusCode.UNAVAILABLE else None


class NotLeader(Unavailable):
    """This scheduler is a standby; the message names the leader (clients with a list move on to the next)."""


class SchedulerHandle:
    """A running scheduler: ``address``, ``core`` (None on a standby), ``metrics`` (its Prometheus registry;
    served on ``metrics_port`` when ``SchedulerConfig.metrics_port`` is set, else None), ``close()`` (idempotent).

    With an electing store (etcd) the handle serves at once but leads only once elected: the election thread
    campaigns, builds a ``SchedulerDriver`` from the stored state when it wins (so a new leader starts from the
    last saved map, and gives every server a full heartbeat timeout), renews the lease every third of its
    TTL, and steps down (drops the core, answers as a standby, campaigns again) when the lease could not be
    renewed within the TTL or the store refused a write. The store's fencing, not this thread's timing, is
    what keeps a deposed leader from changing the map (``stores.etcd``)."""

    def __init__(self, config: SchedulerConfig, store: MapStore | None = None) -> None:
        self.config = config
        self._tmp = None
        if store is None and config.store is not None:
            from tigana.ps.scheduler.stores.etcd import EtcdMapStore

            store = EtcdMapStore(config.store)
        if store is None:
            data_dir = config.data_dir
            if data_dir is None:
                import tempfile

                self._tmp = tempfile.TemporaryDirectory(prefix="tigana-scheduler-")
                data_dir = self._tmp.name
            store = FileMapStore(data_dir)
        self.store = store
        self.electing = hasattr(store, "campaign")
        self.security = config.security()
        self.announcer = Announcer(security=self.security)
        # One registry for the process, kept across leadership terms; a standby reports leader 0.
        self.metrics = SchedulerMetrics(self._figures)
        self.metrics_port: int | None = None
        self.core: SchedulerDriver | None = None if self.electing else self._new_core()
        self.auth_rejected = 0
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                              thread_name_prefix="tigana-scheduler"),
                                   options=[("grpc.max_send_message_length", 64 << 20),
                                            ("grpc.max_receive_message_length", 64 << 20),
                                            ("grpc.so_reuseport", 0)],
                                   interceptors=self.security.interceptors(self._rejected))
        rpc.register(self._server, spb.DESCRIPTOR.services_by_name["Scheduler"], SchedulerService(self._leading))
        rpc.add_health_and_reflection(self._server, self.health, (SERVICE_NAME,))
        port = 0
        try:
            port = self.security.add_port(self._server, f"{config.host}:{config.port}")
        except RuntimeError:
            port = 0
        if not port:
            self.announcer.close()
            raise OSError(f"cannot bind {config.host}:{config.port} (port in use or address not local)")
        self.port = port
        host = "127.0.0.1" if config.host in ("", "0.0.0.0", "[::]", "::") else config.host
        self.address = config.advertise or f"{host}:{port}"
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="tigana-scheduler-tick", daemon=True)
        self._election = threading.Thread(target=self._elect, name="tigana-scheduler-election", daemon=True)
        self._closed = False
        self._renewed = 0.0  # when the last successful lease renewal was sent
        self.terms = 0  # times this scheduler became the leader

    def _new_core(self) -> SchedulerDriver:
        return SchedulerDriver(self.config, self.store, announce=self.announcer,
                             probe=lambda a: probe_closed(a, self.config.probe_timeout_s, self.security),
                             metrics=self.metrics)

    def _figures(self) -> dict[str, float]:
        core = getattr(self, "core", None)
        return core.figures() if core is not None else {"leader": 0.0}

    def _leading(self) -> SchedulerDriver:
        core = self.core
        if core is None:
            try:
                leader = self.store.leader() if self.electing else None
            except PSError:
                leader = None
            raise NotLeader(f"scheduler {self.address} is a standby; the leader is "
                            f"{leader or 'being elected'}")
        return core

    # --- election (electing stores only) ----------------------------------------------------------------
    def _elect(self) -> None:
        ttl = self.config.leader_ttl_s
        while not self._stop.is_set():
            try:
                if self.core is None:
                    if self.store.campaign(self.address, ttl):
                        self._lead()
                    else:
                        self._stop.wait(min(0.25, ttl / 4))
                    continue
                sent = time.monotonic()
                renewed = self.store.keep_alive()
                if renewed:
                    self._renewed = sent  # the lease runs at least ttl from when the renewal was sent
                if self.store.deposed.is_set() or time.monotonic() - self._renewed >= ttl:
                    self._step_down("the store refused a write" if self.store.deposed.is_set()
                                    else f"the lease was not renewed for {ttl}s")
                    continue
                self._stop.wait(ttl / 3 if renewed else 0.1)
            except Exception:  # noqa: BLE001 - etcd unreachable: keep trying; a leader steps down on its TTL
                log.debug("election round failed", exc_info=True)
                if self.core is not None and time.monotonic() - self._renewed >= ttl:
                    self._step_down(f"the lease was not renewed for {ttl}s")
                self._stop.wait(0.2)

    def _lead(self) -> None:
        self._renewed = time.monotonic()
        try:
            core = self._new_core()  # loads the last saved state (and fences it from here on)
        except Exception:
            log.exception("taking over as leader failed; resigning")
            self.store.resign()
            raise
        self.terms += 1
        self.core = core
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("leading cluster %s from epoch %d (term %d at %s; store %s)", core.map.cluster_id, core.map.epoch,
                 self.terms, self.address, self.store.describe())
        self.announcer(core.map)

    def _step_down(self, why: str) -> None:
        core, self.core = self.core, None
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.warning("stepping down as leader: %s", why)
        if core is not None:
            core.close()  # long polls on the old core return; their clients ask again and are redirected
        self.store.resign()

    def _rejected(self, method: str, reason: str) -> None:
        self.auth_rejected += 1
        log.warning("refused %s: %s credential", method, reason)

    def _tick(self) -> None:
        interval = min(0.2, self.config.heartbeat_timeout_s / 10)
        last = time.monotonic()
        while not self._stop.wait(interval):
            now = time.monotonic()
            stalled, last = stalled_between(last, now, self.config.heartbeat_timeout_s), now
            core = self.core
            if core is None:
                continue
            try:
                core.tick(stalled)
                # tigana.v1.Scheduler.replication: SERVING only while every slot has its 1 + replicas copies;
                # tigana.v1.Scheduler.domains: only while no slot's in-sync copies share a failure domain
                figures = core.figures()
                for name, key in ((REPLICATION_HEALTH_NAME, "slots_degraded"),
                                  (DOMAINS_HEALTH_NAME, "slots_domain_degraded")):
                    self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING if figures[key]
                                    else health_pb2.HealthCheckResponse.SERVING)
            except Unavailable as exc:  # the store: deposed (the election thread steps down) or unreachable
                log.warning("scheduler tick: %s", exc)
            except Exception:  # noqa: BLE001 - keep detecting failures whatever happened
                log.exception("scheduler tick failed")

    def start(self) -> SchedulerHandle:
        self._server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        # the scheduler service itself is SERVING only on the leader (a readiness probe on it routes a
        # Kubernetes Service to the leader alone); a standby answers UNAVAILABLE naming the leader
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING if self.electing
                        else health_pb2.HealthCheckResponse.SERVING)
        self._ticker.start()
        if self.electing:
            self._election.start()
        else:
            self.announcer(self.core.map)
        if self.config.metrics_port:
            self.metrics_port = self.metrics.serve_http(self.config.metrics_port, self.config.metrics_host)
        return self

    def close(self, grace: float = 1.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        core = self.core
        if core is not None:
            core.close()  # wake the long polls: their threads would hold the process up to 30 s
        self._server.stop(grace).wait()
        # No gRPC call may outlive the handle: the tick's probes and the announcer's InstallMaps end first
        # (a daemon exiting under a call in flight can abort in gRPC's teardown: exit status 134).
        if self._ticker.is_alive():
            self._ticker.join(5.0)
        if core is not None:
            core.wait_probes(5.0)
        self.announcer.close()
        self.metrics.close()
        if self.electing:
            self._election.join(5.0)
            self.store.resign()  # a standby takes over at once instead of after the lease TTL
            self.store.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> SchedulerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_scheduler(config: SchedulerConfig | None = None, store: MapStore | None = None) -> SchedulerHandle:
    """Bind and start a scheduler; returns its handle (serving at once)."""
    return SchedulerHandle(config or SchedulerConfig(), store).start()
