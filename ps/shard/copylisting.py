"""The stored ids of a table with their routing slots, listed once for every slot copy one map install starts.

A map that moves slots starts a slot copy to each target at once (a rebalance onto a new server and a few
replica moves: three or four per server), and each copy used to list every stored id of the table under its
lock, map them all to slots and sort its share, at the same moment as the others: a burst of full scans that
held the table's lock for as long as they took and stalled the pushes behind it for up to seconds
(``bench reshard``). The copies of one install share one listing instead: the first to come makes it, the
others wait for it and take their slots' ids from it, and the last to leave frees it.

A listing made once every copy of the install had its ``SNAPSHOT_BEGIN`` queued holds every id a copy must
send (an id inserted later reaches the target as a change); a copy that comes after the others left makes a
new one, which is later still, so it is as good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class _Entry:
    __slots__ = ("lock", "users", "value")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.value: Any = None


class SharedListings:
    """Values made once per key while anyone uses them (single flight), freed when the last user leaves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Any, _Entry] = {}

    @contextmanager
    def shared(self, key: Any, make: Callable[[], Any]) -> Iterator[Any]:
        """The value of ``key``: made by ``make()`` unless a user of the same key holds it already."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry()
            entry.users += 1
        try:
            with entry.lock:
                if entry.value is None:
                    entry.value = make()
            yield entry.value
        finally:
            with self._lock:
                entry.users -= 1
                if entry.users == 0 and self._entries.get(key) is entry:
                    del self._entries[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
