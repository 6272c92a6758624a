"""``tigana scheduler``: run the scheduler that owns a cluster's shard map, until SIGTERM or Ctrl-C.

Shard servers started with ``--scheduler HOST:PORT`` register with it; clients connect to it. The map is
persisted in ``--data-dir`` before it is announced, so a restart (even after ``kill -9``) loses nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path

from tigana.embeddings.files import atomic_write
from tigana.ps import settings
from tigana.ps.errors import PSError
from tigana.ps.logs import FORMATS, setup_logging
from tigana.ps.scheduler import SchedulerConfig, load_scheduler_config, start_scheduler
from tigana.tools.daemon_flags import add_metrics_flags, add_security_flags, say
from tigana.tools.signals import StopSignal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The scheduler's flags: every default is None, so only flags given override ``TIGANA_*`` variables and
    the config file; ``--help`` shows the value each setting takes when nothing sets it."""
    a = parser.add_argument
    a("--host", help="address to bind")
    a("--port", type=int, help="gRPC port (0: a free port, printed at start)")
    a("--data-dir", help="the shard map is persisted here (required to survive a restart) unless --store says "
                         "otherwise; none: a temporary folder")
    a("--store", help="etcd://HOST:PORT[,HOST:PORT][/PREFIX]: keep the map in etcd; run 2-3 schedulers on it, one "
                      "leads (none: the data dir)")
    a("--leader-ttl", dest="leader_ttl_s", type=int,
      help="seconds of the leader's etcd lease: a standby takes over this long after the leader dies")
    a("--advertise", help="HOST:PORT servers and clients reach this scheduler at (a standby names the leader by "
                          "it; none: the bound address)")
    a("--replicas", type=int, help="copies of every slot besides its primary")
    a("--heartbeat-timeout", dest="heartbeat_timeout_s", type=float,
      help="seconds without a heartbeat before a server is declared dead")
    a("--num-slots", type=int, help="virtual slots (fixed for the cluster's life)")
    a("--expect-servers", type=int, help="the first placement waits for this many servers (or --bootstrap-wait)")
    a("--bootstrap-wait", dest="bootstrap_wait_s", type=float, help="seconds the first placement waits for more servers")
    a("--auto-rebalance", action="store_const", const=True,
      help="give a server that holds or leads no slot its share (the default)")
    a("--no-auto-rebalance", dest="auto_rebalance", action="store_const", const=False,
      help="leave servers that join empty until `tigana admin rebalance`")
    add_security_flags(parser, "scheduler", "servers register with it; admin operations need it")
    a("--config", help="YAML or TOML file of settings (keys as the flags, with _ or -; a scheduler: section when "
                       "present)")
    add_metrics_flags(parser, "failovers, slot moves, servers, slots")
    a("--ready-file", default=None, help="write {address, port, metrics_port, pid} as JSON here once serving")
    a("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    a("--log-format", default="text", choices=FORMATS, help="text lines, or one JSON object per line (default: text)")
    settings.describe_defaults(parser, SchedulerConfig)


FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerConfig)) + ("config",)


def load(args: argparse.Namespace) -> settings.Loaded[SchedulerConfig]:
    """The effective settings of parsed flags (``tigana config show scheduler`` prints them)."""
    return load_scheduler_config({k: getattr(args, k, None) for k in FIELDS})


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    stop = StopSignal()
    try:
        config = load(args).config
    except PSError as exc:  # a bad setting
        say(args, f"tigana scheduler: {exc}", logging.ERROR)
        return 2
    try:
        handle = start_scheduler(config)
    except (OSError, PSError) as exc:
        say(args, f"tigana scheduler: {exc}", logging.ERROR)
        return 1
    try:
        if args.ready_file:
            path = Path(args.ready_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps({"address": handle.address, "port": handle.port,
                                           "metrics_port": handle.metrics_port, "pid": os.getpid()}))
        metrics = f", metrics on :{handle.metrics_port}" if handle.metrics_port else ""
        if handle.core is not None:
            say(args, f"tigana scheduler: serving on {handle.address} (cluster {handle.core.map.cluster_id}, epoch "
                  f"{handle.core.map.epoch}, {config.replicas} replica(s), state in {handle.store.describe()}"
                  f"{metrics})")
        else:
            say(args, f"tigana scheduler: serving on {handle.address}, standing by for election (state in "
                  f"{handle.store.describe()}{metrics})")
        stop.wait()
    finally:
        handle.close()
        if args.ready_file:
            Path(args.ready_file).unlink(missing_ok=True)
    return 0
