"""Failure domains in placement (a room of the scheduler core, beside ``moves``): the domain groups placement
keeps a slot's copies apart by, the slots whose copies share a domain (``domain_degraded``), the target that
spreads them again (``_respread``) and why a drain or a move would collapse a slot into one domain
(``_collapses``). The arithmetic is ``tigana.ps.domains``; ``moves`` calls these.
"""

from __future__ import annotations

import logging

import numpy as np

from tigana.ps import domains
from tigana.ps.logs import event, slots_text
from tigana.ps.routing import CATCHING_UP, NO_SERVER, ShardMap
from tigana.ps.scheduler import placement
from tigana.ps.scheduler._fields import CoreFields

log = logging.getLogger("tigana.ps.scheduler")  # one logger for the whole scheduler


class Spread(CoreFields):
    """The failure-domain side of placement (see the module docstring); lock held by the caller."""

    def _domains(self) -> list[domains.FailureDomain]:
        return [s.domain for s in self.map.servers]

    def _groups(self, usable: np.ndarray) -> np.ndarray | None:
        """(num_servers,) domain ids at the widest level at which the ``usable`` servers keep a slot's copies
        apart; None where no level can (placement then keeps copies on distinct servers only)."""
        want = 1 + min(self.config.replicas, max(int(usable.sum()) - 1, 0))
        groups, level = domains.groups_for(self._domains(), usable, want)
        return None if level == domains.SERVER else groups

    def domain_groups(self) -> np.ndarray | None:
        """(num_servers,) the domain of each server at the level placement keeps copies apart at now (over the
        servers that may hold copies); None where no level can."""
        return self._groups(self._placeable())

    def domain_degraded(self, m: ShardMap | None = None) -> tuple[np.ndarray, str]:
        """((num_slots,) bool, level): the slots whose in-sync copies on servers up share a failure domain (at
        the level placement uses, or a host where no level has enough domains), and that level; in map ``m``
        (default: the core's)."""
        m = self.map if m is None else m
        alive = np.array([s.up for s in m.servers], bool)
        c = m.copies
        counted = (c >= 0) & (m.states != CATCHING_UP) & (alive[np.clip(c, 0, None)] if alive.size else False)
        return domains.degraded_slots(c, counted, [s.domain for s in m.servers], alive, 1 + self.config.replicas)

    def _respread(self, copies: np.ndarray, placeable: np.ndarray) -> None:
        """With no target: when copies of some slot share a domain and a balanced placement keeps more slots'
        copies apart, aim for it (lock held)."""
        if self.target is not None or not placeable.any():
            return
        groups = self._groups(placeable)
        if groups is None:
            return
        shared = int(domains.collapsed(copies, groups).sum())
        if not shared:
            return
        target = placement.balance(copies, placeable, self.config.replicas, groups=groups)
        if int(domains.collapsed(target, groups).sum()) >= shared or not placement.moves(copies, target):
            return
        self.target, self.target_kind = target, "balance"
        self._save()
        log.info("failure domains at epoch %d: copies of %d slot(s) share a domain; %d slot(s) to move",
                 self.map.epoch, shared, len(placement.moves(copies, target)),
                 extra=event("domain_respread", epoch=self.map.epoch))

    def _collapses(self, usable: np.ndarray, target: np.ndarray, slots: np.ndarray | None = None) -> str:
        """Why ``target`` puts copies of a slot (of ``slots``, default all) into one failure domain they do not
        share now (judged at the level the ``usable`` servers allow), or "" when it does not."""
        m = self.map
        want = 1 + min(self.config.replicas, max(int(usable.sum()) - 1, 0))
        level = domains.choose_level(self._domains(), usable, want)
        level = level if level != domains.SERVER else "host"
        judged = domains.group_ids(self._domains(), level)
        rows = np.arange(m.num_slots) if slots is None else np.asarray(slots, np.int64)
        width = max(m.width, target.shape[1])
        now = domains.spread(_pad(m.copies, width)[rows], judged)
        then = domains.spread(_pad(target, width)[rows], judged)
        worse = rows[then < np.minimum(now, (target[rows] >= 0).sum(axis=1))]
        if not worse.size:
            return ""
        slot = int(worse[0])
        row = target[slot][target[slot] >= 0]
        ids, counts = np.unique(judged[row], return_counts=True)
        shared = row[judged[row] == ids[np.argmax(counts)]]
        where = m.servers[int(shared[0])].domain.describe(level)
        return (f"slot {slot}'s copies would share {level} {where} (on {','.join(self._ids(shared))}); "
                f"{worse.size} slot(s) would (slots {slots_text(worse)})")


def _pad(a: np.ndarray, width: int) -> np.ndarray:
    """``a`` widened to ``width`` columns (no server or 0 in the new ones)."""
    if a.shape[1] >= width:
        return a
    fill = NO_SERVER if a.dtype == np.int32 else 0
    return np.concatenate([a, np.full((a.shape[0], width - a.shape[1]), fill, a.dtype)], axis=1)


