"""Parts in flight, watched against the map: a part sent to a server that a newer map no longer names as the
primary of every slot it carries is given up at once and routed again by the new map.

Without this, a part sent to a primary that stops answering (a SIGSTOP, a partition) waits for its own
deadline (``ClientConfig.timeout_s``) or for keepalive to break the connection, long after the scheduler
declared the server dead and published new primaries. ``SentParts.track`` wraps a part's completion
callback so that it runs exactly once, and keeps the part (its server, its ids, the route it was sent by)
until then; ``SentParts.on_route`` (the client installed a newer map) settles every tracked part whose slots
moved with a retryable ``Unavailable`` naming the new epoch, and the part's own ``_retry_or_fail`` routes
it again at once by that map. The answer of the abandoned attempt, if it ever comes, finds the callback spent
and is ignored. A push re-sent this way keeps its (client id, seq): the abandoned attempt may have been
applied, and the servers apply a key once per slot (``inflight``).

Thread-safety: every method may be called from any thread; the registry is guarded by one lock, and a
part's callback by its own ``once`` lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tigana.ps import routing
from tigana.ps.client.routes import Route, Server
from tigana.ps.errors import PSError, Unavailable

Done = Callable[[Any, "PSError | None"], None]


class _Part:
    __slots__ = ("server", "ids", "epoch", "done", "once", "key")

    def __init__(self, server: Server, ids: np.ndarray, epoch: int, done: Done, key: int) -> None:
        self.server, self.ids, self.epoch, self.done, self.key = server, ids, epoch, done, key
        self.once = threading.Lock()


class SentParts:
    """The parts in flight of one client (see the module docstring). ``current`` returns the route new
    operations take now; ``on_moved(n)`` counts the parts given up because a map moved their slots."""

    def __init__(self, current: Callable[[], Route], on_moved: Callable[[int], None]) -> None:
        self._current, self._on_moved = current, on_moved
        self._parts: dict[int, _Part] = {}
        self._lock = threading.Lock()
        self._next = 0

    def track(self, server: Server, ids: np.ndarray, route: Route, done: Done) -> Done | None:
        """Keep the part sending ``ids`` ((n,) int64, a view is fine: it is read only if a map moves them) to
        ``server`` by ``route`` until it settles; returns the callback to send it with: ``done`` run once,
        by the first of the answer, the transport's error and a newer map moving its slots. None: a map
        newer than ``route`` moved its slots already, ``done`` ran (the part is routed again): send nothing."""
        with self._lock:
            self._next += 1
            part = _Part(server, ids, route.epoch, done, self._next)
            self._parts[part.key] = part

        def settle(reply: Any, error: PSError | None) -> None:
            if not part.once.acquire(blocking=False):  # given up already: a late answer is ignored
                return
            with self._lock:
                self._parts.pop(part.key, None)
            part.done(reply, error)

        # A map installed between the route's read and the registration above was not seen by its scan.
        now = self._current()
        if now.epoch > route.epoch and _moved(part, now):
            self._give_up(part, now)
            return None
        return settle

    def on_route(self, route: Route) -> int:
        """A newer map is installed (``route`` is already what new operations take): give up every part whose
        server no longer leads all its slots. Returns how many. One vectorized check per part. The callbacks
        run in this thread: call it holding no lock that a re-route takes (the map follower's)."""
        with self._lock:
            parts = [p for p in self._parts.values() if p.epoch < route.epoch]
        moved = [p for p in parts if _moved(p, route)]
        for p in moved:
            self._give_up(p, route)
        return len(moved)

    def stranded(self, route: Route) -> int:
        """How many parts in flight wait on a server that ``route`` no longer names as the primary of every slot
        they carry: 0 once ``on_route(route)`` has run (docs/replication.md L7; the simulator checks it)."""
        with self._lock:
            parts = [p for p in self._parts.values() if p.epoch < route.epoch] if self._parts else []
        return sum(_moved(p, route) for p in parts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._parts)

    def _give_up(self, part: _Part, route: Route) -> None:
        if not part.once.acquire(blocking=False):
            return
        with self._lock:
            self._parts.pop(part.key, None)
        self._on_moved(1)
        part.done(None, Unavailable(
            f"{part.server.address}: no longer the primary of every slot of this part at epoch {route.epoch} "
            f"(was at {part.epoch}); routed again by the new map", epoch=route.epoch, answered=True))


def _moved(part: _Part, route: Route) -> bool:
    """Whether ``route`` names another primary (or none) for some slot of ``part``."""
    try:
        index = route.servers.index(part.server)
    except ValueError:
        return True  # the server left the map
    slots = routing.slot_of(part.ids, route.num_slots)
    return bool((route.primary_of_slot[slots] != index).any())
