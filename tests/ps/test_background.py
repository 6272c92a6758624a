"""Background threads of a shard server (a planned move's slot copy, the drop of unheld slots) run at a lower
CPU priority than the data path (``tigana.ps.background``); a copy that restores a replica does not."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from tigana.ps.background import BACKGROUND_NICE, BACKGROUND_THREADS, lower_this_thread, start_thread

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a thread has a priority of its own on Linux")


def _nice_of_thread_named(name: str) -> int:
    seen: list[int] = []
    done = threading.Event()

    def probe() -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        done.set()

    start_thread(name, probe)
    assert done.wait(10)
    return seen[0]


def test_background_threads_run_below_the_data_path() -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for name in ("tigana-slot-copy", "tigana-drop-slots"):
        assert name.startswith(BACKGROUND_THREADS)
        assert _nice_of_thread_named(name) == min(19, base + BACKGROUND_NICE)
    # the data path, a write's replication, a copy restoring a replica and a copy lane's sender (it sends
    # restoring copies' chunks too) keep the process's priority
    for name in ("tigana-repl-4f81cc1a", "tigana-exchange-reader", "tigana-ack-deadlines", "tigana-slot-restore",
                 "tigana-copy-4f81cc1a"):
        assert _nice_of_thread_named(name) == base
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller is untouched


def test_lowering_stops_at_the_lowest_priority() -> None:
    seen: list[int] = []

    def twice() -> None:
        assert lower_this_thread(15) and lower_this_thread(15)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=twice)
    t.start()
    t.join(10)
    assert seen == [19]
