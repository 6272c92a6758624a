"""The error guard of the shard server's unary handlers: ``_rpc``.

Every exception a handler raises becomes a gRPC status here (through ``errors.to_status``), with the class
name and this server's epoch as trailing metadata; a bug answers INTERNAL and the server keeps serving.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from tigana.ps import rpc
from tigana.ps.errors import Unavailable, status_metadata, to_status
from tigana.ps.shard._fields import ShardFields

log = logging.getLogger("tigana.ps.server")  # one logger for the whole shard server

_STATES = {"loading": "is loading its tables", "failed": "failed to load its tables (see its log)",
           "closed": "is shut down"}


def _rpc(method: str) -> Callable:
    """Wrap a handler: refuse while not serving, time it, count it, turn any exception into a status (with
    the class name and this server's epoch as trailing metadata)."""

    def wrap(handler: Callable) -> Callable:
        @functools.wraps(handler)
        def wrapper(self: ShardFields, request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            status: grpc.StatusCode | None = None
            try:
                rpc.check(request)
                if self.state != "serving":
                    raise Unavailable(f"{method}: server {_STATES.get(self.state, self.state)}")
                return handler(self, request, context)
            except Exception as exc:  # noqa: BLE001 - a request never takes the daemon down
                status, message = to_status(exc)
                if status == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed with a bug", method)
                context.set_trailing_metadata(status_metadata(exc, self._view.epoch))
            finally:
                self.metrics.observe(method, status.name if status else "OK", time.perf_counter() - start)
            context.abort(status, message)

        return wrapper

    return wrap
