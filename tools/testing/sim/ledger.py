"""The ledger of the simulated trainers' pushes: what was sent, what was acknowledged, what is in doubt.

Every push adds 1 to column 0 of its ids' rows and its own weight (``push_weight``: 1..1000, from its client
and seq) to column 1 (SGD, lr 1, zero rows, gradient -1 and -weight), so the ledger knows, per table and id,
how many pushes were acknowledged (``acked``, their weights ``acked_w``) and sent (``sent``, ``sent_w``), and
which pushes are still in doubt (``doubt``: sent, some ids not acknowledged; given-up pushes stay there). A
copy that must hold every acknowledged push holds exactly ``acked`` plus the pushes in doubt its exactly-once
window says it applied, in both columns: one push applied twice and another lost do not cancel out, as their
weights differ (``exactness``). The trainers that feed it are the real client (``realclient``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["DIM", "Ledger", "Push", "push_weight"]

DIM = 2


@dataclass(eq=False)
class Push:
    """One push of the ledger, under its exactly-once key (``client_id``, ``seq``); ``aliases``: the keys its
    parts were sent again under (a new session), each a ``Push`` of those parts' ids."""

    table: str
    ids: np.ndarray
    seq: int
    started: float = 0.0
    client_id: str = ""
    weight: int = 1
    pending: np.ndarray | None = None  # per id: not acknowledged yet
    slots: np.ndarray | None = None  # per id: its slot (set by the checkers)
    aliases: list[Push] = field(default_factory=list)

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
    doubt: dict[str, dict[tuple[str, int], Push]] = field(default_factory=dict)  # (client id, seq) -> push
    lost_at: np.ndarray | None = None  # per id: when every copy of its slot was last lost (-inf: never)

    def __post_init__(self) -> None:
        self.lost_at = np.full(self.ids, -np.inf)

    def table(self, name: str) -> None:
        for book in (self.acked, self.sent, self.acked_w, self.sent_w):
            book.setdefault(name, np.zeros(self.ids, np.int64))
        self.doubt.setdefault(name, {})

    def sent_push(self, p: Push) -> None:
        self.sent[p.table][p.ids] += 1
        self.sent_w[p.table][p.ids] += p.weight
        self.doubt[p.table][(p.client_id, p.seq)] = p

    def rekeyed(self, table: str, of: tuple[str, int], client_id: str, seq: int, ids: np.ndarray) -> None:
        """Ids ``ids`` of the push first keyed ``of`` were sent again under (``client_id``, ``seq``) (a new
        session): in doubt under that key too, until the push is acknowledged."""
        p = self.doubt.get(table, {}).get(of)
        if p is None:
            return
        alias = Push(table, np.asarray(ids, np.int64), seq, started=p.started, client_id=client_id,
                     weight=p.weight)
        p.aliases.append(alias)
        self.doubt[table][(client_id, seq)] = alias

    def acked_part(self, p: Push, sub: np.ndarray, counted: np.ndarray) -> None:
        """Ids ``sub`` of push ``p`` acknowledged; ``counted``, those of them the ledger keeps (not lost with
        every copy of their slot meanwhile, ``disk.lose_slots``)."""
        self.acked[p.table][counted] += 1
        self.acked_w[p.table][counted] += p.weight
        p.pending &= ~(p.ids[:, None] == sub).any(axis=1)  # a push's few ids: cheaper than np.isin's sort
        if not p.pending.any():
            for q in (p, *p.aliases):
                self.doubt[p.table].pop((q.client_id, q.seq), None)


def push_weight(stamp: int, seq: int) -> int:
    """A push's weight (what it adds to column 1 of its rows): 1..1000, from its client and seq (no draw from
    the world's random source, so the workload's schedule does not depend on it)."""
    return 1 + (seq * 7919 + stamp * 104_729) % 1000
