"""Exactly-once pushes: a bounded window of the (client_id, seq, part) keys a table has applied.

A client numbers its pushes; a retried push carries the same key, so the server answers ``duplicate`` instead of
applying it twice. The window keeps the last ``size`` keys per client (and at most ``max_clients`` clients, least
recently seen dropped first). Below the window a per-client floor remembers the highest seq evicted (minus one,
as other parts of that seq may still be in flight): a push at or under it is reported as seen. With seq numbers
increasing per client, such a push was sent ``size`` pushes ago and has been applied or lost its chance to be.

Not thread-safe: the server checks, applies and records under the table's push lock so the three are atomic.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class DedupWindow:
    """Applied push keys per client. ``key = (seq, part)``; an empty ``client_id`` opts out of deduplication."""

    def __init__(self, size: int = 8192, max_clients: int = 4096) -> None:
        if size < 1 or max_clients < 1:
            raise ValueError("size and max_clients must be >= 1")
        self.size = size
        self.max_clients = max_clients
        # client_id -> (keys applied, in arrival order; lowest seq evicted so far (-1: none))
        self._clients: OrderedDict[str, tuple[OrderedDict[tuple[int, int], int], list[int]]] = OrderedDict()

    def seen(self, client_id: str, seq: int, part: int) -> bool:
        """True when (seq, part) of ``client_id`` was applied already (or is older than the window)."""
        if not client_id:
            return False
        entry = self._clients.get(client_id)
        if entry is None:
            return False
        keys, floor = entry
        return (seq, part) in keys or seq <= floor[0]

    def record(self, client_id: str, seq: int, part: int, applied_rows: int = 0) -> None:
        """Remember an applied push."""
        if not client_id:
            return
        entry = self._clients.get(client_id)
        if entry is None:
            entry = (OrderedDict(), [-1])
            self._clients[client_id] = entry
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client_id)
        keys, floor = entry
        keys[(seq, part)] = applied_rows
        while len(keys) > self.size:
            (old_seq, _), _ = keys.popitem(last=False)
            # Other parts of old_seq may still be in flight: the floor stays below it.
            floor[0] = max(floor[0], old_seq - 1)

    def __len__(self) -> int:
        return sum(len(keys) for keys, _ in self._clients.values())

    # --- persistence next to a snapshot, so a restart keeps exactly-once --------------------------------
    def to_state(self) -> dict[str, Any]:
        return {"size": self.size, "max_clients": self.max_clients,
                "clients": {cid: {"floor": floor[0], "keys": [[s, p, n] for (s, p), n in keys.items()]}
                            for cid, (keys, floor) in self._clients.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any], size: int | None = None) -> DedupWindow:
        window = cls(size or int(state.get("size", 8192)), int(state.get("max_clients", 4096)))
        for cid, entry in state.get("clients", {}).items():
            keys: OrderedDict[tuple[int, int], int] = OrderedDict(
                ((int(s), int(p)), int(n)) for s, p, n in entry.get("keys", []))
            window._clients[str(cid)] = (keys, [int(entry.get("floor", -1))])
            while len(keys) > window.size:
                keys.popitem(last=False)
        return window
