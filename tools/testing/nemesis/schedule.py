"""The nemesis's plan: planned operations and faults in a seeded random order (pure: no I/O).

A run is a sequence of rounds. The first round holds every planned operation once and no fault (the clean
phase: whatever it demotes or loses, no failure excuses). Later rounds, when faults are on, mix the planned
operations with the faults. Within a round the order is the seed's shuffle, except that a scratch table is
created before it is dropped.

Example::

    >>> rng = random.Random(7)
    >>> first = plan_round(rng, faults=False, join=True)
    >>> sorted(first) == sorted(PLANNED)
    True
"""

from __future__ import annotations

import random

# every planned operation (a round holds each once; "join" only while joins are left)
PLANNED = ("scratch_create", "scratch_drop", "move", "move_primary", "handover", "rebalance", "drain", "join",
           "checkpoint", "export", "restore")
# kill9: kill -9, a failover, then a restart on the old data dir; crash_restart: kill -9 and a restart at once
# (before the heartbeat timeout: the scheduler sees a new boot); pause: SIGSTOP past the timeout, SIGCONT
FAULTS = ("kill9", "crash_restart", "pause")
# the faults that take a primary away (an async update it acknowledged but had not shipped may be lost)
PRIMARY_FAULTS = frozenset({"kill9", "crash_restart", "pause"})


def plan_round(rng: random.Random, *, faults: bool, join: bool) -> list[str]:
    """One round's operations in order: every planned operation (``join`` only when ``join``) and, when
    ``faults``, every fault."""
    ops = [op for op in PLANNED if join or op != "join"]
    if faults:
        ops += FAULTS
    rng.shuffle(ops)
    i, j = ops.index("scratch_create"), ops.index("scratch_drop")
    if i > j:
        ops[i], ops[j] = ops[j], ops[i]
    return ops


def pause_between(rng: random.Random, quick: bool) -> float:
    """Seconds of plain traffic between two operations (the scratch table is used meanwhile)."""
    return rng.uniform(0.2, 0.8) if quick else rng.uniform(0.5, 3.0)
