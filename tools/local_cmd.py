"""``tigana local``: a scheduler and a cluster of shard daemons as child processes, until Ctrl-C or SIGTERM.

Prints the address to ``ps.connect`` (the scheduler's; with ``--replicas none`` the comma-separated shard
list) on one line, then a human line.
Stops every daemon (each snapshots into its data dir) on Ctrl-C/SIGTERM; exits 1 when a daemon dies on its own.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from tigana.ps.errors import PSError
from tigana.ps.ops.local import LocalCluster, LocalEtcd
from tigana.ps.routing import DEFAULT_NUM_SLOTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--shards", type=int, default=2, help="number of shard daemons (default 2)")
    a("--replicas", default="1", type=_replicas,
      help="copies of every slot besides its primary (default 1); 'none': no scheduler, a static shard list")
    a("--base-port", type=int, default=None, help="shard i listens on BASE_PORT + i (default: free ports)")
    a("--host", default="127.0.0.1", help="address the shards bind (default 127.0.0.1)")
    a("--data-dir", default=None, help="one shard-<i> data dir and log per shard here (default: a temp dir)")
    a("--memory-budget", default=None, help="per-table memory budget of every shard, e.g. 1GiB")
    a("--num-slots", type=int, default=DEFAULT_NUM_SLOTS, help="virtual slots (default 4096)")
    a("--metrics", action="store_true", help="serve Prometheus metrics from every shard on a free port")
    a("--startup-timeout", type=float, default=120.0, help="seconds to wait for every shard to serve")
    a("--log-format", default="text", choices=("text", "json"), help="the daemons' logs: text, or JSON lines")
    a("--log-dir", default=None,
      help="keep the daemons' logs here (scheduler.log, shard-<i>.log), also after exit (default: the data dir, "
           "a temp dir removed on exit unless --data-dir is given)")
    a("--schedulers", type=int, default=1,
      help="schedulers (default 1); more than one keeps the map in etcd (--store, or an etcd started here) and "
           "elects a leader")
    a("--store", default=None, help="etcd://HOST:PORT of an etcd for the schedulers (default: the data dir, or a "
                                    "local etcd with --schedulers > 1)")


def _replicas(text: str) -> str:
    """An argparse type: ``none`` or a count >= 0 (kept as text; run() reads it)."""
    if text.strip().lower() == "none":
        return "none"
    try:
        if int(text) >= 0:
            return str(int(text))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a number of replicas (0, 1, ...) or none")


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    etcd = None
    try:
        replicas = None if str(args.replicas).lower() == "none" else int(args.replicas)
        store = args.store
        if args.schedulers > 1 and store is None:
            etcd = LocalEtcd(Path(args.data_dir) / "etcd" if args.data_dir else None)
            store = etcd.url
        cluster = LocalCluster(args.shards, replicas=replicas, base_port=args.base_port, data_dir=args.data_dir,
                               num_slots=args.num_slots, host=args.host, memory_budget=args.memory_budget,
                               metrics=args.metrics, startup_timeout=args.startup_timeout,
                               schedulers=args.schedulers, store=store, log_dir=args.log_dir,
                               server_args=["--log-format", args.log_format],
                               scheduler_args=["--log-format", args.log_format])
    except (RuntimeError, TimeoutError, OSError, ValueError, PSError) as exc:  # noqa: B014
        print(f"tigana local: {exc}", file=sys.stderr)
        if etcd is not None:
            etcd.close()
        return 1
    code = 0
    try:
        print(cluster.target, flush=True)
        extra = (f"; metrics on ports {cluster.metrics_ports} (scheduler {cluster.scheduler_metrics_ports})"
                 if args.metrics else "")
        sched = f"scheduler {cluster.scheduler}, {replicas} replica(s), " if cluster.scheduler else ""
        if store:
            sched += f"map in {store}, "
        print(f"tigana local: {sched}{args.shards} shard(s) serving on {','.join(cluster.addresses)}, data in "
              f"{cluster.data_dir}, logs in {cluster.log_dir}{extra}; Ctrl-C stops them", flush=True)
        while not stop.wait(0.5):
            dead = [i for i, alive in enumerate(cluster.alive()) if not alive]
            if dead:
                print(f"tigana local: shard(s) {dead} exited on their own; stopping the rest\n"
                      f"{cluster.log_tail(dead[0])}", file=sys.stderr, flush=True)
                code = 1
                break
    finally:
        codes = cluster.close()
        if etcd is not None:
            etcd.close()
    print(f"tigana local: stopped; exit codes {codes}", file=sys.stderr, flush=True)
    return code
