"""What this server holds under its current map: ``View`` (one map's slots led and held, immutable),
``Holdings`` (the current view, the leads check every write and pull makes) and ``check_unmoved`` (may a write
that waited for its copies be acknowledged under the view now current).

``Ownership`` (``ownership``) replaces the view when it installs a map; everything else reads it. A reader
takes the view once (``Holdings.view``) and decides against that one object: a check and the apply made under
a table's write lock see the same map, because ``install`` swaps the view only while it holds every table's
write lock.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from tigana.ps import _kernels
from tigana.ps.errors import InvalidArgument, Unavailable, WrongShard
from tigana.ps.routing import ShardMap, slot_of
from tigana.ps.shard.links import ServerLinks

__all__ = ["Holdings", "View", "check_unmoved"]


@dataclasses.dataclass(frozen=True, eq=False)
class View:
    """What this server holds under one map: epoch, the slots it leads and holds, whether the map names this
    process (``valid``), per slot the number of in-sync copies, the slots it leads but refuses writes to
    while it hands them over (``fenced``), the copies the cluster keeps of a slot (``want``), and per slot the
    epoch since which this server has held it without a break (``held_since``: a slot dropped loses its rows
    and log, so a write applied before that is not in what it holds now). Arrays are (num_slots,)."""

    epoch: int
    map: ShardMap | None
    me: int
    leads: np.ndarray
    holds: np.ndarray
    valid: bool
    in_sync: np.ndarray
    fenced: np.ndarray
    want: int = 1
    held_since: np.ndarray | None = None

    @functools.cached_property
    def fencing(self) -> bool:
        """Whether any slot is ``fenced`` (once per view: every write's leads check and every step of the
        hand-over loop ask)."""
        return bool(self.fenced.any())

    def held_from(self, old: View) -> View:
        """This view with ``held_since`` carried on from ``old`` (the view it replaces)."""
        kept = self.holds & old.holds & old.valid
        before = old.held_since if old.held_since is not None else np.zeros(self.holds.shape[0], np.int64)
        return dataclasses.replace(self, held_since=np.where(kept, before, self.epoch).astype(np.int64))

    def kept_while_down(self, old: View) -> View:
        """This view for a map that declares this very process dead while it runs (a pause, a partition, a new
        scheduler that did not hear it in time): it leads nothing, yet keeps every row and log position it held
        until it registers again, as the scheduler then asks it to. Its rows may be the newest of a slot that
        lost every in-sync copy meanwhile: the election needs them (invariant S10)."""
        none = np.zeros_like(self.leads)
        return dataclasses.replace(self, leads=none, fenced=none, holds=old.holds.copy() if old.valid else none)

    @classmethod
    def static(cls, owned: np.ndarray) -> View:
        return cls(0, None, -1, owned, owned, True, np.ones(owned.shape[0], np.int64), np.zeros_like(owned))

    @classmethod
    def waiting(cls, num_slots: int) -> View:
        none = np.zeros(num_slots, bool)
        return cls(0, None, -1, none, none, False, np.zeros(num_slots, np.int64), none)

    @classmethod
    def of(cls, m: ShardMap, me: int, valid: bool) -> View:
        if me < 0 or not valid:
            none = np.zeros(m.num_slots, bool)
            return cls(m.epoch, m, me, none, none, False, m.in_sync_count(), none, 1 + m.replicas)
        leads = m.leads(me)
        return cls(m.epoch, m, me, leads, m.holds(me), True, m.in_sync_count(), leads & m.handing_over(),
                   1 + m.replicas)

    def complete_slots(self) -> np.ndarray:
        """(num_slots,) bool: slots whose copy here is complete (led, or in sync): the only positions a snapshot
        keeps, since an unclean election trusts them."""
        if self.map is None:
            return self.holds
        return self.leads | (self.map.copy_state(self.me) == 0) if self.valid else self.holds


class Holdings:
    """The current ``View`` of one shard server and the checks made against it.

    Static servers (``clustered`` False) start leading ``owned``; clustered ones start waiting for their first
    map. Thread-safety: ``view`` is one attribute read; only ``Ownership`` replaces it (``replace``), under
    every table's write lock. Nothing here blocks."""

    def __init__(self, server_id: str, num_slots: int, links: ServerLinks, *, clustered: bool,
                 owned: np.ndarray | None = None) -> None:
        self.server_id, self.num_slots, self.clustered = server_id, num_slots, clustered
        self._links = links
        self._view = View.waiting(num_slots) if clustered else View.static(np.asarray(owned, bool))

    @property
    def view(self) -> View:
        """The view now current (read it once per decision)."""
        return self._view

    @property
    def epoch(self) -> int:
        return self._view.epoch

    def replace(self, view: View) -> None:
        """Make ``view`` current (``Ownership.install``, every table's write lock held)."""
        self._view = view

    def set_owned_slots(self, mask: np.ndarray) -> None:
        """Static mode: replace the owned slot set ((num_slots,) bool)."""
        mask = np.asarray(mask, dtype=bool)
        if self.clustered:
            raise InvalidArgument("owned slots: this server takes its slots from the scheduler's map")
        if mask.shape != (self.num_slots,):
            raise InvalidArgument(f"owned slots: expected a mask of {self.num_slots} slots, got {mask.shape}")
        self._view = View.static(mask.copy())

    def owned_slots(self) -> np.ndarray:
        """(num_slots,) bool: the slots this server leads now (a copy)."""
        return self._view.leads.copy()

    def leads_ids(self, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: whether this server leads each id's slot (an eviction predicate: only a row's primary
        decides its eviction)."""
        return self._view.leads[slot_of(ids, self.num_slots)]

    def check_leads(self, table: str, ids: np.ndarray, epoch: int, created_epoch: int | None = None
                    ) -> tuple[View, np.ndarray]:
        """(view, (n,) slot of each id) after checking this server leads every id's slot in its current map
        and is not handing it over (``WrongShard`` otherwise, naming the epoch; a request routed at a newer
        ``epoch`` has the agent fetch that map). ``created_epoch``: the incarnation of the table served here
        (None: not hosted); a table created by a map this server has not installed yet is not served
        (``Unavailable``). Call under the table's write lock, so that the apply sees the same map."""
        view = self._view
        if not view.valid:
            raise Unavailable(f"table {table!r}: server {self.server_id} is not in the cluster yet "
                              "(registering with the scheduler)", epoch=view.epoch)
        if created_epoch is not None and created_epoch > view.epoch:
            # ``install`` creates a new map's tables before it has every table's lock and the new view: until
            # then the table is not served (a write now would be stamped and replicated under the old map).
            raise Unavailable(f"table {table!r} (created at epoch {created_epoch}) is not served by "
                              f"{self.server_id} before it installs that map (it is at epoch {view.epoch}); retry",
                              epoch=view.epoch)
        slots, count, first = _kernels.slots_foreign(ids, view.leads)
        if not count and view.fencing:
            fenced = view.fenced[slots]
            if fenced.any():
                s = int(slots[np.argmax(fenced)])
                raise WrongShard(f"table {table!r}: slot {s} is being handed over to a new primary at epoch "
                                 f"{view.epoch}; retry by the next map (nothing applied)", epoch=view.epoch)
        if count:
            if epoch > view.epoch:
                self._links.refresh_soon(epoch)
            example = int(ids[first])
            raise WrongShard(f"table {table!r}: field 'ids' has {count} id(s) in slots this server does not lead "
                             f"at epoch {view.epoch} (e.g. id {example}, slot {int(slots[first])}; the request "
                             f"was routed at epoch {epoch})", epoch=view.epoch)
        return view, slots


def check_unmoved(table: str, view: View, now: View, slots: np.ndarray) -> None:
    """After a write applied under ``view`` waited for its copies, with ``now`` the view current: ``Unavailable``
    (retry; the write is idempotent or applied once) when this server no longer leads every slot of it (a
    hand-over or a failover meanwhile: the client must learn the new primary), dropped one of them meanwhile (its
    rows were deleted and built again from another copy: ``held_since``), or the map is gone.

    Other changes of the copies meanwhile need no retry, because the marks it waited for stay complete for the
    map now current (S1): a copy added since is built from rows that hold the write (its slot copy starts after
    it), a copy demoted or dropped no longer needs it, and a copy that joined the in-sync set meanwhile applied
    every item queued before its switch, this one included (S3). Answering UNAVAILABLE to those made every sync
    write in flight during a rebalance (a map every 0.1 s) start again. Pure: no lock, no I/O."""
    if now.epoch == view.epoch:
        return
    if now.map is None or not now.leads[slots].all() or \
            (now.held_since is not None and (now.held_since[slots] > view.epoch).any()):
        raise Unavailable(f"table {table!r}: this server no longer leads every slot of the write (epoch "
                          f"{view.epoch} -> {now.epoch}); retry it (it is applied once)", epoch=now.epoch)
