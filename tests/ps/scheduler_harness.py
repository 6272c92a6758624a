"""A scheduler core (``SchedulerCore``) to drive without sockets: a ``FileMapStore`` under ``tmp_path`` and a fake
clock (``t[0]``), registered servers and their boots, and the check every map it announces must pass."""

from __future__ import annotations

import numpy as np
from primaries import report_all

from tigana.embeddings import TableConfig
from tigana.ps.routing import IN_SYNC, ShardMap, TableDef
from tigana.ps.scheduler import SchedulerConfig, SchedulerCore
from tigana.ps.scheduler.stores.file import FileMapStore

TIMEOUT = 3.0
SLOTS = 24


class Cluster:
    """A core, its fake clock, the maps it announced, and the boot of every server we registered."""

    def __init__(self, tmp_path, *, t0: float = 0.0, **config) -> None:
        self.t = [t0]
        self.dir = tmp_path / "scheduler"
        config.setdefault("num_slots", SLOTS)
        config.setdefault("heartbeat_timeout_s", TIMEOUT)
        config.setdefault("replicas", 1)
        self.config = SchedulerConfig(**config)
        self.announced: list[ShardMap] = []
        self.core = SchedulerCore(self.config, FileMapStore(self.dir), announce=self.announced.append,
                                  clock=lambda: self.t[0])
        self.boots: dict[str, str] = {}

    @property
    def map(self) -> ShardMap:
        return self.core.map

    def register(self, server: str, boot: str | None = None, positions=None) -> ShardMap:
        self.boots[server] = boot or self.boots.get(server) or f"{server}-boot1"
        return self.core.register(server, f"host-{server}:1", self.boots[server], positions)

    def advance(self, dt: float, *, alive: tuple[str, ...] = ()) -> None:
        """Time passes in steps of a second; at each, the servers in ``alive`` heartbeat, then a tick."""
        end = self.t[0] + dt
        while self.t[0] < end:
            self.t[0] = min(end, self.t[0] + 1.0)
            for s in alive:
                _, again = self.core.heartbeat(s, self.boots[s], self.map.epoch)
                assert not again, s
            self.core.tick()

    def catch_up_all(self) -> int:
        """Every primary reports every catching-up copy of its slots caught up (a report can change the map:
        each is made from the current one). Returns the reports made."""
        return report_all(self.core)


def assert_valid(m: ShardMap) -> None:
    """Copies on distinct servers that are up; a primary is in sync; slot_epochs never ahead of the map."""
    up = np.array([s.up for s in m.servers], bool)
    for slot in range(m.num_slots):
        row = [int(x) for x in m.copies[slot] if x >= 0]
        assert len(row) == len(set(row)), f"slot {slot}: {m.copies[slot]}"
        assert all(up[x] for x in row), f"slot {slot}: a copy on a server that is down: {m.copies[slot]}"
        if m.copies[slot, 0] >= 0:
            assert m.states[slot, 0] == IN_SYNC
    assert (m.slot_epochs <= m.epoch).all()


def started(tmp_path, servers=("a", "b", "c"), **config) -> Cluster:
    config.setdefault("expect_servers", len(servers))
    c = Cluster(tmp_path, **config)
    for s in servers:
        c.register(s)
    assert (c.map.copies[:, 0] >= 0).all()
    return c


def spec(name: str = "emb", dim: int = 8, **kw) -> TableDef:
    return TableDef(TableConfig(name, dim), **kw)
