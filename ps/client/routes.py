"""Where the client sends: the shard servers as it sees them, and routes.

A ``Route`` is one routing snapshot: the map epoch, the servers, and for every slot its primary. A batch is
deduplicated and bucketed by slot in one pass (slots ordered by primary, so each server's ids are one
contiguous range, and within it each slot's), then cut into messages at slot boundaries under
``chunk_bytes``, one message per server unless a batch is larger. A ``Server`` sends a message as a frame of
its ``Exchange`` stream (``exchange``), or as a unary call (``ClientConfig.transport``, or a server without
streams), and holds the push permits that bound the pushes in flight to it.

Thread-safety: a ``Server`` may be used from any thread; a ``Route`` is immutable once built.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc as pb_grpc
from tigana.ps import _kernels, routing
from tigana.ps.channels import Call
from tigana.ps.client.exchange import Exchange
from tigana.ps.errors import PSError
from tigana.ps.wire import data as wire
from tigana.ps.wire import frames

_PULL = "/tigana.v1.Shard/Pull"
_PUSH = "/tigana.v1.Shard/Push"


class Server:
    """One shard server as the client sees it: its channel, the data path (an ``Exchange`` stream, or the
    unary callables) and its push permits (at most ``max_pushes_in_flight`` push messages outstanding)."""

    __slots__ = ("address", "channel", "stub", "pull", "push", "exchange", "permits", "calls", "lock")

    def __init__(self, address: str, options: list, max_pushes_in_flight: int, security: Any = None, *,
                 stream: bool = True) -> None:
        self.address = address
        self.channel = security.channel(address, options) if security is not None else \
            grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.ShardStub(self.channel)
        self.pull = self.channel.unary_unary(_PULL, request_serializer=wire.identity,
                                             response_deserializer=wire.decode_pull_response)
        self.push = self.channel.unary_unary(_PUSH, request_serializer=wire.identity,
                                             response_deserializer=pb.PushResponse.FromString)
        self.exchange = Exchange(self.channel, address) if stream else None
        self.permits = threading.BoundedSemaphore(max_pushes_in_flight)
        self.calls: set[Call] = set()
        self.lock = threading.Lock()

    def send(self, kind: int, parts: list, timeout_s: float, done: Callable[[Any, PSError | None], None],
             on_retry: Callable[[], None]) -> None:
        """One data-path request (``frames.PULL``/``PUSH``, a single attempt) in pieces: a frame of the stream,
        or a unary call tracked so ``cancel_all`` can give up on it."""
        if self.exchange is not None and self.exchange.supported:
            self.exchange.send(kind, parts, timeout_s, done)
            return
        holder: list[Call] = []

        def finished(response: Any, error: PSError | None) -> None:
            with self.lock:
                self.calls.discard(holder[0])
            done(response, error)

        method = self.pull if kind == frames.PULL else self.push
        call = Call(method, b"".join(parts), self.address, timeout_s, None, finished, on_retry)
        holder.append(call)
        with self.lock:
            self.calls.add(call)
        call.start()

    def send_many(self, items: list[tuple[int, list, Callable[[Any, PSError | None], None]]], timeout_s: float,
                  on_retry: Callable[[], None]) -> None:
        """Requests (kind, pieces, done) made together: one message on the stream (a bundle), or unary calls."""
        if self.exchange is not None and self.exchange.supported:
            self.exchange.send_many(items, timeout_s)
            return
        for kind, parts, done in items:
            self.send(kind, parts, timeout_s, done, on_retry)

    def cancel_all(self) -> int:
        """Cancel the calls and frames in flight (the map declared this server dead: a paused one would hold
        them until their deadline); they are routed again by the new map."""
        with self.lock:
            calls = list(self.calls)
        for call in calls:
            call.cancel()
        return len(calls) + (self.exchange.cancel_all() if self.exchange is not None else 0)

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
        self.channel.close()


class Route:
    """Where every slot's primary is, at one map epoch: ``primary_of_slot[s]`` is the index in ``servers`` of slot
    s's primary (-1: no primary now)."""

    def __init__(self, epoch: int, servers: Sequence[Server | None], primary_of_slot: np.ndarray) -> None:
        self.epoch = epoch
        self.servers = list(servers)
        self.primary_of_slot = np.asarray(primary_of_slot, np.int64)
        self.num_slots = int(self.primary_of_slot.shape[0])
        self.key_of_slot, self.primary_starts = routing.group_keys(self.primary_of_slot, len(self.servers))

    def group(self, ids: np.ndarray, grads: np.ndarray | None = None) -> tuple:
        """One pass over a batch: unique ids bucketed by slot key (primary, then slot). Pull: (uniq, starts,
        src) with ids == uniq[src]; push: (uniq, sums, starts, finite). ``starts`` bounds each key's range."""
        if grads is None:
            return _kernels.dedup_grouped(ids, self.key_of_slot, self.num_slots)
        return _kernels.dedup_sum_grouped(ids, grads, self.key_of_slot, self.num_slots)

    def parts(self, starts: np.ndarray, row_bytes: int, chunk_bytes: int) -> list[tuple[int, int, int]]:
        """(primary, lo, hi) of every message: each primary's range of the grouped batch, cut at slot
        boundaries into chunks of at most ``chunk_bytes`` (a single slot larger than that is one message).
        Primary -1 covers the ids whose slot has no primary."""
        per = max(1, chunk_bytes // (8 + row_bytes))
        out = []
        for o in range(len(self.servers) + 1):
            k0, k1 = int(self.primary_starts[o]), int(self.primary_starts[o + 1])
            lo, hi = int(starts[k0]), int(starts[k1])
            if lo == hi:
                continue
            primary = o if o < len(self.servers) else -1
            if hi - lo <= per:
                out.append((primary, lo, hi))
                continue
            bounds = starts[k0:k1 + 1]
            while lo < hi:
                cut = int(bounds[np.searchsorted(bounds, lo + per, side="right") - 1])
                if cut <= lo:  # one slot above the chunk size: send it whole
                    cut = int(bounds[np.searchsorted(bounds, lo, side="right")])
                out.append((primary, lo, cut))
                lo = cut
        return out
