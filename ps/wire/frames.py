"""The frames of the streaming data path (``Shard/Exchange``), written and read without protobuf objects.

An ``ExchangeRequest`` is a frame id, a ``PullRequest`` or ``PushRequest`` and the client's remaining deadline;
an ``ExchangeResponse`` repeats the id and carries the ``PullResponse``/``PushResponse`` or an error (status
code, message, error class, epoch). As on the unary path (``wire``), ids and rows are copied once on the way
out (one join of header and payload) and read as views of the received message on the way in.

Bundles: frames queued together travel as one message, an ``ExchangeRequest`` whose ``bundle`` holds them
(``bundle``), and the answers ready together go back the same way (``bundle_answer``). A gRPC message costs
more CPU on both sides than a small pull's table work, and a step of a model with many tables sends one frame
per table and server at once. Each frame in a bundle keeps its own id, deadline and answer.

Multi-table frames: a bundle still costs a decode, a pass and an answer per frame. A frame may instead carry
several tables' parts for its server (``ExchangeRequest.pulls``/``pushes``, kinds ``PULLS``/``PUSHES``,
``request_many``): one id, one deadline, one answer holding each part's reply or error in order
(``ExchangeResponse.parts``, ``many_answer``; read back as an ``Answer`` whose reply is the list of the
parts' answers). A non-zero code on the frame itself refuses all of it (nothing applied).
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import PSError, from_status, status_metadata, to_status
from tigana.ps.rpc import Malformed
from tigana.ps.wire import data as wire

EXCHANGE = "/tigana.v1.Shard/Exchange"  # the stream's method
PULL, PUSH = 2, 3  # the oneof field numbers of both frames
BUNDLE, BUNDLE_ANSWER = 5, 8  # ExchangeRequest.bundle, ExchangeResponse.bundle
PULLS, PUSHES = 6, 7  # ExchangeRequest.pulls, .pushes: a multi-table frame's parts
PARTS = 9  # ExchangeResponse.parts: a multi-table frame's answers, one per part
KINDS = {PULL: "Pull", PUSH: "Push", PULLS: "Pull", PUSHES: "Push"}  # the method a frame counts as
MANY = {PULL: PULLS, PUSH: PUSHES}  # a single-table kind -> its multi-table kind
_STATUS = {c.value[0]: c for c in grpc.StatusCode}


# --- client -> server -----------------------------------------------------------------------------------
def request(frame_id: int, timeout_ms: int, kind: int, parts: list) -> bytes:
    """An ``ExchangeRequest`` around a request in pieces (``wire.pull_request_parts``/``push_request_parts``),
    joined in one copy."""
    head = [wire.varint_field(1, frame_id)]
    tail = [wire.varint_field(4, timeout_ms)] if timeout_ms else []
    return b"".join(head + wire.len_field_parts(kind, parts) + tail)


def request_many(frame_id: int, timeout_ms: int, kind: int, parts: list[list]) -> bytes:
    """A multi-table ``ExchangeRequest`` (``kind`` PULL or PUSH) around several requests in pieces, each one
    table's part for this server, joined in one copy."""
    field_no = MANY[kind]
    head = [wire.varint_field(1, frame_id)]
    tail = [wire.varint_field(4, timeout_ms)] if timeout_ms else []
    return b"".join(head + [p for part in parts for p in wire.len_field_parts(field_no, part)] + tail)


class Frame:
    """A received ``ExchangeRequest``: its id, kind (PULL/PUSH, or PULLS/PUSHES for a multi-table frame),
    request (``pb.PullRequest``, push views from ``wire.decode_push_request``, a list of them for a
    multi-table frame, or ``Malformed``) and deadline budget in ms (0: none)."""

    __slots__ = ("id", "kind", "request", "timeout_ms")

    def __init__(self, frame_id: int, kind: int, req: Any, timeout_ms: int) -> None:
        self.id, self.kind, self.request, self.timeout_ms = frame_id, kind, req, timeout_ms


def bundle(raws: list[bytes]) -> bytes:
    """Serialized frames as one ``ExchangeRequest`` (its ``bundle``)."""
    return b"".join([p for raw in raws for p in wire.len_field_parts(BUNDLE, [raw])])


def bundle_answer(answers: list[bytes]) -> bytes:
    """Serialized answers as one ``ExchangeResponse`` (its ``bundle``)."""
    return b"".join([p for raw in answers for p in wire.len_field_parts(BUNDLE_ANSWER, [raw])])


def read_request(raw: bytes | memoryview, *, nested: bool = False) -> Frame | Malformed | list[Frame | Malformed]:
    """A serialized ``ExchangeRequest`` -> ``Frame``, or the list of its frames for a bundle. A frame whose id
    parses but whose request does not is a ``Frame`` holding ``Malformed`` (answered INVALID_ARGUMENT under
    its id); one that does not parse at all is ``Malformed`` (the stream is ended with INVALID_ARGUMENT:
    there is no id to answer)."""
    try:
        frame_id, kind, body, timeout_ms = 0, 0, None, 0
        parts: list[memoryview] = []
        many: dict[int, list[memoryview]] = {PULLS: [], PUSHES: []}
        for field_no, value in wire.message_fields(memoryview(raw), "ExchangeRequest"):
            if field_no == BUNDLE and isinstance(value, memoryview) and not nested:
                parts.append(value)
            elif field_no == 1 and isinstance(value, int):
                frame_id = value & 0xFFFFFFFFFFFFFFFF
            elif field_no in (PULL, PUSH) and isinstance(value, memoryview):
                kind, body = field_no, value
            elif field_no in (PULLS, PUSHES) and isinstance(value, memoryview):
                many[field_no].append(value)
            elif field_no == 4 and isinstance(value, int):
                timeout_ms = value & 0xFFFFFFFF
            elif field_no in (1, PULL, PUSH, 4, BUNDLE, PULLS, PUSHES):
                raise ValueError(f"field {field_no} has the wrong wire type" if not nested or field_no != BUNDLE
                                 else "a bundle inside a bundle")
        if parts and (frame_id or body is not None or many[PULLS] or many[PUSHES]):
            raise ValueError("a bundle carries frames only")
    except (PSError, ValueError) as exc:
        return Malformed("Exchange", str(exc))
    if parts:
        return [read_request(part, nested=True) for part in parts]  # type: ignore[misc]
    if many[PULLS] or many[PUSHES]:
        return _read_many(frame_id, body is not None, many, timeout_ms)
    if body is None:
        return Frame(frame_id, PULL, Malformed("Exchange", "frame carries neither pull nor push"), timeout_ms)
    try:
        req = pb.PullRequest.FromString(bytes(body)) if kind == PULL else wire.decode_push_request(body)
    except Exception as exc:  # noqa: BLE001 - the client's malformed request
        req = Malformed(KINDS[kind], f"{type(exc).__name__}: {exc}")
    return Frame(frame_id, kind, req, timeout_ms)


def _read_many(frame_id: int, single: bool, many: dict[int, list[memoryview]], timeout_ms: int) -> Frame:
    """A multi-table frame: its parts decoded as single-table frames' requests are. A frame that mixes pulls,
    pushes or a single-table request, or one part that does not parse, makes the whole frame ``Malformed``
    (answered INVALID_ARGUMENT under its id, nothing of it applied)."""
    kind = PULLS if many[PULLS] else PUSHES
    if single or (many[PULLS] and many[PUSHES]):
        return Frame(frame_id, kind, Malformed("Exchange", "a multi-table frame carries pulls or pushes only, "
                                               "not both nor a single-table request"), timeout_ms)
    reqs: list = []
    for i, body in enumerate(many[kind]):
        try:
            reqs.append(pb.PullRequest.FromString(bytes(body)) if kind == PULLS else wire.decode_push_request(body))
        except Exception as exc:  # noqa: BLE001 - the client's malformed request
            field = "pulls" if kind == PULLS else "pushes"
            return Frame(frame_id, kind, Malformed(KINDS[kind], f"field {field!r} part {i}: {type(exc).__name__}: "
                                                   f"{exc}; nothing of the frame applied"), timeout_ms)
    return Frame(frame_id, kind, reqs, timeout_ms)


# --- server -> client -----------------------------------------------------------------------------------
def pull_answer(frame_id: int, rows: np.ndarray, codec: int) -> bytes:
    """The answer to a pull frame: its rows in ``codec``, in one copy."""
    return b"".join([wire.varint_field(1, frame_id)] + wire.len_field_parts(PULL, wire.pull_response_parts(rows, codec)))


def push_answer(frame_id: int, response: pb.PushResponse) -> bytes:
    return pb.ExchangeResponse(id=frame_id, push=response).SerializeToString()


def many_answer(frame_id: int, parts: list[bytes]) -> bytes:
    """The answer to a multi-table frame: each part's answer (``pull_answer``/``push_answer``/``error_answer``
    made with id 0), in the order of its parts."""
    return b"".join([wire.varint_field(1, frame_id)] +
                    [p for raw in parts for p in wire.len_field_parts(PARTS, [raw])])


def error_answer(frame_id: int, exc: BaseException, epoch: int) -> bytes:
    """The answer to a frame that failed: what the unary call's status and trailing metadata would carry."""
    code, message = to_status(exc)
    meta = dict(status_metadata(exc, epoch))
    return pb.ExchangeResponse(id=frame_id, code=code.value[0], message=message,
                               error=meta.get("tigana-error", ""), epoch=epoch).SerializeToString()


class Answer:
    """A received ``ExchangeResponse``: the frame id and either the reply (``wire.RawRows`` views for a pull,
    ``pb.PushResponse`` for a push, the list of the parts' ``Answer`` objects for a multi-table frame) or the
    error."""

    __slots__ = ("id", "reply", "error")

    def __init__(self, frame_id: int, reply: Any, error: PSError | None) -> None:
        self.id, self.reply, self.error = frame_id, reply, error


def read_answers(raw: bytes, address: str = "") -> list[Answer]:
    """A serialized ``ExchangeResponse``, one answer or a bundle of them -> its answers
    (``InvalidArgument`` when it does not parse)."""
    parts = [v for f, v in wire.message_fields(memoryview(raw), "ExchangeResponse") if f == BUNDLE_ANSWER]
    if not parts:
        return [read_answer(raw, address)]
    return [read_answer(part, address) for part in parts]


def read_answer(raw: bytes | memoryview, address: str = "") -> Answer:
    """A serialized ``ExchangeResponse`` -> ``Answer`` (``InvalidArgument`` when it does not parse)."""
    frame_id, kind, body, code, message, error, epoch = 0, 0, None, 0, "", "", 0
    parts: list[memoryview] = []
    for field_no, value in wire.message_fields(memoryview(raw), "ExchangeResponse"):
        if field_no == PARTS:
            parts.append(value)
        elif field_no == 1:
            frame_id = int(value)
        elif field_no in (PULL, PUSH):
            kind, body = field_no, value
        elif field_no == 4:
            code = int(value)
        elif field_no == 5:
            message = str(value, "utf-8", "replace")
        elif field_no == 6:
            error = str(value, "utf-8", "replace")
        elif field_no == 7:
            epoch = int(value)
    if code:
        status = _STATUS.get(code, grpc.StatusCode.UNKNOWN)
        if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and address:
            message = f"{address}: {message}"
        meta = [("tigana-error", error)] if error else []
        if epoch:
            meta.append(("tigana-epoch", str(epoch)))
        return Answer(frame_id, None, from_status(status, message, meta))
    if parts:
        return Answer(frame_id, [read_answer(part, address) for part in parts], None)
    if kind == PULL:
        return Answer(frame_id, wire.decode_pull_response(body), None)
    return Answer(frame_id, pb.PushResponse.FromString(bytes(body or b"")), None)
