"""The client's side of the streaming data path: one bidirectional ``Shard/Exchange`` stream per server.

Frames are sent as they are made, each under a client-chosen id, and answered in completion order; a reader
thread settles each frame's callback exactly once: with its answer, its error, ``DeadlineExceeded`` when its
deadline passes first, or ``Unavailable`` (unanswered) when the stream breaks or is cancelled. The frames
carry the same requests as the unary calls, so everything that keeps a pull or push correct stays where it
was: (client id, seq) for exactly-once, the routed epoch for fencing, the client's re-routing of failed
parts, its push permits. A broken stream is opened again by the next frame. Frames queued while the stream
was sending go out together as one bundle (``frames.bundle``), each under its own id. Parts of several tables
made together for this server (``send_many``: a step's ``pull_many``/``push_many``) go as one multi-table frame
(``frames.request_many``): one id, one deadline, one answer whose parts settle each part's callback with its
own reply or error. (The server's side is ``tigana.ps.shard.streams`` and ``multitable``.)

Invariant (the same as the unary path's): a frame whose callback got an error may still have been applied by
the server (an answer lost with the connection, or later than the deadline). Only pushes have effects, and a
push re-sent under its (client id, seq) is applied once, so "unanswered" is always safe to retry.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from tigana.ps.errors import DeadlineExceeded, Internal, PSError, Unavailable, from_rpc_error
from tigana.ps.wire import data as wire
from tigana.ps.wire import frames
from tigana.ps.wire.frames import EXCHANGE

Done = Callable[[Any, "PSError | None"], None]
_END = object()
_BUNDLE_FRAMES = 64  # at most this many frames in one bundle (and parts in one multi-table frame)
_BUNDLE_BYTES = 4 << 20  # and no more once it holds this many bytes
log = logging.getLogger("tigana.ps.client")


class _Pending:
    __slots__ = ("done", "generation")

    def __init__(self, done: Done, generation: int) -> None:
        self.done, self.generation = done, generation


class _Deadlines:
    """One thread for the deadlines of every frame of this process (a timer thread per frame costs more than
    a small frame): ``add(when, fn)`` calls ``fn()`` at ``when`` (monotonic) unless the frame settled first,
    which ``fn`` finds out itself."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cond = threading.Condition()
        self._count = 0
        self._thread: threading.Thread | None = None

    def add(self, when: float, fn: Callable[[], None]) -> None:
        with self._cond:
            self._count += 1
            heapq.heappush(self._heap, (when, self._count, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tigana-frame-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][1] == self._count:  # the new earliest deadline: wake the thread to sleep less
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, fn = heapq.heappop(self._heap)
            with contextlib.suppress(Exception):  # a deadline callback must not stop the others
                fn()


_DEADLINES = _Deadlines()


class Exchange:
    """This client's stream to one server. ``send`` returns at once; ``done(reply, error)`` runs once per
    frame on the reader or a timer thread. ``supported`` turns False when the server has no ``Exchange``
    (an older server): the caller then uses the unary calls.

    Thread-safety: every method may be called from any thread."""

    def __init__(self, channel: grpc.Channel, address: str) -> None:
        self.address = address
        self._method = channel.stream_stream(EXCHANGE, request_serializer=wire.identity,
                                             response_deserializer=wire.identity)
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._generation = 0
        self._queue: queue.SimpleQueue | None = None  # the open stream's outgoing frames
        self._call: Any = None
        self._closed = False
        self._answered = False  # some frame of some stream was answered: the server has Exchange
        self.supported = True
        self.bundled = 0  # frames sent inside bundles (with others queued at the same time)
        self.merged = 0  # parts sent inside multi-table frames (``send_many``)

    def send(self, kind: int, parts: list, timeout_s: float, done: Done) -> None:
        """Send one frame (a pull or push request in pieces, ``wire.*_request_parts``)."""
        self._send_frames([(kind, parts, done, False)], timeout_s)

    def send_many(self, items: list[tuple[int, list, Done]], timeout_s: float) -> None:
        """Send requests (kind, request in pieces, done) made together, e.g. every table's part of a step for
        this server: the parts of one kind go as one multi-table frame (cut at the bundle limits), and the
        frames as one message. Each ``done`` still runs once, with its own part's reply or error."""
        merged = _merge(items, self.address)
        self.merged += sum([len(m[1]) for m in merged if m[3]])
        self._send_frames(merged, timeout_s)

    def _send_frames(self, items: list[tuple[int, list, Done, bool]], timeout_s: float) -> None:
        """Send frames (kind, request in pieces or, ``many``, the list of the parts' pieces, done, many)."""
        with self._lock:
            if self._closed:
                err: PSError | None = Unavailable(f"{self.address}: client closed")
            else:
                err = None
                if self._queue is None:
                    self._open()
                ids = list(range(self._next_id + 1, self._next_id + 1 + len(items)))
                self._next_id += len(items)
                for frame_id, (_, _, done, _) in zip(ids, items, strict=True):
                    self._pending[frame_id] = _Pending(done, self._generation)
                q = self._queue
        if err is not None:
            for _, _, done, _ in items:
                done(None, err)
            return
        raws, sent = [], []
        budget_ms = max(1, int(timeout_s * 1000))
        expires = time.monotonic() + timeout_s
        for frame_id, (kind, parts, _, many) in zip(ids, items, strict=True):
            try:
                raws.append(frames.request_many(frame_id, budget_ms, kind, parts) if many else
                            frames.request(frame_id, budget_ms, kind, parts))
            except Exception as exc:  # noqa: BLE001 - settle the frame, never leave it pending
                self._settle(frame_id, None, Internal(f"{self.address}: frame encoding: {exc}"))
                continue
            sent.append(frame_id)
        if sent:  # one deadline for the frames made together (they share it), not one each
            _DEADLINES.add(expires, functools.partial(self._expire, sent, timeout_s))
        assert q is not None
        if raws:
            q.put(raws[0] if len(raws) == 1 else raws)

    def cancel_all(self) -> int:
        """Give up on every frame in flight (the server was declared dead): they get ``Unavailable``."""
        with self._lock:
            call, n = self._call, len(self._pending)
        if call is not None:
            call.cancel()  # the reader then fails every frame of this stream
        return n

    def close(self) -> None:
        with self._lock:
            self._closed = True
            call, q = self._call, self._queue
            self._queue = self._call = None
        if q is not None:
            q.put(_END)
        if call is not None:
            call.cancel()

    # --- internals ---
    def _open(self) -> None:
        """Start a new stream (under the lock)."""
        self._generation += 1
        q: queue.SimpleQueue = queue.SimpleQueue()

        def outgoing() -> Iterator[bytes]:
            # Frames queued meanwhile go as one bundle (``frames.bundle``): one message instead of many. An item
            # is a frame, or a list of frames made together (``send_many``); a bundle is cut at its limits.
            carry: list[bytes] = []
            end = False
            while not (end and not carry):
                if not carry:
                    item = q.get()
                    if item is _END:
                        return
                    carry = item if isinstance(item, list) else [item]
                while not end and len(carry) < _BUNDLE_FRAMES:  # whatever else is queued already
                    try:
                        more = q.get_nowait()
                    except queue.Empty:
                        break
                    if more is _END:
                        end = True
                    else:
                        carry.extend(more if isinstance(more, list) else [more])
                batch, size = [], 0
                while carry and len(batch) < _BUNDLE_FRAMES and (not batch or size + len(carry[0]) <= _BUNDLE_BYTES):
                    size += len(carry[0])
                    batch.append(carry.pop(0))
                if len(batch) > 1:
                    self.bundled += len(batch)
                yield batch[0] if len(batch) == 1 else frames.bundle(batch)

        call = self._method(outgoing())
        self._queue, self._call = q, call
        thread = threading.Thread(target=self._read, args=(call, q, self._generation),
                                  name=f"tigana-exchange-{self.address}", daemon=True)
        thread.start()

    def _read(self, call: Any, q: queue.SimpleQueue, generation: int) -> None:
        error: PSError | None = None
        try:
            for raw in call:
                try:
                    answers = frames.read_answers(raw, self.address)
                except PSError as exc:  # a reply we cannot read: fail the stream's frames
                    error = Internal(f"{self.address}: unreadable stream answer: {exc}")
                    call.cancel()
                    break
                self._answered = True
                for answer in answers:
                    self._settle(answer.id, answer.reply, answer.error)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED) and not self._answered:
                # A server without Exchange, or with no stream to spare: its frames go as unary calls from now.
                self.supported = False
            if code == grpc.StatusCode.CANCELLED:
                error = Unavailable(f"{self.address}: stream cancelled (the server was declared dead or the "
                                    "client closed)")
            else:
                error = from_rpc_error(err, self.address)
                if not isinstance(error, Unavailable):  # a failed stream: no frame of it was answered
                    error = Unavailable(f"{self.address}: stream failed: {error}")
        except Exception as exc:  # noqa: BLE001 - a reader thread must never die silently
            error = Unavailable(f"{self.address}: stream failed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                if self._generation == generation:
                    self._queue = self._call = None
                lost = [k for k, p in self._pending.items() if p.generation == generation]
            q.put(_END)
            for k in lost:
                self._settle(k, None, error or Unavailable(f"{self.address}: stream ended"))

    def _expire(self, frame_ids: list[int], timeout_s: float) -> None:
        """The deadline of frames sent together: those still unanswered fail (the others are settled)."""
        with self._lock:
            late = [k for k in frame_ids if k in self._pending]
        for k in late:
            self._settle(k, None, DeadlineExceeded(
                f"{self.address}: no answer within {timeout_s:g}s (deadline exceeded)"))

    def _settle(self, frame_id: int, reply: Any, error: PSError | None) -> None:
        with self._lock:
            pending = self._pending.pop(frame_id, None)
        if pending is None:  # answered already (a late answer after the deadline, or the reverse)
            return
        pending.done(reply, error)


def _merge(items: list[tuple[int, list, Done]], address: str) -> list[tuple[int, list, Done, bool]]:
    """Requests made together as frames (kind, pieces, done, many): those of one kind as multi-table frames
    of at most ``_BUNDLE_FRAMES`` parts and, past the first part, ``_BUNDLE_BYTES`` (a part alone stays a
    single-table frame)."""
    by_kind: dict[int, list[tuple[list, Done]]] = {}
    for kind, parts, done in items:
        by_kind.setdefault(kind, []).append((parts, done))
    out: list[tuple[int, list, Done, bool]] = []
    for kind, group in by_kind.items():
        batch: list[tuple[list, Done]] = []
        size = 0
        for parts, done in group:
            n = wire.parts_nbytes(parts)
            if batch and (len(batch) >= _BUNDLE_FRAMES or size + n > _BUNDLE_BYTES):
                out.append(_frame_of(kind, batch, address))
                batch, size = [], 0
            batch.append((parts, done))
            size += n
        out.append(_frame_of(kind, batch, address))
    return out


def _frame_of(kind: int, batch: list[tuple[list, Done]], address: str) -> tuple[int, list, Done, bool]:
    if len(batch) == 1:
        return kind, batch[0][0], batch[0][1], False
    return kind, [parts for parts, _ in batch], _fan_out([done for _, done in batch], address), True


def _fan_out(dones: list[Done], address: str) -> Done:
    """The callback of a multi-table frame: each part's ``done`` with its own answer (``frames.Answer``), or
    every one with the frame's error (the frame was refused whole, lost or late)."""
    def done(reply: Any, error: PSError | None) -> None:
        if error is None and (not isinstance(reply, list) or len(reply) != len(dones)):
            got = len(reply) if isinstance(reply, list) else "no"
            error = Internal(f"{address}: the answer to a frame of {len(dones)} tables' parts has {got} parts")
        for k, part_done in enumerate(dones):
            try:
                if error is not None:
                    part_done(None, error)
                else:
                    answer = reply[k]
                    part_done(answer.reply, answer.error)
            except Exception:  # noqa: BLE001 - one part's callback must not keep the others unsettled
                log.exception("%s: a part's callback failed", address)
    return done
