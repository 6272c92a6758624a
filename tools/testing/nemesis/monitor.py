"""What the nemesis watches while it runs: the scheduler's demotion counters, split into the windows with and
without a fault, and the map's health over time.

Demotions are read from the scheduler's Prometheus endpoint: ``tigana_scheduler_copies_demoted_total`` with
the label ``reason`` (``replication_failed``: a primary reported it could not stream to a copy; ``restart``:
a server came back with a new boot id); beside them, ``tigana_scheduler_servers_declared_dead_total``. A
window *with a fault* opens just before a fault is injected and closes at the first observation, after the
fault is healed (the daemon restarted or resumed), of a settled map (every slot with its primary and every
copy in sync, nothing moving). Every demotion counted outside those windows is a demotion without a failure
(target: 0); a server declared dead outside them is a false failure.

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

import numpy as np

from tigana.ps.ops import admin

_DEMOTED = re.compile(r'^tigana_scheduler_copies_demoted_total\{reason="([^"]+)"\}\s+(\S+)$', re.M)
_DEMOTION_LINE = re.compile(r"(\d+) cop\(ies\) on (\S+) out of the in-sync set \(slots .*?; reported by (\S+): "
                            r"(.*?)\)(?: \(\{.*\}\))?\s*$")


_DEAD = re.compile(r"^tigana_scheduler_servers_declared_dead_total\s+(\S+)$", re.M)


def scrape(metrics_port: int, timeout_s: float = 5.0) -> tuple[dict[str, float], float]:
    """(reason -> copies demoted so far, servers declared dead so far), from the scheduler's metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    dead = _DEAD.search(text)
    return {reason: float(v) for reason, v in _DEMOTED.findall(text)}, float(dead.group(1)) if dead else 0.0


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
        # (copies demoted, servers declared dead): the counts when the current window opened, and the sums
        # of the closed windows without and with a failure
        self._window_base = np.zeros(2)
        self.without_failure = np.zeros(2)
        self.with_failure = np.zeros(2)
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

    def _total(self) -> np.ndarray:
        """(copies demoted, servers declared dead) so far; NaN (which fails the target) when the scheduler's
        metrics do not answer three times."""
        for attempt in range(3):
            try:
                demoted, dead = scrape(self.metrics_port)
                return np.array([sum(demoted.values()), dead])
            except OSError:
                time.sleep(0.5 * (attempt + 1))
        return np.full(2, np.nan)

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
        total_by_reason: dict[str, float] = {}
        with contextlib.suppress(OSError):
            total_by_reason = scrape(self.metrics_port)[0]
        total = self._total()
        with self._lock:
            if self.clean:
                self.without_failure += total - self._window_base
            else:
                self.with_failure += total - self._window_base
            self._window_base = total
            return {"copies_demoted_without_failure": _int(self.without_failure[0]),
                    "copies_demoted_with_failure": _int(self.with_failure[0]),
                    "servers_declared_dead_without_failure": _int(self.without_failure[1]),
                    "copies_demoted_by_reason": {k: int(v) for k, v in total_by_reason.items()},
                    "first_settled_s": None if self.first_settled_s is None else round(self.first_settled_s, 2),
                    "settled_at_end": self.settled_last, "degraded_slots_end": self.degraded_last,
                    "degraded_slots_max": self.max_degraded}


def _int(x: float) -> int | None:
    return None if np.isnan(x) else int(x)
