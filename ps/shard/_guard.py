"""The error guard of the shard server's handlers: ``_rpc``, the shard server's settings of ``rpc.guard``.

Every exception a handler raises becomes a gRPC status (through ``errors.to_status``), with the class name and
this server's epoch as trailing metadata; a bug answers INTERNAL and the server keeps serving. Every call is
refused while the server is not serving (``check_serving``), timed and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tigana.ps import rpc
from tigana.ps.errors import Unavailable

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server

_STATES = {"loading": "is loading its tables", "failed": "failed to load its tables (see its log)",
           "closed": "is shut down"}


def check_serving(server: Any, method: str) -> None:
    """Raise ``Unavailable`` naming ``method`` while ``server`` (its ``state``) is loading, failed or shut down."""
    if server.state != "serving":
        raise Unavailable(f"{method}: server {_STATES.get(server.state, server.state)}")


def _observe(server: Any, method: str, code: str, seconds: float) -> None:
    server.metrics.observe(method, code, seconds)


def _rpc(method: str) -> Callable[[Callable], Callable]:
    """Wrap a unary or server-streaming handler (``rpc.guard``): refuse while not serving, time it, count it,
    turn any exception into a status (with the class name and this server's epoch as trailing metadata)."""
    return rpc.guard(method, log, epoch=lambda server: server.epoch, ready=check_serving, observe=_observe)
