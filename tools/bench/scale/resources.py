"""CPU seconds and memory: of a process (``/proc``, ``getrusage``), of the machine (memory available), and
the engine's estimated bytes per resident row (the memory check before a run)."""

from __future__ import annotations

import contextlib
import os
import resource
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
    """A process's anonymous resident memory (``RssAnon``): its heap and arrays, not mapped file pages."""
    return _status_bytes(pid, "RssAnon")


def _status_bytes(pid: int, key: str) -> int:
    """A size field of ``/proc/<pid>/status`` in bytes, 0 when the process is gone."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(f"{key}:"))
        return int(line.split()[1]) * 1024
    return 0
