"""``tigana.ps.health.check_health``, the one health probe: an answer (SERVING, NOT_SERVING), an unknown
service (NOT_FOUND) and a closed port (UNAVAILABLE) come back as values, never as a raised ``RpcError``; the
scheduler's ``probe_closed`` reads them as answered / unknown / closed, and ``connect`` knows a scheduler (even a
standby) by its answer for the Scheduler service."""

from __future__ import annotations

import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tigana.ps.client.facade import _is_scheduler
from tigana.ps.health import check_health
from tigana.ps.scheduler import probe_closed


@pytest.fixture
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("up", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("down", health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer.set("tigana.v1.Scheduler", health_pb2.HealthCheckResponse.NOT_SERVING)  # a standby
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(None)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_answers_unknown_services_and_closed_ports_are_values(server: str) -> None:
    up = check_health(server, "up", timeout_s=5)
    assert up.answered and up.serving and up.code == grpc.StatusCode.OK
    down = check_health(server, "down", timeout_s=5)
    assert down.answered and not down.serving
    assert down.status == health_pb2.HealthCheckResponse.NOT_SERVING
    unknown = check_health(server, "nope", timeout_s=5)
    assert not unknown.answered and unknown.code == grpc.StatusCode.NOT_FOUND
    assert unknown.status == health_pb2.HealthCheckResponse.UNKNOWN
    closed = check_health(_closed_port(), timeout_s=5)
    assert not closed.answered and closed.code == grpc.StatusCode.UNAVAILABLE and not closed.serving


def test_probe_closed_reads_the_probe(server: str) -> None:
    assert probe_closed(server, 5.0) is False  # the server as a whole ("") answers
    assert probe_closed(_closed_port(), 5.0) is True


def test_connect_knows_a_scheduler_by_its_health_answer(server: str) -> None:
    from tigana.ps.security import NONE

    assert _is_scheduler(server, 5.0, NONE)
    assert not _is_scheduler(_closed_port(), 5.0, NONE)
