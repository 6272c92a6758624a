"""Server-side gRPC plumbing shared by the shard service and the scheduler: registration with request
deserializers that never fail.

A request that does not parse (random bytes, a truncated message, a wrong wire type) is handed to the
handler as a ``Malformed`` value instead of making gRPC answer INTERNAL ("exception deserializing
request"), so the handler's one error path answers INVALID_ARGUMENT with a message naming the method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
             overrides: Mapping[str, tuple[Callable, Callable[[bytes], Any], Callable[[Any], bytes]]] | None = None
             ) -> None:
    """Register every method of ``service`` on ``server`` with safe deserializers. ``overrides`` gives a
    method its own (handler, deserializer, serializer)."""
    overrides = overrides or {}
    handlers = {}
    for name, method in service.methods_by_name.items():
        handler, de, ser = overrides.get(name, (
            getattr(servicer, name), message_factory.GetMessageClass(method.input_type).FromString,
            message_factory.GetMessageClass(method.output_type).SerializeToString))
        kind = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = kind(handler, request_deserializer=safe(de, name), response_serializer=ser)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
