"""``ServerLinks``: what the objects of one shard server share that is not theirs: its lifecycle state and its
link to the scheduler (the daemon's membership agent), both set from outside after construction.

``state`` is loading -> serving -> closed (or failed), set by the daemon (or a simulator). ``agent`` is the
membership agent (``refresh(epoch, wait_s)``, ``refresh_soon(epoch)``, ``report_copy_failure``,
``copy_caught_up``, ``handover_ready``, ``lease_ok``); None on a static server, or before the daemon links it.
The replicator's callbacks (refresh the map, report a failure, report a copy caught up) go here, to the agent,
never back into the server's objects.

Thread-safety: the fields are read and written as single attribute accesses (atomic under the GIL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ServerLinks"]


class ServerLinks:
    """The lifecycle state and the scheduler link of one shard server (see the module docstring)."""

    def __init__(self) -> None:
        self.state = "loading"
        self.agent: Any = None
        self.on_install: Callable[[], None] | None = None  # the daemon's health update, after each map install

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    def refresh(self, epoch: int, wait_s: float = 0.0) -> None:
        """Ask the scheduler for a map newer than ``epoch`` and install it (blocks up to ``wait_s``; no-op
        without an agent). Never call under a table or install lock: the answer installs a map."""
        if self.agent is not None:
            self.agent.refresh(epoch, wait_s)

    def refresh_soon(self, epoch: int) -> None:
        """Have the agent fetch a map of at least ``epoch`` in the background (never blocks)."""
        if self.agent is not None:
            self.agent.refresh_soon(epoch)

    def report_failure(self, target: str, slots: np.ndarray, reason: str, epoch: int) -> None:
        """Report to the scheduler that the copy on ``target`` of ``slots`` failed (an RPC: no lock held)."""
        if self.agent is not None:
            self.agent.report_copy_failure(target, slots, reason, epoch)

    def caught_up(self, target: str, slots: np.ndarray, since_epoch: int) -> bool | None:
        """Report a slot copy on ``target`` caught up (an RPC: no lock held); the scheduler's answer, None
        without an agent or an answer."""
        if self.agent is not None:
            return self.agent.copy_caught_up(target, slots, since_epoch)
        return None

    def lease_ok(self) -> bool:
        """Whether the primary lease holds (async pushes are refused when it does not); True without an agent."""
        return self.agent is None or bool(self.agent.lease_ok())
