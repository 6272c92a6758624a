"""The state every room of ``SchedulerCore`` shares.

``SchedulerCore`` is assembled from one mixin per concept (``liveness``, ``moves``), each a subclass of
``CoreFields``, which declares the fields the core's ``__init__`` sets and the methods one room calls in
another, so that each room reads (and type-checks) alone. Sans-IO: no lock, store or clock (see ``core``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tigana.ps.metrics import SchedulerMetrics
from tigana.ps.routing import ShardMap
from tigana.ps.scheduler.actions import Probe
from tigana.ps.scheduler.config import SchedulerConfig

__all__ = ["CoreFields"]


class CoreFields:
    """Fields of the scheduler's state machine (set by ``SchedulerCore.__init__``)."""

    config: SchedulerConfig
    metrics: SchedulerMetrics
    now: float  # the time of the event being handled
    map: ShardMap
    target: np.ndarray | None  # the placement the map moves toward, None when it is there
    target_kind: str  # "balance": re-planned on failures; "moves": rolled back per slot
    draining: set[str]
    _moved: set[int]
    _moved_on: set[str]
    started: float
    ticked: bool
    last_seen: dict[str, float]
    heard: set[str]
    stats: dict[str, dict[str, float]]
    positions: dict[str, dict[str, dict[int, tuple[int, int]]]]
    orphaned_since: dict[int, float]
    first_register: float | None
    registered_at: dict[str, float]
    _probing: set[str]
    catching_since: dict[tuple[int, int], int]
    handover_since: dict[int, float]
    _warned_unprotected: float
    _degraded_since: float | None
    _states: list
    _announce: ShardMap | None
    _probes: list[Probe]

    if TYPE_CHECKING:  # the methods one room calls in another
        def _commit(self, new: ShardMap, why: str, extra: dict[str, Any] | None = None) -> ShardMap: ...
        def _save(self) -> None: ...
        def _alive(self) -> np.ndarray: ...
        def _ids(self, indexes: Any) -> list[str]: ...
        def _elect(self) -> None: ...
        def _reconcile(self) -> None: ...
