"""Server-side gRPC plumbing shared by the shard service, the scheduler and ``tigana serve``: registration with
request deserializers that never fail, and the one error guard of their handlers (``guard``).

A request that does not parse (random bytes, a truncated message, a wrong wire type) is handed to the
handler as a ``Malformed`` value instead of making gRPC answer INTERNAL ("exception deserializing
request"), so the handler's one error path answers INVALID_ARGUMENT with a message naming the method.

``guard`` is that error path: every exception a handler raises becomes a gRPC status (``errors.to_status``)
with the class name and the map epoch as trailing metadata (``errors.status_metadata``); a bug answers
INTERNAL, is logged with its traceback, and the daemon keeps serving.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor, message_factory

from tigana.ps.errors import InvalidArgument, status_metadata, to_status


class Malformed:
    """A request that could not be decoded: the method it was sent to and why."""

    __slots__ = ("method", "why")

    def __init__(self, method: str, why: str) -> None:
        self.method, self.why = method, why

    def error(self) -> InvalidArgument:
        return InvalidArgument(f"{self.method}: malformed request ({self.why[:200]})")


def check(request: Any) -> None:
    """Raise ``InvalidArgument`` for a request that could not be decoded."""
    if isinstance(request, Malformed):
        raise request.error()


def answer_status(exc: BaseException, method: str, log: logging.Logger) -> tuple[grpc.StatusCode, str]:
    """The status a server answers for ``exc`` (``errors.to_status``); a bug (INTERNAL) is logged on ``log``
    with its traceback as "``method`` failed with a bug"."""
    code, message = to_status(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed with a bug", method)
    return code, message


def guard(method: str, log: logging.Logger, *, epoch: Callable[[Any], int] = lambda servicer: 0,
          ready: Callable[[Any, str], None] | None = None,
          observe: Callable[[Any, str, str, float], None] | None = None) -> Callable[[Callable], Callable]:
    """Decorate a servicer's unary or server-streaming handler ``(self, request, context)``: raise for a
    ``Malformed`` request, call ``ready(self, method)`` (which raises while the servicer cannot serve), run
    the handler, and turn any exception into an aborted call with ``answer_status``'s status and the class
    name and ``epoch(self)`` as trailing metadata. ``observe(self, method, code name, seconds)`` is called
    once per call, "OK" included. A request never takes the daemon down.

    Example::

        @rpc.guard("Status", log, epoch=lambda service: service.epoch())
        def Status(self, request, context): ...
    """

    def start(servicer: Any, request: Any) -> None:
        check(request)
        if ready is not None:
            ready(servicer, method)

    def failed(servicer: Any, exc: Exception, context: grpc.ServicerContext) -> tuple[grpc.StatusCode, str]:
        code, message = answer_status(exc, method, log)
        context.set_trailing_metadata(status_metadata(exc, epoch(servicer)))
        return code, message

    def finish(servicer: Any, code: grpc.StatusCode | None, began: float) -> None:
        if observe is not None:
            observe(servicer, method, code.name if code else "OK", time.perf_counter() - began)

    def wrap(handler: Callable) -> Callable:
        if inspect.isgeneratorfunction(handler):
            @functools.wraps(handler)
            def streaming(servicer: Any, request: Any, context: grpc.ServicerContext) -> Any:
                began, code = time.perf_counter(), None
                try:
                    start(servicer, request)
                    yield from handler(servicer, request, context)
                except Exception as exc:  # noqa: BLE001 - a request never takes the daemon down
                    code, message = failed(servicer, exc, context)
                    context.abort(code, message)
                finally:
                    finish(servicer, code, began)
            return streaming

        @functools.wraps(handler)
        def unary(servicer: Any, request: Any, context: grpc.ServicerContext) -> Any:
            began, code = time.perf_counter(), None
            try:
                start(servicer, request)
                return handler(servicer, request, context)
            except Exception as exc:  # noqa: BLE001 - a request never takes the daemon down
                code, message = failed(servicer, exc, context)
            finally:
                finish(servicer, code, began)
            context.abort(code, message)
        return unary

    return wrap


def safe(deserializer: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the caller's malformed request
            return Malformed(method, f"{type(exc).__name__}: {exc}")
    return decode


def register(server: grpc.Server, service: descriptor.ServiceDescriptor, servicer: Any,
             overrides: Mapping[str, tuple[Callable, Callable[[bytes], Any], Callable[[Any], bytes]]] | None = None,
             *, guard: bool = False) -> None:
    """Register every method of ``service`` on ``server`` with safe deserializers. ``overrides`` gives a
    method its own (handler, deserializer, serializer). ``guard``: for a servicer that does not check for
    ``Malformed`` itself (gRPC's health and reflection services), answer INVALID_ARGUMENT before calling it."""
    overrides = overrides or {}
    handlers = {}
    for name, method in service.methods_by_name.items():
        handler, de, ser = overrides.get(name, (
            getattr(servicer, name), message_factory.GetMessageClass(method.input_type).FromString,
            message_factory.GetMessageClass(method.output_type).SerializeToString))
        if guard:
            handler = _guarded(handler, method.client_streaming)
        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(method.client_streaming, method.server_streaming)]
        handlers[name] = kind(handler, request_deserializer=safe(de, name), response_serializer=ser)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _guarded(handler: Callable, client_streaming: bool) -> Callable:
    if client_streaming:
        def streaming(requests, context: grpc.ServicerContext):
            def checked():
                for request in requests:
                    if isinstance(request, Malformed):
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))
                    yield request
            return handler(checked(), context)
        return streaming

    def unary(request, context: grpc.ServicerContext):
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))
        return handler(request, context)
    return unary


def add_health_and_reflection(server: grpc.Server, health_servicer: Any, service_names: Sequence[str]) -> None:
    """gRPC's health service and server reflection for ``service_names``, with safe deserializers (a
    malformed health check answers INVALID_ARGUMENT, like every other method)."""
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    register(server, health_pb2.DESCRIPTOR.services_by_name["Health"], health_servicer, guard=True)
    names = (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    register(server, reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
             reflection.ReflectionServicer(names), guard=True)
