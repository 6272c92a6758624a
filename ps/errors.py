"""Errors users of the parameter server can act on, and their one mapping to and from gRPC status codes.

    PSError
    ├── Unavailable        UNAVAILABLE         server unreachable after retries (names the address)
    ├── DeadlineExceeded   DEADLINE_EXCEEDED   a call ran past its deadline
    ├── TableNotFound      NOT_FOUND           unknown table
    ├── TableExists        ALREADY_EXISTS      create_table with a different spec under the same name
    ├── InvalidArgument    INVALID_ARGUMENT    bad ids/grads/dims/config; nothing was applied
    ├── WrongShard         FAILED_PRECONDITION ids for slots this server does not own
    ├── ResourceExhausted  RESOURCE_EXHAUSTED  memory/LMDB/disk full, message too large, too many requests
    ├── DataLoss           DATA_LOSS           a corrupt store or snapshot
    └── Internal           INTERNAL            a bug; the daemon keeps serving

Servers raise these (or storage-engine errors) and ``to_status`` turns them into a status; the client turns
every ``grpc.RpcError`` into one of these with ``from_rpc_error`` and never leaks a raw gRPC error.
"""

from __future__ import annotations

import grpc

from tigana.embeddings import errors as storage


class PSError(Exception):
    """Base of every parameter-server error."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class Unavailable(PSError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PSError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class TableNotFound(PSError, KeyError):
    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class TableExists(PSError):
    code = grpc.StatusCode.ALREADY_EXISTS


class InvalidArgument(PSError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class WrongShard(PSError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(PSError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLoss(PSError):
    code = grpc.StatusCode.DATA_LOSS


class Internal(PSError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[PSError]] = {
    cls.code: cls
    for cls in (Unavailable, DeadlineExceeded, TableNotFound, TableExists, InvalidArgument, WrongShard,
                ResourceExhausted, DataLoss, Internal)
}

# Storage-engine errors as the server reports them.
_FROM_STORAGE: list[tuple[type[Exception], grpc.StatusCode]] = [
    (storage.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (storage.StorageFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (storage.CorruptStore, grpc.StatusCode.DATA_LOSS),
    (storage.SnapshotNotFound, grpc.StatusCode.NOT_FOUND),
    (storage.StorageError, grpc.StatusCode.INTERNAL),
]


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a server answers for ``exc`` (unknown exceptions are INTERNAL)."""
    if isinstance(exc, PSError):
        return exc.code, str(exc)
    for cls, code in _FROM_STORAGE:
        if isinstance(exc, cls):
            return code, str(exc)
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {exc}"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def from_status(code: grpc.StatusCode, message: str) -> PSError:
    """The client-side exception for a status."""
    return _BY_CODE.get(code, Internal)(message)


def from_rpc_error(err: grpc.RpcError, address: str = "") -> PSError:
    """Translate a raw gRPC error; UNAVAILABLE and DEADLINE_EXCEEDED messages name the server address."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and address:
        details = f"{address}: {details}"
    return from_status(code, details or code.name)
