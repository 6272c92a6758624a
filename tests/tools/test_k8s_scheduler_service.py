"""The scheduler behind one Kubernetes Service address, every replica Ready (tools/k8s/scheduler.yaml).

Every scheduler replica, leader or standby, answers health "" SERVING, so the readiness probe on it makes all
of them Ready and a Deployment's rollout completes. The Service then balances connections over leader and
standbys alike; a standby answers UNAVAILABLE "... is a standby", and callers with that single address dial it
again until a connection lands on the leader. Here a round-robin TCP proxy (what kube-proxy does per
connection) stands for the Service in front of two real schedulers on a real etcd, and a shard server, a
client and ``tigana admin`` all go through it.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tigana import ps
from tigana.ps.ops import admin
from tigana.tools import cli

pytestmark = pytest.mark.timeout(240)


class RoundRobinProxy:
    """Accepts TCP connections on a loopback port and pipes each to the next backend in turn."""

    def __init__(self, backends: list[str]) -> None:
        self._backends = itertools.cycle(backends)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host, port = next(self._backends).rsplit(":", 1)
            try:
                upstream = socket.create_connection((host, int(port)), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()


@pytest.fixture
def service(make_shard_cluster, etcd) -> Iterator[tuple[ps.LocalCluster, RoundRobinProxy]]:
    cluster = make_shard_cluster(1, replicas=0, schedulers=2, store=etcd.url)
    proxy = RoundRobinProxy(cluster.scheduler.split(","))
    try:
        yield cluster, proxy
    finally:
        proxy.close()


def _health(address: str, name: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name),
                                                         timeout=5).status


def test_every_replica_is_ready_and_callers_reach_the_leader_through_one_address(service, make_shard_server
                                                                                 ) -> None:
    cluster, proxy = service
    schedulers = cluster.scheduler.split(",")
    # the readiness probe of tools/k8s/scheduler.yaml: "" is SERVING on the leader and on the standby
    assert [_health(a, "") for a in schedulers] == [health_pb2.HealthCheckResponse.SERVING] * 2
    # (the leader-only name still tells them apart)
    leader_only = [_health(a, "tigana.v1.Scheduler") for a in schedulers]
    assert sorted(leader_only) == sorted([health_pb2.HealthCheckResponse.SERVING,
                                          health_pb2.HealthCheckResponse.NOT_SERVING])

    # tigana admin with the single address: every call lands on the leader, whichever replica it first reaches
    for _ in range(6):
        assert admin.status(proxy.address, timeout_s=20).map.epoch >= 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["admin", "--scheduler", proxy.address, "--json", "status"]) == 0
    assert '"ok": true' in out.getvalue()

    # a shard server registering through the address, and a client routing by the map it gets there
    make_shard_server(port=0, scheduler=proxy.address, heartbeat_interval_s=0.2)
    deadline = time.monotonic() + 60
    while sum(s["up"] for s in admin.cluster_status(proxy.address, timeout_s=20)["servers"]) < 2:
        assert time.monotonic() < deadline, "the server never registered through the Service address"
        time.sleep(0.2)
    with ps.connect(scheduler=proxy.address, failover_timeout_s=60) as client:
        client.create_table("svc", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        ids = np.arange(1000, dtype=np.int64)
        client.push("svc", ids, np.ones((1000, 4), np.float32)).result()
        np.testing.assert_array_equal(client.pull("svc", ids), -np.ones((1000, 4), np.float32))
    assert proxy.connections >= 2  # both replicas were reached through the one address
