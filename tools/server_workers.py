"""``tigana server --workers N``: N shard processes on one host, under one supervisor.

A ``tigana server`` is one Python process, and its per-frame work holds the GIL: one daemon uses about one core
for Python whatever the host has. ``--workers N`` runs N shard processes, each a ``tigana server`` of its own
(a server of the map: its own port, data folder, server id and streams), all in this daemon's failure domain,
so the scheduler never puts two copies of a slot on this host (``--domain``; the host defaults to the machine's
name, the same for every worker).

What worker ``i`` (0-based) of ``N`` gets, from the supervisor's own settings (``worker_overrides``):

- ``--port``: P + 1 + i when the supervisor has port P > 0 (the supervisor keeps P for the health check); a
  free port when P is 0. ``--advertise HOST:PORT``: HOST:PORT + 1 + i (HOST:0 stays HOST:0: the bound port).
- ``--data-dir``: ``DIR/worker-i`` (none without a data dir). ``--server-id``: ``ID-wi`` when the supervisor
  has an id (given, or a StatefulSet pod's hostname); else each worker keeps the one stored in its folder.
- ``--metrics-port``: M + i for M > 0 (any free port for -1, off for 0).
- ``--memory-budget``: the budget / N: the host's resident rows stay within the budget given.
- ``--slots`` (static shard lists, no scheduler): the supervisor's slots cut into N contiguous ranges, worker i
  the i-th, so that the workers' addresses in order are a static shard list of their own.

The supervisor serves ``grpc.health.v1`` on ``--port`` for all of them: "" and ``tigana.v1.Shard`` are
SERVING while every worker's are, ``tigana.v1.Shard.copies`` while every worker's copies are in sync (what the
Kubernetes probes ask). ``--ready-file`` gets ``{address, port, pid, workers: [each worker's ready file]}``
once every worker serves, and again when a worker started again serves. A worker that exits while the supervisor runs is started again on its folder (a
restart of that server), after 1 s, doubling to 30 s while it keeps failing within a minute of its start.
SIGTERM or Ctrl-C: every worker drains and snapshots (it gets the signal), the supervisor waits for all of
them and exits 0 when every one did. The workers die with the supervisor (``setpriv --pdeathsig TERM``: a
``kill -9`` of the supervisor still drains them).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tigana.embeddings.files import atomic_write
from tigana.ps import rpc
from tigana.ps.ops.local import death_signal_wrapper
from tigana.ps.routing import parse_slots
from tigana.ps.shard import SERVICE_NAME
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import COPIES_HEALTH_NAME, grpc_server_options, host_for_address, lock_data_dir

log = logging.getLogger("tigana.tools.server_workers")

HEALTH_NAMES = ("", SERVICE_NAME, COPIES_HEALTH_NAME)
_POLL_S = 0.25  # how often the supervisor looks at its workers (exits, ready files; health until all serve)
_HEALTH_EVERY_S = 1.0  # how often it asks their health once all have served
_RESTART_FIRST_S, _RESTART_MAX_S, _STABLE_S = 1.0, 30.0, 60.0


def worker_overrides(config: ServerConfig, i: int) -> list[str]:
    """The flags worker ``i`` of ``config.workers`` gets after the supervisor's own (the last of a flag wins)."""
    n = config.workers
    out = ["--workers", "1", "--port", str(config.port + 1 + i if config.port else 0)]
    if config.data_dir:
        out += ["--data-dir", str(Path(config.data_dir) / f"worker-{i}")]
    if config.server_id:
        out += ["--server-id", f"{config.server_id}-w{i}"]
    if config.advertise:
        host, _, port = config.advertise.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"server config: field 'advertise' must be HOST:PORT with workers (each worker "
                             f"advertises PORT + 1 + i, or HOST:0 its own), got {config.advertise!r}")
        out += ["--advertise", f"{host}:{int(port) + 1 + i if int(port) else 0}"]
    if config.metrics_port:
        out += ["--metrics-port", "auto" if config.metrics_port < 0 else str(config.metrics_port + i)]
    if config.memory_budget:
        out += ["--memory-budget", str(config.memory_budget // n)]
    if not config.scheduler:
        out += ["--slots", _slot_share(config, i)]
    return out


def _slot_share(config: ServerConfig, i: int) -> str:
    """Worker ``i``'s contiguous share of the supervisor's slots, as ``--slots`` text (inclusive ranges)."""
    owned = parse_slots(config.slots, config.num_slots).nonzero()[0]
    n = config.workers
    if owned.size < n:
        raise ValueError(f"server config: field 'workers' is {n}, more than the {owned.size} slot(s) it owns")
    lo, hi = owned.size * i // n, owned.size * (i + 1) // n
    share = owned[lo:hi]
    breaks = (share[1:] != share[:-1] + 1).nonzero()[0]  # where a run of consecutive slots ends
    starts, ends = share[[0, *(breaks + 1)]], share[[*breaks, share.size - 1]]
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in zip(starts.tolist(), ends.tolist(), strict=True))


@dataclass
class _Worker:
    index: int
    cmd: list[str]
    ready_file: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0
    backoff_s: float = _RESTART_FIRST_S
    restart_at: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    channel: grpc.Channel | None = None  # to ``info["address"]``, for its health


class Supervisor:
    """The processes of ``tigana server --workers N`` and their common health; ``run`` until ``stop`` is set."""

    def __init__(self, config: ServerConfig, argv: Sequence[str], *, ready_file: str | None = None,
                 run_dir: Path) -> None:
        self.config, self.security = config, config.security()
        self.ready_file = Path(ready_file) if ready_file else None
        self._lock = None
        if config.data_dir:  # the supervisor holds the folder: a second daemon on it is refused at once
            root = Path(config.data_dir)
            if (root / "server-id").exists():
                raise OSError(f"data dir {str(root)!r} holds a single server's tables: with --workers each worker "
                              "keeps its own in DATA_DIR/worker-i; give the workers a new data dir")
            self._lock = lock_data_dir(root, workers=config.workers)
        run_dir.mkdir(parents=True, exist_ok=True)
        base = [*death_signal_wrapper("TERM"), sys.executable, "-m", "tigana.tools.cli", *argv]
        self.workers = []
        for i in range(config.workers):
            ready = run_dir / f"worker-{i}.ready.json"
            self.workers.append(_Worker(i, [*base, *worker_overrides(config, i), "--ready-file", str(ready)], ready))
        self.health = health.HealthServicer(experimental_non_blocking=True)
        for name in HEALTH_NAMES:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="tigana-workers"),
                                   options=grpc_server_options(config),
                                   interceptors=self.security.interceptors())
        rpc.add_health_and_reflection(self._server, self.health, ())
        target = f"{config.host}:{config.port}"
        try:
            self.port = self.security.add_port(self._server, target)
        except RuntimeError as exc:
            raise OSError(f"cannot bind {target} (port in use or address not local)") from exc
        if not self.port:
            raise OSError(f"cannot bind {target} (port in use or address not local)")
        self.address = f"{host_for_address(config.host)}:{self.port}"
        self._announced = False
        self._written: dict[str, Any] | None = None  # the ready file's content
        self._health_at = 0.0

    def run(self, stop: Any) -> int:
        """Start every worker, keep them running and report their health until ``stop`` is set; then stop them
        all (SIGTERM: each drains and snapshots). 0 when every worker exited 0 at the end."""
        self._server.start()
        try:
            for w in self.workers:
                self._start(w)
            while not stop.wait(_POLL_S):
                self._tend()
                if not self._announced or time.monotonic() >= self._health_at:
                    self._health_at = time.monotonic() + _HEALTH_EVERY_S
                    self._report_health()
        finally:
            codes = self._stop_all()
            for w in self.workers:
                self._close_channel(w)
            self._server.stop(grace=1.0)
            if self.ready_file is not None:
                self.ready_file.unlink(missing_ok=True)
            if self._lock is not None:
                self._lock.close()
        return 0 if all(c == 0 for c in codes) else 1

    # --- the workers ---
    def _start(self, w: _Worker) -> None:
        w.ready_file.unlink(missing_ok=True)
        w.proc = subprocess.Popen(w.cmd)  # its output is the supervisor's (a container's log, a terminal)
        w.started, w.restart_at = time.monotonic(), None
        self._forget(w)
        log.info("worker %d started (pid %d)", w.index, w.proc.pid)

    def _tend(self) -> None:
        """Read the workers' ready files; start again, after its backoff, a worker that exited."""
        now = time.monotonic()
        for w in self.workers:
            assert w.proc is not None
            code = w.proc.poll()
            if code is None:
                if not w.info and w.ready_file.exists():
                    try:
                        w.info = json.loads(w.ready_file.read_text())
                    except ValueError:  # written atomically: a partial read is a race with a new start
                        continue
                    w.channel = self.security.channel(w.info["address"])
                continue
            if w.restart_at is None:
                if now - w.started > _STABLE_S:  # it ran a while: a new failure, not the same one again
                    w.backoff_s = _RESTART_FIRST_S
                w.restart_at = now + w.backoff_s
                w.backoff_s = min(w.backoff_s * 2, _RESTART_MAX_S)
                self._forget(w)
                log.warning("worker %d (pid %d) exited with status %s; starting it again in %.0f s", w.index,
                            w.proc.pid, code, w.restart_at - now)
            elif now >= w.restart_at:
                self._start(w)

    def _forget(self, w: _Worker) -> None:
        w.info = {}
        self._close_channel(w)

    @staticmethod
    def _close_channel(w: _Worker) -> None:
        if w.channel is not None:
            w.channel.close()
            w.channel = None

    def _serving(self, w: _Worker, name: str) -> bool:
        """Whether worker ``w`` answers SERVING for health ``name`` (False while it is not up)."""
        if w.channel is None or w.proc is None or w.proc.poll() is not None:
            return False
        try:
            reply = health_pb2_grpc.HealthStub(w.channel).Check(health_pb2.HealthCheckRequest(service=name),
                                                               timeout=2.0)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _report_health(self) -> None:
        """Each health name SERVING while every worker's is (a worker not running is not serving)."""
        every: dict[str, bool] = {name: True for name in HEALTH_NAMES}
        for w in self.workers:
            for name in HEALTH_NAMES:
                every[name] = every[name] and self._serving(w, name)
        for name, ok in every.items():
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING if ok
                            else health_pb2.HealthCheckResponse.NOT_SERVING)
        if not every[""]:
            return
        info = {"address": self.address, "port": self.port, "pid": os.getpid(),
                "workers": [w.info for w in self.workers]}
        if self.ready_file is not None and info != self._written:  # every worker serves, some anew
            self.ready_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.ready_file, json.dumps(info))
            self._written = info
        if not self._announced:
            self._announced = True
            print(f"tigana server: {len(self.workers)} workers serving ("
                  + ", ".join(w.info["address"] for w in self.workers) + f"); health on {self.address}",
                  file=sys.stderr, flush=True)

    def _stop_all(self) -> list[int]:
        """SIGTERM every running worker, then wait for each (it drains and snapshots within its grace); their
        exit statuses (a worker waiting to start again after a crash has none to give)."""
        for name in HEALTH_NAMES:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        running = [w for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for w in running:
            w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_grace_s + 120.0  # the drain, then the snapshot
        codes = []
        for w in running:
            try:
                codes.append(w.proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                log.error("worker %d (pid %d) did not stop in time; killing it", w.index, w.proc.pid)
                w.proc.kill()
                codes.append(w.proc.wait())
        return codes
