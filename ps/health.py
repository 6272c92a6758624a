"""The one gRPC health probe of the project: ``check_health(address, service)``.

A daemon's liveness (the scheduler's failure detector: ``probe_closed``), whether an address serves the
scheduler (``connect``), which scheduler leads (``LocalCluster``) and whether ``tigana serve`` is ready (the
benchmarks) are all one ``grpc.health.v1.Health/Check`` call, read differently. Blocking (up to
``timeout_s``); thread-safe (a channel per call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tigana.ps.security import NONE, Security

__all__ = ["Health", "check_health"]


class Health(NamedTuple):
    """What a health check found. ``code``: OK when the health service answered, else the call's failure
    (UNAVAILABLE: nothing listens or no connection; DEADLINE_EXCEEDED: no answer in time; NOT_FOUND: the
    service is unknown there). ``status``: the ``HealthCheckResponse`` serving status (UNKNOWN unless OK)."""

    code: grpc.StatusCode
    status: int

    @property
    def answered(self) -> bool:
        return self.code == grpc.StatusCode.OK

    @property
    def serving(self) -> bool:
        return self.status == health_pb2.HealthCheckResponse.SERVING


def check_health(address: str, service: str = "", *, timeout_s: float, security: Security = NONE,
                 options: Sequence[tuple[str, object]] = (), wait_for_ready: bool = False) -> Health:
    """One ``Health/Check`` of ``service`` ("" is the server as a whole) at ``address`` over a fresh channel
    (``security``'s TLS and token, ``options``), closed before returning. Never raises ``grpc.RpcError``.
    ``wait_for_ready``: a port not open yet (a daemon starting) is waited for up to ``timeout_s`` instead of
    answering UNAVAILABLE at once."""
    channel = security.channel(address, options)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout_s, wait_for_ready=wait_for_ready)
    except grpc.RpcError as err:
        return Health(err.code(), health_pb2.HealthCheckResponse.UNKNOWN)
    finally:
        channel.close()
    return Health(grpc.StatusCode.OK, reply.status)
