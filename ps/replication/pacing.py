"""CopyPacer: the rate cap on the rows a server's slot copies send for planned moves.

A rebalance, a drain or a primary hand-over copies whole slots while training goes on. On a busy server the copy
competes with the pushes for CPU, and a copy at full speed made a sync push's p99 several times its usual value
(``tigana bench reshard``). Production systems cap that traffic: CockroachDB's rebalance snapshots default to
32 MiB/s per store, TiKV's to 100 MB/s, Kafka throttles reassignments on request. A server paces the slot copies
it sends with one ``CopyPacer`` (``--copy-rate``, bytes a second over all of its copies at once); a copy that
restores a missing replica (a slot with fewer in-sync copies than the cluster keeps) is never paced: until it
ends, one more failure loses acknowledged updates.

Pure (sans-IO): the caller passes the clock and sleeps for the delay it is given. The rule is GCRA, the
virtual-scheduling form of a token bucket: every send moves a theoretical finish time ``tat`` on by
``bytes / rate`` from ``max(tat, now)``; a send waits until ``tat - burst / rate``. So over any window of ``t``
seconds at most ``burst + rate * t`` bytes leave, and an idle pacer lets ``burst`` bytes through at once.
"""

from __future__ import annotations

__all__ = ["CopyPacer"]


class CopyPacer:
    """Delays for the bytes slot copies send: ``rate`` bytes a second on average (None: no cap), bursts of
    ``burst_s`` seconds' worth. Not thread-safe: the adapter calls it under its lock."""

    def __init__(self, rate: float | None, burst_s: float = 0.25) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"copy rate must be > 0 bytes/s or None, got {rate}")
        self.rate = rate
        self.burst_s = burst_s
        self._tat = float("-inf")  # the theoretical time the bytes sent so far are done at ``rate``
        self.paced_s = 0.0  # total delay handed out (a metric: how much the cap held copies back)

    def delay(self, now: float, nbytes: int) -> float:
        """Record ``nbytes`` about to be sent at ``now``; seconds the sender should wait first (0: none)."""
        if self.rate is None or nbytes <= 0:
            return 0.0
        self._tat = max(self._tat, now) + nbytes / self.rate
        wait = max(0.0, self._tat - now - self.burst_s)
        self.paced_s += wait
        return wait
