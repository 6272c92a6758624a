"""``python -m tigana.tools.bench.durability``: what each durability mode loses, measured with a ledger.

Every case runs real daemons started through the CLI, pushes a ledger (``tigana.tools.bench.ledger``: every
acknowledged push adds exactly 1 to its ids' rows), applies its fault and audits the ledger after a restart.
One JSON line per case: ``value`` the acknowledged updates lost, ``peer_value`` those acknowledged, so
``ratio`` is the fraction lost; ``lost_s``: the push loop's lost updates in seconds of its pushing (the
loop ran ``pushing_s``); ``doubled``; the push
latency (``push_p99_s``, ``push_max_s``: a snapshot holds a table's write lock while it cuts).

- ``standalone``: one ``tigana server --data-dir D`` with no snapshot flag (the default interval), a ledger of
  ``--rows`` rows (every row written once, then random pushes); after the first periodic snapshot it pushes
  for 0.9 of an interval (the worst case is a kill just before the next snapshot), then ``kill -9``, restart
  on D, audit.
- ``standalone-off``: the same with ``--snapshot-every 0``, killed after ``--push-s`` seconds.
- ``cluster-sync`` / ``cluster-async``: a scheduler and 2 servers (1 replica), ``kill -9`` of the primary of
  most slots under the push loop once every copy is in sync; async reports the bound from the replication
  lag sampled just before the kill (``lag_bound_updates``, as ``tests/faults/test_durability.py`` checks).
- ``cluster-all-copies``: the same cluster, no snapshot flag; after the first periodic snapshot of both
  servers, 0.9 of an interval of pushes, then ``kill -9`` of both servers (every copy of every slot) and a
  restart of both on their data dirs.

Usage: ``python -m tigana.tools.bench.durability [--only standalone,cluster-sync] [--rows N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tigana import ps
from tigana.embeddings import snapshot as snap
from tigana.ps.ops import admin
from tigana.tools.bench.ledger import TABLE_DIM, PushLoop, create_ledger_table
from tigana.tools.bench.report import emit, log
from tigana.tools.testing.faults.common import leader_of_most

CLI = [sys.executable, "-m", "tigana.tools.cli"]
DEFAULT_EVERY = ps.ServerConfig().snapshot_every_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default="", help="comma-separated cases (default: all)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="ledger rows of the standalone cases")
    parser.add_argument("--push-s", type=float, default=20.0, help="seconds of pushes in standalone-off")


@contextlib.contextmanager
def standalone_server(data_dir: Path, *flags: str, log: Path | None = None
                      ) -> Iterator[tuple[subprocess.Popen, str]]:
    """``tigana server --port 0 --data-dir DATA_DIR [FLAGS]`` as a user starts it: (process, address) once it
    serves; killed on the way out if still running. Output appended to ``log`` (default: server.log beside)."""
    ready = data_dir.parent / f"ready-{time.monotonic_ns()}.json"
    with open(log or data_dir.parent / "server.log", "ab") as out:
        proc = subprocess.Popen([*CLI, "server", "--port", "0", "--data-dir", str(data_dir), "--ready-file",
                                 str(ready), *flags], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        admin.wait_for(lambda: proc.poll() is not None or _json(ready) is not None, 120, "tigana server to serve")
        if proc.poll() is not None:
            raise RuntimeError(f"tigana server exited with {proc.returncode}")
        yield proc, str(_json(ready)["address"])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _json(path: Path) -> dict | None:
    with contextlib.suppress(ValueError, OSError):
        return json.loads(path.read_text())
    return None


def _prefill(client: ps.Client, rows: int) -> np.ndarray:
    """Write every row of the ledger once (acknowledged): (rows,) int64 of ones."""
    grads = -np.ones((50_000, TABLE_DIM), np.float32)
    for lo in range(0, rows, 50_000):
        ids = np.arange(lo, min(rows, lo + 50_000), dtype=np.int64)
        client.push("ledger", ids, grads[:ids.size])
    client.flush()
    return np.ones(rows, np.int64)


def _figures(loop: PushLoop, acked: np.ndarray, actual: np.ndarray, pushing_s: float) -> dict[str, Any]:
    lost = int(np.maximum(acked - actual, 0).sum())
    doubled = int(np.maximum(actual - acked - loop.unknown, 0).sum())
    latency = np.array([done - sent for sent, done in loop.events]) if loop.events else np.zeros(1)
    pushed = int(loop.acked.sum())
    rate = pushed / pushing_s if pushing_s > 0 else 0.0  # the push loop's updates per second
    return {"lost": lost, "doubled": doubled, "acked_updates": int(acked.sum()),
            "lost_s": round(min(lost, pushed) / rate, 2) if rate else None, "pushing_s": round(pushing_s, 1),
            "failed_pushes": len(loop.errors),
            "push_p50_s": round(float(np.percentile(latency, 50)), 4),
            "push_p99_s": round(float(np.percentile(latency, 99)), 4), "push_max_s": round(float(latency.max()), 4)}


def _snapshots(root: Path) -> int:
    return sum(len(snap.list_snapshots(d)) for d in root.glob("**/snapshots/ledger"))


def standalone(args: argparse.Namespace, off: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="tigana-durability-") as tmp:
        data = Path(tmp) / "s0"
        flags = ("--snapshot-every", "0") if off else ()
        with standalone_server(data, *flags) as (proc, address), ps.connect([address]) as client:
            create_ledger_table(client)
            base = _prefill(client, args.rows)
            loop = PushLoop(client, num_ids=args.rows, ids_per_push=500, pause_s=0.005).start()
            started = time.monotonic()
            if off:
                time.sleep(args.push_s)
            else:
                admin.wait_for(lambda: _snapshots(data) > 0, DEFAULT_EVERY + 120, "the first periodic snapshot")
                log(f"  standalone: first periodic snapshot after {time.monotonic() - started:.1f} s of pushes")
                time.sleep(0.9 * DEFAULT_EVERY)
            loop.stop()
            pushing_s = time.monotonic() - started
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        with standalone_server(data, *flags) as (_, address), ps.connect([address]) as client:
            actual = np.rint(client.pull("ledger", np.arange(args.rows), insert=False)[:, 0]).astype(np.int64)
    f = _figures(loop, base + loop.acked, actual, pushing_s)
    return emit("durability.standalone" + ("-off" if off else ""), "updates", f["lost"], "acked updates",
                f["acked_updates"], **f, snapshot_every_s=0 if off else DEFAULT_EVERY, rows=args.rows,
                fault="kill -9 of a standalone server, restart on its data dir")


def cluster_all_copies(args: argparse.Namespace) -> dict:
    num_ids = 50_000
    with ps.LocalCluster(2, replicas=1, startup_timeout=300) as c, ps.connect(scheduler=c.scheduler, failover_timeout_s=300) as client:
        create_ledger_table(client)
        loop = PushLoop(client, num_ids=num_ids, ids_per_push=500, pause_s=0.005).start()
        started = time.monotonic()
        admin.wait_for(lambda: _snapshots(c.data_dir) >= 2, DEFAULT_EVERY + 300, "a periodic snapshot of both")
        time.sleep(0.9 * DEFAULT_EVERY)
        loop.stop()
        pushing_s = time.monotonic() - started
        for i in range(2):
            c.kill(i)
        for i in range(2):
            c.restart(i)
        admin.wait_for(lambda: all(c.alive()), 300, "both servers back")
        actual = np.rint(client.pull("ledger", np.arange(num_ids), insert=False)[:, 0]).astype(np.int64)
    f = _figures(loop, loop.acked, actual, pushing_s)
    return emit("durability.cluster-all-copies", "updates", f["lost"], "acked updates", f["acked_updates"], **f,
                snapshot_every_s=DEFAULT_EVERY, shards=2, replicas=1,
                fault="kill -9 of every server (every copy of every slot), restart on their data dirs")


def _kill_primary(durability: str) -> dict:
    """A scheduler and 2 servers (1 replica), a ledger of ``durability``; once every copy is in sync,
    ``kill -9`` of the server leading the most slots; pushes go on until the failover, then the audit. The
    bound of an async loss: the replication lag the victim reported just before (plus pushes acknowledged
    between that sample and the kill), in updates."""
    num_ids, per_push = 50_000, 500
    with ps.LocalCluster(2, replicas=1, startup_timeout=300) as c, ps.connect(scheduler=c.scheduler, failover_timeout_s=300) as client:
        create_ledger_table(client, durability=durability)
        loop = PushLoop(client, num_ids=num_ids, ids_per_push=per_push, in_flight=8, pause_s=0.005).start()
        started = time.monotonic()
        admin.wait_for(lambda: admin.settled(c.scheduler), 600, "every copy in sync")
        n = loop.acked_count()
        admin.wait_for(lambda: loop.acked_count() > n + 100, 300, "pushes before the kill")
        victim, _ = leader_of_most(c)
        sampled_at = time.monotonic()
        stats = client.server_stats("ledger")[c.addresses[victim]]["ledger"]
        lag_items = int(stats.get("replication_lag_items", 0))
        killed_at = time.monotonic()
        c.kill(victim)
        admin.wait_for(lambda: loop.first_ack_sent_after(killed_at) is not None, 300, "a push after the kill")
        recovery_s = loop.first_ack_sent_after(killed_at) - killed_at
        n = loop.acked_count()
        admin.wait_for(lambda: loop.acked_count() > n + 100, 300, "pushes after the failover")
        loop.stop()
        pushing_s = time.monotonic() - started
        bound = (lag_items + loop.count_acked(killed_at, sampled_at)) * per_push
        actual = np.rint(client.pull("ledger", np.arange(num_ids), insert=False)[:, 0]).astype(np.int64)
    f = _figures(loop, loop.acked, actual, pushing_s)
    return {**f, "recovery_s": round(recovery_s, 3), "lag_items_before_kill": lag_items,
            "lag_bound_updates": bound, "shards": 2, "replicas": 1, "durability": durability}


def cluster_sync(args: argparse.Namespace) -> dict:
    f = _kill_primary("sync")
    return emit("durability.cluster-sync", "updates", f["lost"], "acked updates", f["acked_updates"], **f,
                fault="kill -9 of the primary of most slots under a push loop")


def cluster_async(args: argparse.Namespace) -> dict:
    f = _kill_primary("async")
    return emit("durability.cluster-async", "updates", f["lost"], "acked updates", f["acked_updates"], **f,
                fault="kill -9 of the primary of most slots under a push loop")


CASES: dict[str, Callable[[argparse.Namespace], dict]] = {
    "standalone": standalone,
    "standalone-off": lambda a: standalone(a, off=True),
    "cluster-sync": cluster_sync,
    "cluster-async": cluster_async,
    "cluster-all-copies": cluster_all_copies,
}


def run(args: argparse.Namespace) -> int:
    only = [c for c in args.only.split(",") if c] or list(CASES)
    for name in only:
        log(f"durability: {name}")
        CASES[name](args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
