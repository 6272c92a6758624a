"""Exactly-once pushes: which (client_id, seq) a table has applied, per routing slot.

A client numbers its pushes; a retried push carries the same (client_id, seq). The key is kept per routing
slot, not per message: after a map change a retried push may be split across servers differently, but each
of its ids still lies in the same slot, and a slot is the unit that moves between servers. So a server
applies the ids of the slots not yet applied for that (client_id, seq) and skips the others. The window
travels with its slots: replicated with every push, copied with a slot, saved inside every snapshot.

Per client, the ``size`` highest seqs are kept (a bitmap of slots each; the lowest is dropped first, whatever
the order records arrive in, e.g. merged from a slot copy); at most ``max_clients`` clients (least recently
seen dropped first). Every seq dropped is at or below the ``floor``, every seq kept above it: a seq at or
below it, and not in the window, cannot be told apart from a replay of a dropped one, so ``applied`` raises
``PushExpired`` rather than guess (a first arrival is never reported as a duplicate, nor a replay applied
twice). Clients bound their pushes in flight, so this needs a push delayed by ``size`` later ones.

Forgotten clients. A client dropped past ``max_clients`` takes its records and floor with it, so the window
keeps a ``horizon``: the highest session stamp (``tigana.ps.session``) of a client it dropped. A client it
does not know is new only if its stamp is above the horizon; at or below it, it may be a dropped one, and
``applied`` raises ``UnknownClient`` (nothing applied; the client starts a new session above the horizon
when none of its attempts can have been applied). A client entry may lack records it once had for some
slots: it is *blind* for them (a bitmap of slots) when it was made while its stamp was at or below the
horizon (by a merge or a replicated record: every slot), or when a slot copy brought slots from a window
whose horizon is at or above its stamp (those slots). For a blind slot, a record still says "applied", but
"not applied" becomes ``UnknownClient``. The horizon and the blind slots travel like the floors: in
``records_for`` (``(HORIZON_ID, horizon, slots)`` and ``(client_id, BLIND_SEQ, blind slots)``) and in
``to_bytes``. So a (client_id, seq) applied for a slot is never reported "not applied" for it, through any
mix of evictions, merges, slot copies and restarts (``tests/ps/test_dedup.py`` holds it against a model).

Not thread-safe: the server checks, applies and records under the table's write lock.
"""

from __future__ import annotations

import heapq
import io
import json
from collections import OrderedDict

import numpy as np

from tigana.ps.errors import InvalidArgument, PushExpired, UnknownClient
from tigana.ps.session import client_stamp

__all__ = ["BLIND_SEQ", "HORIZON_ID", "DedupWindow"]

HORIZON_ID = "\x00horizon"  # records_for: (HORIZON_ID, horizon, slots) carries the window's horizon
BLIND_SEQ = (1 << 63) - 1     # records_for: (client_id, BLIND_SEQ, slots) marks a client blind for slots


class _Client:
    """One client's window: a row of slot bits per seq, the lowest seq evicted first (``heap``)."""

    __slots__ = ("row_of_seq", "seq_of_row", "bits", "free", "heap", "floor", "stamp", "blind")

    def __init__(self, nbytes: int, rows: int = 16, stamp: int = 0, blind: np.ndarray | None = None) -> None:
        self.row_of_seq: dict[int, int] = {}
        self.seq_of_row = np.full(rows, -1, np.int64)
        self.bits = np.zeros((rows, nbytes), np.uint8)
        self.free = list(range(rows - 1, -1, -1))
        self.heap: list[int] = []
        self.floor = -1
        self.stamp = stamp    # the client id's session stamp
        self.blind = blind    # (nbytes,) uint8 bitmap of the slots it may lack records for, or None

    def row_for(self, seq: int, size: int) -> int:
        """A row for a new ``seq`` (above the floor): a free one, a new one (the window grows up to ``size``
        rows), or the row of the lowest seq held, which is dropped and raises the floor."""
        if not self.free:
            rows = self.seq_of_row.shape[0]
            if rows < size:
                new = min(size, rows * 2)
                self.seq_of_row = np.concatenate([self.seq_of_row, np.full(new - rows, -1, np.int64)])
                self.bits = np.concatenate([self.bits, np.zeros((new - rows, self.bits.shape[1]), np.uint8)])
                self.free = list(range(new - 1, rows - 1, -1))
            else:
                while True:
                    old = heapq.heappop(self.heap)
                    if old in self.row_of_seq:
                        break
                row = self.row_of_seq.pop(old)
                self.floor = max(self.floor, old)
                self.bits[row] = 0
                self.seq_of_row[row] = -1
                self.free.append(row)
        row = self.free.pop()
        self.seq_of_row[row] = seq
        self.row_of_seq[seq] = row
        heapq.heappush(self.heap, seq)
        return row


def _lowest(c: _Client) -> int:
    while c.heap[0] not in c.row_of_seq:
        heapq.heappop(c.heap)
    return c.heap[0]


def _test(bits: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """(k,) bool: the bits of ``slots`` ((k,) int64) in the (nbytes,) uint8 bitmap ``bits``."""
    return ((bits[slots >> 3] >> (slots & 7).astype(np.uint8)) & 1).astype(bool)


def _bitmask(slots: np.ndarray, nbytes: int) -> np.ndarray:
    m = np.zeros(nbytes * 8, bool)
    m[slots] = True
    return np.packbits(m, bitorder="little")


class DedupWindow:
    """Applied (client_id, seq) per routing slot. An empty ``client_id`` opts out of deduplication."""

    def __init__(self, num_slots: int, size: int = 1024, max_clients: int = 4096) -> None:
        if size < 1 or max_clients < 1 or num_slots < 1:
            raise ValueError("num_slots, size and max_clients must be >= 1")
        self.num_slots, self.size, self.max_clients = num_slots, size, max_clients
        self._nbytes = (num_slots + 7) // 8
        self._clients: OrderedDict[str, _Client] = OrderedDict()
        self.horizon = -1  # the highest session stamp of a client dropped (or merged from a slot copy)

    def __len__(self) -> int:
        """(client, seq) keys held."""
        return sum(len(c.row_of_seq) for c in self._clients.values())

    def applied(self, client_id: str, seq: int, slots: np.ndarray) -> np.ndarray:
        """(k,) bool: which of the (k,) routing ``slots`` already applied ``seq`` of ``client_id``.
        Raises ``PushExpired`` when seq is too old to tell, ``UnknownClient`` when the client may have been
        forgotten (it never answers "not applied" for a key it cannot vouch for)."""
        slots = np.asarray(slots, np.int64)
        if not client_id:
            return np.zeros(slots.shape[0], bool)
        if client_id[0] == "\x00":
            raise InvalidArgument(f"client id {client_id!r} is reserved")
        c = self._clients.get(client_id)
        if c is None:
            if client_stamp(client_id) <= self.horizon:
                raise self._unknown(client_id, seq)
            return np.zeros(slots.shape[0], bool)
        row = c.row_of_seq.get(seq)
        if row is None:
            if seq <= c.floor:
                raise PushExpired(f"push (client {client_id}, seq {seq}) is older than the exactly-once window "
                                  f"({self.size} pushes per client, last dropped seq {c.floor}): it may have been "
                                  "applied already, so it is not applied again")
            done = np.zeros(slots.shape[0], bool)
        else:
            done = _test(c.bits[row], slots)
        if c.blind is not None and (_test(c.blind, slots) & ~done).any():
            raise self._unknown(client_id, seq)
        return done

    def _unknown(self, client_id: str, seq: int) -> UnknownClient:
        return UnknownClient(f"push (client {client_id}, seq {seq}): the exactly-once window does not know this "
                             f"client session and may have forgotten it (more than {self.max_clients} clients; "
                             f"horizon={self.horizon}); nothing applied: start a new client session")

    def _entry(self, client_id: str) -> _Client:
        """The client's entry, made (blind if its stamp is not above the horizon) if missing; the least
        recently seen client is dropped past ``max_clients``, raising the horizon to its stamp."""
        c = self._clients.get(client_id)
        if c is not None:
            self._clients.move_to_end(client_id)
            return c
        stamp = client_stamp(client_id)
        blind = np.full(self._nbytes, 0xFF, np.uint8) if stamp <= self.horizon else None
        c = self._clients[client_id] = _Client(self._nbytes, min(16, self.size), stamp, blind)
        while len(self._clients) > self.max_clients:
            _, dropped = self._clients.popitem(last=False)
            self.horizon = max(self.horizon, dropped.stamp)
        return c

    def record(self, client_id: str, seq: int, slots: np.ndarray) -> None:
        """Remember that ``seq`` of ``client_id`` was applied for ``slots``."""
        if not client_id:
            return
        slots = np.asarray(slots, np.int64)
        c = self._entry(client_id)
        row = c.row_of_seq.get(seq)
        if row is None:
            if seq <= c.floor:  # older than the window (a merged record): nothing to keep
                return
            if len(c.row_of_seq) >= self.size and seq < _lowest(c):
                c.floor = max(c.floor, seq)  # full, and this is the lowest: it is the one dropped
                return
            row = c.row_for(seq, self.size)
        c.bits[row] |= _bitmask(slots, self._nbytes)  # 3 us; np.bitwise_or.at took 8 a push

    # --- moving with slots -------------------------------------------------------------------------
    def records_for(self, slots: np.ndarray) -> list[tuple[str, int, np.ndarray]]:
        """The window restricted to ``slots`` ((k,) int): [(client_id, seq, slots applied)], oldest first per
        client, for a copy of those slots to ``merge``; a client's floor travels as (client_id, floor, no
        slots), so the copy refuses what this window could no longer tell (it would otherwise apply it); the
        horizon as (HORIZON_ID, horizon, ``slots``) first, a client's blind slots among ``slots`` as
        (client_id, BLIND_SEQ, those slots)."""
        slots = np.asarray(slots, np.int64)
        mask = _bitmask(slots, self._nbytes)
        out: list[tuple[str, int, np.ndarray]] = []
        if self.horizon >= 0:
            out.append((HORIZON_ID, int(self.horizon), slots.astype(np.int32)))
        for cid, c in self._clients.items():
            if c.blind is not None:
                blind = c.blind & mask
                if blind.any():
                    out.append((cid, BLIND_SEQ, self._unpack(blind)))
            if c.floor >= 0:
                out.append((cid, int(c.floor), np.empty(0, np.int32)))
            used = np.flatnonzero(c.seq_of_row >= 0)
            if used.size == 0:
                continue
            hit = c.bits[used] & mask
            rows = used[hit.any(axis=1)]
            order = np.argsort(c.seq_of_row[rows], kind="stable")
            for r in rows[order]:
                out.append((cid, int(c.seq_of_row[r]), self._unpack(c.bits[r] & mask)))
        return out

    def _unpack(self, bits: np.ndarray) -> np.ndarray:
        """(nbytes,) uint8 bitmap -> (k,) int32 slots."""
        return np.flatnonzero(np.unpackbits(bits, bitorder="little")[:self.num_slots]).astype(np.int32)

    def merge(self, records: list[tuple[str, int, np.ndarray]]) -> None:
        """Record every (client_id, seq, slots) of ``records`` (a slot copy's or a replicated push's); a record
        with no slots raises the client's floor to its seq; the horizon and blind records as ``records_for``
        writes them."""
        for cid, seq, slots in records:
            if cid == HORIZON_ID:
                self._merge_horizon(int(seq), slots)
            elif not cid:
                continue
            elif seq == BLIND_SEQ:
                c = self._entry(cid)
                c.blind = _bitmask(slots, self._nbytes) | (0 if c.blind is None else c.blind)
            elif slots.size:
                self.record(cid, seq, slots)
            else:
                self._raise_floor(cid, int(seq))

    def _merge_horizon(self, horizon: int, slots: np.ndarray) -> None:
        """The horizon of the window ``slots`` were copied from: a client at or below it may lack records of
        those slots that the source dropped (blind for them), and an unknown one may be one it dropped."""
        self.horizon = max(self.horizon, horizon)
        mask = _bitmask(slots, self._nbytes)
        for c in self._clients.values():
            if c.stamp <= horizon:
                c.blind = mask.copy() if c.blind is None else c.blind | mask

    def _raise_floor(self, client_id: str, floor: int) -> None:
        c = self._entry(client_id)
        if floor <= c.floor:
            return
        c.floor = floor
        for seq in [q for q in c.row_of_seq if q <= floor]:  # at or below the floor: cannot be kept apart
            row = c.row_of_seq.pop(seq)
            c.bits[row] = 0
            c.seq_of_row[row] = -1
            c.free.append(row)

    def forget_slots(self, slots: np.ndarray) -> None:
        """Drop every key of ``slots`` (this server no longer holds them)."""
        keep = ~_bitmask(np.asarray(slots, np.int64), self._nbytes)
        for c in self._clients.values():
            c.bits &= keep
            if c.blind is not None:  # what a copy of these slots brings decides again
                c.blind &= keep

    # --- persistence inside a snapshot -------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        ids = list(self._clients)
        meta = {"num_slots": self.num_slots, "size": self.size, "max_clients": self.max_clients,
                "horizon": self.horizon,
                "clients": [[cid, int(c.blind is not None), c.floor] for cid, c in self._clients.items()]}
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
        for i, cid in enumerate(ids):
            c = self._clients[cid]
            arrays[f"s{i}"] = c.seq_of_row
            arrays[f"b{i}"] = c.bits
            if c.blind is not None:
                arrays[f"k{i}"] = c.blind
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, *, num_slots: int, size: int | None = None) -> DedupWindow:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if int(meta["num_slots"]) != num_slots:
                raise ValueError(f"dedup window of {meta['num_slots']} slots, the server has {num_slots}")
            window = cls(num_slots, size or int(meta["size"]), int(meta["max_clients"]))
            window.horizon = int(meta.get("horizon", -1))
            for i, (cid, blind, floor) in enumerate(meta["clients"]):
                c = _Client(window._nbytes, 1, client_stamp(str(cid)),
                            z[f"k{i}"].astype(np.uint8) if blind else None)
                c.seq_of_row = z[f"s{i}"].astype(np.int64)
                c.bits = z[f"b{i}"].astype(np.uint8)
                c.floor = int(floor)
                c.row_of_seq = {int(s): int(r) for r, s in enumerate(c.seq_of_row) if s >= 0}
                c.free = [r for r in range(c.seq_of_row.shape[0] - 1, -1, -1) if c.seq_of_row[r] < 0]
                c.heap = sorted(c.row_of_seq)
                window._clients[str(cid)] = c
        return window
