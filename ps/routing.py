"""Ids → virtual slots → servers, and the shard map that says which server holds which slot. No I/O.

An id's slot is a stable 64-bit mix (splitmix64's finalizer) of the id modulo ``num_slots``; slots, not ids,
are what servers hold, so moving a slot moves a well-defined set of rows. Which servers hold a slot is data:

- a static shard list assigns contiguous slot ranges in order (``static_assignment``), one copy each;
- with a scheduler, the ``ShardMap``: for every slot, its copies (column 0 the primary, the others replicas),
  each in sync or catching up, the servers by index, the tables, and an ``epoch`` that grows on every change.

A map is immutable; the scheduler derives the next one with ``ShardMap.evolve`` (epoch + 1, and every slot
whose copies changed gets that epoch as its ``slot_epochs`` entry).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tigana.embeddings.config import TableConfig
from tigana.embeddings.mixing import mix64, mix64_scalar, slots_of_keys  # mix64* re-exported for the trainer
from tigana.ps import _kernels
from tigana.ps.domains import FailureDomain

__all__ = ["DEFAULT_NUM_SLOTS", "IN_SYNC", "CATCHING_UP", "HANDING_OVER", "NO_SERVER", "ServerEntry", "ShardMap", "TableDef",
           "group_keys", "mix64", "mix64_scalar", "parse_slots", "slot_of", "slot_range", "split_by_owner", "static_assignment"]

DEFAULT_NUM_SLOTS = 4096
IN_SYNC, CATCHING_UP = 0, 1  # a copy's state (wire: CopyState)
HANDING_OVER = 2  # column 0 only: an in-sync primary refusing writes while it hands its role over
NO_SERVER = -1
DURABILITIES = ("sync", "async")


def slot_of(ids: np.ndarray, num_slots: int = DEFAULT_NUM_SLOTS) -> np.ndarray:
    """Slot of each id, int64 in [0, num_slots): mix64 of the id (its 64 bits) modulo ``num_slots``."""
    ids = np.asarray(ids)
    if ids.dtype not in (np.int64, np.uint64):
        return slots_of_keys(ids, num_slots)
    out = np.empty(ids.shape, np.int64)
    _kernels.slots_of(np.ascontiguousarray(ids).reshape(-1), num_slots, out.reshape(-1))
    return out


def static_assignment(num_servers: int, num_slots: int = DEFAULT_NUM_SLOTS) -> np.ndarray:
    """The server index of each slot's primary for a static list of ``num_servers`` (its only copy):
    contiguous, near-equal ranges."""
    if num_servers < 1:
        raise ValueError("num_servers must be >= 1")
    return (np.arange(num_slots, dtype=np.int64) * num_servers) // num_slots


def slot_range(index: int, num_servers: int, num_slots: int = DEFAULT_NUM_SLOTS) -> tuple[int, int]:
    """[start, stop) of the slots server ``index`` of ``num_servers`` leads under ``static_assignment``."""
    primaries = static_assignment(num_servers, num_slots)
    hits = np.flatnonzero(primaries == index)
    return int(hits[0]), int(hits[-1]) + 1


def parse_slots(text: str, num_slots: int = DEFAULT_NUM_SLOTS) -> np.ndarray:
    """Parse ``"0-2047,4000"`` (inclusive ranges) into a bool mask of the slots named; ``"all"`` or ``""`` names
    all."""
    mask = np.zeros(num_slots, dtype=bool)
    if text.strip() in ("", "all"):
        mask[:] = True
        return mask
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        start, stop = int(lo), int(hi or lo)
        if not 0 <= start <= stop < num_slots:
            raise ValueError(f"slots: range {part!r} outside [0, {num_slots})")
        mask[start:stop + 1] = True
    return mask


def format_slots(slots: Iterable[int]) -> str:
    """``[0, 1, 2, 7]`` -> ``"0-2,7"`` (the inverse of ``parse_slots`` for a list)."""
    s = sorted({int(x) for x in slots})
    out: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def split_by_owner(owners_of_ids: np.ndarray, num_owners: int) -> list[np.ndarray]:
    """Positions of the ids each owner gets (a list of int64 index arrays, one per owner), order kept."""
    order = np.argsort(owners_of_ids, kind="stable")
    bounds = np.searchsorted(owners_of_ids[order], np.arange(num_owners + 1))
    return [order[bounds[i]:bounds[i + 1]] for i in range(num_owners)]


def group_keys(primary_of_slot: np.ndarray, num_servers: int) -> tuple[np.ndarray, np.ndarray]:
    """Order the slots by primary, then by slot: ``(key_of_slot, primary_starts)``.

    ``key_of_slot[s]`` is slot s's rank in that order, so bucketing ids by it groups them by primary and,
    within a primary, by slot; the slots of server o's primaries hold keys ``[primary_starts[o],
    primary_starts[o + 1])``. Slots without a primary (``NO_SERVER``) come last, as server ``num_servers``."""
    primaries = np.where(primary_of_slot < 0, num_servers, primary_of_slot).astype(np.int64)
    order = np.argsort(primaries, kind="stable")
    key_of_slot = np.empty(primary_of_slot.shape[0], np.int64)
    key_of_slot[order] = np.arange(primary_of_slot.shape[0], dtype=np.int64)
    primary_starts = np.searchsorted(primaries[order], np.arange(num_servers + 2)).astype(np.int64)
    return key_of_slot, primary_starts


@dataclass(frozen=True)
class ServerEntry:
    """A server in the map: stable ``id``, ``address`` (host:port), ``boot`` (process incarnation the map's
    copies on it belong to), whether the scheduler considers it ``up``, and the failure ``domain`` it runs in."""

    id: str
    address: str
    boot: str = ""
    up: bool = True
    domain: FailureDomain = FailureDomain()


@dataclass(frozen=True)
class TableDef:
    """A table of the cluster: its storage config and how pushes are acknowledged.

    durability: "sync" (after every in-sync copy applied the push) or "async" (at once; replicas follow).
    min_copies: with sync, a push to a slot with fewer in-sync copies than this is rejected."""

    config: TableConfig
    durability: str = "sync"
    min_copies: int = 1
    # The map epoch that created this incarnation of the table (set by the scheduler; 0 for a static list).
    # Not part of the spec's equality: a client's spec never carries it. A table dropped and created again
    # under the same name is a new incarnation, and replication items of the old one are moot.
    created_epoch: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.durability not in DURABILITIES:
            raise ValueError(f"table {self.config.name!r}: durability must be one of {DURABILITIES}, "
                             f"got {self.durability!r}")
        if self.min_copies < 1:
            raise ValueError(f"table {self.config.name!r}: min_copies must be >= 1, got {self.min_copies}")


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class ShardMap:
    """The cluster's routing table at one ``epoch``. Arrays are read-only; ``evolve`` makes the next map.

    copies:      (num_slots, width) int32 server indexes, ``NO_SERVER`` padded; column 0 is the primary
                 (``NO_SERVER`` there: the slot has no primary now)
    states:      (num_slots, width) uint8, ``IN_SYNC`` or ``CATCHING_UP`` per copy
    slot_epochs: (num_slots,) uint64, the epoch at which each slot's copies last changed
    """

    epoch: int
    num_slots: int
    replicas: int
    servers: tuple[ServerEntry, ...]
    copies: np.ndarray
    states: np.ndarray
    slot_epochs: np.ndarray
    tables: Mapping[str, TableDef] = field(default_factory=dict)
    cluster_id: str = ""

    def __post_init__(self) -> None:
        copies = np.asarray(self.copies, np.int32)
        if copies.ndim != 2 or copies.shape[0] != self.num_slots or copies.shape[1] < 1:
            raise ValueError(f"shard map: copies must be ({self.num_slots}, width), got {copies.shape}")
        states = np.asarray(self.states, np.uint8)
        if states.shape != copies.shape:
            raise ValueError(f"shard map: states {states.shape} do not match copies {copies.shape}")
        if copies.size and (copies.max() >= len(self.servers) or copies.min() < NO_SERVER):
            raise ValueError("shard map: copies name a server index out of range")
        slot_epochs = np.asarray(self.slot_epochs, np.uint64)
        if slot_epochs.shape != (self.num_slots,):
            raise ValueError(f"shard map: slot_epochs must be ({self.num_slots},), got {slot_epochs.shape}")
        for name, a in (("copies", copies), ("states", states), ("slot_epochs", slot_epochs)):
            a = a.copy()
            a.setflags(write=False)
            object.__setattr__(self, name, a)
        object.__setattr__(self, "tables", dict(self.tables))

    # --- construction --------------------------------------------------------------------------------
    @classmethod
    def empty(cls, num_slots: int = DEFAULT_NUM_SLOTS, replicas: int = 0, cluster_id: str = "") -> ShardMap:
        """Epoch 0: no servers, no copies."""
        return cls(0, num_slots, replicas, (), np.full((num_slots, 1), NO_SERVER, np.int32),
                   np.zeros((num_slots, 1), np.uint8), np.zeros(num_slots, np.uint64), {}, cluster_id)

    def evolve(self, *, copies: np.ndarray | None = None, states: np.ndarray | None = None,
               servers: Sequence[ServerEntry] | None = None, tables: Mapping[str, TableDef] | None = None,
               replicas: int | None = None) -> ShardMap:
        """The next map (epoch + 1) with the given parts replaced. Copies are compacted (each row's copies
        first, primary kept in column 0) and trimmed to the widest row; slots whose copies or states
        changed get the new epoch in ``slot_epochs``."""
        epoch = self.epoch + 1
        new_copies = np.asarray(self.copies if copies is None else copies, np.int32)
        new_states = np.asarray(self.states if states is None else states, np.uint8)
        new_copies, new_states = _compact(new_copies, new_states)
        old_c, old_s = _pad(self.copies, new_copies.shape[1]), _pad(self.states, new_copies.shape[1])
        nc, ns = _pad(new_copies, old_c.shape[1]), _pad(new_states, old_c.shape[1])
        changed = (old_c != nc).any(axis=1) | ((old_s != ns) & (nc >= 0)).any(axis=1)
        slot_epochs = self.slot_epochs.copy()
        slot_epochs[changed] = epoch
        return ShardMap(epoch, self.num_slots, self.replicas if replicas is None else replicas,
                        tuple(self.servers if servers is None else servers), new_copies, new_states,
                        slot_epochs, self.tables if tables is None else tables, self.cluster_id)

    # --- queries -------------------------------------------------------------------------------------
    @property
    def width(self) -> int:
        return int(self.copies.shape[1])

    def primary_of_slot(self) -> np.ndarray:
        """(num_slots,) int32 server index of each slot's primary (``NO_SERVER``: none)."""
        return self.copies[:, 0]

    def index_of(self, server_id: str) -> int:
        """The index of ``server_id`` in ``servers``, or -1."""
        for i, s in enumerate(self.servers):
            if s.id == server_id:
                return i
        return -1

    def holds(self, index: int) -> np.ndarray:
        """(num_slots,) bool: slots with a copy (any state) on server ``index``."""
        return (self.copies == index).any(axis=1)

    def leads(self, index: int) -> np.ndarray:
        """(num_slots,) bool: slots whose primary is server ``index``."""
        return self.copies[:, 0] == index

    def copy_state(self, index: int) -> np.ndarray:
        """(num_slots,) int8: the state of server ``index``'s copy of each slot, -1 where it holds none."""
        hit = self.copies == index
        out = np.full(self.num_slots, -1, np.int8)
        rows, cols = np.nonzero(hit)
        out[rows] = self.states[rows, cols]
        return out

    def in_sync_count(self) -> np.ndarray:
        """(num_slots,) int: copies in sync (the primary included, handing over or not) of each slot."""
        return ((self.copies >= 0) & (self.states != CATCHING_UP)).sum(axis=1)

    def handing_over(self) -> np.ndarray:
        """(num_slots,) bool: slots whose primary is handing its role over (it refuses writes meanwhile)."""
        return (self.copies[:, 0] >= 0) & (self.states[:, 0] == HANDING_OVER)

    def slots_of(self, mask: np.ndarray) -> np.ndarray:
        return np.flatnonzero(mask).astype(np.int32)

    def address(self, index: int) -> str:
        return self.servers[index].address

    def summary(self) -> dict[str, int]:
        """Counts for logs: servers up, slots without a primary, slots with fewer in-sync copies than wanted."""
        in_sync = self.in_sync_count()
        placed = self.copies[:, 0] >= 0
        return {"epoch": self.epoch, "servers_up": sum(s.up for s in self.servers),
                "unavailable_slots": int((~placed).sum()),
                "degraded_slots": int((in_sync < 1 + self.replicas).sum()),
                # led, yet held in sync by the primary alone although the cluster keeps replicas: losing
                # that one server loses what was acknowledged there
                "unprotected_slots": int((placed & (in_sync <= 1)).sum()) if self.replicas else 0,
                "catching_up": int(((self.copies >= 0) & (self.states == CATCHING_UP)).sum())}

    def with_servers(self, servers: Sequence[ServerEntry]) -> ShardMap:
        """The next map with only the server list replaced."""
        return self.evolve(servers=servers)

    def replace_server(self, index: int, **changes: object) -> tuple[ServerEntry, ...]:
        servers = list(self.servers)
        servers[index] = dataclasses.replace(servers[index], **changes)  # type: ignore[arg-type]
        return tuple(servers)


def _pad(a: np.ndarray, width: int) -> np.ndarray:
    if a.shape[1] >= width:
        return a
    fill = NO_SERVER if a.dtype == np.int32 else 0
    return np.concatenate([a, np.full((a.shape[0], width - a.shape[1]), fill, a.dtype)], axis=1)


def _compact(copies: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep column 0 (the primary, possibly none); move each row's other copies left; trim empty columns."""
    if copies.shape[1] <= 1:  # only primaries: in sync by definition, as below
        return copies.copy(), np.where((copies >= 0) & (states == HANDING_OVER), HANDING_OVER, 0).astype(np.uint8)
    rest, rest_states = copies[:, 1:], states[:, 1:]
    order = np.argsort(rest < 0, axis=1, kind="stable")  # present copies first, in their order
    rest = np.take_along_axis(rest, order, axis=1)
    rest_states = np.take_along_axis(rest_states, order, axis=1)
    present = (rest >= 0).sum(axis=1)
    width = int(present.max()) if present.size else 0
    c = np.concatenate([copies[:, :1], rest[:, :width]], axis=1)
    s = np.concatenate([states[:, :1], rest_states[:, :width]], axis=1)
    s = np.where(c >= 0, s, 0).astype(np.uint8)
    # a primary is in sync by definition (handing over or not)
    s[:, 0] = np.where(c[:, 0] >= 0, np.where(s[:, 0] == HANDING_OVER, HANDING_OVER, IN_SYNC), 0)
    return c.astype(np.int32), s
