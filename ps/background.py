"""Background work of a shard server at a lower CPU priority than its data path.

The export of a planned move's slot copy (paced by the copy rate) and the drop of the rows of slots a server no
longer holds are work that can wait; pulls, pushes, their replication and a copy that restores a missing replica
(until it ends, a loss of the last copy loses rows) are not. Where several servers share cores (a test box, a
packed node) a move's bursts on three servers at once (each source listing, sorting and exporting its share;
each old copy deleting its rows) took the cores from the pushes: a push in flight waited 0.4-0.5 s. The threads
that do that work lower their own priority (``nice`` +10 on Linux, where a thread has a priority of its own);
the kernel then runs them when the data path leaves a core free, and they still finish on an idle box as fast
as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

BACKGROUND_NICE = 10  # added to a background thread's nice value (CFS weight about a tenth of the data path's)
# The threads of a shard server's copies and drops, by name (the name is what ``start_thread`` and a simulator's
# spawn go by, so every spawn site uses these).
SLOT_COPY_THREAD = "tigana-slot-copy"  # a planned move's copy (paced): background
SLOT_RESTORE_THREAD = "tigana-slot-restore"  # a copy that restores a missing replica (unpaced): full priority
DROP_THREAD = "tigana-drop-slots"  # deletes the rows of slots no longer held: background
# The names of background threads. Not a copy lane's sender (``tigana-copy-*``): it also sends the chunks of
# copies that restore a replica, and a thread cannot raise its priority back without privileges.
BACKGROUND_THREADS = (SLOT_COPY_THREAD, DROP_THREAD)


def lower_this_thread(by: int = BACKGROUND_NICE) -> bool:
    """Lower the calling thread's CPU priority by ``by`` nice levels (Linux; a no-op elsewhere, False)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
        return True
    except (AttributeError, OSError):
        return False


def start_thread(name: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` on a daemon thread named ``name``, at background priority when the name says it is one of
    ``BACKGROUND_THREADS``."""
    if name.startswith(BACKGROUND_THREADS):
        work = fn

        def fn() -> None:
            lower_this_thread()
            work()
    threading.Thread(target=fn, name=name, daemon=True).start()
