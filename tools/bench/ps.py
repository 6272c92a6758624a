"""``tigana bench ps``: the tigana.ps client against 2 shard daemons on loopback, with its limits and a peer.

Workload: batches of 65,536 ids drawn Zipf(1.05) over 10M ids; dim 16 and 64; fp32 and fp16 on the wire.
Cases (rows = ids in the batch, duplicates included, per second):

- ``pull``  ``client.pull`` of one batch;
- ``push``  pushes of Adagrad gradients, counted once acknowledged (4 in flight, then ``flush``);
- ``step``  pull, then push of the batch (staleness 1, as a trainer that overlaps its pushes).

Each case is reported against three references measured in the same run, one JSON line each:

- ``in-process``  the same tables as ``EmbeddingTable`` in this process, no network (the limit);
- ``grpc-echo``   the same messages (sizes, chunks, 2 servers, same channel options) as raw bytes through a
                  generic-handler echo service in 2 child processes (the Python gRPC ceiling of unary calls);
- ``grpc-stream-echo``  the same bytes as frames of one bidirectional stream per echo server (the ceiling
                  of the streaming data path the client uses by default);
- ``ps-unary``    the same client with ``transport="unary"`` (one RPC per message);
- ``redis``       ``redis-server`` on a free loopback port, pipelined MGET/MSET of the unique ids' rows as
                  packed bytes (skipped with a message on stderr when the binary is absent).

The timed runs of a case and its three references are interleaved round-robin (medians reported), so all see the
same load on a shared machine. Every process involved (client, daemons, echo servers) runs with ``tigana.ps.allocator.tune_allocator``'s large-buffer
malloc thresholds (glibc otherwise maps and unmaps every multi-MiB gRPC buffer, which costs ~3x on loopback).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import itertools
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures as cf
from pathlib import Path

import grpc
import numpy as np

from tigana import ps
from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.ps import routing
from tigana.ps.allocator import tune_allocator
from tigana.ps.channels import channel_options
from tigana.ps.local import stop_process
from tigana.ps.wire import data as wire
from tigana.tools.bench.report import emit, log

_ECHO = "/tigana.bench.Echo/Exchange"
_ECHO_STREAM = "/tigana.bench.Echo/Stream"

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


def zipf_batches(count: int, size: int, num_ids: int, a: float, seed: int = 0) -> list[np.ndarray]:
    """``count`` batches of ``size`` int64 ids in [0, num_ids), Zipf(a) by rank (rejection above num_ids)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = np.empty(0, np.int64)
        while ids.size < size:
            draw = rng.zipf(a, size * 2)
            ids = np.concatenate([ids, draw[draw <= num_ids] - 1])
        # scatter ranks over the id space so hot ids do not share slots
        out.append((routing.mix64(ids[:size]) % np.uint64(num_ids)).astype(np.int64))
    return out


class _Cycle:
    def __init__(self, items: list) -> None:
        self.items, self.i = items, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def _die_with_parent() -> None:  # a crashed benchmark leaves no servers behind
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# --- the raw gRPC ceiling ---------------------------------------------------------------------------------
def _echo_main(ready_file: str) -> None:
    """Child process: a generic-handler service answering ``Exchange`` with the reply size the request asks."""
    from tigana.ps.config import ServerConfig
    from tigana.ps.daemon import grpc_server_options

    # Die with the benchmark, set here rather than in a preexec_fn: Python code between fork and exec in the
    # multi-threaded (gRPC) parent can crash or hang the child; without it the child is spawned by vfork.
    _die_with_parent()
    if os.getppid() == 1:  # the parent died before the death signal was armed
        return
    tune_allocator()  # as tigana server does
    replies: dict[int, bytes] = {}

    def exchange(request: bytes, context) -> bytes:
        size = int.from_bytes(request[:8], "little")
        reply = replies.get(size)
        if reply is None:
            reply = replies[size] = bytes(size)
        return reply

    def stream(requests, context):  # frame: reply size (8 bytes), frame id (8 bytes), payload
        for request in requests:
            yield request[8:16] + exchange(request, context)

    handler = grpc.method_handlers_generic_handler("tigana.bench.Echo", {
        "Exchange": grpc.unary_unary_rpc_method_handler(exchange),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)})
    server = grpc.server(cf.ThreadPoolExecutor(max_workers=16), options=grpc_server_options(ServerConfig()))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(ready_file).write_text(f"127.0.0.1:{port}")
    server.wait_for_termination()


class EchoServers:
    """``n`` echo server child processes; ``exchange(plan)`` sends every (server, request, reply) at once."""

    def __init__(self, n: int, options: list) -> None:
        self.procs: list[subprocess.Popen] = []
        self.channels: list[grpc.Channel] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="tigana-echo-")
        try:
            files = []
            for i in range(n):
                ready = Path(self._tmp.name) / f"echo-{i}"
                files.append(ready)
                self.procs.append(subprocess.Popen([sys.executable, "-m", "tigana.tools.bench.ps", "--echo-server",
                                                    str(ready)], stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + 60
            while not all(f.exists() and f.read_text() for f in files):
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise RuntimeError("echo servers did not start")
                time.sleep(0.05)
            self.channels = [grpc.insecure_channel(f.read_text(), options=options) for f in files]
            self.calls = [c.unary_unary(_ECHO, request_serializer=wire.identity, response_deserializer=wire.identity)
                          for c in self.channels]
            self.streams = [_EchoStream(c) for c in self.channels]
        except BaseException:
            self.close()
            raise

    def exchange(self, plan: list[tuple[int, bytes]]) -> int:
        """plan: (server index, request) pairs, all sent in parallel; returns reply bytes received."""
        futs = [self.calls[i].future(req, timeout=60) for i, req in plan]
        return sum(len(f.result()) for f in futs)

    def stream_exchange(self, plan: list[tuple[int, bytes]]) -> int:
        """``exchange`` through the streams: every request a frame (its id in bytes 8-16), all sent at once."""
        futs = [self.streams[i].send(req) for i, req in plan]
        return sum(f.result(timeout=60) for f in futs)

    def close(self) -> None:
        for st in getattr(self, "streams", []):
            st.close()
        for c in self.channels:
            c.close()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._tmp.cleanup()


class _EchoStream:
    """One bidirectional echo stream: frames carry an id in bytes 8-16; answers settle futures by id."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[int, cf.Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

        def outgoing():
            while (item := self._queue.get()) is not None:
                yield item

        self._call = channel.stream_stream(_ECHO_STREAM, request_serializer=wire.identity,
                                           response_deserializer=wire.identity)(outgoing())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for reply in self._call:
                with self._lock:
                    fut = self._waiting.pop(int.from_bytes(reply[:8], "little"))
                fut.set_result(len(reply) - 8)

    def send(self, request: bytes) -> cf.Future:
        fut: cf.Future = cf.Future()
        frame_id = next(self._ids)
        with self._lock:
            self._waiting[frame_id] = fut
        self._queue.put(request[:8] + frame_id.to_bytes(8, "little") + request[16:])
        return fut

    def close(self) -> None:
        self._queue.put(None)
        self._call.cancel()


def _message_plan(uniq: np.ndarray, dim: int, codec: str, kind: str, chunk_bytes: int,
                  shards: int = 2) -> list[tuple[int, bytes]]:
    """The messages the client sends for one batch (same routing, same chunks) as echo requests of the same
    sizes: ids out and rows back for a pull, ids and rows out and a small ack back for a push."""
    row_bytes = wire.rows_nbytes(1, dim, wire.codec_of(codec))
    per = max(1, chunk_bytes // (8 + row_bytes))
    owners = routing.static_assignment(shards)[routing.slot_of(uniq)]
    plan = []
    for server in range(shards):
        count = int((owners == server).sum())
        for start in range(0, count, per):
            n = min(per, count - start)
            if kind in ("pull", "step"):
                plan.append((server, (n * row_bytes).to_bytes(8, "little") + bytes(8 * n)))
            if kind in ("push", "step"):
                plan.append((server, (8).to_bytes(8, "little") + bytes(n * (8 + row_bytes))))
    return plan


# --- Redis ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisPeer:
    """A throw-away ``redis-server`` on a free loopback port, no persistence."""

    def __init__(self, binary: str, attempts: int = 3) -> None:
        import redis

        # The free port can be taken between our probe and redis' bind, and redis then exits at once: retry on
        # a new port. `setpriv --pdeathsig` makes redis die with the benchmark without a preexec_fn (Python code
        # between fork and exec in a multi-threaded gRPC process can hang or crash the child).
        wrapper = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
        for attempt in range(1, attempts + 1):
            self.port = _free_port()
            with tempfile.TemporaryFile() as output:  # redis logs to stdout; read only when it fails to start
                self.proc = subprocess.Popen([*wrapper, binary, "--port", str(self.port), "--bind", "127.0.0.1",
                                              "--save", "", "--appendonly", "no", "--protected-mode", "no",
                                              "--loglevel", "warning"],
                                             stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                if self._started(redis):
                    return
                self.close()
                output.seek(0)
                why = output.read().decode(errors="replace")[-500:].strip()
            if attempt == attempts:
                raise RuntimeError(f"redis-server did not start on port {self.port} (exit {self.proc.returncode}): "
                                   f"{why}")
            log(f"bench ps: redis-server did not start on port {self.port}; trying another port")

    def _started(self, redis) -> bool:
        """Wait until our server answers PING (True), or it exits, or 30 s pass (False). A short-timeout probe
        client: something else listening on the port must not hang the wait."""
        self.db = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 30
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, socket_connect_timeout=1,
                         retry=Retry(NoBackoff(), 0)) as probe:
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    probe.ping()
                    return self.proc.poll() is None
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
        return False

    def mget(self, keys: list[int], step: int = 1024) -> list[bytes]:
        pipe = self.db.pipeline(transaction=False)
        for i in range(0, len(keys), step):
            pipe.mget(keys[i:i + step])
        out: list[bytes] = []
        for part in pipe.execute():
            out.extend(part)
        return out

    def mset(self, keys: list[int], values: list[bytes], step: int = 1024) -> None:
        pipe = self.db.pipeline(transaction=False)
        for i in range(0, len(keys), step):
            pipe.mset(dict(zip(keys[i:i + step], values[i:i + step], strict=True)))
        pipe.execute()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.db.close()
        stop_process(self.proc)


def _rows_as_values(rows: np.ndarray, codec: str) -> list[bytes]:
    block = rows.astype("<f2") if codec == "fp16" else np.ascontiguousarray(rows, "<f4")
    return block.view(np.dtype((np.void, block.shape[1] * block.itemsize))).ravel().tolist()


def _values_as_rows(values: list[bytes], dim: int, codec: str) -> np.ndarray:
    dtype = "<f2" if codec == "fp16" else "<f4"
    return np.frombuffer(b"".join(values), dtype).astype(np.float32).reshape(-1, dim)


# --- the run ----------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if getattr(args, "echo_server", None):
        _echo_main(args.echo_server)
        return 0
    tune_allocator()  # the client does it too (ClientConfig.tune_allocator); the Redis client shares it
    if args.replicas > 0:
        return _bench_replication(args)
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


def interleaved_rates(fns: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Median items/s of each function, their timed runs interleaved (round-robin, rotating the start) so
    that every system sees the same machine load: a shared, busy machine otherwise biases the ratios."""
    names = list(fns)
    for name in names:  # warm-up
        fns[name]()
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            t0 = time.perf_counter()
            items = fns[name]()
            rates[name].append(items / (time.perf_counter() - t0))
    return {name: statistics.median(v) for name, v in rates.items()}


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


def _bench_replication(args: argparse.Namespace) -> int:
    """Push (and pull) rows/s with sync and async replication against none, interleaved in one run."""
    repeats = args.repeats or (5 if args.quick else 9)
    dims = [int(d) for d in args.dims.split(",")] if args.dims != "16,64" else [64]
    batches = zipf_batches(4 if args.quick else 8, args.batch, args.num_ids, args.zipf)
    unique_rows = int(np.mean([np.unique(b).size for b in batches]))
    env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0")
    log(f"bench ps --replicas {args.replicas}: batch {args.batch}, ~{unique_rows} unique ids, dims {dims}")
    base = {"batch": args.batch, "unique_ids": unique_rows, "num_ids": args.num_ids, "zipf": args.zipf, "shards": 2,
            "replicas": args.replicas, "repeats": repeats, "wire": "fp32", "optimizer": "adagrad"}
    with ps.LocalCluster(2, replicas=None, env=env) as plain, \
            ps.LocalCluster(2, replicas=args.replicas, env=env) as replicated, \
            ps.connect(plain.addresses) as none_client, ps.connect(scheduler=replicated.scheduler) as rep_client:
        for dim in dims:
            tables = {"none": (none_client, f"rep_none_d{dim}"), "sync": (rep_client, f"rep_sync_d{dim}"),
                      "async": (rep_client, f"rep_async_d{dim}")}
            for mode, (client, name) in tables.items():
                client.create_table(name, dim=dim, optimizer=ps.Adagrad(lr=0.01), initializer=ps.Normal(std=0.01),
                                    staleness=1, durability=None if mode == "none" else mode)
                for b in batches:  # insert every row first: the timed runs update existing rows
                    client.pull(name, b)
            rng = np.random.default_rng(1)
            grads = _Cycle([rng.normal(0, 0.01, (b.size, dim)).astype(np.float32) for b in batches])
            batch = _Cycle(batches)
            n, in_flight = batches[0].size, 4

            push = interleaved_rates({m: _pusher(*tables[m], batch, grads, n, in_flight) for m in tables}, repeats)
            pull = interleaved_rates({m: _puller(*tables[m], batch, n) for m in tables}, repeats)
            params = dict(base, dim=dim)
            for mode in ("sync", "async"):
                emit(f"push_{mode}", "rows/s", push[mode], "no replication", push["none"], durability=mode, **params)
            for mode in ("sync", "async"):
                emit(f"pull_{mode}", "rows/s", pull[mode], "no replication", pull["none"], durability=mode, **params)
            lag = rep_client.server_stats(tables["async"][1])
            log("bench ps --replicas: replication lag after the async runs: " + ", ".join(
                f"{a}: {v[tables['async'][1]].get('replication_lag_items', 0):.0f} items" for a, v in lag.items()))
            for client, name in tables.values():
                client.drop_table(name)
    return 0


def _pusher(client: ps.Client, name: str, batch: _Cycle, grads: _Cycle, n: int, in_flight: int
            ) -> Callable[[], int]:
    def fn() -> int:
        for _ in range(in_flight):
            client.push(name, batch(), grads())
        client.flush()
        return n * in_flight
    return fn


def _puller(client: ps.Client, name: str, batch: _Cycle, n: int) -> Callable[[], int]:
    def fn() -> int:
        client.pull(name, batch())
        return n
    return fn


def _redis_cases(peer: RedisPeer, uniques: list, dim: int, codec: str,
                 n: int) -> dict[str, tuple[str, Callable[[], int]]]:
    """Redis versions of the cases over the unique ids of each batch, rows stored as packed bytes."""
    peer.db.flushall()
    rng = np.random.default_rng(2)
    keys = [u.tolist() for u, _ in uniques]
    rows = [rng.normal(0, 0.01, (len(u), dim)).astype(np.float32) for u, _ in uniques]
    for k, r in zip(keys, rows, strict=True):
        peer.mset(k, _rows_as_values(r, codec))
    which = _Cycle(list(range(len(uniques))))

    def mget() -> int:
        i = which()
        got = _values_as_rows(peer.mget(keys[i]), dim, codec)
        got[uniques[i][1]]  # back to batch order, as the client does
        return n

    def mset() -> int:
        i = which()
        peer.mset(keys[i], _rows_as_values(rows[i], codec))
        return n

    def both() -> int:
        mget()
        return mset()

    return {"pull": ("redis MGET", mget), "push": ("redis MSET", mset), "step": ("redis MGET+MSET", both)}


if __name__ == "__main__":  # the echo server child: python -m tigana.tools.bench.ps --echo-server READY_FILE
    _parser = argparse.ArgumentParser()
    _parser.add_argument("--echo-server")
    raise SystemExit(run(_parser.parse_args()))
