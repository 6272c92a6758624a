"""What a ``Client`` is configured with: ``ClientConfig`` (deadlines, retries, message sizes, security,
transport) and ``Compression`` (a table's wire codecs per direction). Frozen dataclasses, checked when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tigana.ps import routing
from tigana.ps.channels import RetryPolicy
from tigana.ps.errors import InvalidArgument
from tigana.ps.security import Security
from tigana.ps.wire import data as wire

MiB = 1 << 20


@dataclass(frozen=True)
class ClientConfig:
    """Settings of a ``Client``; the defaults work for a local cluster and for training.

    timeout_s: deadline of each data-path RPC attempt (pull, push, describe...); admin_timeout_s: of
    snapshot and restore. Retries (UNAVAILABLE only, idempotent calls only): ``max_attempts`` tries with
    exponential backoff from ``initial_backoff_s`` up to ``max_backoff_s``. ``chunk_bytes``: the largest
    payload of one message; bigger batches are split (kept under the 4 MiB that many gRPC peers accept by
    default). ``max_message_bytes``: channel send/receive limit. ``max_pushes_in_flight``: push messages
    outstanding per server before ``push`` blocks (back-pressure). ``num_slots`` must match the servers'.
    ``tune_allocator``: at connect, raise glibc's mmap/trim thresholds for this process (process-wide, as
    ``tigana server`` does) so multi-MiB message buffers are reused instead of mapped and faulted in per call.
    With a scheduler: a data-path call is re-routed until ``failover_timeout_s`` passes; the map is
    long-polled ``map_poll_s`` at a time. Security: ``tls_ca`` verifies the servers (TLS), ``tls_cert``/
    ``tls_key`` is this client's certificate (mutual TLS), ``auth_token_file`` holds the token it sends
    (a trainer's, or the admin one for admin operations); a token needs TLS unless
    ``allow_insecure_loopback``. ``transport``: ``"stream"`` sends pulls and pushes as frames of one
    bidirectional stream per server (``tigana.ps.client.exchange``; falls back to unary calls for a server without
    it), ``"unary"`` as one RPC per message.
    """

    timeout_s: float = 60.0
    admin_timeout_s: float = 600.0
    max_attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    chunk_bytes: int = 4_000_000
    max_message_bytes: int = 64 * MiB
    max_pushes_in_flight: int = 8
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    reconnect_backoff_s: float = 0.1
    num_slots: int = routing.DEFAULT_NUM_SLOTS
    tune_allocator: bool = True
    failover_timeout_s: float = 60.0
    map_poll_s: float = 10.0
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token_file: str | None = None
    allow_insecure_loopback: bool = False
    transport: str = "stream"

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidArgument:
            return InvalidArgument(f"client config: field {name!r} {why}, got {getattr(self, name)!r}")

        for name in ("timeout_s", "admin_timeout_s", "keepalive_time_s", "keepalive_timeout_s",
                     "reconnect_backoff_s", "failover_timeout_s", "map_poll_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0")
        if self.max_attempts < 1:
            raise bad("max_attempts", "must be >= 1")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise bad("initial_backoff_s", "must be in [0, max_backoff_s]")
        if self.chunk_bytes < 4096:
            raise bad("chunk_bytes", "must be >= 4096")
        if self.max_message_bytes < self.chunk_bytes + 64 * 1024:
            raise bad("max_message_bytes", "must exceed chunk_bytes by at least 64KiB")
        if self.transport not in ("stream", "unary"):
            raise bad("transport", "must be 'stream' or 'unary'")
        if self.max_pushes_in_flight < 1:
            raise bad("max_pushes_in_flight", "must be >= 1")
        if self.num_slots < 1:
            raise bad("num_slots", "must be >= 1")

    def security(self) -> Security:
        return Security.of_files(tls_cert=self.tls_cert, tls_key=self.tls_key, tls_ca=self.tls_ca,
                                 token_file=self.auth_token_file, allow_insecure=self.allow_insecure_loopback)

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(self.max_attempts, self.initial_backoff_s, self.max_backoff_s)


@dataclass(frozen=True)
class Compression:
    """Wire codec of a table per direction: ``pull`` for the rows servers send, ``push`` for the gradients
    the client sends. One of none (fp32), fp16, bf16, int8 (row-wise scale)."""

    pull: str = "none"
    push: str = "none"

    @classmethod
    def of(cls, value: Any, *, table: str) -> Compression:
        """Accepts None, a codec name for both directions, a dict {pull:, push:}, or a Compression."""
        if value is None:
            out = cls()
        elif isinstance(value, Compression):
            out = value
        elif isinstance(value, str):
            out = cls(value, value)
        elif isinstance(value, dict):
            unknown = sorted(set(value) - {"pull", "push"})
            if unknown:
                raise InvalidArgument(f"table {table!r}: field 'compression' has unknown keys {unknown}; "
                                      "expected 'pull' and/or 'push'")
            out = cls(value.get("pull", "none"), value.get("push", "none"))
        else:
            raise InvalidArgument(f"table {table!r}: field 'compression' must be a codec name, a dict or "
                                  f"Compression, got {type(value).__name__}")
        for direction in ("pull", "push"):
            name = getattr(out, direction)
            if name not in wire.CODECS:
                raise InvalidArgument(f"table {table!r}: field 'compression.{direction}' is {name!r}; "
                                      f"expected one of {sorted(wire.CODECS)}")
        return out
