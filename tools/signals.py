"""How a daemon's main thread waits for SIGTERM or SIGINT (Ctrl-C) and then says which one stopped it."""

from __future__ import annotations

import signal
import threading
import time

_POLL_S = 0.2


class StopSignal(threading.Event):
    """An event that SIGTERM and SIGINT set (handlers installed at construction, on the main thread);
    ``name`` is the first signal that arrived, e.g. ``SIGTERM``. ``set()`` stops it from code.

    Python runs signal handlers only on the main thread, between bytecodes, and the kernel may deliver a
    process-directed signal to any thread (gRPC's, the server's): one delivered elsewhere does not interrupt a
    main thread blocked on a lock. A plain ``Event.wait()`` therefore slept through a SIGTERM (a server took
    60 s and a SIGKILL to stop, about one close in ten under load). So ``wait`` polls, and the handler takes no
    lock (``Event.set`` does: run while the main thread held it inside ``wait``, it would deadlock); it only
    records the signal, which ``is_set`` and ``wait`` read."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.received.append(signum)  # no lock in a signal handler

    def is_set(self) -> bool:
        return bool(self.received) or super().is_set()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            super().wait(left)  # back to the interpreter at least every _POLL_S to run a pending handler
        return True

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0]).name if self.received else "stop"
