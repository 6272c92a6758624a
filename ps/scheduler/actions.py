"""What the scheduler's core asks its driver to do (``SchedulerCore.take_ready``): persist, announce, probe.

The core never does I/O; its driver (``driver.SchedulerDriver``, or the simulator) carries these out in the
order ``Ready`` gives, and feeds the answers back as events.
"""

from __future__ import annotations

import dataclasses

from tigana.ps.routing import ShardMap
from tigana.ps.scheduler.stores.file import SchedulerState

__all__ = ["Probe", "Ready"]


@dataclasses.dataclass(frozen=True)
class Probe:
    """Action: ask whether ``address`` (server ``server_id``, incarnation ``boot``) still listens; the answer
    comes back as ``SchedulerCore.probe_answered``."""

    server_id: str
    address: str
    boot: str


@dataclasses.dataclass(frozen=True)
class Ready:
    """What one or more events left to do, in this order: ``persist`` each state (one per change: every map
    the events made, one safe step each, and every change of the target or of the servers draining), then
    ``announce`` the map (None: unchanged since the last Ready) and answer the callers, then start ``probes``.
    Nothing of an event may be shown to anyone before its states are persisted."""

    persist: tuple[SchedulerState, ...]
    announce: ShardMap | None
    probes: tuple[Probe, ...]
