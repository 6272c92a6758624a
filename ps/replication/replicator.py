"""The thread and gRPC adapter of the primary's replication core (``Primary``, in ``primary``).

``Replicator`` holds one lock (a condition) around every call into the core, carries out the actions it
returns after releasing it (a map's go back to the server, which runs them once its own locks are released:
``on_map``, ``run``), and gives the waits the server needs: a sync write's acknowledgements (``wait``), room in
a full queue (``room``), a slot copy's window (``wait_for_room``). Neither of the last two gives up and queues
anyway: a writer or a copy that finds no room in time fails, and the bounds hold. It owns the transport: a gRPC
channel per stream and a sender thread per lane of it (changes, copied rows). Nothing here decides anything the
protocol depends on.

Seams for a simulator: ``clock``, and ``spawn(name, fn)`` (run ``fn`` on a thread of its own): a simulator
passes its clock, runs what is spawned when it chooses, drives each stream's lanes with ``core.request`` and
hands each send's outcome to ``sent`` (what a lane's sender thread does with it: the answer or the failure,
then the pause before its next send).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.ps.background import SLOT_COPY_THREAD, SLOT_RESTORE_THREAD, start_thread
from tigana.ps.channels import channel_options
from tigana.ps.replication.actions import (
    Action,
    CloseStream,
    OpenStream,
    Pause,
    RefreshMap,
    ReportCaughtUp,
    ReportFailure,
    StartCopy,
)
from tigana.ps.replication.copy import Session
from tigana.ps.replication.pacing import CopyPacer
from tigana.ps.replication.primary import Primary
from tigana.ps.replication.stream import Mark, Stream, item_bytes
from tigana.ps.routing import ShardMap
from tigana.ps.wire.cluster import Item

log = logging.getLogger("tigana.ps.replication")

SLOW_ACK_S = 1.0  # a sync acknowledgement slower than this is explained in the log (at most every 5 s)


@dataclass(eq=False)
class _Waiter:
    """A write waiting for its marks (``when_done``): called back, not a thread blocked."""

    marks: list[Mark]
    deadline: float
    callback: Callable[[bool], None]
    since: float
    told: bool = False  # its slowness was logged


class Replicator:
    """The primary side of replication on one server: the ``Primary`` core under a lock, and its transport.

    ``refresh_map(epoch)``, ``report_failure(target, slots, reason, epoch)`` and ``caught_up(target, slots,
    since_epoch) -> bool`` are the server's links to the scheduler (called from sender threads, never under
    the lock); ``caught_up`` answers False when the scheduler refused the report as stale, and the copy is then
    started again. ``copy_rows(stream, session)`` exports a slot copy's rows through ``enqueue_rows``."""

    def __init__(self, server_id: str, boot: str, num_slots: int, *, max_message_bytes: int,
                 refresh_map: Callable[[int], None], report_failure: Callable[[str, np.ndarray, str, int], None],
                 caught_up: Callable[[str, np.ndarray, int], bool | None],
                 copy_rows: Callable[[Stream, Session], None],
                 failure_timeout_s: float = 2.0, send_timeout_s: float = 10.0, batch_bytes: int = 24 << 20,
                 max_queue_bytes: int = 512 << 20, copy_window_bytes: int = 16 << 20,
                 copy_rate: float | None = None,
                 channel: Callable[[str, list], grpc.Channel] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[str, Callable[[], None]], None] | None = None,
                 generation: int | None = None) -> None:
        # Stream generations only grow within a boot (a target tells a new stream from an old one of the same
        # boot by it); the wall clock seeds them unless a simulator gives its own first generation.
        first = int(time.time() * 1000) << 8 if generation is None else generation
        self.core = Primary(server_id, boot, num_slots, generation=first,
                            batch_bytes=min(batch_bytes, max_message_bytes // 2),
                            failure_timeout_s=failure_timeout_s, max_queue_bytes=max_queue_bytes,
                            copy_window_bytes=copy_window_bytes)
        self.max_message_bytes = max_message_bytes
        self.refresh_map, self.report_failure, self.caught_up = refresh_map, report_failure, caught_up
        self.copy_rows = copy_rows
        self.pacer = CopyPacer(copy_rate)  # under ``cond``
        self.copy_stall_s = 30.0  # a slot copy whose copy lane stays full this long fails (``wait_for_room``)
        self.send_timeout_s = send_timeout_s
        self.channel = channel or (lambda address, options: grpc.insecure_channel(address, options=options))
        self.clock = clock
        self.threaded = spawn is None
        self.spawn = spawn or _thread
        self.cond = threading.Condition()
        self._links: dict[Stream, tuple[grpc.Channel, Callable]] = {}
        self._backoff: dict[tuple[Stream, int], float] = {}  # a lane's pause after a failed send (under ``cond``)
        self._waiters: list[_Waiter] = []  # under ``cond``; settled by the events that complete their marks
        self._sweeping = False  # the deadline sweeper runs (started with the first waiter)
        self._slow_logged = float("-inf")
        self._closed = threading.Event()

    @property
    def streams(self) -> dict[str, Stream]:
        return self.core.streams

    # --- carrying out the core's actions (never under the lock) -------------------------------------------
    def _do(self, actions: list[Action]) -> float:
        """Carry out ``actions`` in order; the pause a sender must take (0: none)."""
        pause = 0.0
        for a in actions:
            if isinstance(a, OpenStream):
                self._open(a.stream)
            elif isinstance(a, CloseStream):
                with self.cond:
                    link = self._links.pop(a.stream, None)
                    for lane in (0, 1):
                        self._backoff.pop((a.stream, lane), None)
                if link is not None:
                    self.spawn("tigana-repl-close", link[0].close)
            elif isinstance(a, StartCopy):
                # a planned move's copy runs at background priority (``ps.background``), one that restores a
                # missing replica does not: until it ends a loss of the last copy loses rows
                name = SLOT_COPY_THREAD if a.session.paced else SLOT_RESTORE_THREAD
                self.spawn(name, lambda s=a.stream, sess=a.session: self._copy(s, sess))
            elif isinstance(a, ReportFailure):
                self.report_failure(a.target, a.slots, a.reason, a.epoch)
            elif isinstance(a, ReportCaughtUp):
                if self.caught_up(a.stream.target_id, a.session.slots, a.session.epoch) is False:
                    with self.cond:
                        self.core.report_refused(a.stream, a.session)
                        self.cond.notify_all()
                        settled = self._settle()
                    _fire(settled)
            elif isinstance(a, RefreshMap):
                self.refresh_map(a.epoch)
            elif isinstance(a, Pause):
                pause = max(pause, a.seconds)
        return pause

    def _call(self, event: Callable[[], list[Action]]) -> float:
        """Run one event of the core under the lock, wake the waiters, carry out its actions."""
        with self.cond:
            actions = event()
            self.cond.notify_all()
            settled = self._settle()
        _fire(settled)
        return self._do(actions)

    def _open(self, s: Stream) -> None:
        channel = self.channel(s.address, channel_options(self.max_message_bytes, 30.0, 10.0, 0.1))
        call = channel.unary_unary("/tigana.v1.Shard/Replicate", request_serializer=_identity,
                                   response_deserializer=pb.ReplicateResponse.FromString)
        with self.cond:  # a map's actions run after its install released its locks: a later map may have closed s
            if not s.closed:
                self._links[s] = (channel, call)
        if s.closed:
            channel.close()
            return
        self.spawn(f"tigana-repl-{s.target_id[:8]}", lambda: self._send_loop(s, 0))
        self.spawn(f"tigana-copy-{s.target_id[:8]}", lambda: self._send_loop(s, 1))

    # --- events -------------------------------------------------------------------------------------------
    def on_map(self, m: ShardMap, me: int, tables: list[str], positions: Callable[[str, np.ndarray], np.ndarray],
               dedup_records: Callable[[str, np.ndarray], list]) -> list[Action]:
        """A map installed (the caller holds every table's write lock): ``Primary.on_map``. Returns its actions
        (open or close streams, start slot copies, report failures) for the caller to ``run`` once it has
        released every lock: a report is a call to the scheduler, whose answer may bring a newer map to install
        (run under the install lock, it waited on that very lock: the server hung holding every table lock)."""
        with self.cond:
            actions = self.core.on_map(m, me, tables, positions, dedup_records, self.clock())
            self.cond.notify_all()
            settled = self._settle()
        _fire(settled)
        return actions

    def run(self, actions: list[Action]) -> None:
        """Carry out actions an event returned (``on_map``), in order. Blocking (a report is a scheduler call):
        the caller holds no table, install or registry lock."""
        self._do(actions)

    def enqueue(self, item: Item) -> list[Mark]:
        """A write applied (under its table's write lock): the marks a sync write must wait for."""
        with self.cond:
            marks = self.core.enqueue(item)
            self.cond.notify_all()
        return marks

    def tail_marks(self, slots: np.ndarray) -> list[Mark]:
        with self.cond:
            return self.core.tail_marks(slots)

    def enqueue_rows(self, s: Stream, sess: Session, item: Item) -> bool:
        with self.cond:
            ok = self.core.enqueue_rows(s, sess, item)
            self.cond.notify_all()
        return ok

    def session_active(self, s: Stream, sess: Session) -> bool:
        with self.cond:
            return self.core.session_active(s, sess)

    def answered(self, s: Stream, reply: pb.ReplicateResponse, lane: int = 0) -> float:
        """A target's answer on ``lane``: a newer map first, then the answer itself; the pause before the next
        send."""
        with self.cond:
            first = self.core.newer_map(reply)
        self._do(first)
        if lane:
            return self._call(lambda: self.core.copy_answered(s, reply, self.clock()))
        return self._call(lambda: self.core.answered(s, reply, self.clock()))

    def send_failed(self, s: Stream, reason: str, lane: int = 0) -> None:
        if lane:
            self._call(lambda: self.core.copy_send_failed(s, reason, self.clock()))
        else:
            self._call(lambda: self.core.send_failed(s, reason, self.clock()))

    def retry_reports(self) -> None:
        self._call(self.core.retry)

    def needs_restart(self) -> bool:
        with self.cond:
            return self.core.needs_restart()

    def _copy(self, s: Stream, sess: Session) -> None:
        """A slot copy's rows (by the server's ``copy_rows``), then ``rows_copied``."""
        try:
            self.copy_rows(s, sess)
        except Exception:  # noqa: BLE001 - retried: the server's upkeep restarts failed copies
            with self.cond:
                self.core.copy_failed(s, sess)
            return
        self._call(lambda: self.core.rows_copied(s, sess, self.clock()))

    # --- the sender of one stream -------------------------------------------------------------------------
    def _send_loop(self, s: Stream, lane: int) -> None:
        """Send the head of one lane, hand the answer (or the failure) to the core, pause when it says so."""
        try:
            while True:
                with self.cond:
                    while not s.closed and not s.has_batch(lane):
                        self.cond.wait()
                    request = self.core.request(s, lane)
                link = self._links.get(s)
                if request is None or link is None:
                    return
                try:
                    reply = link[1](request, timeout=self.send_timeout_s)
                except grpc.RpcError as err:
                    if s.closed:
                        return
                    self._pause(s, self.sent(s, lane, None, f"{err.code().name}: {err.details()}"))
                    continue
                self._pause(s, self.sent(s, lane, reply))
        except ValueError:  # the channel was closed under a call: the stream is closing
            return

    def sent(self, s: Stream, lane: int, reply: pb.ReplicateResponse | None, failure: str = "") -> float:
        """The outcome of one send on ``lane`` of ``s``: its answer (``answered``), or the reason it failed
        (``send_failed``). Returns the seconds the lane's sender waits before its next send: the pause the core
        asks for after an answer; after a failure a backoff from 0.05 s, doubling up to 1 s, that an answer
        resets."""
        key = (s, lane)
        if reply is None:
            self.send_failed(s, failure, lane)
            with self.cond:
                backoff = self._backoff.get(key, 0.05)
                if not s.closed:
                    self._backoff[key] = min(1.0, backoff * 2)
            return backoff
        with self.cond:
            self._backoff.pop(key, None)
        return self.answered(s, reply, lane)

    def _pause(self, s: Stream, seconds: float) -> None:
        if seconds <= 0 or not self.threaded:
            return  # driven by a simulator: its clock, not a sleep, spaces the retries
        with self.cond:
            if not s.closed:
                self.cond.wait(seconds)

    # --- waits --------------------------------------------------------------------------------------------
    def wait(self, marks: list[Mark], timeout_s: float) -> bool:
        """Wait until every mark is done (``Primary.mark_done``). False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                if all(self.core.mark_done(m) for m in marks):
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self.core.closed:
                    return False
                self.cond.wait(min(left, 0.5))

    def when_done(self, marks: list[Mark], timeout_s: float, callback: Callable[[bool], None]) -> None:
        """Call ``callback(True)`` once every mark is done (``Primary.mark_done``), ``callback(False)`` when
        ``timeout_s`` passes first or the replicator closes: on the thread of the event that settled it (an
        acknowledgement, a map), of the deadline sweeper, or this one when it is settled already. No thread
        waits meanwhile: a sync push waiting for its copies held one of the server's frame-pool threads for up
        to ``ack_timeout_s``, so a few dozen waiting on a paused copy held every other sync acknowledgement of
        the server behind them. The callback must not block."""
        with self.cond:
            if self.core.closed or all(self.core.mark_done(m) for m in marks):
                done = not self.core.closed
            else:
                now = self.clock()
                self._waiters.append(_Waiter(marks, now + timeout_s, callback, now))
                if not self._sweeping and self.threaded:
                    self._sweeping = True
                    self.spawn("tigana-ack-deadlines", self._sweep)
                return
        callback(done)

    def _settle(self) -> list[tuple[Callable[[bool], None], bool]]:
        """The waiters an event settled (``cond`` held): every mark done, past the deadline, or closed; taken
        out, to be called once the lock is released (``_fire``)."""
        if not self._waiters:
            return []
        now, closed = self.clock(), self.core.closed
        out, keep = [], []
        for w in self._waiters:
            if not closed and all(self.core.mark_done(m) for m in w.marks):
                out.append((w.callback, True))
            elif closed or now >= w.deadline:
                out.append((w.callback, False))
            else:
                keep.append(w)
        self._waiters = keep
        return out

    def _sweep(self) -> None:
        """The deadline sweeper's thread: ``expire`` every 0.1 s until the replicator closes."""
        while True:
            self._closed.wait(0.1)  # not the condition: that wakes at every write
            if self.expire():
                return

    def expire(self) -> bool:
        """Settle the waiters whose deadline passed (nothing else would: their copies stopped answering), and
        explain in the log the first waiter past ``SLOW_ACK_S`` (at most every 5 s). The sweeper thread calls
        it; a simulator at its steps. True once the replicator is closed (every waiter settled)."""
        with self.cond:
            settled = self._settle()
            closed = self.core.closed
            slow = None
            now = self.clock()
            if now - self._slow_logged >= 5.0:
                slow = next((w for w in self._waiters if not w.told and now - w.since >= SLOW_ACK_S), None)
                if slow is not None:
                    slow.told = True
                    self._slow_logged = now
        _fire(settled)
        if slow is not None:
            log.info("a sync write has waited %.1fs for its copies (%d waiting): %s", now - slow.since,
                     len(self._waiters), self._waiting_on(slow.marks))
        return closed

    def _waiting_on(self, marks: list[Mark]) -> str:
        """The marks not done yet, as a line for a log: per stream, the seq waited for, the seq acknowledged, what
        is queued ahead and since when the stream is broken (a slow sync acknowledgement, explained)."""
        with self.cond:
            now = self.clock()
            out = []
            for m in marks:
                if self.core.mark_done(m):
                    continue
                s = m.stream
                ahead = sum(1 for q in s.queue if q.seq <= m.seq)
                out.append(f"{s.target_id}: seq {m.seq} (acknowledged {s.acked}, {ahead} item(s) ahead, "
                           f"{s.queued_bytes} B queued, {len(s.sessions)} slot cop(ies), last ack "
                           f"{now - s.acked_time:.1f}s ago"
                           + (f", broken for {now - s.broken_since:.1f}s: {s.last_error[:120]}"
                              if s.broken_since is not None else "")
                           + (f", {int(s.excluded[m.slots].sum())} slot(s) excluded" if s.excluded[m.slots].any()
                              else "") + ")")
            return "; ".join(out)

    def wait_for_room(self, s: Stream, sess: Session, timeout_s: float | None = None) -> bool:
        """Block while ``s``'s copy lane holds more than ``copy_window_bytes`` unacknowledged: the export runs
        only a window ahead of what the target applied (the rows are read under the table's lock, and a window
        bounds the memory they take while queued). True once there is room (or the stream or ``sess`` is over:
        nothing more is queued then); False when ``timeout_s`` (default ``copy_stall_s``) passed with the lane
        still full: the caller fails the copy, which is started again, rather than exceed the window."""
        deadline = time.monotonic() + (self.copy_stall_s if timeout_s is None else timeout_s)
        with self.cond:
            while s.copy_bytes > self.core.copy_window_bytes and self.core.session_active(s, sess) \
                    and not self.core.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.05))
        return True

    def pace(self, sess: Session, item: Item) -> None:
        """After a chunk of a paced slot copy was queued: wait as long as the server's copy rate asks
        (``pacing``), outside every lock. A copy restoring a missing replica is never held back."""
        if not sess.paced:
            return
        with self.cond:
            wait = self.pacer.delay(self.clock(), item_bytes(item))
        if wait > 0:
            self._closed.wait(wait)  # a closing server stops waiting

    def room(self, slots: np.ndarray | None, timeout_s: float) -> Stream | None:
        """Wait (up to ``timeout_s``) until every stream that a write of ``slots`` (None: any) goes to holds at
        most ``max_queue_bytes`` unacknowledged; the stream still over it, or None. Called before a write takes
        its table's lock: the queue is bounded by back-pressure on the writers, never by dropping items."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                full = self.core.full_stream(slots)
                left = deadline - time.monotonic()
                if full is None or left <= 0:
                    return full
                self.cond.wait(min(left, 0.1))

    def stats(self) -> dict[str, float]:
        with self.cond:
            return {**self.core.stats(self.clock()), "slot_copy_paced_s": self.pacer.paced_s}

    def close(self) -> None:
        with self.cond:
            actions = self.core.close()
            self.cond.notify_all()
            settled = self._settle()
        self._closed.set()
        _fire(settled)
        for a in actions:
            link = self._links.pop(a.stream, None) if isinstance(a, CloseStream) else None
            if link is not None:
                link[0].close()


def _fire(settled: list[tuple[Callable[[bool], None], bool]]) -> None:
    """Call the settled waiters (no lock held); one failing never keeps the others from their answer."""
    for callback, ok in settled:
        try:
            callback(ok)
        except Exception:  # noqa: BLE001 - a waiter's answer is its own business
            log.exception("a sync acknowledgement callback failed")


def _identity(raw: bytes) -> bytes:
    return raw


def _thread(name: str, fn: Callable[[], None]) -> None:
    start_thread(name, fn)  # a planned move's copy at background priority (``ps.background``)
