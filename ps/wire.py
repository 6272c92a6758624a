"""The one place that converts between protobuf messages and numpy arrays / dataclasses.

Ids travel as little-endian int64 bytes; rows as float32, float16, bfloat16 or int8 with a float32 scale
per row. Decoders validate lengths and raise ``InvalidArgument`` naming the table and field.
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings import config as cfg
from tigana.embeddings.errors import InvalidArgument as StorageInvalidArgument
from tigana.proto import shard_pb2 as pb
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
        return pb.Rows(codec=codec, dim=dim, data=rows.astype("<f2").tobytes())
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
    if len(msg.data) != n * dim * itemsize:
        raise InvalidArgument(
            f"table {table!r}: field {field!r} has {len(msg.data)} bytes, expected {n}x{dim}x{itemsize}")
    if msg.codec == pb.CODEC_FP32:
        return np.frombuffer(msg.data, "<f4").reshape(n, dim)
    if msg.codec == pb.CODEC_FP16:
        return np.frombuffer(msg.data, "<f2").astype(np.float32).reshape(n, dim)
    if msg.codec == pb.CODEC_BF16:
        return _from_bf16(np.frombuffer(msg.data, "<u2")).reshape(n, dim)
    if len(msg.scales) != 4 * n:
        raise InvalidArgument(f"table {table!r}: field {field!r}.scales has {len(msg.scales)} bytes, expected {4 * n}")
    scales = np.frombuffer(msg.scales, "<f4")
    return np.frombuffer(msg.data, np.int8).reshape(n, dim).astype(np.float32) * scales[:, None]


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
        admission=pb.Admission(min_count=c.admission.min_count, probability=c.admission.probability),
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
        admission=cfg.Admission(min_count=s.admission.min_count, probability=s.admission.probability or 1.0),
        eviction=cfg.Eviction(ttl_steps=s.eviction.ttl_steps or None, ttl_seconds=s.eviction.ttl_seconds or None,
                              max_rows=s.eviction.max_rows or None, policy=policy),  # type: ignore[arg-type]
        memory_budget=s.memory_budget_bytes or None,
    )
