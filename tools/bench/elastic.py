"""``tigana bench elastic --data DIR [--quick]``: ``kill -9`` of one of two trainers mid-run, against undisturbed runs.

A static 2-shard cluster (``ps.LocalCluster``) serves every run and is never restarted. Each run is
``tigana train --nproc 2 --max-restarts 2`` of DeepFM on MovieLens-100K u1 (u1.base -> u1.test); a disturbed
run has one of its trainer processes ``kill -9``-ed as soon as the first elastic state is written, and the job
starts its trainers again from it. Two trainers pushing to the same rows asynchronously do not train the same
model twice (whose push a pull sees first varies), so undisturbed runs alone spread by a few 1e-3 AUC: the
figure is the mean AUC of the disturbed runs against the mean of the undisturbed ones, over ``--trials`` each
(target: within 0.002), with the spread of both reported.

One JSON line: ``auc_delta`` (value; the 0.002 target as the peer), ``auc_calm``, ``auc_disturbed``, their
spreads, ``restarts``, ``servers_restarted`` (must be 0), ``recovery_s`` (the extra wall time a restart cost).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tigana import ps
from tigana.tools.bench.report import emit, log

TARGET_AUC_DELTA = 0.002


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="the MovieLens-100K folder (u1.base, u1.test, u.item...)")
    parser.add_argument("--quick", action="store_true", help="1 run of each instead of 3")
    parser.add_argument("--trials", type=int, default=None, help="runs of each kind (default 3, quick 1)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run (default 1)")


def train_args(data: str | os.PathLike, ps_target: str, folder: Path, epochs: int = 1) -> list[str]:
    """``tigana train`` arguments of one elastic run: 2 trainers, restarts allowed, state every 10 steps. The
    optimizer settings are spelled out (Adagrad 0.05 on the rows, the ones the README's figures were measured
    with), so MovieLens's tuned defaults do not move this benchmark."""
    return ["--model", "deepfm", "--dataset", "movielens-100k", "--data", str(data), "--ps", ps_target,
            "--nproc", "2", "--epochs", str(epochs), "--batch-size", "512", "--embedding-optimizer", "adagrad",
            "--embedding-lr", "0.05", "--weight-decay", "0", "--no-progress",
            "--table-prefix", f"{folder.name}_", "--checkpoint-dir", str(folder), "--max-restarts", "2",
            "--elastic-every", "10"]


# torch 2.13's agents share their rendezvous store with the workers by default; after a membership change (a
# node joining a running --nnodes MIN:MAX job) the old rank 0 does not publish the master address again and the
# new node's agent waits for it until the rendezvous times out. Without the shared store each round's rank 0
# publishes a fresh address and port, so scale-up works (tests/trainer/test_elastic.py).
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_command(args: list[str], nnodes: str = "1", nproc_per_node: int = 2,
                     rdzv_endpoint: str = "127.0.0.1:0") -> list[str]:
    """The same job under torchrun (torch elastic): its agent restarts the workers, ``--max-restarts 2``; run it
    with ``TORCHRUN_ENV`` in its environment. ``nnodes`` MIN:MAX lets agents (nodes) join: give them all one
    ``rdzv_endpoint`` with a real port; the first one there hosts the rendezvous."""
    rest = [a for i, a in enumerate(args) if a not in ("--nproc", "--max-restarts")
            and args[i - 1] not in ("--nproc", "--max-restarts")]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node),
            "--max-restarts", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
            "--rdzv-conf", "last_call_timeout=1", "--monitor-interval", "0.2", "-m", "tigana.trainer", *rest]


def trainer_pids(launcher: int) -> list[int]:
    """The trainer processes a launcher started (its children running multiprocessing's spawn, or
    ``tigana.trainer`` under torchrun)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and (b"spawn_main" in cmdline
                                                                      or b"tigana.trainer" in cmdline):
            pids.append(int(entry.name))
    return sorted(pids)


def train(args: list[str], kill_after_state: Path | None = None, timeout_s: float = 300,
          command: list[str] | None = None) -> dict[str, Any]:
    """Run ``tigana train`` with ``args`` (or ``command``) to the end; with ``kill_after_state``, ``kill -9``
    one trainer once that elastic state folder has a state. Returns the result, with ``wall_s``."""
    start = time.monotonic()
    proc = subprocess.Popen(command or [sys.executable, "-m", "tigana.tools.cli", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **TORCHRUN_ENV} if command else None)
    try:
        if kill_after_state is not None:
            deadline = time.monotonic() + timeout_s
            while not (kill_after_state / "state.json").is_file():
                if proc.poll() is not None:
                    raise RuntimeError(f"tigana train ended before its first elastic state: "
                                       f"{proc.stderr.read()[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no elastic state in {kill_after_state} after {timeout_s} s")
                time.sleep(0.05)
            victims = trainer_pids(proc.pid)
            if len(victims) != 2:
                raise RuntimeError(f"expected 2 trainer processes, found {victims}")
            os.kill(victims[-1], signal.SIGKILL)
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"tigana train exited with {proc.returncode}: {err[-3000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "wall_s": time.monotonic() - start}


def run(args: argparse.Namespace) -> int:
    trials = args.trials or (1 if args.quick else 3)
    calm, hit = [], []
    with ps.LocalCluster(2, replicas=None) as cluster, tempfile.TemporaryDirectory(prefix="tigana-elastic-") as tmp:
        servers = [p.pid for p in cluster.procs]
        target = ",".join(cluster.addresses)
        for i in range(trials):
            calm.append(train(train_args(args.data, target, Path(tmp) / f"calm{i}", args.epochs)))
            folder = Path(tmp) / f"hit{i}"
            hit.append(train(train_args(args.data, target, folder, args.epochs), kill_after_state=folder / "elastic"))
            log(f"bench elastic: trial {i + 1}: undisturbed AUC {calm[-1]['auc']:.4f}, disturbed {hit[-1]['auc']:.4f} "
                f"({hit[-1].get('resumed_from')})")
        servers_restarted = sum(1 for a, p in zip(servers, cluster.procs, strict=True)
                                if a != p.pid or p.poll() is not None)
    auc_calm = statistics.mean(r["auc"] for r in calm)
    auc_hit = statistics.mean(r["auc"] for r in hit)
    delta = abs(auc_hit - auc_calm)
    emit("elastic", "auc", round(delta, 5), "target |auc delta|", TARGET_AUC_DELTA,
         auc_calm=round(auc_calm, 5), auc_disturbed=round(auc_hit, 5),
         auc_calm_spread=round(max(r["auc"] for r in calm) - min(r["auc"] for r in calm), 5),
         auc_disturbed_spread=round(max(r["auc"] for r in hit) - min(r["auc"] for r in hit), 5),
         restarts=sum(r.get("restarts", 0) for r in hit), servers_restarted=servers_restarted,
         recovery_s=round(statistics.mean(r["wall_s"] for r in hit) - statistics.mean(r["wall_s"] for r in calm), 2),
         trials=trials, trainers=2, model="deepfm", dataset="movielens-100k u1", epochs=args.epochs,
         elastic_every=10, quick=bool(args.quick))
    return 0 if servers_restarted == 0 and all(r.get("restarts") == 1 for r in hit) else 1
