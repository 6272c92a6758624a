"""A scheduler core (``SchedulerCore``) to drive without sockets: a recording ``FileMapStore`` under
``tmp_path`` and a fake clock (``t[0]``), registered servers and their boots, and the check every map it
announces or saves must pass. The one harness of the scheduler-core tests (core, map, operations)."""

from __future__ import annotations

import numpy as np
import pytest
from primaries import report_all

from tigana.embeddings import TableConfig
from tigana.ps.routing import HANDING_OVER, IN_SYNC, ShardMap, TableDef
from tigana.ps.scheduler import SchedulerConfig, SchedulerDriver
from tigana.ps.scheduler.stores.file import FileMapStore, SchedulerState

TIMEOUT = 3.0
SLOTS = 24


class RecordingStore(FileMapStore):
    """A ``FileMapStore`` that keeps every state it saved (the announcer only sees the last map of a call)."""

    def __init__(self, data_dir) -> None:
        super().__init__(data_dir)
        self.saved: list[SchedulerState] = []

    def save(self, state: SchedulerState) -> None:
        super().save(state)
        self.saved.append(state)


class Cluster:
    """A core, its fake clock, its recording store, the maps it announced, and the boot of every server
    registered."""

    def __init__(self, tmp_path, *, t0: float = 0.0, boots: dict[str, str] | None = None, **config) -> None:
        self.t = [t0]
        self.dir = tmp_path / "scheduler"
        config.setdefault("num_slots", SLOTS)
        config.setdefault("heartbeat_timeout_s", TIMEOUT)
        config.setdefault("replicas", 1)
        self.config = SchedulerConfig(**config)
        self.store = RecordingStore(self.dir)
        self.announced: list[ShardMap] = []
        self.core = SchedulerDriver(self.config, self.store, announce=self.announced.append,
                                  clock=lambda: self.t[0])
        self.boots: dict[str, str] = dict(boots or {})

    @property
    def map(self) -> ShardMap:
        return self.core.map

    def idx(self, server: str) -> int:
        return self.map.index_of(server)

    def register(self, server: str, boot: str | None = None, positions=None, domain=None) -> ShardMap:
        self.boots[server] = boot or self.boots.get(server) or f"{server}-boot1"
        return self.core.register(server, f"host-{server}:1", self.boots[server], positions, domain)

    def up(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.map.servers if s.up)

    def advance(self, dt: float, alive: tuple[str, ...] | None = None) -> None:
        """Time passes in steps of at most a second: at each, the ``alive`` servers (default: all up)
        heartbeat, then a tick."""
        end = self.t[0] + dt
        while self.t[0] < end:
            self.t[0] = min(end, self.t[0] + 1.0)
            for s in self.up() if alive is None else alive:
                _, again = self.core.heartbeat(s, self.boots[s], self.map.epoch)
                assert not again, s
            self.core.tick()

    def kill(self, server: str) -> None:
        """``server`` stops: the clock jumps past the timeout at once (no tick in between), the others
        heartbeat, one tick declares it dead."""
        others = tuple(s for s in self.up() if s != server)
        self.t[0] += TIMEOUT + 0.5
        for s in others:
            self.core.heartbeat(s, self.boots[s], self.map.epoch)
        self.core.tick()
        assert not self.map.servers[self.idx(server)].up

    def catch_up_all(self) -> int:
        """Every primary reports each of its slots' catching-up copies caught up (one report per
        (primary, copy) pair, made from the map current at the time). Returns the reports made."""
        return report_all(self.core)

    def run_to_target(self, limit: int = 40) -> int:
        """Catch up and tick until the target is reached, checking every saved map on the way."""
        for step in range(limit):
            if self.core.target is None:
                self.check_saved()
                return step
            self.catch_up_all()
            self.advance(0.5)
        pytest.fail(f"the target was not reached: {self.core.target}")

    def check_saved(self) -> None:
        for state in self.store.saved:
            assert_valid(state.map)


def assert_valid(m: ShardMap, *, unled_ok: bool = False) -> None:
    """Copies on distinct servers that are up; a primary is in sync or handing over; slot_epochs never ahead
    of the map. Every slot with copies has a primary, unless ``unled_ok`` (a failover that found no in-sync
    copy keeps the slot's catching-up copies without a primary: unavailable, never promoted)."""
    up = np.array([s.up for s in m.servers], bool)
    for slot in range(m.num_slots):
        row = [int(x) for x in m.copies[slot] if x >= 0]
        assert len(row) == len(set(row)), f"epoch {m.epoch} slot {slot}: {m.copies[slot]}"
        assert all(up[x] for x in row), f"epoch {m.epoch} slot {slot}: a copy on a server that is down"
        if m.copies[slot, 0] >= 0:
            assert m.states[slot, 0] in (IN_SYNC, HANDING_OVER), f"epoch {m.epoch} slot {slot}: {m.states[slot]}"
        elif row:
            assert unled_ok, f"epoch {m.epoch} slot {slot}: copies {m.copies[slot]} without a primary"
    assert (m.slot_epochs <= m.epoch).all()


def started(tmp_path, servers=("a", "b", "c"), **config) -> Cluster:
    config.setdefault("expect_servers", len(servers))
    c = Cluster(tmp_path, **config)
    for s in servers:
        c.register(s)
    assert (c.map.copies[:, 0] >= 0).all() and (c.map.states == IN_SYNC).all()
    c.core.tick()  # a running scheduler has ticked (its first tick forgives the time since its start)
    return c


def spec(name: str = "emb", dim: int = 8, **kw) -> TableDef:
    return TableDef(TableConfig(name, dim), **kw)
