"""What the client keeps per table, and the staleness bound it enforces.

``TableState`` holds a table's dim and wire codecs for this client, its staleness bound, the pushes this
client issued and has not had acknowledged (step -> future, in step order) and the byte and staleness
counters ``Client.stats`` reports. A pull of a table with bound k waits (``after_own_pushes``) until this
client's pushes older than its last k are applied; nothing waits for other clients' pushes.

Thread-safety: a ``TableState``'s counters and ``pending`` are guarded by its ``lock``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent import futures as cf
from typing import Any

import numpy as np

from tigana.ps.client.config import Compression
from tigana.ps.errors import InvalidArgument
from tigana.ps.wire import data as wire


class TableState:
    """Client-side state of one table: dim, codecs, staleness bound, this client's unacknowledged pushes."""

    def __init__(self, name: str, dim: int, compression: Compression, staleness: int | None) -> None:
        self.name, self.dim = name, dim
        self.pull_codec = wire.codec_of(compression.pull)
        self.push_codec = wire.codec_of(compression.push)
        self.staleness = staleness
        self.lock = threading.Lock()
        self.step = 0  # pushes issued (each push call is one step)
        self.pending: dict[int, cf.Future] = {}  # step -> future, unacknowledged, in step order
        self.stale_last = 0
        self.stale_max = 0
        self.stale_waits = 0
        self.bytes = {"sent": {"pull": 0, "push": 0}, "received": {"pull": 0, "push": 0}}


class Countdown:
    """Calls ``fn`` once after ``n`` calls of ``one`` (in the thread that makes the last): the join of a
    step's futures, or of a bundle's answers."""

    def __init__(self, n: int, fn: Callable[[], None]) -> None:
        self._left = n
        self._lock = threading.Lock()
        self._fn = fn

    def one(self, *_: Any) -> None:
        with self._lock:
            self._left -= 1
            fire = self._left == 0
        if fire:
            self._fn()


def after_own_pushes(states: Sequence[TableState], fn: Callable[[], None]) -> None:
    """Run ``fn`` once this client's pushes to each of ``states`` from more than its ``staleness`` steps back
    are done (at once, in this thread, when none is outstanding; else in the thread that completes the last):
    one wait for every table of a call, so a many-table pull still leaves as one message per server."""
    waits = []
    for st in states:
        k = st.staleness
        if k is None:
            continue
        with st.lock:
            threshold = st.step - k
            mine = [f for s, f in st.pending.items() if s <= threshold]
            if mine:
                st.stale_waits += 1
        waits += mine
    if waits:
        countdown = Countdown(len(waits), fn)
        for f in waits:
            f.add_done_callback(countdown.one)
    else:
        fn()


def check_staleness(table: str, staleness: Any) -> None:
    if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, (int, np.integer))
                                  or staleness < 0):
        raise InvalidArgument(f"table {table!r}: field 'staleness' must be None or an integer >= 0, "
                              f"got {staleness!r}")
