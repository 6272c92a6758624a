"""``tigana bench ps --workers N``: one ``tigana server --workers N`` against ``--workers 1``, saturated.

Two daemons run side by side, each a static shard list of its own (no scheduler, no replica, so that only the
process count differs): ``tigana server --workers N`` and ``tigana server --workers 1``. ``--clients`` client
processes (default 2) drive one daemon at a time, each pushing (or pulling) Zipf batches back to back for
``--seconds`` (a pull in flight each, or 8 pushes then a flush): the daemons take turns in every round, and each line reports
the median over rounds. Cases, one JSON line each, the N-worker daemon against the 1-worker one:

- ``workers_push``         rows/s of pushes of ``--batch`` ids (dim 16, fp32, Adagrad)
- ``workers_pull``         rows/s of pulls of the same batches
- ``workers_push_frames``  frames/s the daemon handled, pushes of ``--frame-ids`` ids each: a frame's fixed
                           cost (a push goes to every worker that owns one of its ids, one frame each:
                           ``frames_per_call``)

Each line gives ``server_cores`` (the daemon's processes' CPU seconds per second of the round: 1.0 is one
core kept busy) beside ``peer_server_cores``: with enough clients the 1-worker figure is a process's ceiling,
its ``peer_value`` the rows/s (or frames/s) one worker serves when saturated (docs/deployment.md sizes hosts
with it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tigana.ps.ops.local import death_signal_wrapper
from tigana.tools.bench.report import emit, log
from tigana.tools.bench.scale.resources import process_cpu_s

DIM = 16
_TABLE = "bench_workers"
_IN_FLIGHT = 8  # pushes a client sends before it waits for their acknowledgements (flush)


def bench_workers(args: argparse.Namespace) -> int:
    n, clients, seconds = args.workers, args.clients, args.seconds
    repeats = args.repeats or (3 if args.quick else 5)
    params = dict(workers=n, clients=clients, seconds=seconds, repeats=repeats, dim=DIM, batch=args.batch,
                  frame_ids=args.frame_ids, num_ids=args.num_ids, zipf=args.zipf, wire="fp32", optimizer="adagrad",
                  statistic=f"median of {repeats} rounds")
    with tempfile.TemporaryDirectory(prefix="tigana-bench-workers-") as tmp:
        daemons = {w: _Daemon(Path(tmp) / f"workers-{w}", w) for w in (n, 1)}
        ctx = mp.get_context("spawn")
        procs, pipes = [], []
        try:
            for d in daemons.values():
                d.wait_ready()
            for k in range(clients):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_client_main, args=(child, k, args.num_ids, args.zipf), daemon=True)
                p.start()
                procs.append(p)
                pipes.append(parent)
            for d in daemons.values():  # each client inserts its rows once, so the timed runs update
                _ask(pipes, ("warm", d.addresses, args.batch))
            figures: dict[str, dict[int, dict[str, list[float]]]] = {}
            for op, size, unit in (("push", args.batch, "rows"), ("pull", args.batch, "rows"),
                                   ("push", args.frame_ids, "frames")):
                case = f"workers_{op}" + ("_frames" if unit == "frames" else "")
                figures[case] = {w: {"rate": [], "cores": []} for w in daemons}
                for r in range(repeats + 1):  # one untimed round first
                    for w in (list(daemons) if r % 2 else list(daemons)[::-1]):
                        rate, cores = _round(daemons[w], pipes, op, size, seconds, unit)
                        if r:
                            figures[case][w]["rate"].append(rate)
                            figures[case][w]["cores"].append(cores)
                    if r:
                        log(f"  {case} round {r}: " + ", ".join(
                            f"{w} worker(s) {figures[case][w]['rate'][-1]:.0f}/s" for w in daemons))
                ours, peer = figures[case][n], figures[case][1]
                extra = {"frames_per_call": _frames_per_call(daemons[n], size, args)} if unit == "frames" else {}
                emit(case, f"{unit}/s", statistics.median(ours["rate"]), "tigana server --workers 1",
                     statistics.median(peer["rate"]), **params, ids_per_call=size, **extra,
                     server_cores=round(statistics.median(ours["cores"]), 2),
                     peer_server_cores=round(statistics.median(peer["cores"]), 2))
        finally:
            for pipe in pipes:
                with contextlib.suppress(OSError):
                    pipe.send(None)
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            for d in daemons.values():
                d.close()
    return 0


def _round(daemon: _Daemon, pipes: list, op: str, size: int, seconds: float, unit: str) -> tuple[float, float]:
    """Every client runs ``op`` against ``daemon`` for ``seconds`` at once: (rows or calls a second, all
    clients together; the daemon's processes' cores busy meanwhile)."""
    cpu0, t0 = daemon.cpu_s(), time.perf_counter()
    replies = _ask(pipes, ("run", daemon.addresses, op, size, seconds))
    elapsed, cpu = time.perf_counter() - t0, daemon.cpu_s() - cpu0
    done = sum(rep[0 if unit == "rows" else 3] for rep in replies)
    return done / max(max(rep[2] for rep in replies), 1e-9), cpu / elapsed


def _frames_per_call(daemon: _Daemon, size: int, args: argparse.Namespace) -> float:
    """Frames a call of ``size`` ids sends to ``daemon`` on average, over the clients' batches."""
    from tigana.tools.bench.ps.workload import zipf_batches

    frames = _frames_of(daemon.workers)
    return float(np.mean([frames(b) for b in zipf_batches(4, size, args.num_ids, args.zipf, seed=100)]))


def _ask(pipes: list, message: tuple) -> list[Any]:
    for pipe in pipes:
        pipe.send(message)
    replies = [pipe.recv() for pipe in pipes]
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies


def _client_main(conn: Any, k: int, num_ids: int, zipf: float) -> None:
    """A client process: connects to the daemon it is told, then runs timed loops of pulls or pushes."""
    from tigana import ps
    from tigana.tools.bench.ps.workload import _Cycle, zipf_batches

    clients: dict[tuple[str, ...], Any] = {}
    batches: dict[int, _Cycle] = {}
    grads: dict[int, np.ndarray] = {}

    def client_for(addresses: list[str]) -> Any:
        key = tuple(addresses)
        if key not in clients:
            clients[key] = c = ps.connect(list(addresses))
            c.create_table(_TABLE, dim=DIM, optimizer=ps.Adagrad(lr=0.01), staleness=None)
        return clients[key]

    def batch_of(size: int) -> _Cycle:
        if size not in batches:
            batches[size] = _Cycle(zipf_batches(4, size, num_ids, zipf, seed=100 + k))
            grads[size] = np.random.default_rng(k).normal(0, 0.01, (size, DIM)).astype(np.float32)
        return batches[size]

    try:
        while (message := conn.recv()) is not None:
            try:
                if message[0] == "warm":
                    _, addresses, size = message
                    c, cycle = client_for(addresses), batch_of(size)
                    for ids in cycle.items:
                        c.pull(_TABLE, ids)
                    conn.send(None)
                    continue
                _, addresses, op, size, seconds = message
                c, cycle = client_for(addresses), batch_of(size)
                grad, frames_of = grads[size], _frames_of(len(addresses))
                rows = calls = frames = 0
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    ids = cycle()
                    if op == "push":
                        c.push(_TABLE, ids, grad)
                        if calls % _IN_FLIGHT == _IN_FLIGHT - 1:
                            c.flush()
                    else:
                        c.pull(_TABLE, ids)
                    rows, calls, frames = rows + ids.size, calls + 1, frames + frames_of(ids)
                c.flush()  # every push of the run applied before its time is taken
                conn.send((rows, calls, time.perf_counter() - t0, frames))
            except Exception as exc:  # noqa: BLE001 - the parent raises it
                conn.send(RuntimeError(f"bench client {k}: {type(exc).__name__}: {exc}"))
    finally:
        for c in clients.values():
            c.close()


def _frames_of(workers: int) -> Any:
    """ids -> the frames a call of them sends to a static list of ``workers`` (one per worker owning an id)."""
    from tigana.ps.routing import slot_of, slot_range

    starts = np.array([slot_range(i, workers)[0] for i in range(workers)])
    memo: dict[int, int] = {}

    def frames(ids: np.ndarray) -> int:  # the batches cycle: each is counted once
        key = id(ids)
        if key not in memo:
            memo[key] = int(np.unique(np.searchsorted(starts, slot_of(ids), side="right")).size)
        return memo[key]
    return frames


class _Daemon:
    """A ``tigana server --workers W`` (static: every slot, no scheduler) in ``root``; its workers' addresses."""

    def __init__(self, root: Path, workers: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.ready = root / "ready.json"
        self.log = open(root / "server.log", "ab")  # noqa: SIM115 - closed by close()
        env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0")
        self.proc = subprocess.Popen([*death_signal_wrapper(), sys.executable, "-m", "tigana.tools.cli", "server",
                                      "--port", "0", "--workers", str(workers), "--ready-file", str(self.ready)],
                                     stdout=self.log, stderr=self.log, env=env)
        self.workers, self.addresses, self.pids = workers, [], []

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bench ps --workers: the {self.workers}-worker daemon did not start "
                                   f"(log {self.log.name})")
            time.sleep(0.05)
        info = json.loads(self.ready.read_text())
        workers = info.get("workers", [info])  # --workers 1 is a plain server
        self.addresses = [str(w["address"]) for w in workers]
        self.pids = [int(w["pid"]) for w in workers]

    def cpu_s(self) -> float:
        return sum(process_cpu_s(pid) for pid in self.pids)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
