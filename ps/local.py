"""LocalCluster: N shard daemons as child processes on loopback, each owning a contiguous slot range.

Each child runs ``python -m tigana.tools.cli server`` and writes a ready file (its bound address, as JSON) once its
tables are loaded and health says SERVING; the cluster waits for every file. ``close()`` sends SIGTERM (the
daemons drain, snapshot and exit 0), waits, and kills what is left. Children die with the thread that started
them (PR_SET_PDEATHSIG on Linux) so a crashed parent leaves no daemons behind.

Example::

    with LocalCluster(shards=2) as cluster:
        client = ps.connect(cluster.addresses)
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
from collections.abc import Sequence
from pathlib import Path

from tigana.ps.routing import DEFAULT_NUM_SLOTS, slot_range


def _death_signal_wrapper() -> list[str]:
    """A command prefix that makes a child die with us (PR_SET_PDEATHSIG via util-linux ``setpriv``), or none.

    Not a ``preexec_fn``: Python code between fork and exec in a multi-threaded (gRPC) parent can hang or crash
    the child; without one, the child is spawned without running Python code in it."""
    return ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []


class LocalCluster:
    """Shard daemons as child processes. ``addresses`` lists ``host:port`` in slot order (shard i owns
    ``routing.slot_range(i, shards, num_slots)``). Not thread-safe; ``close`` is idempotent.

    data_dir: a folder with one ``shard-<i>`` data dir and log file per shard (a temporary folder, removed on
    close, when None). base_port: shard i listens on base_port + i (free ports when None).
    server_args: extra ``tigana server`` flags for every shard (e.g. ``["--memory-budget", "1GiB"]``).
    """

    def __init__(self, shards: int = 2, *, base_port: int | None = None, data_dir: str | os.PathLike | None = None,
                 num_slots: int = DEFAULT_NUM_SLOTS, host: str = "127.0.0.1", memory_budget: str | None = None,
                 metrics: bool = False, server_args: Sequence[str] = (), startup_timeout: float = 120.0,
                 python: str = sys.executable, env: dict[str, str] | None = None) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.shards = shards
        self.num_slots = num_slots
        self.host = host
        self._tmp = tempfile.TemporaryDirectory(prefix="tigana-local-") if data_dir is None else None
        self.data_dir = Path(self._tmp.name if self._tmp else data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.metrics_ports: list[int | None] = []
        self.returncodes: list[int | None] = []
        self._closed = False
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            ready_files = []
            for i in range(shards):
                start, stop = slot_range(i, shards, num_slots)
                shard_dir = self.data_dir / f"shard-{i}"
                ready = shard_dir / "ready.json"
                shard_dir.mkdir(parents=True, exist_ok=True)
                ready.unlink(missing_ok=True)
                cmd = [*_death_signal_wrapper(), python, "-m", "tigana.tools.cli", "server", "--host", host,
                       "--port", str(base_port + i if base_port else 0), "--data-dir", str(shard_dir),
                       "--slots", f"{start}-{stop - 1}", "--num-slots", str(num_slots),
                       "--ready-file", str(ready), "--metrics-port", "auto" if metrics else "0"]
                if memory_budget:
                    cmd += ["--memory-budget", memory_budget]
                cmd += list(server_args)
                log = open(self.data_dir / f"shard-{i}.log", "ab")  # noqa: SIM115 - the child keeps it
                try:
                    self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                       env=child_env, start_new_session=True))
                finally:
                    log.close()
                ready_files.append(ready)
            self._wait_ready(ready_files, startup_timeout)
        except BaseException:
            self.close(timeout=10)
            raise

    def _wait_ready(self, ready_files: list[Path], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        infos: list[dict | None] = [None] * len(ready_files)
        while any(info is None for info in infos):
            for i, (proc, path) in enumerate(zip(self.procs, ready_files, strict=True)):
                if infos[i] is not None:
                    continue
                if proc.poll() is not None:
                    raise RuntimeError(f"shard {i} exited with code {proc.returncode} while starting:\n"
                                       f"{self.log_tail(i)}")
                if path.exists():
                    with contextlib.suppress(ValueError):
                        infos[i] = json.loads(path.read_text())
            if time.monotonic() > deadline:
                late = [i for i, info in enumerate(infos) if info is None]
                raise TimeoutError(f"shard(s) {late} not ready after {timeout:.0f}s:\n{self.log_tail(late[0])}")
            time.sleep(0.05)
        self.addresses = [str(info["address"]) for info in infos]  # type: ignore[index]
        self.metrics_ports = [info.get("metrics_port") for info in infos]  # type: ignore[union-attr]

    def log_path(self, i: int) -> Path:
        return self.data_dir / f"shard-{i}.log"

    def log_tail(self, i: int, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path(i).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> list[bool]:
        """Whether each shard process is still running."""
        return [p.poll() is None for p in self.procs]

    def close(self, timeout: float = 60.0) -> list[int | None]:
        """SIGTERM every shard, wait up to ``timeout`` seconds in all, SIGKILL the rest; returns exit codes."""
        if self._closed:
            return self.returncodes
        self._closed = True
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
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
            for p in getattr(self, "procs", []):
                if p.poll() is None:
                    p.kill()
