"""The state every room of ``ShardService`` shares.

``ShardService`` is assembled from one mixin per concept (``hosted``, ``ownership``, ``writes``, ``export``,
``persistence``), each a subclass of ``ShardFields``, which declares the fields the service's ``__init__``
sets and the methods one room calls in another, so that each room reads (and type-checks) alone.
Thread-safety: see the ``tigana.ps.shard`` docstring (a write lock per table, the install lock, the registry
lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tigana.embeddings import Changes, EmbeddingTable, TableConfig
from tigana.ps.catalog import Catalog
from tigana.ps.config import ServerConfig
from tigana.ps.dedup import DedupWindow
from tigana.ps.metrics import ServerMetrics
from tigana.ps.replication import Inbound, Replicator, SlotLog
from tigana.ps.routing import TableDef
from tigana.ps.security import Security

if TYPE_CHECKING:
    from tigana.ps.shard.hosted import _Hosted
    from tigana.ps.shard.ownership import _View


class ShardFields:
    """Fields of one shard server (set by ``ShardService.__init__``)."""

    config: ServerConfig
    security: Security
    metrics: ServerMetrics
    state: str  # loading -> serving -> closed (or failed)
    num_slots: int
    data_dir: Path | None
    catalog: Catalog | None
    server_id: str
    boot: str
    clustered: bool
    corrupt_stores: int
    agent: Any
    on_install: Callable[[], None] | None
    wall_clock: Callable[[], float]
    clock: Callable[[], float]
    _tables: dict[str, _Hosted]
    _registry_lock: threading.RLock
    _install_lock: threading.Lock
    _inbound: dict[str, tuple[Inbound, threading.Lock]]
    _inbound_lock: threading.Lock
    _handover_wake: threading.Event
    _drop_lock: threading.Lock
    _drop_wanted: bool
    _drop_running: bool
    _handover_started: bool
    _last_decay: float
    _cuts: dict[str, Any]  # cluster cuts by name (``cuts``)
    _cuts_lock: threading.Lock
    _streams: int
    _streams_lock: threading.Lock
    _frame_pool: futures.ThreadPoolExecutor
    _control_pool: futures.ThreadPoolExecutor
    _view: _View
    replicator: Replicator | None

    if TYPE_CHECKING:  # the methods one room calls in another
        def _get(self, name: str) -> _Hosted: ...
        def cut_chunks(self, request: Any) -> Any: ...
        def table_names(self) -> list[str]: ...
        def _effective(self, spec: TableConfig) -> TableConfig: ...
        def _new_hosted(self, spec: TableDef, table: EmbeddingTable | None = None,
                        dedup: DedupWindow | None = None, slot_log: SlotLog | None = None) -> _Hosted: ...
        def _leads_ids(self, ids: np.ndarray) -> np.ndarray: ...
        def _create_local(self, spec: TableDef) -> _Hosted: ...
        def _drop_local(self, name: str) -> bool: ...
        def _rebudget(self) -> None: ...
        def _check_leads(self, table: str, ids: np.ndarray, epoch: int) -> tuple[_View, np.ndarray]: ...
        def _check_rows(self, table: str, n: int) -> None: ...
        def _replicate(self, hosted: _Hosted, view: _View, changes: Changes | None, slots: np.ndarray | None,
                       key: tuple[str, int, np.ndarray] | None) -> list: ...
        def _check_unmoved(self, table: str, view: _View, slots: np.ndarray) -> None: ...
        def _wait_for_room(self, table: str, timeout_s: float | None = None) -> None: ...
        def _save_registry(self, without: str | None = None) -> None: ...
