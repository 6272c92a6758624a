"""Server-side gRPC plumbing shared by the shard service and the scheduler: registration with request
deserializers that never fail.

A request that does not parse (random bytes, a truncated message, a wrong wire type) is handed to the
handler as a ``Malformed`` value instead of making gRPC answer INTERNAL ("exception deserializing
request"), so the handler's one error path answers INVALID_ARGUMENT with a message naming the method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor, message_factory

from tigana.ps.errors import InvalidArgument


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
