"""TableLock: a served table's write lock, where the data path goes before a slot copy's background work.

Every change to a table's rows happens under its write lock: pushes and inserting pulls, the change-lane items a
copy applies (which a sync push's acknowledgement waits for), map installs, and the background work of slot
copies: a source reading a chunk of rows to send, a target importing one, a server deleting the rows of slots
it no longer holds. ``threading.Lock`` is not fair: in a profiled move, change-lane items on a target waited
30-85 ms behind the copy chunks of three sources, and sync pushes waited on them (``bench reshard``).

So background work enters through ``yielding()``: it waits while a data-path caller is waiting for the lock
(for at most ``max_wait_s``, so a copy cannot starve under a steady load), then takes the lock as anyone does.
Data-path callers use the lock as a plain lock (``with lock``, ``acquire``/``release``) and are counted while
they wait. A caller that finds the lock free takes it at once and is never counted: the count costs an
uncontended caller nothing. Best effort, not a queue: it only keeps a copy from going first while the data path
waits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["TableLock"]

YIELD_MAX_S = 0.05  # the longest background work waits for the data path before it takes the lock anyway


class TableLock:
    """A mutex (not re-entrant) whose ``yielding()`` entry lets waiting data-path callers go first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0  # data-path callers blocked in ``acquire``

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        with self._cond:
            self._waiting += 1
        try:
            return self._lock.acquire(timeout=timeout)
        finally:
            with self._cond:
                self._waiting -= 1
                if not self._waiting:
                    self._cond.notify_all()

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> TableLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @property
    def waiting(self) -> int:
        """Data-path callers waiting for the lock now."""
        return self._waiting

    @contextmanager
    def yielding(self, max_wait_s: float = YIELD_MAX_S) -> Iterator[None]:
        """Hold the lock for background work, once no data-path caller waits for it (or ``max_wait_s`` passed)."""
        with self._cond:
            if self._waiting:
                self._cond.wait_for(lambda: not self._waiting, max_wait_s)
        with self._lock:
            yield
