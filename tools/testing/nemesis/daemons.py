"""The nemesis's daemons: a scheduler and shard servers started through the ``tigana`` command line, as the
README's cluster section spells them, each a subprocess in a process group of its own.

    tigana scheduler --port P --data-dir D/scheduler --replicas 1 --heartbeat-timeout 3
    tigana server --port P1 --data-dir D/server-0 --scheduler 127.0.0.1:P --snapshot-every 60
    ...

Two flags beyond the README's, which change nothing the cluster does: ``--ready-file`` (the daemon writes
its address, port, metrics port and pid once it serves: how a script knows the process is up, not that the
cluster settled) and, on the scheduler, ``--metrics-port auto`` (the demotion counters are read there).

The faults act on a daemon's process group: ``kill9`` (SIGKILL), ``pause``/``resume`` (SIGSTOP/SIGCONT) and
``restart`` (the same command line again: same port, same data dir). ``Daemons.close`` stops every process
it started by its own handle (SIGCONT, SIGTERM, then SIGKILL of the group), also when the run failed.
Not thread-safe: one thread (the nemesis's main thread) starts and signals the daemons.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tigana.ps.ops.local import death_signal_wrapper, free_port


def tigana_command() -> list[str]:
    """The ``tigana`` console script of this environment (``python -m tigana.tools.cli`` when absent)."""
    script = Path(sys.executable).with_name("tigana")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tigana.tools.cli"]


def rss_mib(pid: int) -> float | None:
    """Resident memory of ``pid`` in MiB (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


@dataclass
class Daemon:
    """One daemon: its command line (without the ready file), data dir, log and current process."""

    name: str
    argv: list[str]
    data_dir: Path
    log_path: Path
    port: int
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    info: dict[str, Any] = field(default_factory=dict)
    paused: bool = False
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ready_file(self) -> Path:
        return self.log_path.with_suffix(".ready.json")

    def start(self) -> None:
        """Spawn the command (returns at once; ``wait_ready`` waits for the ready file)."""
        self.ready_file.unlink(missing_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([*death_signal_wrapper(), *self.argv, "--ready-file", str(self.ready_file)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
                                         start_new_session=True)
        self.starts += 1
        self.paused = False

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The ready file's content once the process serves; an error with the log's tail if it died."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.ready_file.exists():
                with contextlib.suppress(ValueError):
                    self.info = json.loads(self.ready_file.read_text())
                    return self.info
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited before it was ready:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive and self.proc is not None else None

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill9(self) -> None:
        """``kill -9`` of the process group, reaped."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self.paused = False

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def terminate(self) -> None:
        """SIGCONT (a paused daemon cannot exit), then SIGTERM: it drains, snapshots and exits."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> None:
        """``terminate``, wait, then SIGKILL of the group; reaped."""
        if self.proc is None or self.proc.poll() is not None:
            return  # never started, or already reaped (its group id may belong to someone else by now)
        self.terminate()
        deadline = time.monotonic() + timeout_s
        while not _exited(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # whatever is left of the group (the daemon, or a child it started) goes too, before the leader is
        # reaped: until then its zombie keeps the group id ours (reaped first, the id could be reused)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.paused = False


class Daemons:
    """The scheduler and the servers of one nemesis run, under ``root`` (one folder per daemon, logs beside).

    Example::

        with Daemons(root, heartbeat_timeout_s=3.0) as d:
            d.start_scheduler(replicas=1)
            for _ in range(3):
                d.start_server()
            d.wait_ready()
            ...  # d.servers[i].kill9(); d.restart(d.servers[i])
    """

    def __init__(self, root: Path, *, heartbeat_timeout_s: float = 3.0, snapshot_every_s: float = 60.0,
                 env: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.snapshot_every_s = snapshot_every_s
        self.env = dict(os.environ if env is None else env)
        self.scheduler: Daemon | None = None
        self.servers: list[Daemon] = []

    @property
    def scheduler_address(self) -> str:
        assert self.scheduler is not None
        return self.scheduler.address

    @property
    def metrics_port(self) -> int | None:
        port = self.scheduler.info.get("metrics_port") if self.scheduler is not None else None
        return int(port) if port else None

    def start_scheduler(self, replicas: int = 1) -> Daemon:
        port = free_port()
        data = self.root / "scheduler"
        argv = [*tigana_command(), "scheduler", "--port", str(port), "--data-dir", str(data), "--replicas",
                str(replicas), "--heartbeat-timeout", f"{self.heartbeat_timeout_s:g}", "--metrics-port", "auto"]
        self.scheduler = Daemon("scheduler", argv, data, self.root / "scheduler.log", port, self.env)
        self.scheduler.start()
        return self.scheduler

    def start_server(self, *extra: str) -> Daemon:
        """``tigana server --scheduler ... EXTRA`` on a new data dir (a server joining), started, not waited for."""
        k = len(self.servers)
        port = free_port()
        data = self.root / f"server-{k}"
        argv = [*tigana_command(), "server", "--port", str(port), "--data-dir", str(data), "--scheduler",
                self.scheduler_address, "--snapshot-every", f"{self.snapshot_every_s:g}", *extra]
        server = Daemon(f"server-{k}", argv, data, self.root / f"server-{k}.log", port, self.env)
        self.servers.append(server)
        server.start()
        return server

    def restart(self, daemon: Daemon) -> None:
        """The same command line again: same port, same data dir (a restart after a crash)."""
        if daemon.alive:
            raise RuntimeError(f"{daemon.name} is still running")
        daemon.start()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        for d in self.all():
            if d.alive:
                d.wait_ready(timeout_s)

    def all(self) -> list[Daemon]:
        return ([self.scheduler] if self.scheduler is not None else []) + self.servers

    def by_address(self, address: str) -> Daemon | None:
        return next((s for s in self.servers if s.address == address), None)

    def rss(self) -> dict[int, float]:
        """pid -> resident MiB of every running daemon."""
        out = {}
        for d in self.all():
            pid = d.pid
            mib = rss_mib(pid) if pid is not None else None
            if pid is not None and mib is not None:
                out[pid] = mib
        return out

    def close(self) -> None:
        """Stop the servers (all told at once), then the scheduler, each by its own handle; errors of one never
        skip the rest."""
        for d in self.servers:
            with contextlib.suppress(Exception):
                if d.alive:
                    d.terminate()
        for d in [*reversed(self.servers), *([self.scheduler] if self.scheduler else [])]:
            with contextlib.suppress(Exception):
                d.stop()

    def __enter__(self) -> Daemons:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it (``waitid`` with ``WNOWAIT``)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True

