"""Failure domains: where a server runs (zone, rack, host), and how placement reads them. Pure; no I/O.

A copy protects an acknowledged write only if it fails independently of the primary. A server is started with
its domain, a label such as ``zone=eu-1a,rack=r7,host=node-12`` (``tigana server --domain``; the host defaults
to the machine's name), sends it with ``Register``, and the scheduler keeps it in the map's server list.

Placement reads the domains at one *level*: the widest of ``zone``, ``rack`` and ``host`` at which the servers
that may hold copies fall into at least as many distinct domains as a slot has copies. A rack is named within
its zone and a host within its rack, so two racks called ``r1`` in two zones are two racks. A server whose host
is unknown (empty: a map saved before domains existed, or a test that names none) is a host of its own.

When no level has enough domains (two hosts and three copies, or every server on one machine), the level is
``server``: placement only keeps copies on distinct servers, as it always did, and the slots whose in-sync copies
span fewer hosts than the copies a slot wants count as *domain-degraded*; so does any slot whose in-sync copies
span fewer domains than that at the chosen level. Losing that one domain loses what those copies acknowledged, so the scheduler reports them (status,
health, metrics) as it reports under-replicated slots.

Example::

    >>> d = [FailureDomain.parse("zone=a,host=h1"), FailureDomain.parse("zone=a,host=h2"),
    ...      FailureDomain.parse("zone=b,host=h3")]
    >>> choose_level(d, np.ones(3, bool), copies=2)
    'zone'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LEVELS", "SERVER", "FailureDomain", "choose_level", "collapsed", "degraded_slots", "fits", "group_ids",
           "groups_for", "relay", "relay_roles", "separate", "spread"]

LEVELS = ("zone", "rack", "host")  # widest first
SERVER = "server"  # the fallback level: every server a domain of its own


@dataclass(frozen=True)
class FailureDomain:
    """Where a server runs. Empty parts are unknown (an unknown host is the server's own)."""

    zone: str = ""
    rack: str = ""
    host: str = ""

    @classmethod
    def parse(cls, text: str, *, field: str = "domain") -> FailureDomain:
        """``"zone=Z,rack=R,host=H"`` (any subset, any order; a part left out or empty is unknown) -> a
        ``FailureDomain``.
        Raises ``ValueError`` naming ``field`` for an unknown key, a repeated key or a part without ``=``."""
        parts: dict[str, str] = {}
        for raw in str(text).split(","):
            item = raw.strip()
            if not item:
                continue
            key, eq, value = item.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not eq or key not in LEVELS:
                raise ValueError(f"{field}: expected zone=Z,rack=R,host=H (any of them), got {item!r} in {text!r}")
            if key in parts:
                raise ValueError(f"{field}: {key!r} given twice in {text!r}")
            if any(c in value for c in "= \t"):
                raise ValueError(f"{field}: {key} must be a name without '=', ',' or spaces, got {value!r}")
            parts[key] = value  # empty: unknown (a Kubernetes node without a zone label)
        return cls(**parts)

    def with_host(self, host: str) -> FailureDomain:
        """This domain with ``host`` filled in where it is unknown."""
        return self if self.host else FailureDomain(self.zone, self.rack, host)

    def key(self, level: str) -> tuple[str, ...]:
        """The domain's name at ``level`` (a rack within its zone, a host within its rack)."""
        return (self.zone, self.rack, self.host)[:LEVELS.index(level) + 1]

    def describe(self, level: str) -> str:
        """``zone=a,rack=r1`` for ``level`` rack: the parts that name the domain at that level."""
        return ",".join(f"{k}={v}" for k, v in zip(LEVELS, self.key(level), strict=False) if v) or f"{level}=?"

    def __bool__(self) -> bool:
        """Whether any part is known."""
        return bool(self.zone or self.rack or self.host)

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in zip(LEVELS, (self.zone, self.rack, self.host), strict=True) if v)


def group_ids(domains: Sequence[FailureDomain], level: str) -> np.ndarray:
    """(num_servers,) int64: the index of each server's domain at ``level`` (servers in one domain share it);
    level ``server``, or a server whose host is unknown at level ``host``, gets a domain of its own."""
    n = len(domains)
    if level == SERVER:
        return np.arange(n, dtype=np.int64)
    names: dict[tuple[str, ...], int] = {}
    out = np.empty(n, np.int64)
    for i, d in enumerate(domains):
        key = d.key(level)
        if level == "host" and not d.host:
            key = (*key[:2], f"#{i}")  # unknown host: its own (a name no --domain can give)
        out[i] = names.setdefault(key, len(names))
    return out


def choose_level(domains: Sequence[FailureDomain], usable: np.ndarray, copies: int) -> str:
    """The widest level at which the ``usable`` servers ((num_servers,) bool) span at least ``copies`` domains;
    ``server`` when none does."""
    usable = np.asarray(usable, bool)
    for level in LEVELS:
        if np.unique(group_ids(domains, level)[usable]).size >= copies:
            return level
    return SERVER


def groups_for(domains: Sequence[FailureDomain], usable: np.ndarray, copies: int) -> tuple[np.ndarray, str]:
    """(group ids at the chosen level, the level): what placement keeps a slot's copies apart by."""
    level = choose_level(domains, usable, copies)
    return group_ids(domains, level), level


def spread(copies: np.ndarray, groups: np.ndarray, counted: np.ndarray | None = None) -> np.ndarray:
    """(num_slots,) int64: the distinct domains among each slot's copies (``copies``: (num_slots, width) server
    indexes, negative for none; ``counted``: same shape, bool, the copies to count, default all)."""
    c = np.asarray(copies)
    ok = c >= 0 if counted is None else (c >= 0) & np.asarray(counted, bool)
    g = np.where(ok, np.asarray(groups, np.int64)[np.clip(c, 0, None)], -1) if groups.size else np.full(c.shape, -1)
    g = np.sort(g, axis=1)  # (S, W); -1 first
    new = np.ones(g.shape, bool)
    new[:, 1:] = g[:, 1:] != g[:, :-1]
    return ((g >= 0) & new).sum(axis=1)


def collapsed(copies: np.ndarray, groups: np.ndarray, counted: np.ndarray | None = None) -> np.ndarray:
    """(num_slots,) bool: slots with two counted copies in one domain."""
    c = np.asarray(copies)
    ok = c >= 0 if counted is None else (c >= 0) & np.asarray(counted, bool)
    return spread(c, groups, ok) < ok.sum(axis=1)


def degraded_slots(copies: np.ndarray, counted: np.ndarray, domains: Sequence[FailureDomain],
                   usable: np.ndarray, want: int) -> tuple[np.ndarray, str]:
    """((num_slots,) bool, level): the domain-degraded slots, those whose ``counted`` copies (the in-sync ones on
    servers up) span fewer distinct domains than ``want`` copies should (or than they are, when fewer) at the
    level that ``usable`` servers allow for ``want`` copies, or at the host level where no level does; and that
    level (``server`` when none). A slot moving within a domain holds one copy more than it wants for a moment
    (three in-sync copies on two hosts, two wanted): losing either domain still leaves a copy, so it is not
    degraded."""
    level = choose_level(domains, usable, want)
    judged = group_ids(domains, level if level != SERVER else "host")
    c = np.asarray(copies)
    ok = (c >= 0) & np.asarray(counted, bool)
    return spread(c, judged, ok) < np.minimum(ok.sum(axis=1), want), level


def separate(copies: np.ndarray, alive: np.ndarray, groups: np.ndarray, load: np.ndarray, weights: np.ndarray
             ) -> None:
    """In place: move every replica (columns 1+ of ``copies``) that shares its slot's domain (``groups``) with
    another copy to the least loaded (``load``, (num_servers,) float, updated with ``weights`` per slot) alive
    server of a domain the slot lacks; where there is none it stays (the slot is domain-degraded)."""
    n = alive.shape[0]
    load = np.asarray(load, float).copy()
    for slot in np.flatnonzero(collapsed(copies, groups)):
        for j in range(1, copies.shape[1]):
            row = copies[slot]
            others = row[(row >= 0) & (np.arange(row.shape[0]) != j)]
            if row[j] < 0 or groups[row[j]] not in groups[others]:
                continue
            order = np.lexsort((np.arange(n), load))
            to = next((int(t) for t in order if alive[t] and t not in row and groups[t] not in groups[others]),
                      None)
            if to is not None:
                load[row[j]] -= weights[slot]
                load[to] += weights[slot]
                copies[slot, j] = to


def fits(rows: np.ndarray, cols: np.ndarray | int, server: int, groups: np.ndarray) -> np.ndarray:
    """(k,) bool: whether ``server`` may take the copy in column ``cols`` of each of ``rows`` ((k, width) server
    indexes, negative for none): it holds no other copy of the slot and its domain holds none."""
    k = np.arange(rows.shape[0])
    gg = np.where(rows >= 0, groups[np.clip(rows, 0, None)], -1)
    gg[k, cols] = -1
    other = rows.copy()
    other[k, cols] = -1
    return ~(gg == groups[server]).any(axis=1) & ~(other == server).any(axis=1)


def relay(copies: np.ndarray, alive: np.ndarray, groups: np.ndarray, load: np.ndarray, weights: np.ndarray) -> bool:
    """In place: take a replica's load off a busy server along a chain ``busy -> m1 -> ... -> idle``, for when
    the domains forbid every direct move to a less loaded server (each slot on the busy one already has a copy
    in the idle ones' domains). Each hop moves a replica (columns 1+ of ``copies``) of another slot to a server
    whose domain that slot lacks (``fits``), so each server in between gives one copy and takes one, and the
    idle server ends up with one more. Example: hosts A, B of servers {a1, a2}, {b1, b2}, every slot on b2 also
    on host A: a copy moves b2 -> b1 (same host) and another b1 -> a1.

    ``load``: (num_servers,) float, the weighted copies held; ``weights``: (num_slots,) float, a copy's load.
    Busy servers are tried busiest first, each with the shortest chain to every less loaded server, idlest
    first; a chain is taken only if it lowers the sum of squared loads (so repeated relays end). Returns
    whether one was taken. Cost: a pass over every replica per alive server, then a breadth-first search
    (num_servers^2) per busy server and a walk per chain tried."""
    n = alive.shape[0]
    live = np.flatnonzero(alive)
    num_slots, width = copies.shape
    present = copies >= 0
    rows, cols = np.nonzero(present[:, 1:])
    held = copies[rows, cols + 1]
    # per slot: the copies in each domain (one column more for none), and the servers holding one
    ng = int(groups.max(initial=0)) + 1
    gid = np.where(present, groups[np.clip(copies, 0, None)], ng)
    count = np.bincount((np.arange(num_slots)[:, None] * (ng + 1) + gid).ravel(),
                        minlength=num_slots * (ng + 1)).reshape(num_slots, ng + 1)
    holds = np.zeros((num_slots, n), bool)
    holds[np.nonzero(present)[0], copies[present]] = True
    reach = np.zeros((n, n), bool)  # reach[u, v]: some replica on u may move to v (as ``fits`` says)
    for v in live:
        gv = groups[v]
        alone = count[rows, gv] - (groups[held] == gv) == 0  # no other copy of the slot in v's domain
        reach[held[alone & ~holds[rows, v]], v] = True
    np.fill_diagonal(reach, False)
    before = float((load ** 2).sum())
    for busy in live[np.argsort(-load[live], kind="stable")]:
        parent = _chains(reach, int(busy))
        ends = [int(t) for t in live[np.argsort(load[live], kind="stable")]
                if parent[t] >= 0 and t != busy and load[t] < load[busy]]
        for end in ends:
            path = [end]
            while path[-1] != busy:
                path.append(int(parent[path[-1]]))
            if _walk(copies, groups, load, weights, path[::-1], before):
                return True
    return False


def _chains(reach: np.ndarray, start: int) -> np.ndarray:
    """(n,) int64: each server's predecessor on a shortest chain from ``start`` over ``reach`` (-1: none)."""
    parent = np.full(reach.shape[0], -1, np.int64)
    parent[start] = start
    frontier = [start]
    while frontier:
        nxt = []
        for u in frontier:
            for v in np.flatnonzero(reach[u] & (parent < 0)):
                parent[v] = u
                nxt.append(int(v))
        frontier = nxt
    return parent


def _walk(copies: np.ndarray, groups: np.ndarray, load: np.ndarray, weights: np.ndarray, path: list[int],
          before: float) -> bool:
    """Move a replica along each hop of ``path`` (a different slot each hop; the first the heaviest that narrows
    the gap between the ends, the later ones closest to its weight, so the servers between keep their load);
    keep the moves if every hop found one and the sum of squared loads fell below ``before``, else undo them."""
    after = load.astype(float).copy()
    done: list[tuple[int, int, int]] = []
    first = 0.0
    for u, v in zip(path[:-1], path[1:], strict=True):
        r, k = np.nonzero(copies[:, 1:] == u)
        k = k + 1
        keep = fits(copies[r], k, v, groups) & ~np.isin(r, [d[0] for d in done])
        r, k = r[keep], k[keep]
        if not r.size:
            break
        if not done:
            narrows = weights[r] < load[path[0]] - load[path[-1]]
            i = int(np.argmax(np.where(narrows, weights[r], -np.inf))) if narrows.any() else int(np.argmin(weights[r]))
            first = float(weights[r[i]])
        else:
            i = int(np.argmin(np.abs(weights[r] - first)))
        copies[r[i], k[i]] = v
        after[u] -= weights[r[i]]
        after[v] += weights[r[i]]
        done.append((int(r[i]), int(k[i]), u))
    else:
        if float((after ** 2).sum()) < before - 1e-9:
            return True
    for row, col, server in reversed(done):
        copies[row, col] = server
    return False


def relay_roles(copies: np.ndarray, alive: np.ndarray, groups: np.ndarray, load: np.ndarray, weights: np.ndarray,
                busy: int) -> bool:
    """In place: move primary roles (column 0 of ``copies``) off ``busy`` two hops at once, ``busy -> mid ->
    idle`` (``idle`` the least loaded alive server), for when the domains let ``busy``'s roles go only to servers
    already at their share. Each role moves to a server holding a copy of its slot (the roles swap) or to one
    whose domain the slot lacks (``fits``, the copy moving with it). Example: hosts A = {a1, a2}, B = {b1, b2},
    every replica on b1: a1's roles can go to b1 alone, and b1's (replicas on A) to b2; a batch of each.

    ``load``: (num_servers,) float, the primaries' weighted load; ``weights``: (num_slots,) float, a role's load.
    The ``mid`` with the most roles to pass is taken, as many roles per hop as bring ``busy`` down to the mean
    or ``idle`` up to it; kept only if the sum of squared loads falls. Returns whether roles moved."""
    live = np.flatnonzero(alive)
    mean = float(load[live].mean())
    idle = int(live[np.argmin(load[live])])
    room = min(float(load[busy]) - mean, mean - float(load[idle]))
    if room <= 0 or idle == busy:
        return False
    led = np.flatnonzero(copies[:, 0] == busy)
    best: tuple[int, np.ndarray, np.ndarray] | None = None
    for mid in live:
        if mid in (busy, idle):
            continue
        onward = np.flatnonzero(copies[:, 0] == mid)
        a, b = _takers(copies, led, int(mid), groups, weights), _takers(copies, onward, idle, groups, weights)
        k = min(_within(weights[a], room), _within(weights[b], room))
        if k and (best is None or k > best[1].size):
            best = (int(mid), a[:k], b[:k])
    if best is None:
        return False
    mid, a, b = best
    saved = copies[a].copy(), copies[b].copy()
    _hand(copies, a, busy, mid)
    _hand(copies, b, mid, idle)
    after = load.astype(float).copy()
    after[busy] -= weights[a].sum()
    after[mid] += weights[a].sum() - weights[b].sum()
    after[idle] += weights[b].sum()
    if float((after ** 2).sum()) < float((load ** 2).sum()) - 1e-9:
        return True
    copies[a], copies[b] = saved
    return False


def _takers(copies: np.ndarray, slots: np.ndarray, server: int, groups: np.ndarray, weights: np.ndarray
            ) -> np.ndarray:
    """Of ``slots`` (led by one server), those whose role ``server`` may take: it holds a copy (a swap, first) or
    its domain holds none (``fits``); heaviest first within each."""
    holds = (copies[slots] == server).any(axis=1)
    ok = holds | fits(copies[slots], 0, server, groups)
    slots, holds = slots[ok], holds[ok]
    return slots[np.lexsort((-weights[slots], ~holds))]


def _within(weights: np.ndarray, room: float) -> int:
    """How many of ``weights`` (in order) fit in ``room`` (at least one when there is any)."""
    if not weights.size:
        return 0
    return max(1, int(np.searchsorted(np.cumsum(weights), room + 1e-9, side="right")))


def _hand(copies: np.ndarray, slots: np.ndarray, old: int, new: int) -> None:
    """The role of ``slots`` from ``old`` to ``new``: where ``new`` holds a copy the two swap, else ``new``
    takes ``old``'s copy."""
    rows = copies[slots]
    rows[rows == new] = old
    rows[:, 0] = new
    copies[slots] = rows
