"""``tigana scheduler``: run the scheduler that owns a cluster's shard map, until SIGTERM or Ctrl-C.

Shard servers started with ``--scheduler HOST:PORT`` register with it; clients connect to it. The map is
persisted in ``--data-dir`` before it is announced, so a restart (even after ``kill -9``) loses nothing.
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

from tigana.ps.errors import PSError
from tigana.ps.scheduler import SchedulerConfig, start_scheduler


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default=os.environ.get("TIGANA_SCHEDULER_HOST", "127.0.0.1"), help="address to bind (default 127.0.0.1)")
    a("--port", type=int, default=int(os.environ.get("TIGANA_SCHEDULER_PORT", "0")),
      help="gRPC port (0: a free port, printed at start)")
    a("--data-dir", default=os.environ.get("TIGANA_SCHEDULER_DATA_DIR"),
      help="the shard map is persisted here (required to survive a restart) unless --store says otherwise")
    a("--store", default=os.environ.get("TIGANA_SCHEDULER_STORE"),
      help="etcd://HOST:PORT[,HOST:PORT][/PREFIX]: keep the map in etcd; run 2-3 schedulers on it, one leads "
           "(default: the data dir)")
    a("--leader-ttl", type=int, default=int(os.environ.get("TIGANA_LEADER_TTL", "2")),
      help="seconds of the leader's etcd lease: a standby takes over this long after the leader dies (default 2)")
    a("--replicas", type=int, default=int(os.environ.get("TIGANA_REPLICAS", "1")),
      help="copies of every slot besides its primary (default 1)")
    a("--heartbeat-timeout", type=float, default=3.0,
      help="seconds without a heartbeat before a server is declared dead (default 3)")
    a("--num-slots", type=int, default=4096, help="virtual slots (default 4096; fixed for the cluster's life)")
    a("--expect-servers", type=int, default=1,
      help="the first placement waits for this many servers (or --bootstrap-wait seconds; default 1)")
    a("--bootstrap-wait", type=float, default=2.0, help="seconds the first placement waits for more servers")
    a("--auto-rebalance", action="store_true", help="move slots to servers that join")
    env = os.environ.get
    a("--tls-cert", default=env("TIGANA_TLS_CERT"), help="PEM certificate the scheduler presents (TLS)")
    a("--tls-key", default=env("TIGANA_TLS_KEY"), help="PEM private key of --tls-cert")
    a("--tls-ca", default=env("TIGANA_TLS_CA"), help="PEM CA that verifies peers (and client certificates)")
    a("--require-client-cert", action="store_true", default=env("TIGANA_REQUIRE_CLIENT_CERT", "") in ("1", "true"),
      help="mutual TLS: refuse callers without a certificate signed by --tls-ca")
    a("--auth-token-file", default=env("TIGANA_AUTH_TOKEN_FILE"), help="file with the trainers' token")
    a("--admin-token-file", default=env("TIGANA_ADMIN_TOKEN_FILE"),
      help="file with the admin token (servers register with it; admin operations need it)")
    a("--allow-insecure-loopback", action="store_true",
      default=env("TIGANA_ALLOW_INSECURE_LOOPBACK", "") in ("1", "true"),
      help="accept tokens without TLS, from this machine only")
    a("--ready-file", default=None, help="write {address, port, pid} as JSON here once serving")
    a("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        config = SchedulerConfig(host=args.host, port=args.port, data_dir=args.data_dir, replicas=args.replicas,
                                 num_slots=args.num_slots, heartbeat_timeout_s=args.heartbeat_timeout,
                                 expect_servers=args.expect_servers, bootstrap_wait_s=args.bootstrap_wait,
                                 auto_rebalance=args.auto_rebalance, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                 tls_ca=args.tls_ca, require_client_cert=args.require_client_cert,
                                 auth_token_file=args.auth_token_file, admin_token_file=args.admin_token_file,
                                 allow_insecure_loopback=args.allow_insecure_loopback, store=args.store,
                                 leader_ttl_s=args.leader_ttl)
        handle = start_scheduler(config)
    except (OSError, PSError) as exc:
        print(f"tigana scheduler: {exc}", file=sys.stderr)
        return 1
    try:
        if args.ready_file:
            path = Path(args.ready_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"address": handle.address, "port": handle.port, "pid": os.getpid()}))
            os.replace(tmp, path)
        if handle.core is not None:
            print(f"tigana scheduler: serving on {handle.address} (cluster {handle.core.map.cluster_id}, epoch "
                  f"{handle.core.map.epoch}, {args.replicas} replica(s), state in {handle.store.describe()})",
                  file=sys.stderr, flush=True)
        else:
            print(f"tigana scheduler: serving on {handle.address}, standing by for election (state in "
                  f"{handle.store.describe()})", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        handle.close()
        if args.ready_file:
            Path(args.ready_file).unlink(missing_ok=True)
    return 0
