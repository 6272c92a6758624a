"""Placement: where every slot's copies should live. Pure functions over arrays; no I/O, no clock.

The scheduler keeps two matrices of shape (num_slots, width), server indexes with ``NO_SERVER`` padding and
column 0 the primary: the map's current ``copies`` (with a state per copy) and a ``target``. These functions

- ``initial``: spread primaries in contiguous ranges and each range's replicas over all other servers;
- ``repair``: drop the copies on servers that are not alive, promote an in-sync copy where the primary went
  (only an in-sync copy may be promoted: it has every acknowledged update), and add catching-up copies on
  the least loaded alive servers until each slot has ``1 + replicas`` copies where servers allow;
- ``balance``: a target in which every alive server leads about ``S / n`` slots and holds about
  ``S (1 + r) / n`` copies, reached by moving as few copies as possible (a primary moves to a server that
  already holds an in-sync copy before any data moves);
- ``step_toward``: one safe step of the current copies toward a target: add the missing copies (catching
  up), move the primary role to an in-sync target copy, then drop copies the target does not have once the
  target's copies are in sync. Every intermediate map is valid, so a crash between steps leaves nothing
  half done: the next step starts from whatever map was persisted.

Failure domains (``tigana.ps.domains``): ``repair``, ``balance`` and ``plan`` take ``groups``, each server's
domain at the level the scheduler chose ((num_servers,) ints; None: every server its own). A slot's copies go
to distinct groups wherever the servers allow it: a new copy to the least loaded server of a group the slot
lacks, a balanced target moves a copy out of a group it shares, and evening out the load never moves a copy or
a primary role into a group the slot already holds.

Invariants every result keeps (property-tested): a slot's copies are on distinct servers (and, in a target,
in distinct groups when there are enough groups); a primary is in sync; a slot never loses its last in-sync
copy through ``step_toward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tigana.ps import domains
from tigana.ps.routing import CATCHING_UP, HANDING_OVER, IN_SYNC, NO_SERVER

__all__ = ["CostModel", "Plan", "balance", "cancel_hand_overs", "copy_counts", "hand_over", "initial", "moves",
           "plan", "repair", "server_loads", "step_toward", "trim"]


def initial(num_servers: int, num_slots: int, replicas: int) -> np.ndarray:
    """(num_slots, 1 + min(replicas, n - 1)) copies: primaries in contiguous near-equal ranges (as a
    static shard list), and the replicas of each range spread evenly over the other servers, so a dead
    server's load falls on all the others rather than on one neighbour."""
    if num_servers < 1:
        raise ValueError("placement: need at least one server")
    r = min(replicas, num_servers - 1)
    primary = (np.arange(num_slots, dtype=np.int64) * num_servers) // num_slots
    copies = np.full((num_slots, 1 + r), NO_SERVER, np.int32)
    copies[:, 0] = primary
    if r:
        rank = np.arange(num_slots) - np.searchsorted(primary, primary)  # position within its range
        for j in range(1, r + 1):
            offset = 1 + (rank + j - 1) % (num_servers - 1)
            copies[:, j] = (primary + offset) % num_servers
    return copies


def copy_counts(copies: np.ndarray, num_servers: int) -> tuple[np.ndarray, np.ndarray]:
    """(primaries per server, copies per server), each (num_servers,) int64."""
    prim = np.bincount(copies[:, 0][copies[:, 0] >= 0], minlength=num_servers)[:num_servers]
    flat = copies[copies >= 0]
    total = np.bincount(flat, minlength=num_servers)[:num_servers]
    return prim.astype(np.int64), total.astype(np.int64)


def widen(copies: np.ndarray, states: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Copies of ``copies`` and ``states`` with at least ``width`` columns (new ones empty)."""
    if copies.shape[1] >= width:
        return copies.copy(), states.copy()
    extra = width - copies.shape[1]
    return (np.concatenate([copies, np.full((copies.shape[0], extra), NO_SERVER, np.int32)], axis=1),
            np.concatenate([states, np.zeros((states.shape[0], extra), np.uint8)], axis=1))


def repair(copies: np.ndarray, states: np.ndarray, alive: np.ndarray, replicas: int,
           placeable: np.ndarray | None = None, groups: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Copies after servers not ``alive`` ((num_servers,) bool) are gone: their copies dropped, the first
    in-sync survivor promoted where the primary was lost (none: the slot has no primary), and catching-up
    copies added on the alive servers holding the fewest copies until each slot with a primary has
    ``1 + replicas`` copies (or every alive server holds one). New copies go only to ``placeable`` servers
    (default: the alive ones; a draining server is alive but not placeable), in a group (``groups``) the slot
    holds no copy in where one has a placeable server."""
    alive = np.asarray(alive, bool)
    placeable = alive if placeable is None else np.asarray(placeable, bool) & alive
    n = alive.shape[0]
    g = _groups(groups, n)
    want = 1 + replicas
    c, s = widen(np.asarray(copies, np.int32), np.asarray(states, np.uint8), want)
    gone = (c >= 0) & ~alive[np.clip(c, 0, None)]
    c[gone] = NO_SERVER
    s[gone] = 0
    # Promotion: only an in-sync copy has every acknowledged update.
    lost = np.flatnonzero(c[:, 0] < 0)
    for slot in lost:
        cand = np.flatnonzero((c[slot, 1:] >= 0) & (s[slot, 1:] == IN_SYNC))
        if cand.size:
            j = 1 + int(cand[0])
            c[slot, 0], c[slot, j] = c[slot, j], NO_SERVER
            s[slot, 0], s[slot, j] = IN_SYNC, 0
    # Re-replication onto the least loaded alive servers.
    _, load = copy_counts(c, n)
    load = np.where(placeable, load, np.iinfo(np.int64).max)
    have = (c >= 0).sum(axis=1)
    short = np.flatnonzero((c[:, 0] >= 0) & (have < want))
    for slot in short:
        for _ in range(want - int(have[slot])):
            held = c[slot][c[slot] >= 0]
            order = np.lexsort((np.arange(n), load))
            free = [int(t) for t in order if placeable[t] and t not in held]
            target = next((t for t in free if g[t] not in g[held]), free[0] if free else None)
            if target is None:
                break
            free = np.flatnonzero(c[slot] < 0)
            free = free[free > 0]
            col = int(free[0])
            c[slot, col], s[slot, col] = target, CATCHING_UP
            load[target] += 1
    return c, s


def trim(copies: np.ndarray, states: np.ndarray, replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """Drop catching-up copies beyond ``1 + replicas`` per slot (left by an election, or by a copy the
    placement no longer wants); in-sync copies are never dropped here."""
    c, s = copies.copy(), states.copy()
    want = 1 + replicas
    extra = np.flatnonzero((c >= 0).sum(axis=1) > want)
    for slot in extra:
        for j in range(c.shape[1] - 1, 0, -1):
            if (c[slot] >= 0).sum() <= want:
                break
            if c[slot, j] >= 0 and s[slot, j] == CATCHING_UP:
                c[slot, j], s[slot, j] = NO_SERVER, 0
    return c, s


def balance(copies: np.ndarray, alive: np.ndarray, replicas: int,
            weights: np.ndarray | None = None, primary_weights: np.ndarray | None = None,
            groups: np.ndarray | None = None) -> np.ndarray:
    """A target placement over the ``alive`` servers that moves as little as possible from ``copies``.

    Each slot keeps ``1 + min(replicas, alive - 1)`` copies on distinct alive servers. Primaries are evened
    out first (by handing the role to a server that already holds a copy where possible: no data moves),
    then copies move from the most to the least loaded servers. ``weights`` ((num_slots,) float, default 1)
    is the load of a slot's copy (rows held...) and ``primary_weights`` (default: ``weights``) the load of
    leading it (request rate...): balancing evens both weighted sums. ``groups``: the copies of a slot go to
    distinct groups where there are enough (see the module docstring)."""
    alive = np.asarray(alive, bool)
    n = alive.shape[0]
    live = np.flatnonzero(alive)
    if live.size == 0:
        raise ValueError("placement: no alive server")
    num_slots = copies.shape[0]
    w = np.ones(num_slots) if weights is None else np.asarray(weights, float)
    r = min(replicas, live.size - 1)
    g = _groups(groups, n)
    states = np.zeros(copies.shape, np.uint8)
    c, _ = repair(copies, states, alive, r, groups=g)  # dead servers out, every slot topped up
    # A slot with no primary at all (every copy lost) gets one on the least loaded server.
    for slot in np.flatnonzero(c[:, 0] < 0):
        _, load = copy_counts(c, n)
        cand = [int(t) for t in np.lexsort((np.arange(n), load)) if alive[t]]
        c[slot, 0] = cand[0]
    c, _ = repair(c, np.zeros(c.shape, np.uint8), alive, r, groups=g)
    # Drop surplus copies (more than 1 + r) from the most loaded servers (first those sharing a group with
    # another copy), then trim the width: a row's replicas need not be in its first columns (repair leaves
    # holes where dead copies were).
    for slot in np.flatnonzero((c[:, 1:] >= 0).sum(axis=1) > r):
        extra = np.flatnonzero(c[slot, 1:] >= 0) + 1
        while extra.size > r:
            _, load = copy_counts(c, n)
            shared = np.array([(g[c[slot][c[slot] >= 0]] == g[c[slot, j]]).sum() > 1 for j in extra])
            j = int(extra[np.lexsort((-load[c[slot, extra]], ~shared))[0]])
            c[slot, j] = NO_SERVER
            extra = np.flatnonzero(c[slot, 1:] >= 0) + 1
    order = np.argsort(c[:, 1:] < 0, axis=1, kind="stable")  # present replicas first, in their order
    c = np.concatenate([c[:, :1], np.take_along_axis(c[:, 1:], order, axis=1)], axis=1)[:, :1 + r]
    domains.separate(c, alive, g, _weighted(c, n, w, primaries=False), w)
    pw = w if primary_weights is None else np.asarray(primary_weights, float)
    # Primaries, then copies, again until the copies' moves open no role move: a target balance would change
    # again is a target the scheduler would re-plan (each round of roles lowers their spread, so it ends).
    for round_ in range(c.shape[0] + 1):
        before = c[:, 0].copy()
        if pw.max(initial=0.0) > 0:
            _even_primaries(c, alive, np.maximum(pw, 1e-9), g, groups is not None)
        if round_ and np.array_equal(before, c[:, 0]):
            break
        _even_copies(c, alive, w, g, groups is not None)
    return c


def _groups(groups: np.ndarray | None, n: int) -> np.ndarray:
    """(n,) int64 group ids: ``groups``, or every server a group of its own."""
    return np.arange(n, dtype=np.int64) if groups is None else np.asarray(groups, np.int64)


def _pairs(load: np.ndarray, alive: np.ndarray, every: bool, k: int = 8) -> list[tuple[int, int]]:
    """(busiest, idlest) server pairs to try a move between: the extreme pair, or with ``every`` (groups may
    forbid the moves between those two) the ``k`` busiest against the ``k`` idlest, widest gap first."""
    live = np.flatnonzero(alive)
    order = live[np.lexsort((live, load[live]))]
    if not every:
        hi = int(live[np.argmax(load[live])])
        return [(hi, int(order[0]))]
    pairs = [(int(h), int(lo)) for h in order[::-1][:k] for lo in order[:k] if load[h] > load[lo]]
    return sorted(pairs, key=lambda p: load[p[1]] - load[p[0]])


def _weighted(c: np.ndarray, n: int, w: np.ndarray, primaries: bool) -> np.ndarray:
    out = np.zeros(n)
    cols = c[:, :1] if primaries else c
    for j in range(cols.shape[1]):
        col = cols[:, j]
        ok = col >= 0
        out += np.bincount(col[ok], weights=w[ok], minlength=n)[:n]
    return out


def _even_primaries(c: np.ndarray, alive: np.ndarray, w: np.ndarray, g: np.ndarray, every: bool) -> None:
    """Move primary roles from the most to the least loaded alive servers until no move helps. Each round
    moves a batch from the busiest to the idlest server: the slots whose copy on the idlest exists first (a
    role swap, no data moves), heaviest first, as many as narrow the gap (at most half of it). A role that
    needs a new copy moves only where ``domains.fits`` allows (``every``: try other pairs when groups block one,
    and where the only pair left moves roles into a server at its share, move them on through it in one batch:
    ``domains.relay_roles``)."""
    n = alive.shape[0]
    for _ in range(c.shape[0]):
        load = _weighted(c, n, w, primaries=True)
        for hi, lo in _pairs(load, alive, every):
            gap = load[hi] - load[lo]
            led = np.flatnonzero(c[:, 0] == hi)
            led = led[w[led] < gap]  # moving it must narrow the gap
            holds_lo = (c[led] == lo).any(axis=1)
            ok = holds_lo | domains.fits(c[led], 0, lo, g)
            led, holds_lo = led[ok], holds_lo[ok]
            if led.size:
                break
        else:
            return
        if every and load[lo] >= load[alive].mean() - 1e-9 and domains.relay_roles(c, alive, g, load, w, hi):
            continue  # lo is at its share: the roles went on through it in one batch
        picks = led[np.lexsort((-w[led], ~holds_lo))]
        k = _batch(w[picks], load, alive, hi, lo)
        for pick in picks[:k]:
            j = np.flatnonzero(c[pick] == lo)
            if j.size:
                c[pick, int(j[0])] = hi  # swap roles: hi keeps a copy as replica
            c[pick, 0] = lo


def _batch(weights: np.ndarray, load: np.ndarray, alive: np.ndarray, hi: int, lo: int) -> int:
    """How many of the candidate moves (``weights`` in order) to make at once from ``hi`` to ``lo``: as many
    as keep ``hi`` at or above the mean load and ``lo`` at or below it (at least one): the same end state as
    moving one at a time from the busiest to the idlest, in far fewer rounds."""
    mean = float(load[alive].mean())
    room = min(load[hi] - mean, mean - load[lo])
    return max(1, int(np.searchsorted(np.cumsum(weights), room + 1e-9, side="right")))


def _even_copies(c: np.ndarray, alive: np.ndarray, w: np.ndarray, g: np.ndarray, every: bool) -> None:
    """Move replica copies from the most to the least loaded alive servers until no move helps (in batches,
    heaviest first, as many as narrow the gap between the two), only where ``domains.fits`` allows; where the
    domains forbid every such move (``every``), a copy is relayed through servers in between
    (``domains.relay``)."""
    n = alive.shape[0]
    if c.shape[1] < 2:
        return
    for _ in range(c.shape[0] * c.shape[1]):
        load = _weighted(c, n, w, primaries=False)
        for hi, lo in _pairs(load, alive, every):
            gap = load[hi] - load[lo]
            rows, cols = np.nonzero(c[:, 1:] == hi)
            cols = cols + 1
            ok = domains.fits(c[rows], cols, lo, g) & (w[rows] < gap)
            rows, cols = rows[ok], cols[ok]
            if rows.size:
                break
        else:
            if every and domains.relay(c, alive, g, load, w):  # the domains forbid every direct move
                continue
            return
        order = np.argsort(-w[rows], kind="stable")
        rows, cols = rows[order], cols[order]
        k = _batch(w[rows], load, alive, hi, lo)
        c[rows[:k], cols[:k]] = lo


@dataclass(frozen=True)
class CostModel:
    """How a slot loads a server and what moving it costs.

    row_weight: load of one row held (memory and snapshot work), on every copy; rate_weight: load of one
    row/s pulled or pushed, on the primary only (requests go to primaries); None: chosen so that the mean
    slot's rows and rate weigh the same. link_bytes_per_s: copy bandwidth, to predict how long moves take."""

    row_weight: float = 1.0
    rate_weight: float | None = None
    link_bytes_per_s: float = 100e6


@dataclass(frozen=True, eq=False)
class Plan:
    """What ``plan`` proposes: the target placement, the moves (slot, servers added, removed, primary from,
    primary to, bytes copied), and the predicted load per server (before and after) and cost. ``note``: when
    the request needed nothing (its end state already holds or is already planned), what holds."""

    target: np.ndarray
    moves: list[tuple[int, list[int], list[int], int, int, int]]
    load_before: np.ndarray
    load_after: np.ndarray
    bytes_moved: int
    seconds: float
    note: str = ""


def server_loads(copies: np.ndarray, num_servers: int, rows: np.ndarray, rates: np.ndarray,
                 cost: CostModel) -> np.ndarray:
    """(num_servers,) load under ``cost``: rows of every copy held, plus request rate of the slots led."""
    row_w = cost.row_weight
    rate_w = _rate_weight(rows, rates, cost)
    load = np.zeros(num_servers)
    for j in range(copies.shape[1]):
        col = copies[:, j]
        ok = col >= 0
        w = row_w * rows[ok] + (rate_w * rates[ok] if j == 0 else 0.0)
        load += np.bincount(col[ok], weights=w, minlength=num_servers)[:num_servers]
    return load


def _rate_weight(rows: np.ndarray, rates: np.ndarray, cost: CostModel) -> float:
    if cost.rate_weight is not None:
        return cost.rate_weight
    mean_rate = float(np.mean(rates)) if rates.size else 0.0
    return cost.row_weight * float(np.mean(rows)) / mean_rate if mean_rate > 0 else 0.0


def plan(copies: np.ndarray, alive: np.ndarray, replicas: int, rows: np.ndarray, bytes_: np.ndarray,
         rates: np.ndarray, cost: CostModel | None = None, groups: np.ndarray | None = None) -> Plan:
    """The cost-model placement: a target over the ``alive`` servers that evens out the load (rows held and
    request rate led, weighted by ``cost``) while moving as little as possible: primaries move first to
    servers already holding a copy (no data copied), then copies move from the busiest to the idlest
    servers, heaviest first, keeping copies in distinct ``groups`` (see ``balance``). Pure: the caller
    measures the per-slot ``rows``, ``bytes_`` and ``rates``."""
    cost = cost or CostModel()
    n = np.asarray(alive).shape[0]
    rows, bytes_, rates = (np.asarray(a, float) for a in (rows, bytes_, rates))
    # The cost model: rows load every copy, the request rate only the primary. Copies are evened by rows,
    # primary roles by rate (without rates, by rows, which also spreads where reads and writes will go).
    row_load = cost.row_weight * rows
    rate_load = _rate_weight(rows, rates, cost) * rates
    copy_w = np.where(row_load > 0, row_load, max(float(row_load.mean()) * 1e-3, 1e-9) if rows.size else 1.0)
    lead_w = rate_load if rate_load.max(initial=0.0) > 0 else copy_w
    target = balance(copies, alive, replicas, weights=copy_w, primary_weights=lead_w, groups=groups)
    before = server_loads(copies, n, rows, rates, cost)
    after = server_loads(target, n, rows, rates, cost)
    live = np.asarray(alive, bool)
    g = _groups(groups, n)
    if live.any() and (copies[copies >= 0] < n).all() and np.isin(copies[copies >= 0], np.flatnonzero(live)).all() \
            and after[live].max() > before[live].max() * (1 + 1e-9) \
            and domains.collapsed(copies, g).sum() <= domains.collapsed(target, g).sum():
        target = copies.copy()  # never propose a placement that makes the busiest server busier
    out = []
    moved = 0
    for slot, added, removed in moves(copies, target):
        b = int(bytes_[slot]) * len(added)
        moved += b
        out.append((slot, added, removed, int(copies[slot, 0]), int(target[slot, 0]), b))
    for slot in np.flatnonzero((copies[:, 0] != target[:, 0]) & ~np.isin(np.arange(copies.shape[0]),
                                                                        [m[0] for m in out])):
        out.append((int(slot), [], [], int(copies[slot, 0]), int(target[slot, 0]), 0))
    return Plan(target, out, before, server_loads(target, n, rows, rates, cost), moved,
                moved / cost.link_bytes_per_s)


def moves(current: np.ndarray, target: np.ndarray) -> list[tuple[int, list[int], list[int]]]:
    """Per slot that differs: (slot, copies added, copies removed) in server indexes; primary changes that
    need no data count as neither."""
    out = []
    for slot in np.flatnonzero(_differs(current, target)):
        cur = set(current[slot][current[slot] >= 0].tolist())
        tgt = set(target[slot][target[slot] >= 0].tolist())
        out.append((int(slot), sorted(tgt - cur), sorted(cur - tgt)))
    return out


def _differs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    width = max(a.shape[1], b.shape[1])
    a = np.concatenate([a, np.full((a.shape[0], width - a.shape[1]), NO_SERVER, np.int32)], axis=1)
    b = np.concatenate([b, np.full((b.shape[0], width - b.shape[1]), NO_SERVER, np.int32)], axis=1)
    sa, sb = np.sort(a, axis=1), np.sort(b, axis=1)
    return (sa != sb).any(axis=1) | (a[:, 0] != b[:, 0])


def step_toward(copies: np.ndarray, states: np.ndarray, target: np.ndarray, *, max_new_copies: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """One safe step from (copies, states) toward ``target``, for every slot at once:

    1. add each target copy the slot lacks, catching up (at most ``max_new_copies`` slots start copying);
    2. once no slot of the move has a target copy still to make or catching up, start handing every primary
       role that moves to the target's primary (an in-sync copy): the primary is marked ``HANDING_OVER`` (it
       refuses writes and drains its stream); ``hand_over`` completes the step when it reports (the old
       primary stays a replica);
    3. once, besides, no primary role of the move is still to hand over, drop the copies not in target.

    Hand-overs wait for the copies (2) because a fenced slot refuses writes until the new primary's map is
    out, and a write touches most slots: hand-overs spread over the copies' completions would stall every
    write once per completion, and a primary drains its stream behind the rows it is still copying. Held
    back, they are one fence, over idle streams. Drops wait for the hand-overs (3) so that deleting the
    dropped rows does not take the CPU from the servers in the fence. Slots without a primary are left
    alone (nothing can copy from them), and hold nothing back."""
    width = max(copies.shape[1], target.shape[1]) * 2
    c, s = widen(np.asarray(copies, np.int32), np.asarray(states, np.uint8), width)
    moving = np.flatnonzero(_differs(c, target))
    moving = moving[c[moving, 0] >= 0]
    copying = any(_copying(c[slot], s[slot], target[slot]) for slot in moving)
    handing = bool(((c[moving, 0] != target[moving, 0]) & (target[moving, 0] >= 0)).any())
    started = 0
    for slot in moving:
        if c[slot, 0] < 0:
            continue
        tgt = [int(x) for x in target[slot] if x >= 0]
        row = c[slot]
        missing = [x for x in tgt if x not in row]
        if missing:
            if max_new_copies is not None and started >= max_new_copies:
                continue
            started += 1
            for x in missing:
                col = int(np.flatnonzero(row[1:] < 0)[0]) + 1
                c[slot, col], s[slot, col] = x, CATCHING_UP
            continue
        in_sync = all(s[slot, int(np.flatnonzero(row == x)[0])] == IN_SYNC for x in tgt)  # not while handing over
        if not in_sync:
            continue
        if row[0] != tgt[0]:
            # A planned hand-over takes two maps: here the primary is told to refuse writes and drain its
            # stream (HANDING_OVER); ``hand_over`` names the new primary once it reported that it did.
            if not copying:
                s[slot, 0] = HANDING_OVER
            continue
        if handing:
            continue
        for j in range(1, c.shape[1]):
            if c[slot, j] >= 0 and int(c[slot, j]) not in tgt:
                c[slot, j], s[slot, j] = NO_SERVER, 0
    return c, s


def _copying(row: np.ndarray, states: np.ndarray, target_row: np.ndarray) -> bool:
    """Whether a slot (its copies ``row`` and their ``states``) lacks a copy of ``target_row`` or has one
    still catching up."""
    for x in target_row[target_row >= 0]:
        j = np.flatnonzero(row == x)
        if not j.size or states[j[0]] == CATCHING_UP:
            return True
    return False


def hand_over(copies: np.ndarray, states: np.ndarray, slots: np.ndarray, target: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Complete the hand-over of ``slots`` (their primary reported that it refuses writes and that its in-sync
    copies hold everything it wrote): where the primary is ``HANDING_OVER`` and the target's primary holds an
    in-sync copy, the roles swap (both in sync). Returns (copies, states, the slots handed over)."""
    c, s = copies.copy(), states.copy()
    done = []
    for slot in np.asarray(slots, np.int64):
        if not 0 <= slot < c.shape[0] or c[slot, 0] < 0 or s[slot, 0] != HANDING_OVER:
            continue
        new = int(target[slot, 0]) if slot < target.shape[0] else NO_SERVER
        j = np.flatnonzero(c[slot] == new) if new >= 0 else np.empty(0, np.int64)
        if not j.size or j[0] == 0 or s[slot, j[0]] != IN_SYNC:
            continue
        k = int(j[0])
        c[slot, 0], c[slot, k] = new, c[slot, 0]
        s[slot, 0], s[slot, k] = IN_SYNC, IN_SYNC
        done.append(int(slot))
    return c, s, np.asarray(done, np.int64)


def cancel_hand_overs(copies: np.ndarray, states: np.ndarray, target: np.ndarray | None,
                      expired: np.ndarray | None = None) -> np.ndarray:
    """States with the hand-overs that can no longer complete cancelled (the primary serves writes again):
    no target, a target whose primary is the current one, or whose primary holds no in-sync copy of the slot,
    or ``expired`` ((num_slots,) bool: the primary never reported)."""
    s = states.copy()
    slots = np.flatnonzero((copies[:, 0] >= 0) & (s[:, 0] == HANDING_OVER))
    for slot in slots:
        new = int(target[slot, 0]) if target is not None and slot < target.shape[0] else NO_SERVER
        j = np.flatnonzero(copies[slot, 1:] == new) + 1 if new >= 0 else np.empty(0, np.int64)
        ok = j.size and s[slot, j[0]] == IN_SYNC and not (expired is not None and expired[slot])
        if not ok:
            s[slot, 0] = IN_SYNC
    return s
