"""The one place that converts between protobuf messages and numpy arrays / dataclasses.

Ids travel as little-endian int64 bytes; rows as float32, float16, bfloat16 or int8 with a float32 scale
per row. Decoders validate lengths and raise ``InvalidArgument`` naming the table and field.
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings import config as cfg
from tigana.embeddings.errors import InvalidArgument as StorageInvalidArgument
from tigana.proto import shard_pb2 as pb
from tigana.ps import _kernels
from tigana.ps.errors import InvalidArgument

CODECS = {"fp32": pb.CODEC_FP32, "fp16": pb.CODEC_FP16, "bf16": pb.CODEC_BF16, "int8": pb.CODEC_INT8,
          "none": pb.CODEC_FP32}
_ITEMSIZE = {pb.CODEC_FP32: 4, pb.CODEC_FP16: 2, pb.CODEC_BF16: 2, pb.CODEC_INT8: 1}


def codec_of(name: str) -> int:
    """The wire codec for a user-facing name (none/fp32, fp16, bf16, int8)."""
    try:
        return CODECS[name]
    except KeyError:
        raise InvalidArgument(f"compression: unknown codec {name!r}; expected one of {sorted(CODECS)}") from None


# --- ids ------------------------------------------------------------------------------------------------
def encode_ids(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def decode_ids(data: bytes, *, table: str, field: str = "ids") -> np.ndarray:
    if len(data) % 8:
        raise InvalidArgument(f"table {table!r}: field {field!r} has {len(data)} bytes, not a multiple of 8 (int64)")
    return np.frombuffer(data, dtype="<i8")


# --- rows -----------------------------------------------------------------------------------------------
def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_rows(rows: np.ndarray, codec: int = pb.CODEC_FP32) -> pb.Rows:
    """(n, dim) float32 -> Rows message in ``codec``."""
    rows = np.asarray(rows, dtype=np.float32)
    dim = rows.shape[1] if rows.ndim == 2 else 0
    if codec == pb.CODEC_FP32:
        return pb.Rows(codec=codec, dim=dim, data=np.ascontiguousarray(rows, "<f4").tobytes())
    if codec == pb.CODEC_FP16:
        return pb.Rows(codec=codec, dim=dim, data=encode_block(rows, codec)[0].tobytes())
    if codec == pb.CODEC_BF16:
        return pb.Rows(codec=codec, dim=dim, data=_to_bf16(rows).astype("<u2").tobytes())
    if codec == pb.CODEC_INT8:
        scale = np.abs(rows).max(axis=1) / 127.0 if rows.size else np.zeros(len(rows), np.float32)
        safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(np.rint(rows / safe[:, None]), -127, 127).astype(np.int8)
        return pb.Rows(codec=codec, dim=dim, data=q.tobytes(), scales=scale.astype("<f4").tobytes())
    raise InvalidArgument(f"rows: unknown codec {codec}")


def decode_rows(msg: pb.Rows, n: int, dim: int, *, table: str, field: str = "rows") -> np.ndarray:
    """Rows message -> (n, dim) float32, checking the codec, dim and byte lengths against n and dim."""
    itemsize = _ITEMSIZE.get(msg.codec)
    if itemsize is None:
        raise InvalidArgument(f"table {table!r}: field {field!r} has unknown codec {msg.codec}")
    if msg.dim != dim:
        raise InvalidArgument(f"table {table!r}: field {field!r} has dim {msg.dim}, table dim is {dim}")
    data = msg.data  # protobuf copies a bytes field on every access: read it once
    if len(data) != n * dim * itemsize:
        raise InvalidArgument(
            f"table {table!r}: field {field!r} has {len(data)} bytes, expected {n}x{dim}x{itemsize}")
    if msg.codec == pb.CODEC_FP32:
        return np.frombuffer(data, "<f4").reshape(n, dim)
    if msg.codec == pb.CODEC_FP16:
        return _kernels.f16_to_f32(np.frombuffer(data, "<u2")).reshape(n, dim)
    if msg.codec == pb.CODEC_BF16:
        return _from_bf16(np.frombuffer(data, "<u2")).reshape(n, dim)
    scales = msg.scales
    if len(scales) != 4 * n:
        raise InvalidArgument(f"table {table!r}: field {field!r}.scales has {len(scales)} bytes, expected {4 * n}")
    return np.frombuffer(data, np.int8).reshape(n, dim).astype(np.float32) * np.frombuffer(scales, "<f4")[:, None]


def rows_nbytes(n: int, dim: int, codec: int) -> int:
    """Bytes ``n`` rows take on the wire in ``codec`` (for chunking)."""
    return n * dim * _ITEMSIZE[codec] + (4 * n if codec == pb.CODEC_INT8 else 0)


# --- table specs ----------------------------------------------------------------------------------------
def spec_to_pb(c: cfg.TableConfig) -> pb.TableSpec:
    ev = c.eviction
    return pb.TableSpec(
        name=c.name, dim=c.dim,
        optimizer=pb.Component(kind=c.optimizer.kind, params=c.optimizer.params()),
        initializer=pb.Component(kind=c.initializer.kind, params=c.initializer.params()),
        seed=c.seed, dtype=c.dtype,
        admission=pb.Admission(min_count=c.admission.min_count, probability=c.admission.probability,
                               max_tracked=c.admission.max_tracked),
        eviction=pb.Eviction(ttl_steps=ev.ttl_steps or 0, ttl_seconds=ev.ttl_seconds or 0.0,
                             max_rows=ev.max_rows or 0, policy=ev.policy),
        memory_budget_bytes=c.memory_budget or 0,
    )


def spec_from_pb(s: pb.TableSpec) -> cfg.TableConfig:
    """TableSpec -> TableConfig; unknown optimizer/initializer kinds or params raise InvalidArgument."""
    where = f"table {s.name!r}"
    if not s.name:
        raise InvalidArgument("table spec: field 'name' is empty")
    if s.dim < 1:
        raise InvalidArgument(f"{where}: field 'dim' must be >= 1, got {s.dim}")
    try:
        optimizer = cfg.from_kind(cfg.OPTIMIZERS, s.optimizer.kind or "sgd", dict(s.optimizer.params),
                                  what=f"{where}: field 'optimizer'")
        initializer = cfg.from_kind(cfg.INITIALIZERS, s.initializer.kind or "normal", dict(s.initializer.params),
                                    what=f"{where}: field 'initializer'")
    except StorageInvalidArgument as exc:
        raise InvalidArgument(str(exc)) from None
    if s.dtype not in ("", "float32", "float16", "bfloat16"):
        raise InvalidArgument(f"{where}: field 'dtype' must be float32, float16 or bfloat16, got {s.dtype!r}")
    policy = s.eviction.policy or "lru"
    if policy not in ("lru", "lfu"):
        raise InvalidArgument(f"{where}: field 'eviction.policy' must be 'lru' or 'lfu', got {policy!r}")
    return cfg.TableConfig(
        name=s.name, dim=s.dim, optimizer=optimizer, initializer=initializer, seed=s.seed,
        dtype=s.dtype or "float32",  # type: ignore[arg-type]
        admission=cfg.Admission(
            min_count=s.admission.min_count,
            probability=s.admission.probability if s.admission.HasField("probability") else 1.0,
            max_tracked=s.admission.max_tracked or cfg.Admission.max_tracked),
        eviction=cfg.Eviction(ttl_steps=s.eviction.ttl_steps or None, ttl_seconds=s.eviction.ttl_seconds or None,
                              max_rows=s.eviction.max_rows or None, policy=policy),  # type: ignore[arg-type]
        memory_budget=s.memory_budget_bytes or None,
    )


# --- the client's hot path: Pull/Push messages encoded and decoded without protobuf objects ---------------
# A 16 MiB row block costs three copies through protobuf objects (tobytes, message field, SerializeToString);
# writing the wire format by hand joins the numpy buffers into the request in one copy, and a Pull reply is
# parsed into zero-copy views of the received bytes. Both are byte-compatible with the shard_pb2 messages
# (tests/ps/test_wire.py checks them against protobuf).
_WT_VARINT, _WT_I64, _WT_LEN, _WT_I32 = 0, 1, 2, 5


def _varint(n: int) -> bytes:
    if 0 <= n < _SMALL_VARINTS:
        return _SMALL[n]  # tags, lengths and counts: a pull and a push frame make about 30 of them
    return _varint_slow(n)


def _varint_slow(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL_VARINTS = 1 << 14  # every varint of one or two bytes, made once at import (2 ms; encoding a pull and a
_SMALL = [bytes((n,)) if n < 0x80 else bytes(((n & 0x7F) | 0x80, n >> 7))  # push frame of 500 ids: 14.8 us,
          for n in range(_SMALL_VARINTS)]  # against 18.2 with each varint built when needed)


def _len_field(field_no: int, payload) -> list:
    """Parts of a length-delimited field (tag, length, payload); payload is any C-contiguous buffer."""
    return [_varint((field_no << 3) | _WT_LEN), _varint(memoryview(payload).nbytes), payload]


def _varint_field(field_no: int, value: int) -> bytes:
    return _varint((field_no << 3) | _WT_VARINT) + _varint(value) if value else b""


def _buffer(a: np.ndarray) -> memoryview:
    a = np.ascontiguousarray(a)
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")


def encode_block(rows: np.ndarray, codec: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(n, dim) float32 -> (data, scales) little-endian numpy buffers in ``codec``; scales only for int8.

    fp16 saturates at ±65504 (so finite gradients stay finite); bf16 rounds to nearest even; int8 is
    symmetric per row with scale = max|row| / 127."""
    rows = np.asarray(rows, dtype=np.float32)
    if codec == pb.CODEC_FP32:
        return np.ascontiguousarray(rows, "<f4"), None
    if codec == pb.CODEC_FP16:
        out = np.empty(rows.shape, "<u2")  # half bits
        _kernels.f32_to_f16_bits(np.ascontiguousarray(rows).reshape(-1), out.reshape(-1))
        return out, None
    if codec == pb.CODEC_BF16:
        return _to_bf16(rows).astype("<u2", copy=False), None
    if codec == pb.CODEC_INT8:
        scale = (np.abs(rows).max(axis=1) / np.float32(127.0)).astype("<f4") if rows.size else \
            np.zeros(len(rows), "<f4")
        safe = np.where(scale > 0, scale, np.float32(1.0))
        q = np.clip(np.rint(rows / safe[:, None]), -127, 127).astype(np.int8)
        return q, scale
    raise InvalidArgument(f"rows: unknown codec {codec}")


def _rows_parts(codec: int, dim: int, data: np.ndarray, scales: np.ndarray | None) -> list:
    parts: list = [_varint_field(1, codec), _varint_field(2, dim)]
    parts += _len_field(3, _buffer(data))
    if scales is not None:
        parts += _len_field(4, _buffer(scales))
    return parts


def pull_request_parts(table: str, ids: np.ndarray, codec: int = pb.CODEC_FP32, epoch: int = 0,
                       read_only: bool = False, unseen: str = "") -> list:
    """The pieces of a serialized ``PullRequest`` (joined by ``encode_pull_request``, or framed first)."""
    parts = _len_field(1, table.encode()) + _len_field(2, _buffer(np.asarray(ids, "<i8")))
    parts += [_varint_field(3, codec), _varint_field(4, epoch), _varint_field(5, int(read_only))]
    return parts + _len_field(6, unseen.encode()) if unseen else parts


def encode_pull_request(table: str, ids: np.ndarray, codec: int = pb.CODEC_FP32, epoch: int = 0,
                        read_only: bool = False, unseen: str = "") -> bytes:
    """A serialized ``PullRequest`` for (n,) int64 ``ids`` (unique) asking for rows in ``codec``, routed at
    map ``epoch``; ``read_only`` inserts nothing, and its missing ids read as ``unseen`` says
    (``tigana.embeddings.unseen``; empty: their initial rows)."""
    return b"".join(pull_request_parts(table, ids, codec, epoch, read_only, unseen))


def push_request_parts(table: str, ids: np.ndarray, codec: int, dim: int, data: np.ndarray,
                       scales: np.ndarray | None, client_id: str, seq: int, part: int, epoch: int = 0) -> list:
    """The pieces of a serialized ``PushRequest`` (see ``encode_push_request``)."""
    rows = _rows_parts(codec, dim, data, scales)
    parts = _len_field(1, table.encode()) + _len_field(2, _buffer(np.asarray(ids, "<i8")))
    parts += [_varint((3 << 3) | _WT_LEN), _varint(parts_nbytes(rows)), *rows]
    parts += _len_field(4, client_id.encode())
    return parts + [_varint_field(5, seq), _varint_field(6, part), _varint_field(7, epoch)]


def encode_push_request(table: str, ids: np.ndarray, codec: int, dim: int, data: np.ndarray,
                        scales: np.ndarray | None, client_id: str, seq: int, part: int, epoch: int = 0) -> bytes:
    """A serialized ``PushRequest``: (n,) int64 ``ids`` and their gradient block from ``encode_block``, routed
    at map ``epoch``."""
    return b"".join(push_request_parts(table, ids, codec, dim, data, scales, client_id, seq, part, epoch))


def pull_response_parts(rows: np.ndarray, codec: int = pb.CODEC_FP32) -> list:
    """The pieces of a serialized ``PullResponse`` for (n, dim) float32 rows (see ``encode_pull_response``)."""
    rows = np.asarray(rows, dtype=np.float32)
    data, scales = encode_block(rows, codec)
    parts = _rows_parts(codec, rows.shape[1] if rows.ndim == 2 else 0, data, scales)
    return [_varint((1 << 3) | _WT_LEN), _varint(parts_nbytes(parts)), *parts]


def encode_pull_response(rows: np.ndarray, codec: int = pb.CODEC_FP32) -> bytes:
    """A serialized ``PullResponse`` for (n, dim) float32 rows, in one copy (for a server that registers Pull
    with a bytes response serializer; ``pb.PullResponse(rows=encode_rows(...))`` costs ~4 copies)."""
    return b"".join(pull_response_parts(rows, codec))  # one copy of the rows


def parts_nbytes(parts: list) -> int:
    """Bytes of a message in pieces (bytes, memoryviews, numpy buffers), without a view made per piece."""
    return sum([len(p) if type(p) is bytes else (p.nbytes if hasattr(p, "nbytes") else memoryview(p).nbytes)
                for p in parts])


def len_field_parts(field_no: int, parts: list) -> list:
    """``parts`` (a serialized message in pieces) as a length-delimited field of an enclosing message."""
    return [_varint((field_no << 3) | _WT_LEN), _varint(parts_nbytes(parts)), *parts]


def varint_field(field_no: int, value: int) -> bytes:
    return _varint_field(field_no, value)


def _read_varint(buf: memoryview, pos: int, what: str) -> tuple[int, int]:
    result = shift = 0
    end = len(buf)
    while True:
        if pos >= end or shift > 63:
            raise InvalidArgument(f"{what}: malformed message (truncated varint)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def message_fields(buf: memoryview, what: str):
    """Yield (field number, value) of a serialized message: int for scalar wire types, a view for LEN."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos, what)
        field_no, wire_type = key >> 3, key & 7
        if wire_type == _WT_VARINT:
            value, pos = _read_varint(buf, pos, what)
        elif wire_type == _WT_LEN:
            n, pos = _read_varint(buf, pos, what)
            if pos + n > end:
                raise InvalidArgument(f"{what}: malformed message (field {field_no} overruns the buffer)")
            value, pos = buf[pos:pos + n], pos + n
        elif wire_type == _WT_I64:
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire_type == _WT_I32:
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        else:
            raise InvalidArgument(f"{what}: malformed message (wire type {wire_type})")
        if pos > end:
            raise InvalidArgument(f"{what}: malformed message (truncated field {field_no})")
        yield field_no, value


class RawRows:
    """A decoded ``Rows`` block as zero-copy views of the received message (see ``decode_pull_response``)."""

    __slots__ = ("codec", "dim", "data", "scales", "nbytes")

    def __init__(self, codec: int, dim: int, data: memoryview, scales: memoryview, nbytes: int) -> None:
        self.codec, self.dim, self.data, self.scales, self.nbytes = codec, dim, data, scales, nbytes

    def to_pb(self) -> pb.Rows:
        return pb.Rows(codec=self.codec, dim=self.dim, data=bytes(self.data), scales=bytes(self.scales))


def parse_rows(buf: memoryview, nbytes: int, what: str) -> RawRows:
    codec, dim, data, scales = 0, 0, memoryview(b""), memoryview(b"")
    for field_no, value in message_fields(buf, what):
        if field_no == 1:
            codec = value
        elif field_no == 2:
            dim = value
        elif field_no == 3:
            data = value
        elif field_no == 4:
            scales = value
    return RawRows(codec, dim, data, scales, nbytes)


def decode_pull_response(raw: bytes) -> RawRows:
    """A serialized ``PullResponse`` -> its rows as views (no copy); used as the gRPC response deserializer."""
    view = memoryview(raw)
    rows = memoryview(b"")
    for field_no, value in message_fields(view, "PullResponse"):
        if field_no == 1:
            rows = value
    return parse_rows(rows, len(raw), "PullResponse.rows")


class RawPush:
    """A ``PushRequest`` parsed into zero-copy views of the received bytes (see ``decode_push_request``); the
    same attribute names as the protobuf message, so the server reads either."""

    __slots__ = ("table", "ids", "grads", "client_id", "seq", "part", "epoch")

    def __init__(self, table: str, ids: memoryview, grads: RawRows, client_id: str, seq: int, part: int,
                 epoch: int = 0) -> None:
        self.table, self.ids, self.grads, self.client_id, self.seq, self.part = table, ids, grads, client_id, seq, part
        self.epoch = epoch


class _NotCanonical(Exception):
    """A message the fast parser leaves to protobuf (wrong wire type, repeated sub-message, bad UTF-8...)."""


def _signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def _len_value(value, field_no: int) -> memoryview:
    if not isinstance(value, memoryview):
        raise _NotCanonical(field_no)
    return value


def _int_value(value, field_no: int) -> int:
    if isinstance(value, memoryview):
        raise _NotCanonical(field_no)
    return value


def _parse_push(raw: bytes | memoryview) -> RawPush:
    view = memoryview(raw)
    table, ids, client_id, seq, part, epoch = "", memoryview(b""), "", 0, 0, 0
    codec = dim = 0
    data = scales = memoryview(b"")
    seen_grads = False
    for field_no, value in message_fields(view, "PushRequest"):
        if field_no == 1:
            table = str(_len_value(value, 1), "utf-8")
        elif field_no == 2:
            ids = _len_value(value, 2)
        elif field_no == 3:
            if seen_grads:  # protobuf merges repeated sub-messages
                raise _NotCanonical(3)
            seen_grads = True
            for f, v in message_fields(_len_value(value, 3), "PushRequest.grads"):
                if f == 1:
                    codec = _signed32(_int_value(v, f))
                elif f == 2:
                    dim = _int_value(v, f) & 0xFFFFFFFF
                elif f == 3:
                    data = _len_value(v, f)
                elif f == 4:
                    scales = _len_value(v, f)
        elif field_no == 4:
            client_id = str(_len_value(value, 4), "utf-8")
        elif field_no == 5:
            seq = _int_value(value, 5) & 0xFFFFFFFFFFFFFFFF
        elif field_no == 6:
            part = _int_value(value, 6) & 0xFFFFFFFF
        elif field_no == 7:
            epoch = _int_value(value, 7) & 0xFFFFFFFFFFFFFFFF
    return RawPush(table, ids, RawRows(codec, dim, data, scales, len(raw)), client_id, seq, part, epoch)


def decode_push_request(raw: bytes | memoryview) -> RawPush | pb.PushRequest:
    """A serialized ``PushRequest`` -> ``RawPush`` views (no copy of ids or rows; protobuf copies every bytes
    field on every access). Used by the server as the Push request deserializer; anything the fast parser does
    not take as is (unknown wire types, a repeated sub-message, invalid UTF-8, truncation) goes to protobuf,
    so the server accepts and rejects exactly what ``pb.PushRequest.FromString`` does."""
    try:
        return _parse_push(raw)
    except (_NotCanonical, InvalidArgument, UnicodeDecodeError):
        return pb.PushRequest.FromString(bytes(raw) if isinstance(raw, memoryview) else raw)


def decode_block(rows: RawRows | pb.Rows, n: int, dim: int, *, table: str, field: str = "rows") -> np.ndarray:
    """A received block -> (n, dim) float32, validating codec, dim and byte lengths (InvalidArgument naming
    table and field). fp32 comes back as a read-only view of the message, other codecs as a new array."""
    codec = rows.codec
    itemsize = _ITEMSIZE.get(codec)
    if itemsize is None:
        raise InvalidArgument(f"table {table!r}: field {field!r} has unknown codec {codec}")
    if rows.dim != dim and n:
        raise InvalidArgument(f"table {table!r}: field {field!r} has dim {rows.dim}, table dim is {dim}")
    data = rows.data
    nbytes = memoryview(data).nbytes
    if nbytes != n * dim * itemsize:
        raise InvalidArgument(
            f"table {table!r}: field {field!r} has {nbytes} bytes, expected {n}x{dim}x{itemsize}")
    if codec == pb.CODEC_FP32:
        return np.frombuffer(data, "<f4").reshape(n, dim)
    if codec == pb.CODEC_FP16:
        return _kernels.f16_to_f32(np.frombuffer(data, "<u2")).reshape(n, dim)
    if codec == pb.CODEC_BF16:
        return _from_bf16(np.frombuffer(data, "<u2")).reshape(n, dim)
    if memoryview(rows.scales).nbytes != 4 * n:
        raise InvalidArgument(
            f"table {table!r}: field {field!r}.scales has {memoryview(rows.scales).nbytes} bytes, expected {4 * n}")
    scales = np.frombuffer(rows.scales, "<f4")
    return np.frombuffer(data, np.int8).reshape(n, dim).astype(np.float32) * scales[:, None]


def identity(raw: bytes) -> bytes:
    """Serializer for requests the client encoded itself."""
    return raw
