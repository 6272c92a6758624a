"""A simulated trainer: ledger pushes routed by its map, retried (same client id and seq) until acknowledged.

Every push adds 1 to column 0 of its ids' rows and its own weight (``push_weight``: 1..1000, from its client
and seq) to column 1 (SGD, lr 1, zero rows, gradient -1 and -weight), so the ledger knows, per table and id,
how many pushes were acknowledged (``acked``, their weights ``acked_w``) and sent (``sent``, ``sent_w``), and
which pushes are still in doubt (``doubt``: sent, some ids not acknowledged; given-up pushes stay there). A
copy that must hold every acknowledged push holds exactly ``acked`` plus the pushes in doubt its exactly-once
window says it applied, in both columns: one push applied twice and another lost do not cancel out, as their
weights differ (``tools.sim.exactness``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import PSError, TableNotFound
from tigana.ps.routing import ShardMap, slot_of
from tigana.ps.wire import data as wire
from tigana.tools.testing.sim.world import Lost, Net, World

__all__ = ["Ledger", "SimClient"]

DIM = 2


@dataclass(eq=False)
class _Push:
    table: str
    ids: np.ndarray
    seq: int
    left: set[int] = field(default_factory=set)  # part numbers not yet acknowledged
    started: float = 0.0
    client_id: str = ""
    weight: int = 1
    pending: np.ndarray | None = None  # per id: not acknowledged yet
    slots: np.ndarray | None = None  # per id: its slot (set by the checkers)

    def __post_init__(self) -> None:
        if self.pending is None:
            self.pending = np.ones(self.ids.size, bool)


@dataclass
class Ledger:
    ids: int
    acked: dict[str, np.ndarray] = field(default_factory=dict)
    sent: dict[str, np.ndarray] = field(default_factory=dict)
    acked_w: dict[str, np.ndarray] = field(default_factory=dict)
    sent_w: dict[str, np.ndarray] = field(default_factory=dict)
    doubt: dict[str, dict[tuple[str, int], _Push]] = field(default_factory=dict)  # (client id, seq) -> push
    lost_at: np.ndarray | None = None  # per id: when every copy of its slot was last lost (-inf: never)

    def __post_init__(self) -> None:
        self.lost_at = np.full(self.ids, -np.inf)

    def table(self, name: str) -> None:
        for book in (self.acked, self.sent, self.acked_w, self.sent_w):
            book.setdefault(name, np.zeros(self.ids, np.int64))
        self.doubt.setdefault(name, {})

    def sent_push(self, p: _Push) -> None:
        self.sent[p.table][p.ids] += 1
        self.sent_w[p.table][p.ids] += p.weight
        self.doubt[p.table][(p.client_id, p.seq)] = p

    def acked_part(self, p: _Push, sub: np.ndarray, counted: np.ndarray) -> None:
        """Ids ``sub`` of push ``p`` acknowledged; ``counted``, those of them the ledger keeps (not lost with
        every copy of their slot meanwhile, ``disk.lose_slots``)."""
        self.acked[p.table][counted] += 1
        self.acked_w[p.table][counted] += p.weight
        p.pending &= ~np.isin(p.ids, sub)
        if not p.pending.any():
            self.doubt[p.table].pop((p.client_id, p.seq), None)


def push_weight(stamp: int, seq: int) -> int:
    """A push's weight (what it adds to column 1 of its rows): 1..1000, from its client and seq (no draw from
    the world's random source, so the workload's schedule does not depend on it)."""
    return 1 + (seq * 7919 + stamp * 104_729) % 1000


class SimClient:
    """One client (a client id) of the simulated cluster; ``servers`` maps server ids to ``SimServer``s."""

    def __init__(self, world: World, net: Net, name: str, stamp: int, scheduler: Any, servers: dict[str, Any],
                 ledger: Ledger, num_slots: int, give_up_s: float = 60.0) -> None:
        self.world, self.net, self.name, self.scheduler, self.servers = world, net, name, scheduler, servers
        self.client_id = f"{stamp:016x}.{name:0>32}"[:49]
        self.stamp = stamp
        self.ledger, self.num_slots, self.give_up_s = ledger, num_slots, give_up_s
        self.map: ShardMap | None = None
        self.seq = 0
        self.pushes: dict[int, _Push] = {}
        self.failed = 0  # pushes given up on (neither acknowledged nor known lost)
        self.to_dropped_tables = 0  # pushes whose (scratch) table was dropped under them
        self.acked = 0
        self.pulls = 0  # pulls answered
        self.doubled: list[str] = []  # pulls that read a row above the pushes ever sent to it (S6)

    def refresh(self) -> None:
        try:
            m = self.net.now_call(self.name, "scheduler", lambda: self.scheduler.core.map)
        except Lost:
            return
        if self.map is None or m.epoch > self.map.epoch:
            self.map = m

    def push(self, table: str, ids: np.ndarray) -> None:
        self.seq += 1
        p = _Push(table, ids, self.seq, started=self.world.now, client_id=self.client_id,
                  weight=push_weight(self.stamp, self.seq))
        self.pushes[self.seq] = p
        self.ledger.sent_push(p)
        self._send(p, ids, part=0)

    def _send(self, p: _Push, ids: np.ndarray, part: int) -> None:
        """Send ``ids`` of push ``p`` to their primaries by the current map (one message per server)."""
        if self.map is None:
            self.refresh()
        m = self.map
        if m is None or self.world.now - p.started > self.give_up_s:
            self._give_up(p)
            return
        owner = m.copies[slot_of(ids, self.num_slots), 0]
        for k, o in enumerate(np.unique(owner)):
            sub = ids[owner == o]
            key = part * 64 + k + 1
            p.left.add(key)
            if o < 0:  # no primary now: try again on a newer map
                self.world.at(0.05, lambda sub=sub, key=key: self._again(p, sub, key))
                continue
            server = self.servers[m.servers[int(o)].id]
            request = pb.PushRequest(table=p.table, ids=wire.encode_ids(sub),
                                     grads=wire.encode_rows(np.repeat([[-1.0, -p.weight]], sub.size, 0)
                                                            .astype(np.float32)),
                                     client_id=self.client_id, seq=p.seq, epoch=m.epoch)
            waiting = {"open": True, "sent": self.world.now}

            def answered(result: Any, error: BaseException | None, sub=sub, key=key, waiting=waiting) -> None:
                if not waiting["open"]:
                    return
                waiting["open"] = False
                if error is None:
                    self._part_done(p, key, sub, sub[self.ledger.lost_at[sub] < waiting["sent"]])
                elif isinstance(error, TableNotFound) and p.table.startswith("scratch"):
                    self._dropped(p)  # its table was dropped meanwhile: the push ends there
                elif isinstance(error, (PSError, Lost)):
                    self.world.at(0.02 + self.world.rng.random() * 0.05, lambda: self._again(p, sub, key))
                else:  # a bug in the server: a test failure, not a retry
                    raise error

            self.net.call(self.name, server.name, lambda s=server, r=request: s.push(r), answered,
                          timeout_s=1.0)
            # a deferred answer from a server that died never comes: the deadline of the call
            self.world.at(8.0, lambda answered=answered: answered(None, Lost("deadline")))

    def pull(self, table: str, ids: np.ndarray, read_only: bool) -> None:
        """One pull, sent once to the primaries of ``ids`` by the current map (a failure is not retried): an
        inserting pull creates rows the pushes never touched, so its sightings replicate too; every answer
        is checked against the ledger (no row above the pushes sent)."""
        if self.map is None:
            self.refresh()
        m = self.map
        if m is None or table not in m.tables:
            return
        owner = m.copies[slot_of(ids, self.num_slots), 0]
        sent = self.ledger.sent[table]
        for o in np.unique(owner[owner >= 0]):
            sub = ids[owner == o]
            server = self.servers[m.servers[int(o)].id]
            request = pb.PullRequest(table=table, ids=wire.encode_ids(sub), epoch=m.epoch, read_only=read_only)

            def answered(result: Any, error: BaseException | None, sub=sub, server=server) -> None:
                if error is not None:
                    if not isinstance(error, (PSError, Lost)):
                        raise error
                    return
                self.pulls += 1
                values = np.rint(result[:, 0]).astype(np.int64)
                inside = sub < sent.size
                over = values[inside] > sent[sub[inside]]
                if over.any() or (values[~inside] != 0).any():
                    self.doubled.append(f"S6: a pull of {table} from {server.name} read id "
                                        f"{int(sub[inside][over][0]) if over.any() else int(sub[~inside][0])} "
                                        "above the pushes sent")

            self.net.call(self.name, server.name, lambda s=server, r=request: s.pull(r), answered, timeout_s=1.0)

    def _again(self, p: _Push, sub: np.ndarray, key: int) -> None:
        p.left.discard(key)
        self.refresh()
        self._send(p, sub, part=key)

    def _part_done(self, p: _Push, key: int, sub: np.ndarray, counted: np.ndarray) -> None:
        # A part's acknowledgement is the server's promise for its ids (a later part may fail or be lost); an
        # answer that crossed the loss of every copy of its slot promises nothing (``disk.lose_slots``).
        if key in p.left and p.seq in self.pushes:
            self.ledger.acked_part(p, sub, counted)
        p.left.discard(key)
        if not p.left and p.seq in self.pushes:
            del self.pushes[p.seq]
            self.acked += 1

    def _dropped(self, p: _Push) -> None:
        if self.pushes.pop(p.seq, None) is not None:
            self.to_dropped_tables += 1

    def _give_up(self, p: _Push) -> None:
        if self.pushes.pop(p.seq, None) is not None:
            self.failed += 1

    @property
    def in_flight(self) -> int:
        return len(self.pushes)
