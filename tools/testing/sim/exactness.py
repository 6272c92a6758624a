"""The ledger's exact checks, after every step (docs/replication.md S1, S6, S7, S8): per table, id and copy,
neither lost nor applied twice.

What the trainers know (``ledger.Ledger``): per id, the pushes acknowledged (count and weight sum) and the
pushes still in doubt (sent, not acknowledged: in flight, or given up). A copy that must hold every
acknowledged push (an in-sync copy of a sync table; the primary of an async table that never lost its
primary unplanned) holds exactly ``acked`` plus the pushes in doubt that its own exactly-once window records
as applied, in both columns (a count and a weight sum): below is a lost update (S1 for a sync copy, S7 for an
async primary), above is one applied twice (S6), and a count that matches with a weight that does not is one
push applied twice and another lost (S6). Every other copy stays within what was sent (S6). Where the window
cannot tell (a seq it evicted, a client it may have forgotten) only the bounds are checked for those ids.

S8 (whole): each push a server applied during the step added to every id of the slots it applied, on that
server (its values before the step against after).

Values are read once per server and table each time the server may have changed them (``SimServer.stamp``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tigana.ps.routing import CATCHING_UP, slot_of
from tigana.ps.session import client_stamp
from tigana.ps.wire import data as wire
from tigana.tools.testing.sim import kernels
from tigana.tools.testing.sim.memo import Passed

__all__ = ["LEDGERS", "Exactness", "window_record"]

LEDGERS = ("ledger_sync", "ledger_async")
ASYNC_GRACE_S = 5.0  # after an unplanned primary change, a deposed primary may still acknowledge (its lease)
_NO_VALUES = np.zeros((0, 2), np.int64)  # ``kernels.rounded``'s cached rows where none are cached


def window_record(window: Any, client_id: str, seq: int) -> tuple[np.ndarray | None, np.ndarray | None] | None:
    """What ``window`` (a ``DedupWindow``) records of ``seq`` of ``client_id``, read from its records (not
    through ``applied``, which a mutation test may replace): (the slots' bitmap it applied the seq for, None:
    none of them; the bitmap of blind slots, which it may lack records for, or None), or None where it cannot
    tell for any slot (a seq below its floor and not kept, a client it may have forgotten). Bitmaps: (nbytes,)
    uint8, slot ``s`` at bit ``s & 7`` of byte ``s >> 3``."""
    c = window._clients.get(client_id)
    if c is None:
        return None if client_stamp(client_id) <= window.horizon else (None, None)
    row = c.row_of_seq.get(seq)
    if row is None and seq <= c.floor:
        return None
    return (None if row is None else c.bits[row]), c.blind


class Exactness:
    """S1, S6, S7 and S8 over the run's ledger (``run``: a ``simulation._Run``)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        n = run.s.ids
        self._values: dict[tuple[str, str], tuple[tuple[int, int], Any, Any, np.ndarray]] = {}  # (stamp, hosted, view, values)
        self._before: dict[tuple[str, str], np.ndarray] = {}
        self.async_loss_until = np.full(run.s.num_slots, -np.inf)  # per slot: async losses allowed until then
        self.async_allow = np.zeros(n, np.int64)  # per id: acknowledged async pushes that may be lost
        self.async_lost_ever = np.zeros(n, bool)
        self.passed = Passed()  # (server, table): the inputs its last check passed with
        self._map: Any = None  # the map the per-map arrays below are of
        self._held: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # server index -> (held, primary) per id
        self._join: tuple[list, tuple[np.ndarray, ...]] | None = None  # the pushes in doubt last joined (``_joined``)

    # --- reading the copies ---
    def values(self, server: Any, hosted: Any) -> np.ndarray:
        """(ids, 2) int64: the table's rows as ``server`` holds them now (cached while it changed nothing: no
        call, no map installed). A read equal to the cached one returns the cached array itself, so that a
        checker may take the array's identity for its content (``memo.Passed``)."""
        name = hosted.spec.config.name
        key, stamp = (server.name, name), server.stamp(name)
        view = server.svc.holdings.view
        cached = self._values.get(key)
        if cached is not None and cached[0] == stamp and cached[1] is hosted and cached[2] is view:
            return cached[3]
        rows = np.ascontiguousarray(hosted.table.peek(self.run.ids)[0], np.float32)
        values = np.empty(rows.shape, np.int64)
        same = kernels.rounded(rows, _NO_VALUES if cached is None else cached[3], values)  # rint, as int64
        if same and cached is not None:
            values = cached[3]
        self._values[key] = (stamp, hosted, view, values)
        return values

    def primary_lost(self, slots: np.ndarray) -> None:
        """Slots whose primary changed unplanned (died, or deposed): async writes it acknowledged may be lost,
        also those it acknowledges for a while after (it may not know yet)."""
        self.async_loss_until[slots] = self.run.world.now + ASYNC_GRACE_S

    def _in_doubt(self, window: Any, pushes: list, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per id of the universe: (count, weight sum) of the pushes in doubt ``window`` records as applied for
        the slots of ``ids`` (bool mask), and the ids it cannot tell about (every id of a push with a slot it
        cannot tell about: blind and not recorded). One pass over every push's ids at once."""
        n = self.run.s.ids
        e0, e1, unknown = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
        if not pushes:
            return e0, e1, unknown
        owner, at, slot, pending, weight = self._joined(pushes)
        if not kernels.kept_in_doubt(pending, at, ids):  # no push in doubt of these ids: nothing to read of the window
            return e0, e1, unknown
        nbytes = (self.run.s.num_slots + 7) // 8
        applied = np.zeros((len(pushes), nbytes), np.uint8)  # per push: the slots the window applied it for
        blind = np.zeros((len(pushes), nbytes), np.uint8)  # ... the slots it may lack records of
        untold = np.zeros(len(pushes), bool)  # ... the window cannot tell for any slot
        for j, p in enumerate(pushes):
            record = window_record(window, p.client_id, p.seq)
            if record is None:
                untold[j] = True
                continue
            if record[0] is not None:
                applied[j] = record[0]
            if record[1] is not None:
                blind[j] = record[1]
        kernels.applied_in_doubt(owner, at, slot, pending, weight, ids, applied, blind, untold, e0, e1, unknown)
        return e0, e1, unknown  # weight sums far below 2**53

    def _joined(self, pushes: list) -> tuple[np.ndarray, ...]:
        """Every push's ids at once: (push of each, id, slot, pending) per id and (weight) per push. Joined once
        per list: a check reads the same list of pushes in doubt for every copy of a table."""
        if self._join is not None and self._join[0] is pushes:
            return self._join[1]
        num_slots = self.run.s.num_slots
        for p in pushes:
            if p.slots is None:
                p.slots = slot_of(p.ids, num_slots)
        joined = (np.repeat(np.arange(len(pushes)), [p.ids.size for p in pushes]),
                  np.concatenate([p.ids for p in pushes]), np.concatenate([p.slots for p in pushes]),
                  np.concatenate([p.pending for p in pushes]), np.array([p.weight for p in pushes], np.float64))
        self._join = (pushes, joined)
        return joined

    # --- the checks ---
    def check(self, pushed: dict[str, list]) -> list[str]:
        """The violations now (``pushed``: per server, the pushes it applied during the step). A server's copy
        of a table is checked again only when something it is checked by changed since it last passed: the
        map, the server (a call, a map installed, a restart), the ledger's books of the table (``memo``)."""
        run = self.run
        m = run.scheduler.core.map
        if not m.servers or LEDGERS[0] not in m.tables:
            return []
        out = self._whole(pushed)
        ledger, slots = run.ledger, run.slots
        now = run.world.now
        losing = self.async_loss_until[slots] >= now
        if losing.any():
            self.async_allow = np.where(losing, ledger.acked[LEDGERS[1]], self.async_allow)
            self.async_lost_ever |= losing
        lost = np.isfinite(ledger.lost_at)  # every copy of their slot lost at once (``disk.lose_slots``)
        if m is not self._map:
            self._map, self._held = m, {}
        in_col = m.copies[slots]  # (ids, copies)
        shared = (ledger.lost_at.tobytes(),)
        for name in LEDGERS:
            spec = m.tables.get(name)
            if spec is None:
                continue
            sync = name == LEDGERS[0]
            acked, acked_w = ledger.acked[name], ledger.acked_w[name]
            sent, sent_w = ledger.sent[name], ledger.sent_w[name]
            books = doubt = None
            for i, entry in enumerate(m.servers):
                server = run.servers.get(entry.id)
                if server is None or not server.alive or server.svc is None or server.svc.boot != entry.boot:
                    continue
                held, primary = self._roles(m, i, in_col)
                hosted = server.svc.tables.find(name)
                if hosted is None or hosted.spec.created_epoch != spec.created_epoch:
                    if sync and held.any() and acked[held].any():
                        out.append(f"S1: {entry.id} is an in-sync copy of {name} without the table")
                    continue
                v = self.values(server, hosted)
                view = server.svc.holdings.view
                if books is None:  # what the ledger knows of the table, as the checks read it
                    doubt = list(ledger.doubt[name].values())
                    books = (*shared, acked.tobytes(), acked_w.tobytes(), sent.tobytes(), sent_w.tobytes(),
                             tuple((p.client_id, p.seq, p.pending.tobytes()) for p in doubt))
                    if not sync:
                        books += (losing.tobytes(), self.async_allow.tobytes(), self.async_lost_ever.tobytes())
                subject, objects = (entry.id, name), (m, server.svc, hosted, hosted.dedup, view, v)
                values = (server.stamp(name), books)
                if self.passed.again(subject, objects, values):
                    continue
                found = self._copy(entry.id, name, sync, v, held, primary, lost, losing, server, hosted, doubt,
                                   acked, acked_w, sent, sent_w, m.epoch)
                if found:
                    self.passed.failed(subject, found[0])
                    return out + found
                digest = self._digest(name, hosted, view, doubt, losing) if Passed.verify else None
                self.passed.passed(subject, objects, values, digest)
        return out

    def _digest(self, name: str, hosted: Any, view: Any, doubt: list, losing: np.ndarray) -> tuple[bytes, ...]:
        """What a copy's check reads, read afresh past every cache (``memo.Passed.verify`` only): its rows, its
        view's leads, its window's records of every push in doubt, and the ledger's books of the table."""
        run, ids = self.run, self.run.ids
        fresh = np.rint(hosted.table.peek(ids)[0]).astype(np.int64)
        every = np.ones(ids.shape[0], bool)
        books = [run.ledger.lost_at] + [getattr(run.ledger, book)[name] for book in ("acked", "acked_w", "sent", "sent_w")]
        if name != LEDGERS[0]:  # what only an async table's check reads
            books += [losing, self.async_allow, self.async_lost_ever]
        return (fresh.tobytes(), view.leads.tobytes() if view.valid else b"",
                *(a.tobytes() for a in self._in_doubt(hosted.dedup, doubt, every)), *(a.tobytes() for a in books))

    def _roles(self, m: Any, i: int, in_col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per id of the universe: whether server ``i`` of map ``m`` holds its slot in sync, and leads it."""
        got = self._held.get(i)
        if got is None:
            in_sync = m.states[self.run.slots] != CATCHING_UP
            got = self._held[i] = (((in_col == i) & (in_col != -1) & in_sync).any(axis=1), in_col[:, 0] == i)
        return got

    def _copy(self, who: str, name: str, sync: bool, v: np.ndarray, held: np.ndarray, primary: np.ndarray,
              lost: np.ndarray, losing: np.ndarray, server: Any, hosted: Any, doubt: list, acked: np.ndarray,
              acked_w: np.ndarray, sent: np.ndarray, sent_w: np.ndarray, epoch: int) -> list[str]:
        """The violations of one server's copy of one ledger table (values ``v``): above what was sent (S6);
        the ids it must hold exactly (``_exact``): a sync table's in-sync copy, an async table's primary that
        leads the slot and lost no acknowledged write; the floor of the ids lost with every copy (S1). One pass
        (``kernels.copy_verdict``) finds the first of each."""
        view = server.svc.holdings.view
        must = np.empty(v.shape[0], bool)  # ids it must hold exactly, less those lost with every copy
        over, any_must, short = kernels.copy_verdict(v, sent, sent_w, acked, held, primary, view.leads,
                                                     bool(view.valid), self.run.slots, losing, lost, sync, must)
        if over >= 0:
            k = over  # the first one
            return [f"S6: {who} {name} id {k} at {v[k].tolist()}, only {sent[k]} push(es) of it were sent, "
                    f"weighing {sent_w[k]} (applied twice)"]
        out = self._exact(who, name, sync, v, must, primary, hosted.dedup, doubt, acked, acked_w, epoch) if any_must else []
        if sync and not out and short >= 0:  # ids lost with every copy of their slot: at least the floor ``lose_slots`` left
            k = short
            out.append(f"S1: {who} (in sync for slot {int(self.run.slots[k])} at epoch {epoch}) has {name} "
                       f"id {k} at {v[k, 0]}, {acked[k]} acknowledged since its last snapshot")
        return out

    def _exact(self, who: str, name: str, sync: bool, v: np.ndarray, must: np.ndarray, primary: np.ndarray,
               window: Any, doubt: list, acked: np.ndarray, acked_w: np.ndarray, epoch: int) -> list[str]:
        """The first violation of the ids ``must`` holds exactly (``kernels.exact_verdict``, in this precedence):
        lost (S1, S7), applied twice (S6), one push twice and another lost (S6), and among the ids whose pushes
        in doubt its window cannot tell, one below what was acknowledged (less, for an async table, what may
        have been lost with a primary)."""
        e0, e1, unknown = self._in_doubt(window, doubt, must)
        code, k = kernels.exact_verdict(v, must, e0, e1, unknown, acked, acked_w, self.async_allow,
                                        self.async_lost_ever, sync)
        slots = self.run.slots
        rule = "S1" if sync else "S7"
        if code == kernels.LOW:
            role = "primary" if primary[k] else "in-sync copy"
            return [f"{rule}: {who} ({role} of slot {int(slots[k])} at epoch {epoch}) has {name} id {k} at "
                    f"{v[k].tolist()}, {acked[k]} push(es) acknowledged weighing {acked_w[k]} and {e0[k]} in "
                    f"doubt applied here weighing {e1[k]} (lost)"]
        if code == kernels.HIGH:
            return [f"S6: {who} has {name} id {k} at {v[k].tolist()}: {acked[k]} push(es) acknowledged and "
                    f"{e0[k]} in doubt applied here (its exactly-once window) make {acked[k] + e0[k]} (applied twice)"]
        if code == kernels.SWAP:
            return [f"S6: {who} has {name} id {k} at {v[k].tolist()}: the right number of pushes, but weighing "
                    f"{v[k, 1]}, not {acked_w[k] + e1[k]}: one push applied twice and another lost"]
        if code == kernels.LOOSE:
            allow = np.zeros_like(acked) if sync else self.async_allow
            return [f"{rule}: {who} (slot {int(slots[k])} at epoch {epoch}) has {name} id {k} at {v[k, 0]}, "
                    f"{acked[k]} acknowledged ({allow[k]} of them may have been lost with a primary)"]
        return []

    def _whole(self, applied: dict[str, list]) -> list[str]:
        """S8: every push applied during the step (``SimServer.pushed``) added to each id of the slots it
        applied, on the server that applied it (its values before the step, against now)."""
        out = []
        for server in self.run.servers.values():
            pushed = applied.get(server.name, [])
            if not server.alive or server.svc is None:
                self._before = {k: v for k, v in self._before.items() if k[0] != server.name}
                continue
            for request, p in pushed:
                if p.duplicate or p.name not in LEDGERS:
                    continue
                hosted = server.svc.tables.find(p.name)
                before = self._before.get((server.name, p.name))
                ids = wire.decode_ids(request.ids, table=p.name)
                if hosted is None or before is None or p.rows != ids.size:
                    continue  # partly a duplicate: which slots it applied now is not told apart here
                now = self.values(server, hosted)
                k = kernels.first_unchanged(ids, self.run.s.ids, server.svc.holdings.view.leads,
                                            self.run.s.num_slots, now, before)
                if k >= 0:
                    out.append(f"S8: {server.name} applied push seq {request.seq} of {p.name} in part: id "
                               f"{k} unchanged at {now[k].tolist()}")
        for server in self.run.servers.values():
            if server.alive and server.svc is not None:
                for name in LEDGERS:
                    hosted = server.svc.tables.find(name)
                    if hosted is not None:
                        self._before[(server.name, name)] = self.values(server, hosted)
        return out
