"""Pulls and pushes in flight: one operation per call, one part per message, re-routed until they settle.

An operation sends its parts along a ``Route`` (``routes``) and reassembles the replies in the order of the
ids. A part that fails with an error a new route can fix (``WrongShard``: the map moved; ``Unavailable``: the
server is down or failing over; ``NotEnoughReplicas``; a deadline) is not failed: its ids are routed again
by the newest map, after a short backoff and a map refresh, as a child operation whose result stands in for
the part's. A part still waiting when a newer map names another primary for one of its slots is given up
(``sentparts``) and routed again the same way, at once, its late answer ignored. Pushes keep their (client
id, seq) through any number of re-routes, and the servers apply exactly once per slot, so a retried push
never doubles. An operation fails only with an error that no route fixes, or when
``ClientConfig.failover_timeout_s`` (static lists: ``max_attempts``) runs out.

Thread-safety: operations complete on gRPC callback and timer threads; all shared state is locked.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent import futures as cf
from typing import Any

import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.ps import _kernels
from tigana.ps.client.ports import PushKeyed
from tigana.ps.client.routes import Route, Server
from tigana.ps.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotEnoughReplicas,
    PSError,
    TableNotFound,
    Unavailable,
    UnknownClient,
    WrongShard,
)
from tigana.ps.wire import data as wire
from tigana.ps.wire import frames

log = logging.getLogger("tigana.ps.client")


def retryable(error: PSError, clustered: bool) -> bool:
    """Whether a new attempt (routed again by the newest map) can succeed."""
    if isinstance(error, (Unavailable, DeadlineExceeded)):
        return True
    return clustered and isinstance(error, (WrongShard, TableNotFound))


class Fanout:
    """Counts the parts of an operation in flight and keeps the first error."""

    def __init__(self, parts: int) -> None:
        self.left = parts
        self.error: PSError | None = None
        self.lock = threading.Lock()

    def part_done(self, error: PSError | None) -> bool:
        """Record one part; True when this was the last part (whether or not all succeeded)."""
        with self.lock:
            self.left -= 1
            if error is not None and self.error is None:
                self.error = error
            return self.left == 0


def retry_plan(error: PSError, routed_epoch: int, attempt: int, clustered: bool, initial_backoff_s: float,
               max_backoff_s: float) -> tuple[float, int]:
    """When a failed part goes again: (backoff in seconds, the map epoch to go at as soon as the client has it;
    0: only the backoff). Backoff doubles with the attempts. A server that refused a part routed by a map
    newer than its own (``WrongShard`` at a lower epoch: it is installing that map, and was told to fetch it)
    is asked again soon, by the same map: waiting for a map newer than the client's, or a backoff grown over the
    attempts of a long rebalance, would hold the part for seconds after the last map of the rebalance."""
    if clustered and isinstance(error, WrongShard) and error.epoch < routed_epoch:
        return initial_backoff_s, 0
    delay = min(max_backoff_s, initial_backoff_s * (2 ** (attempt - 1)))
    return delay, (max(error.epoch, routed_epoch + 1) if clustered else 0)


# Answers that prove the server applied nothing of the request (refused before applying).
_NOTHING_APPLIED = (WrongShard, NotEnoughReplicas, UnknownClient)


class Attempt:
    """What a child operation inherits: the attempt number, the deadline, the last error, and ``refused``:
    whether every earlier attempt was answered with an error proving nothing was applied (so a push may
    be sent again under a new client session, see ``UnknownClient``)."""

    __slots__ = ("number", "deadline", "last", "refused")

    def __init__(self, number: int, deadline: float, last: PSError | None = None, refused: bool = True) -> None:
        self.number, self.deadline, self.last, self.refused = number, deadline, last, refused


def new_future() -> cf.Future:
    fut: cf.Future = cf.Future()
    fut.set_running_or_notify_cancel()  # results come from the wire; cancel() cannot stop a sent push
    return fut


class _Op:
    """Shared by pulls and pushes: send parts, re-route failed ones as child operations."""

    def __init__(self, client: Any, st: Any, fut: cf.Future, attempt: Attempt) -> None:
        self.client, self.st, self.fut, self.attempt = client, st, fut, attempt
        self.fanout: Fanout | None = None
        self.routed_epoch = 0

    def _send(self, server: Server, kind: int, request: list, route: Route, ids: np.ndarray,
              done: Callable[[Any, PSError | None], None]) -> None:
        """Send one part (``ids`` routed to ``server`` by ``route``); with a scheduler, watched so that a newer
        map moving its slots routes it again at once (``sentparts``), its late answer ignored."""
        c = self.client
        if c._maps is not None:
            tracked = c._parts.track(server, ids, route, done)
            if tracked is None:  # a newer map moved it before it was sent: routed again already
                return
            done = tracked
        held = getattr(c._hold, "frames", None)
        if held is not None:  # made with the other tables' parts of a step: sent together (``DataPath``)
            held.append((server, kind, request, done))
            return
        server.send(kind, request, c.config.timeout_s, done, c._note_retry)

    def _retry_or_fail(self, error: PSError, server: Server | None, again: Callable[[Attempt], cf.Future],
                       settle: Callable[[Any, PSError | None], None]) -> None:
        """Route the failed part again by a fresh map (a child op), or settle it with the error."""
        c = self.client
        a = self.attempt
        clustered = c._maps is not None
        now = c._ports.clock()
        dropped = isinstance(error, TableNotFound) and self.st.name in c._dropped  # by a map this client has
        if not retryable(error, clustered) or dropped or now >= a.deadline or \
                (not clustered and a.number >= c.config.max_attempts):
            if isinstance(error, Unavailable) and a.number > 1:
                error = type(error)(f"{error} (after {a.number} attempts)", epoch=error.epoch)
            elif dropped:
                error = TableNotFound(f"{error} (dropped: the map at epoch {c.epoch} has no table {self.st.name!r})")
            settle(None, error)
            return
        c._note_retry()
        delay, wanted = retry_plan(error, self.routed_epoch, a.number, clustered, c.config.initial_backoff_s,
                                   c.config.max_backoff_s)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("table %r: a part to %s failed at attempt %d (%s: %s); routed again by epoch >= %s or in "
                      "%.2fs", self.st.name, server.address if server is not None else "-", a.number,
                      type(error).__name__, str(error)[:200], wanted if wanted else "-", delay)
        child = Attempt(a.number + 1, a.deadline, error, a.refused and isinstance(error, _NOTHING_APPLIED))
        once = threading.Lock()

        def fire() -> None:
            if not once.acquire(blocking=False):  # the newer map or the backoff, whichever comes first
                return
            try:
                fut = again(child)
            except Exception as exc:  # noqa: BLE001 - a timer thread must never raise
                settle(None, exc if isinstance(exc, PSError) else Internal(f"re-route: {exc}"))
                return
            fut.add_done_callback(lambda f: settle(f.result() if f.exception() is None else None,
                                                   f.exception()))

        if clustered:
            if isinstance(error, Unavailable) and server is not None and not error.answered:
                c._maps.report_unreachable(server.address)  # the connection failed: perhaps it died
            if wanted:  # a map newer than the one this part was routed by may route it elsewhere: go as soon
                c._maps.refresh(wanted)  # as one is here
                c._when_epoch(wanted, fire)
        c._ports.call_later(delay, fire)


class PullOp(_Op):
    """One pull in flight: unique ids grouped by primary, one message per part; replies kept as decoded blocks
    (fp32: views of the received bytes) and gathered into the batch's rows by ``src`` when the last arrives."""

    def __init__(self, client: Any, st: Any, fut: cf.Future, ids: np.ndarray, shape: tuple[int, ...],
                 attempt: Attempt, read_only: bool = False, grouped: tuple | None = None, unseen: str = "") -> None:
        super().__init__(client, st, fut, attempt)
        self.ids, self.shape, self.read_only, self.unseen = ids, shape, read_only, unseen
        self.grouped = grouped  # (route, uniq, starts, src) when the caller grouped the ids already
        self.codec, self.dim = st.pull_codec, st.dim
        self.blocks: list[np.ndarray | None] = []

    def start(self) -> None:
        try:
            self._start()
        except Exception as exc:  # noqa: BLE001 - may run on a callback thread; the future carries it
            if not self.fut.done():
                self.fut.set_exception(exc if isinstance(exc, PSError) else Internal(f"pull: {exc}"))

    def _start(self) -> None:
        c, st = self.client, self.st
        grouped, self.grouped = self.grouped, None
        if grouped is not None and grouped[0] is c._route:  # (a pull held back by the staleness bound may
            route, self.uniq, starts, self.src = grouped     # start after a newer map: then it groups again)
        else:
            route = c._route
            self.uniq, starts, self.src = route.group(self.ids)
        self.routed_epoch = route.epoch
        parts = route.parts(starts, wire.rows_nbytes(1, self.dim, self.codec), c.config.chunk_bytes)
        self.fanout = Fanout(len(parts))
        self.blocks = [None] * len(parts)
        with st.lock:
            st.stale_last = len(st.pending)
            st.stale_max = max(st.stale_max, st.stale_last)
        sent = 0
        calls = []
        for k, (primary, lo, hi) in enumerate(parts):
            if primary < 0:
                err = Unavailable(f"table {st.name!r}: {hi - lo} id(s) in slots with no primary at epoch "
                                  f"{route.epoch} (failing over)", epoch=route.epoch)
                calls.append((None, None, k, lo, hi, err))
                continue
            s = route.servers[primary]
            request = wire.pull_request_parts(st.name, self.uniq[lo:hi], self.codec, route.epoch, self.read_only,
                                              self.unseen)
            sent += wire.parts_nbytes(request)
            calls.append((s, request, k, lo, hi, None))
        with st.lock:
            st.bytes["sent"]["pull"] += sent
        for s, request, k, lo, hi, err in calls:
            if s is None:
                self._done_for(k, lo, hi, None)(None, err)
            else:
                self._send(s, frames.PULL, request, route, self.uniq[lo:hi], self._done_for(k, lo, hi, s))

    def _gather(self) -> np.ndarray:
        """The batch's rows, (n, dim) float32, from the unique rows in ``blocks`` (consecutive ranges)."""
        blocks = self.blocks
        out = np.empty((self.src.size, self.dim), np.float32)
        words = _kernels.row_words
        if len(blocks) == 2:
            _kernels.gather_rows2(words(blocks[0]), words(blocks[1]), self.src, words(out))
        else:
            rows = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
            _kernels.gather_rows(words(rows), self.src, words(out))
        return out

    def _again(self, lo: int, hi: int) -> Callable[[Attempt], cf.Future]:
        def again(attempt: Attempt) -> cf.Future:
            fut = new_future()
            PullOp(self.client, self.st, fut, np.ascontiguousarray(self.uniq[lo:hi]), (hi - lo,), attempt,
                   self.read_only, unseen=self.unseen).start()
            return fut
        return again

    def _done_for(self, k: int, lo: int, hi: int, server: Server | None) -> Callable[[Any, PSError | None], None]:
        n = hi - lo

        def settle(block: np.ndarray | None, error: PSError | None) -> None:
            if error is None:
                self.blocks[k] = block
            assert self.fanout is not None
            if not self.fanout.part_done(error):
                return
            if self.fanout.error is not None:
                self.client._count(pull_errors=1)
                self.blocks = []
                self.fut.set_exception(self.fanout.error)
                return
            self.client._count(pulls=1, rows_pulled=int(self.src.size))
            try:
                rows = self._gather()
            except Exception as exc:  # noqa: BLE001 - a callback thread must never raise
                self.fut.set_exception(Internal(f"table {self.st.name!r}: pull reassembly: {exc}"))
                return
            finally:
                self.blocks = []  # free the replies
            self.fut.set_result(rows.reshape(self.shape + (self.dim,)))

        def done(response: wire.RawRows | None, error: PSError | None) -> None:
            block = None
            if error is None:
                try:
                    with self.st.lock:
                        self.st.bytes["received"]["pull"] += response.nbytes
                    block = wire.decode_block(response, n, self.dim, table=self.st.name, field="PullResponse.rows")
                except PSError as exc:
                    error = exc
                except Exception as exc:  # noqa: BLE001
                    error = InvalidArgument(f"table {self.st.name!r}: bad pull reply: {exc}")
            if error is not None:
                self._retry_or_fail(error, server, self._again(lo, hi), settle)
                return
            settle(block, None)
        return done


class PushOp(_Op):
    """One push in flight: its step in the table's pending set (top level only), one message per (primary,
    chunk) under the primary's permits, all carrying this push's (client_id, seq), fixed when the push starts
    (a retry keeps its key even if the client starts a new session meanwhile). The future settles only
    when every part has (so ``flush`` and the staleness waits never return early).

    A part refused with ``UnknownClient`` (the server's exactly-once window may have forgotten this client
    session) is sent again under a new session and seq when every attempt of it was refused before applying
    anything; otherwise it may have been applied, and the push fails with that error."""

    def __init__(self, client: Any, st: Any, fut: cf.Future, uniq: np.ndarray, summed: np.ndarray,
                 starts: np.ndarray | None, route: Route | None, seq: int, attempt: Attempt,
                 *, top: bool = True, client_id: str | None = None, permit: bool = True,
                 first: tuple[str, int] | None = None) -> None:
        super().__init__(client, st, fut, attempt)
        self.permit = permit  # False: the caller holds one permit for a whole bundle (``DataPath.push_many``)
        self.uniq, self.summed, self.starts, self.route, self.seq = uniq, summed, starts, route, seq
        self.client_id: str = client_id if client_id is not None else client.client_id
        self.first = first if first is not None else (self.client_id, seq)  # the key the push started with
        if top and client._ports.on_push is not None:
            client._ports.on_push(PushKeyed(st.name, self.client_id, seq, uniq))
        self.top = top
        self.rows = int(uniq.size)
        self.applied = 0
        self.lock = threading.Lock()
        self.step = 0

    def start(self) -> None:
        c, st = self.client, self.st
        if self.route is None:  # a re-routed part: group again by the newest route
            self.route = c._route
            self.uniq, self.summed, self.starts, _ = self.route.group(self.uniq, self.summed)
        route = self.route
        self.routed_epoch = route.epoch
        codec, dim = st.push_codec, st.dim
        parts = route.parts(self.starts, wire.rows_nbytes(1, dim, codec), c.config.chunk_bytes)
        self.fanout = Fanout(len(parts))
        if self.top:
            with st.lock:
                st.step += 1
                self.step = st.step
                st.pending[self.step] = self.fut
        index = {}
        for primary, lo, hi in parts:
            if primary < 0:
                self._done_for(None, lo, hi)(None, Unavailable(
                    f"table {st.name!r}: {hi - lo} id(s) in slots with no primary at epoch {route.epoch} "
                    "(failing over)", epoch=route.epoch))
                continue
            s = route.servers[primary]
            part = index[primary] = index.get(primary, -1) + 1  # chunk index within the server (informational)
            try:
                data, scales = wire.encode_block(self.summed[lo:hi], codec)
                request = wire.push_request_parts(st.name, self.uniq[lo:hi], codec, dim, data, scales,
                                                  self.client_id, self.seq, part, route.epoch)
            except Exception as exc:  # noqa: BLE001 - settle the part, so flush cannot hang
                error = exc if isinstance(exc, PSError) else Internal(f"table {st.name!r}: push encoding: {exc}")
                self._done_for(None, lo, hi)(None, error)
                continue
            del data, scales
            with st.lock:
                st.bytes["sent"]["push"] += wire.parts_nbytes(request)
            if self.permit:
                s.permits.acquire()  # back-pressure: at most max_pushes_in_flight messages per server
            self._send(s, frames.PUSH, request, route, self.uniq[lo:hi], self._done_for(s, lo, hi))

    def _again(self, lo: int, hi: int, client_id: str | None = None) -> Callable[[Attempt], cf.Future]:
        """A child op for the part [lo, hi): the same key, or (``client_id``) a new session and seq."""
        def again(attempt: Attempt) -> cf.Future:  # this part is unsettled, so the op's arrays are alive
            uniq, summed = np.ascontiguousarray(self.uniq[lo:hi]), np.ascontiguousarray(self.summed[lo:hi])
            fut = new_future()
            if client_id is None:
                cid, seq = self.client_id, self.seq
            else:
                cid, seq = client_id, self.client._next_seq()
                on_push = self.client._ports.on_push
                if on_push is not None:
                    on_push(PushKeyed(self.st.name, cid, seq, uniq, self.first))
            PushOp(self.client, self.st, fut, uniq, summed, None, None, seq, attempt, top=False,
                   client_id=cid, first=self.first).start()
            return fut
        return again

    def _new_session(self, error: UnknownClient, lo: int, hi: int,
                     settle: Callable[[Any, PSError | None], None]) -> bool:
        """Send the part again under a new client session, if no attempt of it can have been applied."""
        a = self.attempt
        if not a.refused or self.client._ports.clock() >= a.deadline:
            return False
        cid = self.client._new_session(self.client_id, error.horizon)
        self.client._note_retry()
        try:
            fut = self._again(lo, hi, cid)(Attempt(a.number + 1, a.deadline, error, True))
        except Exception as exc:  # noqa: BLE001 - settle the part, so flush cannot hang
            settle(None, exc if isinstance(exc, PSError) else Internal(f"push: new session: {exc}"))
            return True
        fut.add_done_callback(lambda f: settle(f.result() if f.exception() is None else None, f.exception()))
        return True

    def _done_for(self, server: Server | None, lo: int, hi: int) -> Callable[[Any, PSError | None], None]:
        def settle(applied: int | None, error: PSError | None) -> None:
            if error is None:
                with self.lock:
                    self.applied += int(applied or 0)
            assert self.fanout is not None
            if not self.fanout.part_done(error):
                return
            self.uniq = self.summed = None  # type: ignore[assignment]
            if self.top:
                with self.st.lock:
                    self.st.pending.pop(self.step, None)
            if self.fanout.error is None:
                if self.top:
                    self.client._count(pushes=1, rows_pushed=self.rows)
                self.fut.set_result(self.applied)
            else:
                if self.top:
                    self.client._push_failed(self.fanout.error)
                self.fut.set_exception(self.fanout.error)

        def done(response: pb.PushResponse | None, error: PSError | None) -> None:
            if server is not None and self.permit:
                server.permits.release()
            if error is None:
                with self.st.lock:
                    self.st.bytes["received"]["push"] += response.ByteSize()
                if response.under_replicated:
                    self.client._under_replicated(self.st.name)
                settle(int(response.applied_rows), None)
                return
            if isinstance(error, UnknownClient) and self._new_session(error, lo, hi, settle):
                return
            self._retry_or_fail(error, server, self._again(lo, hi), settle)
        return done
