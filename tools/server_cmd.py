"""``tigana server``: run one shard server daemon until SIGTERM or Ctrl-C.

Settings come from flags > ``TIGANA_*`` environment variables > ``--config FILE`` (YAML or TOML) > defaults.
On SIGTERM/SIGINT the server stops accepting RPCs, drains the ones in flight, snapshots every table into
``--data-dir`` and exits 0; started again on the same data dir it restores them before serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from tigana.embeddings.files import atomic_write
from tigana.ps import settings
from tigana.ps.allocator import SERVER_ARENAS, tune_allocator
from tigana.ps.errors import InvalidArgument
from tigana.ps.logs import FORMATS, setup_logging
from tigana.ps.shard.config import ServerConfig, load_server_config_sources
from tigana.ps.shard.daemon import start_server
from tigana.tools.daemon_flags import add_metrics_flags, add_security_flags, say
from tigana.tools.signals import StopSignal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default=None, help="address to bind")
    a("--port", type=int, default=None, help="gRPC port (0: a free port, printed at start)")
    a("--data-dir", default=None, help="tables, snapshots and the spill tier live here")
    a("--memory-budget", default=None,
      help="resident row bytes of the whole daemon, shared by its tables, before cold rows spill, e.g. 8GiB")
    a("--spill-max-bytes", default=None,
      help="cap on each table's spill file, e.g. 64GiB; past it new rows are refused (none: the disk)")
    add_metrics_flags(parser, "requests, latency, rows, tables, replication lag")
    a("--slots", default=None, help="owned virtual slots, e.g. 0-2047 (inclusive ranges); default all")
    a("--num-slots", type=int, default=None, help="number of virtual slots")
    a("--max-workers", type=int, default=None, help="gRPC thread pool size")
    a("--max-streams", type=int, default=None,
      help="Exchange (streaming data path) streams at most; past it clients use unary calls")
    a("--stream-window", type=int, default=None, help="frames of one stream handled at once")
    a("--max-message-bytes", default=None, help="largest gRPC message sent or received")
    a("--dedup-window", type=int, default=None, help="pushes remembered per client for exactly-once")
    a("--drain-grace", dest="drain_grace_s", type=float, default=None,
      help="seconds in-flight RPCs get to finish on shutdown")
    a("--keep-snapshots", type=int, default=None,
      help="full snapshot chains kept per table")
    a("--scheduler", default=None, help="HOST:PORT of the scheduler to register with (its map gives the slots)")
    a("--server-id", default=None,
      help="stable identity (none: the one stored in the data dir, else the StatefulSet hostname NAME-ORDINAL "
           "under Kubernetes, else a new one)")
    a("--advertise", default=None, help="HOST:PORT the scheduler, clients and peers reach this server at (HOST:0: the port it binds)")
    a("--domain", default=None,
      help="where this server runs, zone=Z,rack=R,host=H (any of them): the scheduler keeps a slot's copies in "
           "distinct domains; the host defaults to this machine's name")
    a("--heartbeat-interval", dest="heartbeat_interval_s", type=float, default=None,
      help="seconds between heartbeats to the scheduler")
    a("--snapshot-every", dest="snapshot_every_s", type=float, default=None,
      help="seconds between periodic snapshots of every table (incremental, a full one every 10th; needs "
           "--data-dir); bounds what a kill -9 of a standalone server, or losing every copy of a slot, "
           "costs (docs/durability.md); 0 turns them off")
    a("--replication-timeout", dest="replication_timeout_s", type=float, default=None,
      help="seconds a copy may fail to apply the stream before it is reported")
    a("--copy-rate", default=None,
      help="bytes a second the slot copies of planned moves (rebalance, drain, hand-over) sent by this server may "
           "use, e.g. 64MiB (none or unlimited: no cap); copies restoring a missing replica are never paced")
    add_security_flags(parser, "server", "every operation; this server also sends it to the scheduler and peers")
    a("--max-rows-per-request", type=int, default=None, help="ids in one pull or push")
    a("--max-concurrent-requests", type=int, default=None,
      help="RPCs in progress before RESOURCE_EXHAUSTED")
    a("--workers", type=int, default=None,
      help="shard processes on this host, each a server of the map with its own port (--port + 1 + i) and data "
           "folder (DATA_DIR/worker-i), all in this server's failure domain; --port serves their common health "
           "(docs/deployment.md: how many a host wants)")
    a("--config", default=None, help="YAML or TOML file of settings (keys as the flags, with _ or -)")
    a("--ready-file", default=None, help="write {address, port, metrics_port, pid} as JSON here once serving")
    a("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    a("--log-format", default="text", choices=FORMATS, help="text lines, or one JSON object per line (default: text)")
    settings.describe_defaults(parser, ServerConfig, shown={"max_message_bytes": "64MiB", "metrics_port": "0 (off)",
                                                            "copy_rate": "32MiB",
                                                            "data_dir": "none (in memory only)",
                                                            "domain": "host=<this machine's name>"})


FIELDS = tuple(f.name for f in dataclasses.fields(ServerConfig)) + ("config",)


def load(args: argparse.Namespace) -> settings.Loaded[ServerConfig]:
    """The effective settings of parsed flags (``tigana config show server`` prints them)."""
    return load_server_config_sources({k: getattr(args, k, None) for k in FIELDS})


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    try:
        config = load(args).config
    except InvalidArgument as exc:
        say(args, f"tigana server: {exc}")
        return 2

    stop = StopSignal()
    if config.workers > 1:
        return _run_workers(args, config, stop)

    tune_allocator(arena_max=SERVER_ARENAS)
    try:
        handle = start_server(config)
    except (OSError, InvalidArgument) as exc:
        say(args, f"tigana server: {exc}")
        return 1
    try:
        while not handle.wait_ready(0.2):
            if stop.is_set():
                return 0
        if args.ready_file:
            _write_ready(Path(args.ready_file), handle)
        where = f"scheduler {config.scheduler}" if config.scheduler else f"slots {config.slots}"
        say(args, f"tigana server: serving on {handle.address} as {handle.service.server_id} ({where}, "
              f"{config.num_slots} slots, data dir {config.data_dir or 'none'}"
              + (f", metrics on :{handle.metrics_port}" if handle.metrics_port else "") + ")")
        stop.wait()
        say(args, f"tigana server: {stop.name}, draining and snapshotting")
    except Exception as exc:  # noqa: BLE001 - a failed load is reported, not a traceback
        say(args, f"tigana server: {type(exc).__name__}: {exc}")
        return 1
    finally:
        handle.close()  # idempotent; snapshots only when the tables were loaded
        if args.ready_file:
            Path(args.ready_file).unlink(missing_ok=True)
    return 0


def _run_workers(args: argparse.Namespace, config: ServerConfig, stop: StopSignal) -> int:
    """``--workers N``: the supervisor of N shard processes (``tigana.tools.server_workers``)."""
    import tempfile

    from tigana.tools.server_workers import Supervisor

    with tempfile.TemporaryDirectory(prefix="tigana-workers-") as run_dir:
        try:
            supervisor = Supervisor(config, args._argv, ready_file=args.ready_file, run_dir=Path(run_dir))
        except (OSError, ValueError) as exc:
            say(args, f"tigana server: {exc}")
            return 1
        say(args, f"tigana server: starting {config.workers} workers; their health on {supervisor.address}")
        code = supervisor.run(stop)
        say(args, f"tigana server: {stop.name}: every worker drained and snapshotted" if code == 0 else
            f"tigana server: {stop.name}: a worker did not stop cleanly (exit status 1)")
        return code


def _write_ready(path: Path, handle) -> None:
    info = {"address": handle.address, "port": handle.port, "metrics_port": handle.metrics_port, "pid": os.getpid()}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(info))
