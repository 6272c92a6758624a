"""``tigana bench serving-sync [--quick]``: continuous sync from training to serving, on real processes.

A scheduler and 2 shard daemons (``ps.LocalCluster``, no replicas), a table of ``--rows`` rows (dim
``--dim``, SGD, zero init), ``tigana admin export TABLE --follow --out DIR --interval S`` and ``tigana serve
--from DIR`` as child processes. Three measurements, one JSON line each (``tigana.tools.bench.report.emit``):

- ``serving_sync.lag_p50`` / ``serving_sync.lag_p95`` (s): from an acknowledged push of a new id (one every
  ``--push-every`` s for ``--duration`` s) to the first lookup of ``tigana serve`` that finds it (the bench
  looks up every pending id every 5 ms). Peer, measured in the same loop: the same pushes seen by a second
  training client's pull from the shard daemons (the training tier's own freshness, what serving trails).
  ``interval_s`` and ``poll_s`` are the design's wait; ``export_s_mean``: the follower's mean time to write an
  entry.
- ``serving_sync.delta_throughput`` (rows/s): one push updating ``--delta-rows`` existing rows, then the
  delta carrying them: rows / wall-clock seconds from the first carrying delta's cut to the moment ``tigana
  serve`` is seen to have applied it (export, write, poll, read, apply). Peer: a one-shot full export of the same
  table (``tigana admin export``, the same ``ExportRows``), rows / wall-clock seconds. The follower's and the
  server's own seconds come along (``export_s``, ``apply_s``).
- ``serving_sync.lookup_p50`` / ``serving_sync.lookup_p99`` (ms): ``Serving/Lookup`` of 100 ids (90 held,
  10 unknown), ``--lookups`` sequential requests from one client. Peer: a training client's pull of the same
  100 ids from the shard daemons (``insert=False``), each request interleaved with the lookup of the same ids
  (alternating which goes first), so both see the same machine load.

Every child process (cluster, follower, server) is stopped by its own handle, also on failure. The helpers
``spawn_follow``, ``spawn_serve`` and ``wait_serving`` are what the tests use too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from grpc_health.v1 import health_pb2

from tigana import ps
from tigana.ps.health import check_health
from tigana.ps.ops.local import stop_process
from tigana.ps.serving import SERVICE_NAME, ServingClient
from tigana.ps.serving.exportlog import read_manifest
from tigana.tools.bench.report import emit, log

TABLE = "serving"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smaller table and shorter phases (about 20 s)")
    parser.add_argument("--rows", type=int, default=None, help="rows in the table (default 1,000,000; quick 20,000)")
    parser.add_argument("--dim", type=int, default=32, help="embedding dim (default 32)")
    parser.add_argument("--interval", type=float, default=None,
                        help="export --follow --interval, seconds (default 1; quick 0.5)")
    parser.add_argument("--poll", type=float, default=0.05, help="tigana serve --poll, seconds (default 0.05)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of the lag phase (default 30; quick 4)")
    parser.add_argument("--push-every", type=float, default=0.05, help="seconds between lag-phase pushes")
    parser.add_argument("--delta-rows", type=int, default=None,
                        help="rows updated for the throughput phase (default 200,000; quick 10,000)")
    parser.add_argument("--lookups", type=int, default=None, help="lookup requests (default 5,000; quick 300)")


def _child_prefix() -> list[str]:
    """Children die with us (PR_SET_PDEATHSIG through util-linux ``setpriv``) when the bench itself is killed."""
    return ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []


@contextlib.contextmanager
def children(prefix: str) -> Iterator[tuple[Path, list[subprocess.Popen]]]:
    """A temporary folder and the list of the child processes a bench starts in it: every child is stopped by
    its own handle and the folder removed at the end, also on failure."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    procs: list[subprocess.Popen] = []
    try:
        yield work, procs
    finally:
        stop_all(procs)
        shutil.rmtree(work, ignore_errors=True)


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Stop every child by its handle (``stop_process``: SIGTERM, then SIGKILL past its grace)."""
    for proc in procs:
        stop_process(proc)


def spawn_follow(scheduler: str, table: str, out: str | Path, log_path: str | Path, *, interval: float = 1.0,
                 extra: list[str] | None = None) -> subprocess.Popen:
    """``tigana admin export TABLE --follow --out OUT`` as a child process (stop it with ``stop_process``)."""
    cmd = [*_child_prefix(), sys.executable, "-m", "tigana.tools.cli", "admin", "--scheduler", scheduler, "export",
           table, "--follow", "--out", str(out), "--interval", str(interval), *(extra or [])]
    with open(log_path, "ab") as f:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)


def spawn_follow_model(scheduler: str, model: str | Path, log_path: str | Path, *, interval: float | None = None,
                       extra: list[str] | None = None) -> subprocess.Popen:
    """``tigana admin export --follow --model MODEL`` as a child process (stop it with ``stop_process``);
    ``interval`` None: the command's default."""
    cmd = [*_child_prefix(), sys.executable, "-m", "tigana.tools.cli", "admin", "--scheduler", scheduler, "export",
           "--follow", "--model", str(model), *(["--interval", str(interval)] if interval else []), *(extra or [])]
    with open(log_path, "ab") as f:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)


def spawn_serve(source: str | Path, log_path: str | Path, *, poll: float = 0.05, extra: list[str] | None = None,
                timeout: float = 60.0, model: bool = False) -> tuple[subprocess.Popen, str]:
    """``tigana serve --from SOURCE --port 0`` (``model``: ``--model SOURCE``) as a child process; returns it and
    its bound address (stop it with ``stop_process``)."""
    ready = Path(log_path).with_suffix(".ready.json")
    ready.unlink(missing_ok=True)
    cmd = [*_child_prefix(), sys.executable, "-m", "tigana.tools.cli", "serve", "--model" if model else "--from",
           str(source), "--port", "0",
           "--poll", str(poll), "--ready-file", str(ready), *(extra or [])]
    with open(log_path, "ab") as f:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"tigana serve exited {proc.returncode}: {Path(log_path).read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tigana serve did not bind in {timeout}s: {Path(log_path).read_text()[-2000:]}")
            time.sleep(0.02)
        return proc, json.loads(ready.read_text())["address"]
    except BaseException:
        stop_process(proc)
        raise


def health_status(address: str, service: str = SERVICE_NAME) -> int:
    """The health service's status of ``service`` at ``address`` (UNKNOWN when unreachable)."""
    return check_health(address, service, timeout_s=2.0).status


def wait_serving(address: str, timeout: float = 60.0) -> None:
    """Wait until ``tigana serve`` at ``address`` reports SERVING (its first full export is loaded)."""
    deadline = time.monotonic() + timeout
    while health_status(address) != health_pb2.HealthCheckResponse.SERVING:
        if time.monotonic() > deadline:
            raise TimeoutError(f"tigana serve {address}: not SERVING after {timeout}s")
        time.sleep(0.05)


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def measure_lag(client: ps.Client, serving: ServingClient, dim: int, *, duration: float, push_every: float,
                first_id: int, reader: ps.Client) -> tuple[list[float], list[float]]:
    """Push one new id every ``push_every`` s for ``duration`` s (rows start at zero, each push moves its row
    off zero); seconds from each push's acknowledgement to the first lookup that finds it, and to the first pull
    of ``reader`` (a second client of the training tier, ``insert=False``) that shows it, in the same loop."""
    pending: dict[int, float] = {}
    pending_train: dict[int, float] = {}
    lags: list[float] = []
    train_lags: list[float] = []
    lock = threading.Lock()
    done = threading.Event()

    def check() -> None:
        while not (done.is_set() and not pending and not pending_train):
            with lock:
                ids = np.fromiter(pending, np.int64, len(pending))
                train_ids = np.fromiter(pending_train, np.int64, len(pending_train))
            if ids.size:
                _, found = serving.lookup(ids)
                now = time.monotonic()
                with lock:
                    for i in ids[found].tolist():
                        lags.append(now - pending.pop(i))
            if train_ids.size:
                seen = np.asarray(reader.pull(TABLE, train_ids, insert=False)).any(axis=1)
                now = time.monotonic()
                with lock:
                    for i in train_ids[seen].tolist():
                        train_lags.append(now - pending_train.pop(i))
            time.sleep(0.005)

    checker = threading.Thread(target=check, name="bench-lag-check", daemon=True)
    checker.start()
    try:
        next_id, end = first_id, time.monotonic() + duration
        while time.monotonic() < end:
            started = time.monotonic()
            client.push(TABLE, np.array([next_id]), -np.ones((1, dim), np.float32)).result()
            with lock:
                pending[next_id] = pending_train[next_id] = time.monotonic()
            next_id += 1
            time.sleep(max(0.0, started + push_every - time.monotonic()))
    finally:
        done.set()
        checker.join(timeout=duration + 30)
    if checker.is_alive() or pending or pending_train:
        raise TimeoutError(f"{len(pending)} pushed id(s) never became visible in tigana serve, "
                           f"{len(pending_train)} not in the training tier")
    return lags, train_lags


def run(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    rows = args.rows or (20_000 if quick else 1_000_000)
    interval = args.interval or (0.5 if quick else 1.0)
    duration = args.duration or (4.0 if quick else 30.0)
    delta_rows = min(rows, args.delta_rows or (10_000 if quick else 200_000))
    lookups = args.lookups or (300 if quick else 5000)
    params = {"rows": rows, "dim": args.dim, "shards": 2, "replicas": 0, "interval_s": interval, "poll_s": args.poll,
              "quick": quick}
    with children("tigana-bench-serving-") as (work, procs), \
            ps.LocalCluster(2, replicas=0, data_dir=work / "cluster") as cluster, \
            ps.connect(cluster.target) as client, ps.connect(cluster.target) as reader:
        try:
            _measure(args, cluster, client, reader, work, procs, rows=rows, interval=interval,
                     duration=duration, delta_rows=delta_rows, lookups=lookups, params=params)
        finally:  # stopped before the cluster, by their own handles
            stop_all(procs)
    codes = [p.returncode for p in procs]
    if any(codes):
        log(f"serving-sync: a child exited with {codes}")
        return 1
    return 0


def _measure(args: argparse.Namespace, cluster: ps.LocalCluster, client: ps.Client, reader: ps.Client,
             work: Path, procs: list[subprocess.Popen], *, rows: int, interval: float, duration: float, delta_rows: int,
             lookups: int, params: dict[str, Any]) -> None:
    dim = args.dim
    log(f"serving-sync: cluster up; loading {rows} rows of dim {dim}")
    client.create_table(TABLE, dim=dim, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
    rng = np.random.default_rng(0)
    for lo in range(0, rows, 100_000):
        ids = np.arange(lo, min(rows, lo + 100_000), dtype=np.int64)
        client.push(TABLE, ids, rng.normal(size=(ids.size, dim)).astype(np.float32))
    client.flush()
    out = work / "log"
    procs.append(spawn_follow(cluster.scheduler, TABLE, out, work / "follow.log", interval=interval))
    serve, address = spawn_serve(out, work / "serve.log", poll=args.poll)
    procs.append(serve)
    wait_serving(address, timeout=120)
    with ServingClient(address) as serving:
        # 1. lag from an acknowledged push to a visible row
        log(f"serving-sync: lag phase, {duration:g}s")
        lags, train_lags = measure_lag(client, serving, dim, duration=duration, push_every=args.push_every,
                                       first_id=10 * rows + 1, reader=reader)
        m = read_manifest(out) or {}
        export_s = [float(e["seconds"]) for e in m.get("deltas", [])]
        lag = {"samples": len(lags), "push_every_s": args.push_every,
               "export_s_mean": round(float(np.mean(export_s)), 4) if export_s else None}
        peer = "training tier (a second client's pull of the same pushes)"
        emit("serving_sync.lag_p50", "s", percentile(lags, 50), peer, percentile(train_lags, 50), **lag, **params)
        emit("serving_sync.lag_p95", "s", percentile(lags, 95), peer, percentile(train_lags, 95), **lag, **params)

        # 2. delta throughput: one push of delta_rows existing rows, then the delta(s) carrying them
        log(f"serving-sync: delta phase, {delta_rows} rows")
        before = serving.info()
        seq_before = int((read_manifest(out) or {}).get("seq", 0))
        ids = rng.choice(rows, delta_rows, replace=False).astype(np.int64)
        client.push(TABLE, ids, np.ones((ids.size, dim), np.float32)).result()
        acked = time.time()
        m, after = _wait_cut_applied(out, serving, acked, timeout=60 + 10 * interval)
        applied_at = time.time()
        carried = [e for e in m["deltas"] if seq_before < int(e["seq"]) <= after.seq]
        wall_s = applied_at - min(float(e["time"]) for e in carried)
        export_s = sum(float(e["seconds"]) for e in carried)
        apply_s = after.apply_seconds - before.apply_seconds
        delta_total = sum(int(e["rows"]) for e in carried)
        t = time.perf_counter()
        full = client.export(TABLE, str(work / "full"))
        full_s = time.perf_counter() - t
        emit("serving_sync.delta_throughput", "rows/s", delta_total / wall_s,
             "full export of the table (tigana admin export), rows/s", full["rows"] / full_s,
             delta_rows=delta_total, rows_pushed=delta_rows, deltas=len(carried), wall_s=round(wall_s, 4),
             export_s=round(export_s, 4),
             apply_s=round(apply_s, 4), full_export_s=round(full_s, 4), **params)

        # 3. lookup latency, 100 ids
        log(f"serving-sync: lookup phase, {lookups} requests of 100 ids")
        queries = [np.concatenate([rng.choice(rows, 90), 10 * rows + 10**9 + rng.integers(0, 10**6, 10)])
                   .astype(np.int64) for _ in range(lookups)]
        serve_ms, pull_ms = [], []
        calls = ((serve_ms, lambda q: serving.lookup(q)), (pull_ms, lambda q: client.pull(TABLE, q, insert=False)))
        for k, q in enumerate(queries):
            for times, call in calls[k % 2:] + calls[:k % 2]:  # interleaved, alternating which goes first
                t = time.perf_counter()
                call(q)
                times.append(1000 * (time.perf_counter() - t))
        look = {"ids_per_request": 100, "unknown_per_request": 10, "requests": lookups}
        peer = "ps client pull of the same ids (training path)"
        emit("serving_sync.lookup_p50", "ms", percentile(serve_ms, 50), peer, percentile(pull_ms, 50), **look,
             **params)
        emit("serving_sync.lookup_p99", "ms", percentile(serve_ms, 99), peer, percentile(pull_ms, 99), **look,
             **params)


def _wait_cut_applied(out: Path, serving: ServingClient, after_time: float, timeout: float) -> tuple[dict, Any]:
    """Wait until the log holds a cut taken after ``after_time`` (servers' clock, this machine) and ``tigana
    serve`` has applied it: (that manifest, the server's Info)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_manifest(out)
        if m is not None and float(m["time"]) > after_time:
            info = serving.info()
            if info.seq >= int(m["seq"]) and info.data_time >= float(m["time"]):
                return m, info
        if time.monotonic() > deadline:
            raise TimeoutError(f"no cut after {after_time} applied by tigana serve in {timeout}s")
        time.sleep(0.01)
