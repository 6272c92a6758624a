"""``tigana.ps.rpc.guard``, the one error guard of the servers' handlers, without sockets: a domain error, a
bug and a malformed request each abort with their status and the class name and epoch as trailing metadata;
``ready`` refuses before the handler runs; ``observe`` counts every call once; streaming handlers alike."""

from __future__ import annotations

import logging

import grpc
import pytest

from tigana.ps import rpc
from tigana.ps.errors import EPOCH_KEY, ERROR_KEY, TableNotFound, Unavailable

log = logging.getLogger("tigana.test.guard")


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.metadata: tuple = ()
        self.code: grpc.StatusCode | None = None

    def set_trailing_metadata(self, metadata) -> None:
        self.metadata = tuple(metadata)

    def abort(self, code: grpc.StatusCode, message: str):
        self.code, self.message = code, message
        raise Aborted(message)


class Service:
    serving = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def _ready(self, method: str) -> None:
        if not self.serving:
            raise Unavailable(f"{method}: not serving")

    def _observe(self, method: str, code: str, seconds: float) -> None:
        assert seconds >= 0
        self.calls.append((method, code))

    @rpc.guard("Get", log, epoch=lambda service: 7, ready=_ready, observe=_observe)
    def Get(self, request, context):
        if request == "missing":
            raise TableNotFound("table 'x' does not exist")
        if request == "bug":
            raise KeyError("oops")
        return f"got {request}"

    @rpc.guard("Stream", log, epoch=lambda service: 7, ready=_ready, observe=_observe)
    def Stream(self, request, context):
        yield 1
        if request == "bug":
            raise KeyError("oops")
        yield 2


def test_an_answer_passes_through_and_is_counted_ok() -> None:
    service, context = Service(), Context()
    assert service.Get("a", context) == "got a" and context.code is None
    assert list(service.Stream("a", context)) == [1, 2]
    assert service.calls == [("Get", "OK"), ("Stream", "OK")]
    assert service.Get.__name__ == "Get"


@pytest.mark.parametrize(("request_", "code", "name"), [
    ("missing", grpc.StatusCode.NOT_FOUND, "TableNotFound"),
    ("bug", grpc.StatusCode.INTERNAL, "Internal"),
    (rpc.Malformed("Get", "truncated"), grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument"),
])
def test_errors_become_statuses_with_trailing_metadata(request_, code, name, caplog) -> None:
    service, context = Service(), Context()
    with caplog.at_level(logging.ERROR, logger=log.name), pytest.raises(Aborted):
        service.Get(request_, context)
    assert context.code == code
    assert dict(context.metadata) == {ERROR_KEY: name, EPOCH_KEY: "7"}
    assert service.calls == [("Get", code.name)]
    assert bool(caplog.records) == (code == grpc.StatusCode.INTERNAL)  # only a bug is logged


def test_ready_refuses_before_the_handler_and_streams_are_guarded() -> None:
    service, context = Service(), Context()
    service.serving = False
    with pytest.raises(Aborted):
        service.Get("a", context)
    assert context.code == grpc.StatusCode.UNAVAILABLE and "Get: not serving" in context.message
    service.serving = True
    stream = service.Stream("bug", context)
    assert next(stream) == 1
    with pytest.raises(Aborted):
        next(stream)
    assert context.code == grpc.StatusCode.INTERNAL
    assert service.calls == [("Get", "UNAVAILABLE"), ("Stream", "INTERNAL")]
