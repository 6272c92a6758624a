"""How a daemon's main thread waits for SIGTERM or SIGINT (Ctrl-C) and then says which one stopped it."""

from __future__ import annotations

import signal
import threading


class StopSignal(threading.Event):
    """An event that SIGTERM and SIGINT set (handlers installed at construction, on the main thread);
    ``name`` is the first signal that arrived, e.g. ``SIGTERM``."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        self.set()

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0]).name if self.received else "stop"
