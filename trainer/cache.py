"""A bounded cache of hot rows inside one trainer, with bounded staleness per row (in the manner of HET,
Miao et al., VLDB 2022): a step's hot ids are served from copies pulled earlier instead of pulled again.

One ``RowCache`` per PS table. Each cached copy carries a version lag and a clock:

- ``clock``: the table's own pushes issued so far by this trainer (``pushed`` advances it; one per step);
- ``lag[r]``: how many of this trainer's pushes touching id r the copy may not reflect. A copy enters with
  the pushes issued after its pull was sent (``insert(lag=...)``: the pull reflects every push issued before
  it, since the collection pulls with a client bound of 0 when the cache is on); every own push of r adds 1
  (``pushed``), so the trainer's own pushes keep the copy's version exact;
- ``born``: the clock when its pull was sent.

**When a cached copy may be served** (the invariant every ``lookup`` enforces): a copy of row r serves a
forward that comes after ``ahead`` more own pushes, ``pending[r]`` of which touch r, iff

    lag[r] + pending[r] <= staleness        (the table's staleness bound, in own pushes missed)
    and (max_age is None or clock + ahead - born[r] <= max_age)

so a row used by a step never misses more of this trainer's own updates than a fresh pull under the same
staleness bound may. With staleness 0 a copy is served only while no own push has touched its row since
its pull (a training step pushes every row it uses, so hits then come only from rows a step reads without
training them). Pushes of other trainers are not seen, as for fresh pulls (asynchronous SGD);
``max_age`` bounds how many steps a copy may miss them for.

Bounded: at most ``capacity`` rows. When full, an insert evicts copies that can never be served again
(lag or age past the bound) first, then the least frequently used (``policy="lfu"``, uses since insert) or
least recently used (``"lru"``) ones, never the ids in ``protect`` (rows a prefetched step was promised).
Everything is vectorized over whole batches of ids (``SlotIndex``). Not thread-safe: the collection calls
it from its trainer thread only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tigana.ps import InvalidArgument
from tigana.trainer.slots import SlotIndex

__all__ = ["POLICIES", "RowCache"]

POLICIES = ("lfu", "lru")


class RowCache:
    """Up to ``capacity`` rows of PS table ``table`` (width ``dim``), served within ``staleness`` own pushes
    missed and ``max_age`` steps (None: no age bound)."""

    def __init__(self, capacity: int, dim: int, staleness: int, *, max_age: int | None = None,
                 policy: str = "lfu", table: str = "") -> None:
        def bad(field: str, why: str, value: Any) -> InvalidArgument:
            return InvalidArgument(f"table {table!r}: field {field!r} {why}, got {value!r}")

        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise bad("cache_rows", "must be an integer >= 1", capacity)
        if isinstance(staleness, bool) or not isinstance(staleness, (int, np.integer)) or staleness < 0:
            raise bad("staleness", "must be an integer >= 0", staleness)
        if max_age is not None and (isinstance(max_age, bool) or not isinstance(max_age, (int, np.integer))
                                    or max_age < 0):
            raise bad("cache_max_age", "must be None or an integer >= 0", max_age)
        if policy not in POLICIES:
            raise bad("cache_policy", f"must be one of {POLICIES}", policy)
        if dim < 1:
            raise bad("dim", "must be >= 1", dim)
        self.table, self.dim, self.capacity = table, int(dim), int(capacity)
        self.staleness, self.max_age, self.policy = int(staleness), max_age, policy
        self.index = SlotIndex(self.capacity)
        self.rows = np.zeros((self.capacity, self.dim), np.float32)
        self.lag = np.zeros(self.capacity, np.int64)
        self.born = np.zeros(self.capacity, np.int64)
        self.score = np.zeros(self.capacity, np.int64)   # lfu: uses since insert; lru: clock of last use
        self.clock = 0
        self.hits = self.misses = self.inserts = self.evictions = 0

    def __len__(self) -> int:
        return len(self.index)

    # ------------------------------------------------------------------ reads
    def _servable(self, slots: np.ndarray, pending: np.ndarray | None, ahead: int) -> np.ndarray:
        """Which of the (held) ``slots`` satisfy the invariant for a forward ``ahead`` pushes from now."""
        lag = self.lag[slots] if pending is None else self.lag[slots] + pending
        ok = lag <= self.staleness
        if self.max_age is not None:
            ok &= self.clock + ahead - self.born[slots] <= self.max_age
        return ok

    def lookup(self, ids: np.ndarray, *, pending: np.ndarray | None = None, ahead: int = 0) -> np.ndarray:
        """(m,) the slot whose copy may serve each id of ``ids`` at a forward ``ahead`` own pushes from now,
        ``pending`` (m,) of which touch that id (None: none); -1 where no copy may (absent or too stale)."""
        ids = np.asarray(ids, np.int64)
        slots = self.index.find(ids)
        held = np.flatnonzero(slots >= 0)
        if held.size:
            ok = self._servable(slots[held], None if pending is None else np.asarray(pending)[held], ahead)
            slots[held[~ok]] = -1
        return slots

    def read(self, slots: np.ndarray) -> np.ndarray:
        """(k, dim) copies of the rows in ``slots`` (from ``lookup``); counts them as hits and as uses."""
        slots = np.asarray(slots, np.int64)
        self.hits += int(slots.shape[0])
        if self.policy == "lfu":
            self.score[slots] += 1
        else:
            self.score[slots] = self.clock
        return self.rows[slots]

    def miss(self, n: int) -> None:
        """Count ``n`` rows the forward had to pull."""
        self.misses += int(n)

    # ------------------------------------------------------------------ writes
    def insert(self, ids: np.ndarray, rows: np.ndarray, lag: np.ndarray | int = 0, *, born: int | None = None,
               protect: np.ndarray | None = None) -> int:
        """Cache pulled ``rows`` ((m, dim)) of distinct ``ids``; ``lag`` (m,) own pushes of each id issued
        after the pull was sent; ``born`` the clock when it was sent (default: now). Copies that could never
        be served are skipped; an id already held takes the new copy. Returns the rows now cached."""
        ids = np.asarray(ids, np.int64)
        lag = np.broadcast_to(np.asarray(lag, np.int64), ids.shape)
        born = self.clock if born is None else int(born)
        keep = lag <= self.staleness
        if self.max_age is not None and self.clock - born > self.max_age:
            keep[:] = False
        if not keep.all():
            ids, rows, lag = ids[keep], rows[keep], lag[keep]
        if ids.shape[0] == 0:
            return 0
        slots = self.index.find(ids)
        old = slots >= 0
        if old.any():  # a newer copy of a held id: replace it in place
            s = slots[old]
            self.rows[s], self.lag[s], self.born[s] = rows[old], lag[old], born
        new = np.flatnonzero(~old)
        need = new.shape[0] - self.index.free
        if need > 0:
            spared = ids[old] if protect is None else np.concatenate([ids[old], np.asarray(protect, np.int64)])
            new = new[:new.shape[0] - need + self._evict(need, spared)]
        if new.shape[0]:
            s = self.index.add(ids[new])
            self.rows[s], self.lag[s], self.born[s] = rows[new], lag[new], born
            self.score[s] = 1 if self.policy == "lfu" else self.clock
        self.inserts += int(old.sum()) + int(new.shape[0])
        return int(old.sum()) + int(new.shape[0])

    def _evict(self, need: int, spared: np.ndarray) -> int:
        """Free up to ``need`` slots (never those of ``spared`` ids); returns how many were freed. Copies
        that can never be served again go first, then the lowest scores."""
        slots = self.index.used_slots()
        if spared.shape[0]:
            keep = self.index.find(spared)
            slots = np.setdiff1d(slots, keep[keep >= 0], assume_unique=True)
        if slots.shape[0] == 0:
            return 0
        dead = ~self._servable(slots, None, 0)
        # dead copies rank below every live one; ties broken by score
        key = np.where(dead, np.iinfo(np.int64).min, self.score[slots])
        n = min(need, slots.shape[0])
        victims = slots[np.argpartition(key, n - 1)[:n]] if n < slots.shape[0] else slots
        self.index.remove(victims)
        self.evictions += int(victims.shape[0])
        return int(victims.shape[0])

    def pushed(self, ids: np.ndarray) -> None:
        """This trainer issued one push of ``ids`` (distinct): the clock advances, and every held copy of
        those ids misses one more own update."""
        self.clock += 1
        slots = self.index.find(np.asarray(ids, np.int64))
        self.lag[slots[slots >= 0]] += 1

    def clear(self) -> None:
        """Drop every copy (rows changed behind the trainer's back, e.g. a checkpoint restored)."""
        self.index.clear()

    def stats(self) -> dict[str, Any]:
        looked = self.hits + self.misses
        return {"rows": len(self), "capacity": self.capacity, "staleness": self.staleness, "max_age": self.max_age,
                "policy": self.policy, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / looked if looked else 0.0, "inserts": self.inserts,
                "evictions": self.evictions}
