"""``tigana bench ps``: the arguments, the run (a cluster, echo servers, the Redis peer and two clients),
and the cases of one table against every reference."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
from collections.abc import Callable

import numpy as np

from tigana import ps
from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.ps.allocator import tune_allocator
from tigana.ps.channels import channel_options
from tigana.tools.bench.ps.echo import EchoServers, _echo_main, _message_plan
from tigana.tools.bench.ps.inserts import bench_inserts
from tigana.tools.bench.ps.redis_peer import RedisPeer, _redis_cases
from tigana.tools.bench.ps.replication import _bench_replication
from tigana.tools.bench.ps.workers import bench_workers
from tigana.tools.bench.ps.workload import _Cycle, interleaved_rates, zipf_batches
from tigana.tools.bench.report import emit, log


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer repeats (about a minute on 2 cores)")
    parser.add_argument("--batch", type=int, default=65536, help="ids per batch (default 65536)")
    parser.add_argument("--num-ids", type=int, default=10_000_000, help="id space of the Zipf draw (default 10M)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    parser.add_argument("--dims", default="16,64", help="comma-separated dims (default 16,64)")
    parser.add_argument("--wire", default="fp32,fp16", help="comma-separated wire codecs (default fp32,fp16)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per case (default 9, quick 5)")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis peer")
    parser.add_argument("--replicas", type=int, default=0,
                        help="with N > 0: push rows/s of sync and async replication (a scheduler, 2 shards, N "
                             "replicas) against no replication (a static 2-shard list), in one run; dims from "
                             "--dims (default here: 64), fp32 wire")
    parser.add_argument("--inserts", type=int, default=0, metavar="ROWS",
                        help="with ROWS > 0: first-sight pulls (ROWS fresh random ids, each inserted) against pushes "
                             "of resident rows through one daemon, and its RSS per row (issue figures: 20M)")
    parser.add_argument("--insert-dim", type=int, default=16, help="dim of the --inserts table (default 16)")
    parser.add_argument("--workers", type=int, default=1,
                        help="with N > 1: rows/s and frames/s of one `tigana server --workers N` against "
                             "`--workers 1`, saturated by --clients client processes (tools/bench/ps/workers.py)")
    parser.add_argument("--clients", type=int, default=2, help="client processes of --workers (default 2)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds of each timed run of --workers")
    parser.add_argument("--frame-ids", type=int, default=256,
                        help="ids per push of the --workers frames/s case (default 256)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "echo_server", None):
        _echo_main(args.echo_server)
        return 0
    tune_allocator()  # the client does it too (ClientConfig.tune_allocator); the Redis client shares it
    if args.replicas > 0:
        return _bench_replication(args)
    if args.inserts > 0:
        return bench_inserts(args)
    if args.workers > 1:
        return bench_workers(args)
    repeats = args.repeats or (5 if args.quick else 9)
    dims = [int(d) for d in args.dims.split(",")]
    codecs = [c.strip() for c in args.wire.split(",")]
    batches = zipf_batches(4 if args.quick else 8, args.batch, args.num_ids, args.zipf)
    uniques = [np.unique(b, return_inverse=True) for b in batches]
    unique_rows = int(np.mean([len(u) for u, _ in uniques]))
    log(f"bench ps: batch {args.batch}, ~{unique_rows} unique ids, dims {dims}, wire {codecs}, repeats {repeats}")
    base = {"batch": args.batch, "unique_ids": unique_rows, "num_ids": args.num_ids, "zipf": args.zipf,
            "shards": 2, "repeats": repeats}

    redis_bin = None if args.no_redis else shutil.which("redis-server")
    if redis_bin is None and not args.no_redis:
        log("bench ps: redis-server not found (apt-get install redis-server); skipping the Redis peer")
    cfg = ps.ClientConfig()
    options = channel_options(cfg.max_message_bytes, cfg.keepalive_time_s, cfg.keepalive_timeout_s,
                              cfg.reconnect_backoff_s)
    env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0")
    cluster = echo = peer = client = unary = None
    try:
        cluster = ps.LocalCluster(2, replicas=None, env=env)
        echo = EchoServers(2, options)
        peer = RedisPeer(redis_bin) if redis_bin else None
        client = ps.connect(cluster.addresses, cfg)
        client.wait_ready(30)
        unary = ps.connect(cluster.addresses, dataclasses.replace(cfg, transport="unary"))
        for dim in dims:
            for codec in codecs:
                _bench_table(client, unary, echo, peer, batches, uniques, dim, codec, repeats, base)
    finally:
        for c in (client, unary):
            if c is not None:
                with contextlib.suppress(ps.PSError):
                    c.close()
        if peer is not None:
            peer.close()
        if echo is not None:
            echo.close()
        if cluster is not None:
            cluster.close(timeout=30)
    return 0


def _bench_table(client: ps.Client, unary: ps.Client, echo: EchoServers, peer: RedisPeer | None,
                 batches: list[np.ndarray], uniques: list, dim: int, codec: str, repeats: int, base: dict) -> None:
    name = f"bench_d{dim}_{codec}"
    opt = ps.Adagrad(lr=0.01)
    params = dict(base, dim=dim, wire=codec, optimizer="adagrad", transport=client.config.transport)
    for c in (client, unary):
        c.create_table(name, dim=dim, optimizer=opt, initializer=ps.Normal(std=0.01), staleness=1,
                       compression=codec)
    local = EmbeddingTable(TableConfig(name, dim, optimizer=opt, initializer=ps.Normal(std=0.01)))
    rng = np.random.default_rng(1)
    grads = [rng.normal(0, 0.01, (b.size, dim)).astype(np.float32) for b in batches]
    n = batches[0].size
    in_flight = 4  # pushes per timed unit: acknowledged once flush() returns
    try:
        for b in batches:  # insert every row first: the timed runs read and update existing rows
            client.pull(name, b)
            local.pull(b)
        batch, grad = _Cycle(batches), _Cycle(grads)

        def ps_pull(c: ps.Client = client) -> int:
            c.pull(name, batch())
            return n

        def ps_push(c: ps.Client = client) -> int:
            for _ in range(in_flight):
                c.push(name, batch(), grad())
            c.flush()
            return n * in_flight

        def ps_step(c: ps.Client = client) -> int:
            for _ in range(in_flight):
                b = batch()
                c.pull(name, b)
                c.push(name, b, grad())
            c.flush()
            return n * in_flight

        def local_pull() -> int:
            local.pull(batch())
            return n

        def local_push() -> int:
            local.push(batch(), grad())
            return n

        def local_step() -> int:
            b = batch()
            local.pull(b)
            local.push(b, grad())
            return n

        plans = {kind: _Cycle([_message_plan(u, dim, codec, kind, client.config.chunk_bytes) for u, _ in uniques])
                 for kind in ("pull", "push", "step")}

        def echo_case(kind: str, streaming: bool = False) -> Callable[[], int]:
            def fn() -> int:
                (echo.stream_exchange if streaming else echo.exchange)(plans[kind]())
                return n
            return fn

        redis = _redis_cases(peer, uniques, dim, codec, n) if peer is not None else {}
        for kind, fn, lim in (("pull", ps_pull, local_pull), ("push", ps_push, local_push),
                              ("step", ps_step, local_step)):
            fns = {"ps": fn, "in-process": lim, "grpc-echo": echo_case(kind),
                   "grpc-stream-echo": echo_case(kind, streaming=True), "ps-unary": functools.partial(fn, unary)}
            if kind in redis:
                fns["redis"] = redis[kind][1]
            rates = interleaved_rates(fns, repeats)
            for other in ("in-process", "grpc-echo", "grpc-stream-echo", "redis", "ps-unary"):
                if other in rates:
                    extra = {"redis_op": redis[kind][0]} if other == "redis" else {}
                    emit(kind, "rows/s", rates["ps"], other, rates[other], **extra, **params)
        stats = client.stats()
        log(f"bench ps {name}: sent {stats['bytes_sent'][name]} received {stats['bytes_received'][name]} "
            f"staleness {stats['staleness'][name]} retries {stats['retries']}")
    finally:
        client.drop_table(name)
        local.close()
