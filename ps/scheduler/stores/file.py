"""Where the scheduler keeps its state: the shard map and the placement it is moving toward.

``MapStore`` is the small interface a store implements (``load`` and ``save``; ``save`` returns only once
the state is durable, since the scheduler announces a map only after it is saved). ``FileMapStore`` keeps
it in the scheduler's data dir: written to a temp file, fsynced, renamed over the old one, the directory
fsynced, so a ``kill -9`` at any point leaves the old state or the new one, never a mix. A highly available
scheduler keeps it in etcd instead, behind the same interface.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from tigana.embeddings.files import atomic_write
from tigana.proto import scheduler_pb2 as spb
from tigana.ps.errors import DataLoss
from tigana.ps.routing import ShardMap
from tigana.ps.wire import cluster as cluster_wire

__all__ = ["FileMapStore", "MapStore", "SchedulerState"]


@dataclass(frozen=True, eq=False)
class SchedulerState:
    """The map, the target placement ((num_slots, width) int32 server indexes) and the servers being
    drained (ids)."""

    map: ShardMap
    target: np.ndarray
    draining: tuple[str, ...] = ()
    target_kind: str = "balance"


class MapStore(Protocol):
    """Durable storage of the scheduler's state."""

    def load(self) -> SchedulerState | None:
        """The last saved state, or None for a new cluster."""

    def save(self, state: SchedulerState) -> None:
        """Persist ``state``; durable when this returns."""

    def describe(self) -> str:
        """Where the state lives, for logs."""


def encode_state(state: SchedulerState) -> bytes:
    target = np.ascontiguousarray(state.target, "<i4")
    return spb.SchedulerState(map=cluster_wire.map_to_pb(state.map), target=target.tobytes(),
                              target_width=target.shape[1], draining=list(state.draining),
                              target_kind=state.target_kind).SerializeToString()


def decode_state(data: bytes, where: str) -> SchedulerState:
    try:
        msg = spb.SchedulerState.FromString(data)
        m = cluster_wire.map_from_pb(msg.map)
        target = cluster_wire.array(msg.target, "<i4", field="target",
                                    count=m.num_slots * msg.target_width).reshape(m.num_slots, msg.target_width)
    except Exception as exc:  # noqa: BLE001 - any decoding failure means the file is damaged
        raise DataLoss(f"scheduler state {where} cannot be read: {exc}") from exc
    return SchedulerState(m, target.copy(), tuple(msg.draining), msg.target_kind or "balance")


class FileMapStore:
    """State in ``<data_dir>/scheduler-state.pb`` (atomic replace, fsynced)."""

    FILE = "scheduler-state.pb"

    def __init__(self, data_dir: str | os.PathLike) -> None:
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / self.FILE

    def describe(self) -> str:
        return str(self.path)

    def load(self) -> SchedulerState | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return decode_state(data, str(self.path))

    def save(self, state: SchedulerState) -> None:
        data = encode_state(state)
        atomic_write(self.path, data)
