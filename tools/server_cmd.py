"""``tigana server``: run one shard server daemon until SIGTERM or Ctrl-C.

Settings come from flags > ``TIGANA_*`` environment variables > ``--config FILE`` (YAML or TOML) > defaults.
On SIGTERM/SIGINT the server stops accepting RPCs, drains the ones in flight, snapshots every table into
``--data-dir`` and exits 0; started again on the same data dir it restores them before serving.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from tigana.ps.config import load_server_config
from tigana.ps.daemon import start_server, tune_allocator
from tigana.ps.errors import InvalidArgument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default=None, help="address to bind (default 127.0.0.1)")
    a("--port", type=int, default=None, help="gRPC port (0: a free port, printed at start)")
    a("--data-dir", default=None, help="tables, snapshots and the spill tier live here")
    a("--memory-budget", default=None, help="resident row bytes of the whole daemon, shared by its tables, before cold rows spill, e.g. 8GiB "
                                                "(default: none)")
    a("--spill-max-bytes", default=None, help="cap on each table's LMDB spill tier, e.g. 64GiB (default: until the "
                                                "disk is full); past it new rows are refused")
    a("--metrics-port", default=None, help="Prometheus HTTP port; 0 off (default), 'auto' a free port")
    a("--slots", default=None, help="owned virtual slots, e.g. 0-2047 (inclusive ranges); default all")
    a("--num-slots", type=int, default=None, help="number of virtual slots (default 4096)")
    a("--max-workers", type=int, default=None, help="gRPC thread pool size (default 16)")
    a("--max-message-bytes", default=None, help="largest gRPC message sent or received (default 64MiB)")
    a("--dedup-window", type=int, default=None, help="pushes remembered per client for exactly-once (default 8192)")
    a("--drain-grace", dest="drain_grace_s", type=float, default=None,
      help="seconds in-flight RPCs get to finish on shutdown (default 30)")
    a("--keep-snapshots", type=int, default=None,
      help="full snapshot chains kept per table (default 2; 0 keeps all)")
    a("--scheduler", default=None, help="HOST:PORT of the scheduler to register with (its map gives the slots)")
    a("--server-id", default=None, help="stable identity (default: created once in the data dir)")
    a("--advertise", default=None, help="HOST:PORT the scheduler, clients and peers reach this server at")
    a("--heartbeat-interval", dest="heartbeat_interval_s", type=float, default=None,
      help="seconds between heartbeats to the scheduler (default 0.5)")
    a("--snapshot-every", dest="snapshot_every_s", type=float, default=None,
      help="seconds between periodic snapshots of every table (default 0: off); bounds what losing every "
           "copy at once costs")
    a("--replication-timeout", dest="replication_timeout_s", type=float, default=None,
      help="seconds a copy may fail to apply the stream before it is reported (default 2)")
    a("--tls-cert", default=None, help="PEM certificate this server presents (TLS)")
    a("--tls-key", default=None, help="PEM private key of --tls-cert")
    a("--tls-ca", default=None, help="PEM CA that verifies peers (and client certificates)")
    a("--require-client-cert", action="store_const", const=True, default=None,
      help="mutual TLS: refuse clients without a certificate signed by --tls-ca")
    a("--auth-token-file", default=None, help="file with the trainers' token (pull, push, create tables)")
    a("--admin-token-file", default=None,
      help="file with the admin token (every operation; this server also sends it to the scheduler and peers)")
    a("--allow-insecure-loopback", action="store_const", const=True, default=None,
      help="accept tokens without TLS, from this machine only")
    a("--max-rows-per-request", type=int, default=None, help="ids in one pull or push (default 4,000,000)")
    a("--max-concurrent-requests", type=int, default=None,
      help="RPCs in progress before RESOURCE_EXHAUSTED (default 256)")
    a("--config", default=None, help="YAML or TOML file of settings (keys as the flags, with _ or -)")
    a("--ready-file", default=None, help="write {address, port, metrics_port, pid} as JSON here once serving")
    a("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


_FLAG_FIELDS = ("host", "port", "data_dir", "memory_budget", "spill_max_bytes", "metrics_port", "slots", "num_slots", "max_workers",
                "max_message_bytes", "dedup_window", "drain_grace_s", "keep_snapshots", "scheduler", "server_id",
                "advertise", "heartbeat_interval_s", "snapshot_every_s", "replication_timeout_s", "tls_cert", "tls_key",
                "tls_ca", "require_client_cert", "auth_token_file", "admin_token_file", "allow_insecure_loopback",
                "max_rows_per_request", "max_concurrent_requests", "config")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        config = load_server_config({k: getattr(args, k, None) for k in _FLAG_FIELDS})
    except InvalidArgument as exc:
        print(f"tigana server: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    tune_allocator()
    try:
        handle = start_server(config)
    except (OSError, InvalidArgument) as exc:
        print(f"tigana server: {exc}", file=sys.stderr)
        return 1
    try:
        while not handle.wait_ready(0.2):
            if stop.is_set():
                return 0
        if args.ready_file:
            _write_ready(Path(args.ready_file), handle)
        where = f"scheduler {config.scheduler}" if config.scheduler else f"slots {config.slots}"
        print(f"tigana server: serving on {handle.address} as {handle.service.server_id} ({where}, "
              f"{config.num_slots} slots, data dir {config.data_dir or 'none'}"
              + (f", metrics on :{handle.metrics_port}" if handle.metrics_port else "") + ")",
              file=sys.stderr, flush=True)
        stop.wait()
        print(f"tigana server: {signal.Signals(received[0]).name}, draining and snapshotting", file=sys.stderr,
              flush=True)
    except Exception as exc:  # noqa: BLE001 - a failed load is reported, not a traceback
        print(f"tigana server: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        handle.close()  # idempotent; snapshots only when the tables were loaded
        if args.ready_file:
            Path(args.ready_file).unlink(missing_ok=True)
    return 0


def _write_ready(path: Path, handle) -> None:
    info = {"address": handle.address, "port": handle.port, "metrics_port": handle.metrics_port, "pid": os.getpid()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
