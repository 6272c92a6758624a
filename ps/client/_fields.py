"""The state every room of ``Client`` shares.

``Client`` is assembled from one mixin per concept (``datapath``, ``tables``, ``operations``), each a
subclass of ``ClientFields``, which declares the fields ``Client.__init__`` sets and the methods one room
calls in another, so that each room reads (and type-checks) alone. Thread-safety: the counters are guarded
by ``_stats_lock``, the table states by ``_tables_lock``, the seq and client id by ``_seq_lock``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tigana.ps import routing
from tigana.ps.channels import RetryPolicy
from tigana.ps.client.config import ClientConfig
from tigana.ps.client.mapfollower import MapFollower
from tigana.ps.client.ports import ClientPorts
from tigana.ps.client.routes import Route, Server
from tigana.ps.client.sentparts import SentParts
from tigana.ps.client.tablestate import TableState
from tigana.ps.errors import PSError
from tigana.ps.security import Security


class ClientFields:
    """Fields of a client (set by ``Client.__init__`` and its map callback)."""

    config: ClientConfig
    _ports: ClientPorts  # the I/O: transports, the map source, timers, the clock
    client_id: str
    security: Security
    _options: list
    _server_cache: dict[str, Server]
    _retry: RetryPolicy
    _seq: itertools.count
    _seq_lock: threading.Lock
    _tables: dict[str, TableState]
    _tables_lock: threading.Lock
    _stats_lock: threading.Lock
    _counters: dict[str, int]
    _warned_under_replicated: float
    _push_errors: list[PSError]
    _unraised: list[PSError]
    _closed: bool
    _map: routing.ShardMap | None
    _dropped: set[str]
    _maps: MapFollower | None
    _waiters: list[tuple[int, Callable[[], None]]]
    _waiters_lock: threading.Lock
    _route: Route  # the routing snapshot new operations take
    _parts: SentParts  # parts in flight, given up when a newer map moves their slots
    _servers: list[Server]  # the static list, or the servers up in the current map
    _hold: threading.local  # .frames: a calling thread's parts held to go out together (``DataPath``)

    if TYPE_CHECKING:  # the methods one room calls in another
        @property
        def epoch(self) -> int: ...
        @property
        def addresses(self) -> list[str]: ...
        def flush(self) -> None: ...
        def describe_table(self, name: str) -> Any: ...
        def _state(self, table: str) -> TableState: ...
        def _note_retry(self) -> None: ...
        def _when_epoch(self, epoch: int, fn: Callable[[], None]) -> None: ...
        def _call_all(self, method: str, request_for: Callable[[Server], Any], *, retry: bool,
                      timeout_s: float | None = None) -> list[Any]: ...
