"""``SentParts``: a part in flight is given up (once) when a newer map names another primary for one of its
slots, and kept otherwise; its late answer is ignored. Unit tier: no sockets, stand-in servers."""

from __future__ import annotations

import numpy as np

from tigana.ps import routing
from tigana.ps.client.routes import Route
from tigana.ps.client.sentparts import SentParts
from tigana.ps.errors import Unavailable

NUM_SLOTS = 64


class _Server:
    def __init__(self, address: str) -> None:
        self.address = address


def _route(epoch: int, servers: list, owners: np.ndarray) -> Route:
    return Route(epoch, servers, owners)


def _setup():
    a, b = _Server("a:1"), _Server("b:1")
    owners = np.zeros(NUM_SLOTS, np.int64)  # a leads every slot
    holder = {"route": _route(1, [a, b], owners)}
    moved: list[int] = []
    parts = SentParts(lambda: holder["route"], moved.append)
    return a, b, holder, parts, moved


def _recorder():
    calls: list[tuple] = []
    return calls, lambda reply, error: calls.append((reply, error))


def test_a_part_whose_slot_moved_is_given_up_once_and_its_late_answer_ignored() -> None:
    a, b, holder, parts, moved = _setup()
    ids = np.arange(100, dtype=np.int64)
    slots = routing.slot_of(ids, NUM_SLOTS)
    calls, done = _recorder()
    settle = parts.track(a, ids, holder["route"], done)
    assert settle is not None and len(parts) == 1
    owners = np.zeros(NUM_SLOTS, np.int64)
    owners[slots[7]] = 1  # one slot of the part now led by b
    holder["route"] = new = _route(2, [a, b], owners)
    assert parts.stranded(new) == 1 and parts.stranded(_route(2, [a, b], np.zeros(NUM_SLOTS, np.int64))) == 0
    assert parts.on_route(new) == 1 and parts.stranded(new) == 0  # what the simulator's L7 checker reads
    assert len(calls) == 1 and calls[0][0] is None
    error = calls[0][1]
    assert isinstance(error, Unavailable) and error.epoch == 2 and error.answered
    settle("late answer", None)  # the abandoned attempt's answer: ignored
    assert len(calls) == 1 and moved == [1] and len(parts) == 0
    assert parts.on_route(new) == 0


def test_a_part_whose_slots_stayed_is_kept_and_settles_by_its_answer() -> None:
    a, b, holder, parts, moved = _setup()
    ids = np.arange(100, dtype=np.int64)
    slots = np.unique(routing.slot_of(ids, NUM_SLOTS))
    calls, done = _recorder()
    settle = parts.track(a, ids, holder["route"], done)
    owners = np.ones(NUM_SLOTS, np.int64)
    owners[slots] = 0  # every other slot moved to b, none of this part's
    holder["route"] = new = _route(2, [a, b], owners)
    assert parts.on_route(new) == 0 and calls == []
    settle("answer", None)
    settle(None, Unavailable("stream broke later"))  # a second completion never reaches the part
    assert calls == [("answer", None)] and moved == [] and len(parts) == 0


def test_a_server_the_map_dropped_loses_its_parts() -> None:
    a, b, holder, parts, _ = _setup()
    calls, done = _recorder()
    parts.track(a, np.arange(10, dtype=np.int64), holder["route"], done)
    holder["route"] = new = _route(2, [b], np.zeros(NUM_SLOTS, np.int64))
    assert parts.on_route(new) == 1 and isinstance(calls[0][1], Unavailable)


def test_a_part_routed_by_a_map_older_than_the_current_is_checked_when_tracked() -> None:
    """The map changed between the route's read and the registration: the scan missed it, ``track`` does not."""
    a, b, holder, parts, moved = _setup()
    old = holder["route"]
    holder["route"] = _route(2, [a, b], np.ones(NUM_SLOTS, np.int64))  # b leads everything now
    calls, done = _recorder()
    assert parts.track(a, np.arange(10, dtype=np.int64), old, done) is None  # not to be sent
    assert len(calls) == 1 and isinstance(calls[0][1], Unavailable) and moved == [1] and len(parts) == 0
    calls2, done2 = _recorder()
    assert parts.track(b, np.arange(10, dtype=np.int64), old, done2) is not None  # b leads them: sent
    assert calls2 == []
