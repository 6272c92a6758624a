"""CPU seconds and memory: of a process (``/proc``, ``getrusage``), of the machine (memory available), and
the engine's estimated bytes per resident row (the memory check before a run)."""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import threading
from pathlib import Path

# Engine overhead per resident row beyond weights and optimizer state (slot header, hash index, slack): the
# memory check's estimate; the run measures the real figure (scale.rows.memory).
_ROW_OVERHEAD_BYTES = 64
_TICK = os.sysconf("SC_CLK_TCK")


def _bytes_per_row_estimate(dim: int) -> int:
    return dim * 4 * 2 + _ROW_OVERHEAD_BYTES  # weights + Adagrad's per-coordinate accumulator + overhead


def _mem_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        text = Path("/proc/meminfo").read_text()
        line = next(x for x in text.splitlines() if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far (``/proc/<pid>/stat`` utime + stime)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) ": state is field 3, utime 14, stime 15
    return (int(fields[11]) + int(fields[12])) / _TICK


def _self_cpu_s() -> float:
    """User + system CPU seconds of every thread of this process (``getrusage``: microseconds, not ticks)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rss_bytes(pid: int) -> int:
    """A process's resident memory (``VmRSS``), 0 when it is gone."""
    return _status_bytes(pid, "VmRSS")


def _rss_anon(pid: int) -> int:
    """A process's own resident memory, not mapped file pages: its private anonymous pages (``RssAnon``: heap,
    arrays) and its shared anonymous ones (``RssShmem``: an array on a shared anonymous mapping counts there, and
    would escape a measure of ``RssAnon`` alone)."""
    return _status_bytes(pid, "RssAnon") + _status_bytes(pid, "RssShmem")


def _status_bytes(pid: int, key: str) -> int:
    """A size field of ``/proc/<pid>/status`` in bytes, 0 when the process is gone."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(f"{key}:"))
        return int(line.split()[1]) * 1024
    return 0


class RssPeaks:
    """The largest memory of some processes over a stretch of time, sampled every ``every`` seconds on a thread
    (``with RssPeaks(pids) as peaks: ...``): the largest anonymous RSS of any of them (``anon_max``), the
    median along the run of the largest at each sample (``anon_median``), and the largest whole RSS
    (``rss_max``). A few samples a run miss the short spikes a budget must also hold (a rehash, a spill's
    listing), so this samples often: two reads of ``/proc/<pid>/status`` a process, about 0.1 ms."""

    def __init__(self, pids: list[int], every: float = 0.02) -> None:
        self._pids, self._every = list(pids), every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-peaks", daemon=True)
        self._anon: list[int] = []
        self.rss_max = 0

    def __enter__(self) -> RssPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._anon.append(max(_rss_anon(pid) for pid in self._pids))
            self.rss_max = max(self.rss_max, *(_rss_bytes(pid) for pid in self._pids))
            if self._stop.wait(self._every):
                return

    @property
    def anon_max(self) -> int:
        return max(self._anon, default=0)

    @property
    def anon_median(self) -> int:
        return int(statistics.median(self._anon)) if self._anon else 0

    @property
    def samples(self) -> int:
        return len(self._anon)
