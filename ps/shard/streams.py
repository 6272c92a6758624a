"""The server's side of the streaming data path (``Shard/Exchange``; the client's side is
``tigana.ps.client.exchange``, the frames ``tigana.ps.wire.frames``).

``serve``: a reader thread takes frames off the stream and handles each at once (a thread hand-off per frame
cost more CPU than a pull's table work); a step that must wait (a sync push waiting for its copies) comes back
as a callable and runs on the server's frame pool, or as a ``Deferred`` that whoever settles it answers
(a sync push's wait for its copies: no thread waits). Answers are written back as they finish. At most ``window``
frames of one stream are read and not yet answered: past that the reader stops reading, and HTTP/2 flow
control holds the client back. The frames of a bundle are handled in order and the answers ready at its end
go back as one bundle.

Invariant (the same as the unary path's): a frame whose answer is lost (with the connection, or later than
the client's deadline) may still have been applied. Only pushes have effects, and a push re-sent under its
(client id, seq) is applied once, so the client may always retry an unanswered frame.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures as cf
from typing import Any

from tigana.ps.wire import frames

_END = object()


class Deferred:
    """A frame's answer that comes later from whoever completes it, not from a pool thread waiting for it:
    ``start(finish)`` arranges for ``finish(step)`` to be called exactly once, ``step()`` making the answer (a
    sync push waiting for its copies' acknowledgements: ``Replicator.when_done``)."""

    __slots__ = ("start",)

    def __init__(self, start: Callable[[Callable[[Callable[[], bytes]], None]], None]) -> None:
        self.start = start


def serve(requests: Iterator[Any], handle: Callable[[frames.Frame, float], bytes | Callable[[], bytes]],
          pool: cf.Executor, window: int, on_malformed: Callable[[Any], None]) -> Iterator[bytes]:
    """The answers of one ``Exchange`` stream: every frame handled as ``handle(frame, received)`` on the reader
    thread (it answers, or returns the rest of its work for ``pool``, and never raises), at most ``window``
    frames in hand. ``on_malformed`` ends the stream for a frame with no id to answer under (it aborts the
    RPC)."""
    answers: queue.SimpleQueue = queue.SimpleQueue()
    permits = threading.BoundedSemaphore(window)  # one per frame in hand
    lock = threading.Lock()
    open_count = [1]  # the reader, plus one per frame being handled

    def release() -> None:
        with lock:
            open_count[0] -= 1
            last = open_count[0] == 0
        if last:
            answers.put(_END)

    def finish(rest: Callable[[], bytes]) -> None:
        try:
            answers.put(rest())
        finally:
            permits.release()
            release()

    def read() -> None:
        try:
            for item in requests:
                received = time.monotonic()
                ready: list[bytes] = []
                for frame in item if isinstance(item, list) else (item,):
                    if not isinstance(frame, frames.Frame):
                        answers.put(frame)  # Malformed: ends the stream below
                        return
                    permits.acquire()
                    with lock:
                        open_count[0] += 1
                    out = handle(frame, received)
                    if isinstance(out, bytes):
                        ready.append(out)
                        permits.release()  # answered: out of hand (a bundle may hold more than the window)
                    elif isinstance(out, Deferred):
                        out.start(finish)
                    else:
                        pool.submit(finish, out)
                if ready:
                    answers.put(ready[0] if len(ready) == 1 else frames.bundle_answer(ready))
                    for _ in ready:
                        release()
        except Exception:  # noqa: BLE001, S110 - the client went away: answer what is in flight, then end
            pass
        finally:
            release()

    threading.Thread(target=read, name="tigana-exchange-reader", daemon=True).start()
    while True:
        item = answers.get()
        if item is _END:
            return
        if not isinstance(item, bytes):
            on_malformed(item)
            return
        yield item
