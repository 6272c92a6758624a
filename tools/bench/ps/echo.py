"""The raw gRPC ceiling of ``bench ps``: echo servers in child processes answering the same messages as the
client sends (unary calls, and frames of one bidirectional stream per server)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures as cf
from pathlib import Path

import grpc
import numpy as np

from tigana.ps import routing
from tigana.ps.allocator import tune_allocator
from tigana.ps.wire import data as wire

_ECHO = "/tigana.bench.Echo/Exchange"
_ECHO_STREAM = "/tigana.bench.Echo/Stream"


def _die_with_parent() -> None:  # a crashed benchmark leaves no servers behind
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _echo_main(ready_file: str) -> None:
    """Child process: a generic-handler service answering ``Exchange`` with the reply size the request asks."""
    from tigana.ps.shard.config import ServerConfig
    from tigana.ps.shard.daemon import grpc_server_options

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
