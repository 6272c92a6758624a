"""The server's side of the streaming data path (``Shard/Exchange``; the client's side is
``tigana.ps.client.exchange``, the frames ``tigana.ps.wire.frames``).

``serve``: a reader thread takes frames off the stream and hands each to the server's frame pool; answers
are written back as they finish. At most ``window`` frames of one stream are read and not yet answered: past
that the reader stops reading, and HTTP/2 flow control holds the client back.

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


def serve(requests: Iterator[Any], handle: Callable[[frames.Frame, float], bytes], pool: cf.Executor,
          window: int, on_malformed: Callable[[Any], None]) -> Iterator[bytes]:
    """The answers of one ``Exchange`` stream: every frame handed to ``pool`` as ``handle(frame, received)``
    (which answers, never raises), at most ``window`` frames at a time. ``on_malformed`` ends the stream for
    a frame with no id to answer under (it aborts the RPC)."""
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

    def work(frame: frames.Frame, received: float) -> None:
        try:
            answers.put(handle(frame, received))
        finally:
            permits.release()
            release()

    def read() -> None:
        try:
            for frame in requests:
                if not isinstance(frame, frames.Frame):
                    answers.put(frame)  # Malformed: ends the stream below
                    return
                permits.acquire()
                with lock:
                    open_count[0] += 1
                pool.submit(work, frame, time.monotonic())
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
