"""What the nemesis watches while it runs: the scheduler's demotion counters, split into the windows with and
without a fault, and the map's health over time.

Demotions are read from the scheduler's Prometheus endpoint: ``tigana_scheduler_copies_demoted_total`` with
the label ``reason`` (``replication_failed``: a primary reported it could not stream to a copy; ``restart``:
a server came back with a new boot id). A window *with a fault* opens just before a fault is injected and
closes at the first observation, after the fault is healed (the daemon restarted or resumed), of a settled
map (every slot with its primary and every copy in sync, nothing moving). Every demotion counted outside
those windows is a demotion without a failure; the target is 0.

The scheduler's log names each demotion's reporter and reason (``N cop(ies) on S out of the in-sync set
(slots ...; reported by P: REASON)``): ``demotion_reasons`` tallies them as evidence.

Thread-safety: a background thread polls; ``fault_begins``/``fault_healed``/``finish`` come from the
nemesis's main thread; a lock guards the window state.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tigana.ps import admin

_DEMOTED = re.compile(r'^tigana_scheduler_copies_demoted_total\{reason="([^"]+)"\}\s+(\S+)$', re.M)
_DEMOTION_LINE = re.compile(r"(\d+) cop\(ies\) on (\S+) out of the in-sync set \(slots .*?; reported by (\S+): "
                            r"(.*?)\)(?: \(\{.*\}\))?\s*$")


def demotions(metrics_port: int, timeout_s: float = 5.0) -> dict[str, float]:
    """reason -> copies demoted so far, from the scheduler's metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    return {reason: float(v) for reason, v in _DEMOTED.findall(text)}


def demotion_reasons(log_path: Path, top: int = 6) -> dict[str, int]:
    """The scheduler log's demotions by reason (digits folded to N), copies counted, the most frequent first."""
    tally: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in log_path.read_text(errors="replace").splitlines():
            m = _DEMOTION_LINE.search(line)
            if m:
                reason = re.sub(r"\b[0-9a-f]{12}\b", "SERVER", m.group(4))  # server ids
                reason = re.sub(r"N(?:[-,]N)+", "N...", re.sub(r"\d+", "N", reason))[:120]
                tally[reason] = tally.get(reason, 0) + int(m.group(1))
    return dict(sorted(tally.items(), key=lambda kv: -kv[1])[:top])


class Monitor:
    """Polls the scheduler every ``interval_s``: demotion counters, settledness, degraded slots."""

    def __init__(self, scheduler: str, metrics_port: int, interval_s: float = 0.5, t0: float | None = None) -> None:
        self.scheduler, self.metrics_port, self.interval_s = scheduler, metrics_port, interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nemesis-monitor", daemon=True)
        self.t0 = time.monotonic() if t0 is None else t0  # first_settled_s counts from here
        self.clean = True  # no fault in effect
        self._healing = False
        self._window_base = 0.0  # the demotion count when the current clean window opened
        self.without_failure = 0.0  # demotions counted in closed clean windows
        self.with_failure = 0.0
        self.faults = 0
        self.first_settled_s: float | None = None
        self.settled_last = False
        self.max_degraded = 0
        self.degraded_last = 0
        self.samples = 0

    def start(self) -> Monitor:
        self._window_base = self._total()
        self._thread.start()
        return self

    def _total(self) -> float:
        try:
            return sum(demotions(self.metrics_port).values())
        except OSError:
            return float("nan")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                reply = admin.status(self.scheduler, timeout_s=5.0)
            except Exception:  # noqa: BLE001 - a busy scheduler misses a sample, no more
                continue
            settled = (not reply.unavailable_slots and not reply.degraded_slots and not reply.moving_slots
                       and not sum(s.catching_up for s in reply.servers))
            with self._lock:
                self.samples += 1
                self.settled_last = settled
                self.degraded_last = int(reply.degraded_slots)
                self.max_degraded = max(self.max_degraded, self.degraded_last)
                if settled and self.first_settled_s is None:
                    self.first_settled_s = time.monotonic() - self.t0
                if settled and self._healing:
                    self._reopen()

    def _reopen(self) -> None:
        total = self._total()
        self.with_failure += total - self._window_base
        self._window_base, self.clean, self._healing = total, True, False

    def fault_begins(self) -> None:
        """Close the clean window (if one is open) just before a fault is injected."""
        total = self._total()
        with self._lock:
            self.faults += 1
            if self.clean:
                self.without_failure += total - self._window_base
            else:
                self.with_failure += total - self._window_base
            self._window_base, self.clean, self._healing = total, False, False

    def fault_healed(self) -> None:
        """The fault is over (restarted, resumed): the next settled map opens a clean window."""
        with self._lock:
            self._healing = True

    def finish(self) -> dict[str, Any]:
        """Stop polling and close the last window; the figures."""
        self._stop.set()
        self._thread.join(10)
        total_by_reason = {}
        with contextlib.suppress(OSError):
            total_by_reason = demotions(self.metrics_port)
        total = sum(total_by_reason.values()) if total_by_reason else self._total()
        with self._lock:
            if self.clean:
                self.without_failure += total - self._window_base
            else:
                self.with_failure += total - self._window_base
            self._window_base = total
            return {"copies_demoted_without_failure": int(self.without_failure),
                    "copies_demoted_with_failure": int(self.with_failure),
                    "copies_demoted_by_reason": {k: int(v) for k, v in total_by_reason.items()},
                    "first_settled_s": None if self.first_settled_s is None else round(self.first_settled_s, 2),
                    "settled_at_end": self.settled_last, "degraded_slots_end": self.degraded_last,
                    "degraded_slots_max": self.max_degraded}
