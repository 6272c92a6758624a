"""Errors users of the parameter server can act on, and their one mapping to and from gRPC status codes.

    PSError
    ├── Unavailable        UNAVAILABLE         server unreachable after retries (names the address)
    │   └── NotEnoughReplicas                  fewer in-sync copies of a slot than the table's min_copies
    ├── DeadlineExceeded   DEADLINE_EXCEEDED   a call ran past its deadline
    ├── TableNotFound      NOT_FOUND           unknown table
    ├── TableExists        ALREADY_EXISTS      create_table with a different spec under the same name
    ├── InvalidArgument    INVALID_ARGUMENT    bad ids/grads/dims/config; nothing was applied
    ├── WrongShard         FAILED_PRECONDITION ids for slots this server does not lead at the caller's epoch
    ├── PushExpired        ABORTED             a retried push older than the exactly-once window
    │   └── UnknownClient                      a push from a client the window may have forgotten: a new session
    ├── Unauthenticated    UNAUTHENTICATED     no credential, or one the server does not accept
    ├── PermissionDenied   PERMISSION_DENIED   a trainer's credential on an admin operation
    ├── ResourceExhausted  RESOURCE_EXHAUSTED  memory/LMDB/disk full, message too large, too many requests
    ├── DataLoss           DATA_LOSS           a corrupt store or snapshot
    └── Internal           INTERNAL            a bug; the daemon keeps serving

Servers raise these (or storage-engine errors) and ``to_status`` turns them into a status; the client turns
every ``grpc.RpcError`` into one of these with ``from_rpc_error`` and never leaks a raw gRPC error. A status
also carries trailing metadata: ``tigana-error`` names the class (so a subclass sharing its parent's code,
such as ``NotEnoughReplicas``, comes back as itself) and ``tigana-epoch`` the server's shard map epoch (a
``WrongShard`` tells the client how new a map it must fetch).
"""

from __future__ import annotations

import grpc

from tigana.embeddings import errors as storage


class PSError(Exception):
    """Base of every parameter-server error. ``epoch``: the answering server's shard map epoch (0: unknown)."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, *args: object, epoch: int = 0, answered: bool = False) -> None:
        super().__init__(*args)
        self.epoch = epoch
        self.answered = answered  # a server answered with this status (not a lost connection or deadline)


class Unavailable(PSError):
    code = grpc.StatusCode.UNAVAILABLE


class NotEnoughReplicas(Unavailable):
    """A sync push to a slot with fewer in-sync copies than the table's ``min_copies``: rejected, nothing
    applied (retried by the client until a copy catches up or its deadline passes)."""


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


class PushExpired(PSError):
    code = grpc.StatusCode.ABORTED


class UnknownClient(PushExpired):
    """A push from a client id the table's exactly-once window does not know and may have forgotten (its
    session stamp is at or below the window's horizon, see ``tigana.ps.session``): refused, nothing applied
    for the request. Like Kafka's UNKNOWN_PRODUCER_ID: a client whose earlier attempts of the push were all
    refused (so none applied it) starts a new session above ``horizon`` and sends it again; otherwise the push
    may have been applied, and it fails like ``PushExpired``."""

    @property
    def horizon(self) -> int:
        """The window's horizon, read from the message (``horizon=N``); 0 when absent."""
        text = str(self)
        at = text.find("horizon=")
        if at < 0:
            return 0
        digits = text[at + 8:].split(maxsplit=1)[0].rstrip(").,;:")
        return int(digits) if digits.isdigit() else 0


class Unauthenticated(PSError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(PSError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(PSError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLoss(PSError):
    code = grpc.StatusCode.DATA_LOSS


class Internal(PSError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[PSError]] = {
    cls.code: cls
    for cls in (Unavailable, DeadlineExceeded, TableNotFound, TableExists, InvalidArgument, WrongShard,
                PushExpired, Unauthenticated, PermissionDenied, ResourceExhausted, DataLoss, Internal)
}
_BY_NAME: dict[str, type[PSError]] = {cls.__name__: cls for cls in (*_BY_CODE.values(), NotEnoughReplicas,
                                                                      UnknownClient)}
ERROR_KEY, EPOCH_KEY = "tigana-error", "tigana-epoch"

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


def status_metadata(exc: BaseException, epoch: int = 0) -> tuple[tuple[str, str], ...]:
    """Trailing metadata a server sends with the status of ``exc``: its class name and the map epoch."""
    name = type(exc).__name__ if isinstance(exc, PSError) else _BY_CODE.get(to_status(exc)[0], Internal).__name__
    out = ((ERROR_KEY, name),)
    return out + (((EPOCH_KEY, str(epoch)),) if epoch else ())


def from_status(code: grpc.StatusCode, message: str, metadata: object = ()) -> PSError:
    """The client-side exception for a status (and its trailing metadata, when the server sent some)."""
    meta = dict(metadata or ())
    cls = _BY_NAME.get(str(meta.get(ERROR_KEY, "")))
    if cls is None or cls.code != code:
        cls = _BY_CODE.get(code, Internal)
    try:
        epoch = int(meta.get(EPOCH_KEY, 0))
    except ValueError:
        epoch = 0
    return cls(message, epoch=epoch, answered=ERROR_KEY in meta)


def from_rpc_error(err: grpc.RpcError, address: str = "") -> PSError:
    """Translate a raw gRPC error; UNAVAILABLE and DEADLINE_EXCEEDED messages name the server address."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and address:
        details = f"{address}: {details}"
    try:
        metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else ()
    except Exception:  # noqa: BLE001 - some error objects cannot produce metadata
        metadata = ()
    return from_status(code, details or code.name, metadata)
