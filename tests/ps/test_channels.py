"""Our gRPC channels over a real slow link: a server on loopback reached through ``SlowProxy`` (the slow-link
fault's proxy, which delays every byte)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tigana.ps.channels import channel_options, reconnect_options
from tigana.tools.testing.faults.network import SlowProxy


@pytest.fixture
def slow_server():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = SlowProxy(("127.0.0.1", port), delay_s=0.4)  # a round trip of 0.8 s
    try:
        yield proxy.address
    finally:
        proxy.close()
        server.stop(0)


@pytest.mark.parametrize("options", [channel_options(64 << 20, 30.0, 10.0, 0.1), reconnect_options()],
                         ids=["channel_options", "reconnect_options"])
def test_a_new_connection_over_a_slow_link_is_made(slow_server, options) -> None:
    """The handshake takes a round trip or two (0.8 s each). Our options once gave a connection attempt
    100 ms (``grpc.min_reconnect_backoff_ms`` is gRPC's least connect timeout, not a backoff): it failed with
    "connection attempt timed out before receiving SETTINGS frame", every time."""
    with grpc.insecure_channel(slow_server, options=options) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
