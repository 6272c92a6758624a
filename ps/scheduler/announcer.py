"""The announcer: pushes every map the scheduler saves to the servers that are up (``InstallMap``), on its own
thread, so a slow or dead server never holds up the core. Latest map only: a server that misses one gets the
next, or fetches it with its heartbeat."""

from __future__ import annotations

import contextlib
import threading
from concurrent import futures

import grpc

from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps.channels import reconnect_options
from tigana.ps.routing import ShardMap
from tigana.ps.security import NONE, Security
from tigana.ps.wire import cluster as cluster_wire


class Announcer:
    """Pushes every new map to the servers that are up (latest map only; a server that misses one gets the
    next, or fetches it with its heartbeat)."""

    def __init__(self, max_message_bytes: int = 64 << 20, security: Security = NONE) -> None:
        self._security = security
        self._latest: ShardMap | None = None
        self._cond = threading.Condition()
        self._channels: dict[str, grpc.Channel] = {}
        self._pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="tigana-announce")
        self._closed = False
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes), *reconnect_options()]
        self._thread = threading.Thread(target=self._run, name="tigana-announcer", daemon=True)
        self._thread.start()

    def __call__(self, m: ShardMap) -> None:
        with self._cond:
            if self._latest is None or m.epoch > self._latest.epoch:
                self._latest = m
                self._cond.notify_all()

    def channel(self, address: str) -> grpc.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self._security.channel(address, self._options)
        return ch

    def _run(self) -> None:
        sent = 0
        while True:
            with self._cond:
                while not self._closed and (self._latest is None or self._latest.epoch <= sent):
                    self._cond.wait()
                if self._closed:
                    return
                m = self._latest
            request = pb.InstallMapRequest(map=cluster_wire.map_to_pb(m))
            calls = []
            for s in m.servers:
                if s.up:
                    stub = shard_pb2_grpc.ShardStub(self.channel(s.address))
                    calls.append(self._pool.submit(_quiet_call, stub.InstallMap, request, 2.0))
            futures.wait(calls, timeout=3.0)
            sent = m.epoch

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop announcing. The calls in flight end first (each within its 2 s deadline), then the channels
        close: a daemon exiting with a gRPC call still running on another thread can abort in gRPC's C++
        teardown ("terminate called without an active exception")."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for ch in self._channels.values():
            ch.close()


def _quiet_call(method, request, timeout: float) -> None:
    with contextlib.suppress(grpc.RpcError, ValueError):
        method(request, timeout=timeout)
