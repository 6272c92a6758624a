"""gRPC channels to shard servers and one asynchronous call with deadline and retries.

Every RPC the client makes goes through ``Call``: a ``.future()`` call with an explicit deadline, retried with
exponential backoff and jitter only on UNAVAILABLE and only when the caller marks it idempotent; the outcome
(a response or a ``PSError`` translated by ``errors.from_rpc_error``) goes to one callback. No thread waits on
a call: completion runs on gRPC's callback thread, and a retry is a timer.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from tigana.ps.errors import Internal, PSError, Unavailable, from_rpc_error


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts and backoff of idempotent calls that fail with UNAVAILABLE."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def delay(self, attempt: int) -> float:
        """Seconds before attempt ``attempt + 1`` (attempt counts from 1), with ±20% jitter."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * random.uniform(0.8, 1.2)


CONNECT_TIMEOUT_S = 20.0  # gRPC's own default: the slowest link our timeouts tolerate, TLS included, fits


def reconnect_options(backoff_s: float = 0.1, max_backoff_s: float = 1.0,
                      connect_timeout_s: float = CONNECT_TIMEOUT_S) -> list[tuple[str, int]]:
    """gRPC's reconnect settings, the same for every channel of ours: a short backoff, so that a retry
    reaches a restarted server soon, and ``connect_timeout_s`` for each connection attempt.

    gRPC core reads ``grpc.min_reconnect_backoff_ms`` as the least time it gives one connection attempt (its
    MIN_CONNECT_TIMEOUT), not as a floor of the backoff. It used to be set to the backoff (100 ms): then no
    connection whose handshake took longer (a link with a round trip over ~0.1 s, or TLS over half that)
    could ever be made. A replication stream that reconnected over a slow link failed for good, and its
    copies were demoted (the slow-link fault's flaky demotion)."""
    return [("grpc.initial_reconnect_backoff_ms", max(1, int(backoff_s * 1000))),
            ("grpc.min_reconnect_backoff_ms", max(1, int(connect_timeout_s * 1000))),
            ("grpc.max_reconnect_backoff_ms", max(1, int(max(backoff_s, max_backoff_s) * 1000)))]


def channel_options(max_message_bytes: int, keepalive_time_s: float, keepalive_timeout_s: float,
                    reconnect_backoff_s: float) -> list[tuple[str, Any]]:
    """Options of every client channel: message sizes, keepalive, and a short reconnect backoff so that
    our own retries reach a restarted server instead of failing fast on a channel still backing off."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        *reconnect_options(reconnect_backoff_s, max_backoff_s=2.0),
        ("grpc.enable_retries", 0),  # retries are ours: only UNAVAILABLE, only idempotent calls
        ("grpc.use_local_subchannel_pool", 1),
    ]


Done = Callable[[Any, "PSError | None"], None]


class Call:
    """One logical RPC to one server: ``start()`` issues it; ``done(response, error)`` is called exactly once.

    Thread-safety: a Call is started once; its callback runs on a gRPC or timer thread.
    """

    __slots__ = ("method", "request", "address", "timeout_s", "retry", "done", "attempt", "on_retry", "future",
                 "cancelled")

    def __init__(self, method: grpc.UnaryUnaryMultiCallable, request: Any, address: str, timeout_s: float,
                 retry: RetryPolicy | None, done: Done, on_retry: Callable[[], None] | None = None) -> None:
        self.method, self.request, self.address = method, request, address
        self.timeout_s, self.retry, self.done, self.on_retry = timeout_s, retry, done, on_retry
        self.attempt = 0
        self.future: grpc.Future | None = None
        self.cancelled = False

    def start(self) -> None:
        self.attempt += 1
        try:
            future = self.method.future(self.request, timeout=self.timeout_s)
        except grpc.RpcError as err:  # pragma: no cover - gRPC reports call errors through the future
            self._finish(None, from_rpc_error(err, self.address))
            return
        except ValueError as exc:  # the channel was closed
            self._finish(None, Unavailable(f"{self.address}: client closed ({exc})"))
            return
        self.future = future
        future.add_done_callback(self._on_done)
        if self.cancelled:
            future.cancel()

    def cancel(self) -> None:
        """Give up on the call (its server was declared dead): ``done`` gets ``Unavailable``."""
        self.cancelled = True
        if self.future is not None:
            self.future.cancel()

    def _on_done(self, future: grpc.Future) -> None:
        try:
            response = future.result()
        except grpc.FutureCancelledError:
            why = "the server was declared dead" if self.cancelled else "client closed"
            self._finish(None, Unavailable(f"{self.address}: call cancelled ({why})"))
            return
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            if code == grpc.StatusCode.UNAVAILABLE and self.retry is not None \
                    and self.attempt < self.retry.max_attempts:
                if self.on_retry is not None:
                    self.on_retry()
                timer = threading.Timer(self.retry.delay(self.attempt), self.start)
                timer.daemon = True
                timer.start()
                return
            error = from_rpc_error(err, self.address)
            if isinstance(error, Unavailable) and self.attempt > 1:
                error = Unavailable(f"{error} (after {self.attempt} attempts)")
            self._finish(None, error)
            return
        except Exception as exc:  # noqa: BLE001 - a callback thread must never raise
            self._finish(None, Internal(f"{self.address}: {type(exc).__name__}: {exc}"))
            return
        self._finish(response, None)

    def _finish(self, response: Any, error: PSError | None) -> None:
        self.request = None  # free the payload as soon as the call is over
        self.done(response, error)
