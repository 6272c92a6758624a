"""The client's I/O, as ports: where its parts go, how it follows the map, its timers and its clock.

``Client`` decides (routing, parts in flight, retries, sessions: ``inflight``, ``sentparts``) and leaves the
I/O to ports. The defaults are the daemon-facing ones: a gRPC ``routes.Server`` per shard server, a
``MapFollower`` long-polling the scheduler, ``threading.Timer``, ``time.monotonic`` and session ids stamped
by the wall clock. The deterministic
simulator (``tigana.tools.testing.sim.realclient``) plugs in its own (the world's network, event queue and clock),
so the client it drives runs the same code as a trainer's.

Contracts (what every implementation keeps):

- ``Transport`` (one per server address): ``send(kind, parts, timeout_s, done, on_retry)`` returns at once
  and calls ``done(reply, error)`` exactly once, later, with the reply (``pb.PushResponse`` for a push,
  ``wire.RawRows`` for a pull) or a ``PSError``; ``cancel_all()`` settles the calls open to it with
  ``Unavailable``. ``permits`` bounds the push messages outstanding (``acquire``/``release``).
- ``MapSource``: ``fetch(timeout_s)`` returns the first map (delivering it to ``on_map``), ``start()``
  follows newer ones, ``refresh(min_epoch)`` and ``report_unreachable(address)`` never block; ``on_map``
  gets every newer map, in epoch order.
- ``call_later(delay_s, fn)`` runs ``fn()`` once, ``delay_s`` seconds on the ``clock``, never in the calling
  frame (callers may hold a lock that ``fn`` takes).
- ``describe_table(name)`` (optional) returns the table's ``TableInfo`` or raises ``TableNotFound`` naming
  it; None: a ``DescribeTable`` call to every shard server (the client asks once per table, for its width).
- ``on_push(PushKeyed)`` (optional) is told each exactly-once key a push takes: when the push starts, and when
  a part of it is sent again under a new session (``of``: the push's first key). Called on the thread that
  starts the push or the part, before anything is sent; it must not block. The simulator's exact ledger
  keys the pushes in doubt by it.

Thread-safety: the defaults may be used from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tigana.ps.errors import PSError
from tigana.ps.routing import ShardMap
from tigana.ps.session import new_client_id

if TYPE_CHECKING:
    from tigana.ps.client.tables import TableInfo

Done = Callable[[Any, "PSError | None"], None]


class Transport(Protocol):
    """Sends a pull or push part to one shard server (see the module docstring)."""

    address: str
    permits: Any

    def send(self, kind: int, parts: list, timeout_s: float, done: Done, on_retry: Callable[[], None]) -> None: ...

    def send_many(self, items: list[tuple[int, list, Done]], timeout_s: float,
                  on_retry: Callable[[], None]) -> None: ...

    def cancel_all(self) -> int: ...

    def close(self) -> None: ...


class MapSource(Protocol):
    """The scheduler as the client follows it (see the module docstring)."""

    addresses: list[str]
    epoch: int

    def fetch(self, timeout_s: float) -> ShardMap: ...

    def start(self) -> None: ...

    def refresh(self, min_epoch: int = 0) -> None: ...

    def report_unreachable(self, address: str) -> None: ...

    def close(self) -> None: ...


def call_later(delay_s: float, fn: Callable[[], None]) -> None:
    """``fn()`` on a timer thread ``delay_s`` seconds from now (the default ``ClientPorts.call_later``)."""
    timer = threading.Timer(delay_s, fn)
    timer.daemon = True
    timer.start()


@dataclass(frozen=True)
class PushKeyed:
    """An exactly-once key (``client_id``, ``seq``) a push took: as it started (``of`` None), or for a part of
    it sent again under a new session (``of``: the key the push started with). ``ids``: (k,) int64, the
    distinct ids sent under this key."""

    table: str
    client_id: str
    seq: int
    ids: np.ndarray
    of: tuple[str, int] | None = None


@dataclass(frozen=True)
class ClientPorts:
    """The I/O a ``Client`` runs on. ``transport(address)``: a ``Transport`` to that shard server (None: gRPC,
    ``routes.Server``); ``map_source(addresses, on_map)``: the scheduler's map (None: ``MapFollower``);
    ``describe_table`` and ``on_push``: see the module docstring."""

    clock: Callable[[], float] = time.monotonic
    call_later: Callable[[float, Callable[[], None]], None] = call_later
    transport: Callable[[str], Transport] | None = None
    map_source: Callable[[str, Callable[[ShardMap], None]], MapSource] | None = None
    new_session: Callable[[int], str] = new_client_id
    describe_table: Callable[[str], TableInfo] | None = None
    on_push: Callable[[PushKeyed], None] | None = None
