"""``tigana bench serving [--quick]``: a trained model's predictions served, on real processes, at the default
settings a user gets.

A scheduler and 2 shard daemons (``ps.LocalCluster``), ``tigana admin export --follow --model DIR``, ``tigana
train --dataset synthetic --publish-dir DIR`` and ``tigana serve --model DIR`` as child processes, each with
its default intervals. One JSON line per case (``tigana.tools.bench.report.emit``):

- ``serving.freshness_p50`` / ``serving.freshness_p95`` (s), while the trainer trains: a probe pushes a
  gradient to one row of a feature row no training batch holds, every ``--probe-every`` s; the seconds from
  the push's acknowledgement to the first ``Predict`` answer that reflects it (a ``Lookup`` of the row on the
  same server shows the pushed value first: versions only move forward, so the prediction made after it comes
  from a version holding it). Peer, in the same loop: a second training client's pull of the row from the
  shard daemons (the training tier's own freshness). Target: p95 <= 1 s.
- ``serving.predict_p50`` / ``serving.predict_p99`` (ms) and ``serving.predict_rows`` (rows/s), at 1, 64 and
  1024 rows per request, after training: sequential ``Predict`` calls from one client. Peer: the same torch
  model called in this process on the same model version (``tigana.trainer.predict``'s scorer over the same
  published tables), each call interleaved with a request, so both see the same load. Target: p99 at 64 rows
  <= 2x the in-process model.
- ``serving.rollback`` (s): from the start of ``tigana admin publish rollback`` (one version back, held in
  memory) to the first ``Predict`` answered by that version; ``serving.resume`` the same back to the newest;
  ``serving.rollback_rebuilt`` to the oldest version the publish log keeps (no longer held: rebuilt from the
  logs). Peer: the 1 s target. The command's own start (a Python process) is part of each figure.

Every child process is stopped by its own handle, also on failure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tigana import ps
from tigana.ps.serving import ServingClient, modeldir
from tigana.ps.serving.model import ModelFollower
from tigana.tools.bench.report import emit, log
from tigana.tools.bench.serving_sync import (
    children,
    percentile,
    spawn_follow_model,
    spawn_serve,
    stop_all,
    wait_serving,
)

SIZES = (1, 64, 1024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a shorter training run and fewer requests (~40 s)")
    parser.add_argument("--rows", type=int, default=None,
                        help="synthetic training rows (default 1,000,000; quick 200,000)")
    parser.add_argument("--requests", type=int, default=None,
                        help="Predict requests per size (default 2,000; quick 200)")
    parser.add_argument("--probe-every", type=float, default=0.2, help="seconds between freshness probes")


def _tigana() -> list[str]:
    return [sys.executable, "-m", "tigana.tools.cli"]


def run(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    rows = args.rows or (200_000 if quick else 1_000_000)
    requests = args.requests or (200 if quick else 2000)
    with children("tigana-bench-serving-model-") as (work, procs), \
            ps.LocalCluster(2, data_dir=work / "cluster") as cluster:
        try:
            _measure(args, cluster, work, procs, rows=rows, requests=requests, quick=quick)
        finally:  # stopped before the cluster, by their own handles
            stop_all(procs)
    return 0


def _measure(args: argparse.Namespace, cluster: ps.LocalCluster, work: Path, procs: list[subprocess.Popen], *,
             rows: int, requests: int, quick: bool) -> None:
    root = work / "published"
    params: dict[str, Any] = {"model": "deepfm", "dataset": "synthetic", "train_rows": rows, "shards": 2,
                              "replicas": 1, "settings": "defaults", "quick": quick}
    procs.append(spawn_follow_model(cluster.scheduler, root, work / "follow.log"))
    with open(work / "train.log", "wb") as out:
        trainer = subprocess.Popen([*_tigana(), "train", "--dataset", "synthetic", "--ps", cluster.scheduler,
                                    "--synthetic-rows", str(rows), "--publish-dir", str(root), "--no-progress"],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(trainer)
    deadline = time.monotonic() + 120
    while modeldir.read_versions(root) is None:
        if trainer.poll() is not None and trainer.returncode != 0:
            raise RuntimeError(f"tigana train failed: {(work / 'train.log').read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError("no model version published in 120 s")
        time.sleep(0.05)
    serve, address = spawn_serve(root, work / "serve.log", model=True, poll=0.1)  # --poll's default
    procs.append(serve)
    wait_serving(address, timeout=120)
    with ServingClient(address) as serving, ps.connect(cluster.target) as client, \
            ps.connect(cluster.target) as reader:
        log("serving: freshness while training")
        fresh, train_fresh = _freshness(serving, client, reader, root, trainer, args.probe_every)
        emit("serving.freshness_p50", "s", percentile(fresh, 50), "training tier (a second client's pull)",
             percentile(train_fresh, 50), samples=len(fresh), target_p95_s=1.0, **params)
        emit("serving.freshness_p95", "s", percentile(fresh, 95), "training tier (a second client's pull)",
             percentile(train_fresh, 95), samples=len(fresh), target_p95_s=1.0, **params)
        trainer.wait(timeout=600)
        if trainer.returncode != 0:
            raise RuntimeError(f"tigana train failed: {(work / 'train.log').read_text()[-2000:]}")
        time.sleep(1.0)  # the last round of the follower
        _latency(serving, root, requests, params)
        _rollback(serving, root, params)


def _probe_rows(spec: dict[str, Any], rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` feature rows of raw values no training batch holds (random 64-bit values, not 32-bit hex)."""
    dense = rng.uniform(0, 20, (n, spec["num_dense"])).astype(np.float32)
    return dense, rng.integers(1 << 40, 1 << 62, (n, spec["num_sparse"]), dtype=np.int64).view(np.uint64)


def _freshness(serving: ServingClient, client: ps.Client, reader: ps.Client, root: Path,
               trainer: subprocess.Popen, every: float) -> tuple[list[float], list[float]]:
    """Probe pushes until the trainer ends (at least 20): seconds from each acknowledgement to a prediction
    reflecting it, and to a second client's pull showing it."""
    from tigana.trainer.predict import load_scorer

    spec = modeldir.read_spec(root)
    rng = np.random.default_rng(7)
    dense, cats = _probe_rows(spec, rng, 1)
    # the PS row of the probe's first field, mapped as the served model maps it (hash, then fused-table salt)
    scorer = load_scorer(spec, modeldir.read_dense(root, modeldir.newest_dense(root)))
    table, pid = scorer.ps_ids(0, cats[:, 0])
    fresh: list[float] = []
    train_fresh: list[float] = []
    k = 0
    while trainer.poll() is None or k < 20:
        k += 1
        started = time.monotonic()
        client.push(table, pid, rng.normal(0, 1, (1, spec["dim"])).astype(np.float32)).result()
        acked = time.monotonic()
        want = np.asarray(reader.pull(table, pid, insert=False))[0]
        train_fresh.append(time.monotonic() - acked)
        deadline = acked + 30
        while True:
            rows, found = serving.lookup(pid, table=table)
            if found[0] and np.allclose(rows[0], want, rtol=0, atol=1e-6):
                serving.predict(dense, cats)
                fresh.append(time.monotonic() - acked)
                break
            if time.monotonic() > deadline:
                raise TimeoutError("a probe push did not reach serving in 30 s")
            time.sleep(0.005)
        time.sleep(max(0.0, started + every - time.monotonic()))
    return fresh, train_fresh


def _latency(serving: ServingClient, root: Path, requests: int, params: dict[str, Any]) -> None:
    """Predict at each size, each request interleaved with the in-process model on the same version."""
    from tigana.trainer.predict import load_scorer

    local = ModelFollower(root, "zeros", load_scorer)
    local.poll()
    state = local.state
    info = serving.info()
    if state is None or state.version != info.version:
        raise RuntimeError(f"in-process model at version {state.version if state else None}, served {info.version}")
    rng = np.random.default_rng(3)
    for size in SIZES:
        dense, cats = _probe_rows(state.spec, rng, size)
        served, local_s = [], []
        for i in range(requests):
            order = (0, 1) if i % 2 else (1, 0)
            for which in order:
                t = time.perf_counter()
                if which == 0:
                    serving.predict(dense, cats)
                    served.append(time.perf_counter() - t)
                else:
                    state.predict(dense, cats)
                    local_s.append(time.perf_counter() - t)
        p = {"rows_per_request": size, "requests": requests, "version": info.version, **params}
        emit("serving.predict_p50", "ms", 1e3 * percentile(served, 50), "the same model in process",
             1e3 * percentile(local_s, 50), **p)
        emit("serving.predict_p99", "ms", 1e3 * percentile(served, 99), "the same model in process",
             1e3 * percentile(local_s, 99), target_ratio=2.0 if size == 64 else None, **p)
        emit("serving.predict_rows", "rows/s", size * len(served) / sum(served), "the same model in process",
             size * len(local_s) / sum(local_s), **p)


def _rollback(serving: ServingClient, root: Path, params: dict[str, Any]) -> None:
    """Rollback to the oldest kept version and back, through the CLI; seconds to the first answer of each."""
    versions = [int(v["version"]) for v in modeldir.read_versions(root)["versions"]]
    newest = serving.info().version

    def timed(args: list[str], want: int) -> float:
        dense, cats = _probe_rows(modeldir.read_spec(root), np.random.default_rng(1), 1)
        t = time.monotonic()  # from the command's start, as an operator waits for it
        done = subprocess.run([*_tigana(), "admin", "publish", *args, "--model", str(root)], capture_output=True,
                              text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
        while serving.predict(dense, cats)[1] != want:
            if time.monotonic() - t > 30:
                raise TimeoutError(f"no answer from version {want} 30 s after publish {args[0]}")
        return time.monotonic() - t

    back = timed(["rollback"], versions[-2])  # the default: one version back from the newest, held in memory
    emit("serving.rollback", "s", back, "target", 1.0, to_version=versions[-2], from_version=newest,
         versions_kept=len(versions), held=True, **params)
    forward = timed(["resume"], newest)
    emit("serving.resume", "s", forward, "target", 1.0, to_version=newest, held=True, **params)
    rebuilt = timed(["rollback", "--to", str(versions[0])], versions[0])
    emit("serving.rollback_rebuilt", "s", rebuilt, "target", 1.0, to_version=versions[0], from_version=newest,
         versions_kept=len(versions), held=False, **params)
    timed(["resume"], newest)
