"""The scheduler's core without a driver (events in, ``Ready`` out) and its driver's contract: every state is
persisted before its map is shown to anyone, and a refused write leaves nothing of the event visible."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from scheduler_harness import TIMEOUT, spec

from tigana.ps.errors import Unavailable
from tigana.ps.scheduler import SchedulerConfig, SchedulerCore, SchedulerDriver
from tigana.ps.scheduler.actions import Probe
from tigana.ps.scheduler.core import new_state
from tigana.ps.scheduler.stores.file import FileMapStore, SchedulerState


def _core(**config) -> SchedulerCore:
    config.setdefault("num_slots", 12)
    config.setdefault("heartbeat_timeout_s", TIMEOUT)
    config.setdefault("replicas", 1)
    config.setdefault("expect_servers", 3)
    cfg = SchedulerConfig(**config)
    return SchedulerCore(cfg, new_state(cfg, "c1"), now=0.0)


def test_events_return_what_to_persist_announce_and_probe_in_order() -> None:
    core = _core()
    ready = core.take_ready()
    assert ready.persist == () and ready.announce is None and ready.probes == ()
    for i, s in enumerate("abc"):
        core.register(s, f"h{s}:1", f"{s}1", now=float(i))
    ready = core.take_ready()
    epochs = [st.map.epoch for st in ready.persist]
    assert epochs == sorted(set(epochs)) and len(epochs) == 4  # 3 joins, then the first placement
    assert ready.announce is core.map and ready.persist[-1].map is core.map
    assert (core.map.copies[:, 0] >= 0).all()
    # a heartbeat that changes nothing asks for nothing
    m, again = core.heartbeat("a", "a1", core.map.epoch, now=3.0)
    assert m is None and not again
    assert core.take_ready() == type(ready)((), None, ())
    # the time is the event's: a register far in the future does not make the others silent until a tick
    core.heartbeat("b", "b1", 0, now=4.0)
    assert core.take_ready().persist == ()


def test_a_silent_server_is_probed_once_and_the_answer_is_an_event() -> None:
    core = _core()
    for s in "abc":
        core.register(s, f"h{s}:1", f"{s}1", now=0.0)
    core.take_ready()
    for now in (1.0, 1.5):  # c silent for more than a third of the timeout
        for s in "ab":
            core.heartbeat(s, f"{s}1", core.map.epoch, now=now)
        core.tick(now=now)
    ready = core.take_ready()
    assert ready.probes == (Probe("c", "hc:1", "c1"),)  # one probe at a time
    epoch = core.map.epoch
    core.probe_answered("c", "c0", True, now=1.6)  # about another incarnation: nothing
    assert core.map.epoch == epoch
    core.probe_answered("c", "c1", False, now=1.7)  # its health service answers: heard from now
    assert core.last_seen["c"] == 1.7 and core.take_ready().persist == ()
    core.tick(now=2.0)
    assert core.take_ready().probes == ()  # silent for 0.3 s: no probe yet
    for s in "ab":
        core.heartbeat(s, f"{s}1", core.map.epoch, now=2.9)
    core.tick(now=2.9)
    assert core.take_ready().probes == (Probe("c", "hc:1", "c1"),)
    core.probe_answered("c", "c1", True, now=3.0)  # its port is closed: dead at once, no timeout
    ready = core.take_ready()
    assert not core.map.servers[2].up and ready.announce is core.map and ready.persist


def test_the_tick_forgives_the_silence_of_a_stalled_scheduler() -> None:
    core = _core()
    for s in "abc":
        core.register(s, f"h{s}:1", f"{s}1", now=0.0)
    core.take_ready()
    core.tick(now=TIMEOUT + 5, waited_s=TIMEOUT)  # the tick waited for the lock: the silence was ours
    assert all(s.up for s in core.map.servers)
    core.tick(now=2 * TIMEOUT + 6)
    assert not any(s.up for s in core.map.servers)


def test_a_scheduler_stalled_at_every_tick_still_probes_and_sees_a_killed_server_die() -> None:
    """Seen on a loaded 2-core machine: the scheduler's ticks came 2 s apart, each a stall that forgave every
    silence, and a server killed with ``kill -9`` stayed up for over 60 s. A stall forgives the silence but
    still probes the servers that looked silent; the probe's closed port declares the dead one dead."""
    core = _core()
    for s in "abc":
        core.register(s, f"h{s}:1", f"{s}1", now=0.0)
    core.take_ready()
    now = 0.0
    for _ in range(5):  # every tick a stall; a and b beat between ticks, c is gone
        now += TIMEOUT / 2
        for s in "ab":
            core.heartbeat(s, f"{s}1", core.map.epoch, now=now - 0.1)
        core.tick(now=now, stalled=True)
    assert all(s.up for s in core.map.servers)  # nobody declared dead by the silence alone
    probes = core.take_ready().probes
    assert probes == (Probe("c", "hc:1", "c1"),)  # one probe, only of the silent one
    core.probe_answered("c", "c1", True, now=now)
    assert [s.up for s in core.map.servers] == [True, True, False]


def test_a_new_leader_probes_the_servers_it_has_not_heard_and_a_health_answer_keeps_them_up() -> None:
    """A scheduler that starts leading (a standby elected, or a restart) has heard no server yet: their
    heartbeats may still be timing out on the old leader. Seen in a fault test on a loaded machine: the new
    leader declared both servers dead 3.2 s after it took over, without a probe (only servers heard since the
    start were probed). It probes them like any silent server; a health answer counts as hearing from them."""
    core = _core()
    for s in "abc":
        core.register(s, f"h{s}:1", f"{s}1", now=0.0)
    core.take_ready()
    leader = SchedulerCore(core.config, core.state(), now=100.0)  # took over from the state: heard nobody
    leader.tick(now=100.0 + TIMEOUT / 3 + 0.1)
    assert sorted(p.server_id for p in leader.take_ready().probes) == ["a", "b", "c"]
    for s in "ab":  # running: their health service answers; c's port is closed
        leader.probe_answered(s, f"{s}1", False, now=100.0 + TIMEOUT / 2)
    leader.probe_answered("c", "c1", True, now=100.0 + TIMEOUT / 2)
    leader.tick(now=100.0 + TIMEOUT + 0.5)  # past the timeout since the take-over, no heartbeat yet
    assert [s.up for s in leader.map.servers] == [True, True, False]


def test_a_scheduler_whose_first_tick_comes_late_declares_nobody_dead_for_it() -> None:
    """A scheduler restarts and its clock jumps past the heartbeat timeout before its first tick (a pause of its
    VM, a clock step: ``bench sim`` seed 399, where every server was declared dead at once, "no heartbeat for
    5.5s"). With no tick before it, the driver cannot measure the stall: the core counts the time from its start
    to its first tick as its own silence. Nobody is declared dead; every server is probed, and a closed port is
    still the server's own answer."""
    core = _core()
    for s in "abc":
        core.register(s, f"h{s}:1", f"{s}1", now=0.0)
    core.take_ready()
    restarted = SchedulerCore(core.config, core.state(), now=100.0)
    restarted.tick(now=100.0 + TIMEOUT + 2.5)
    assert all(s.up for s in restarted.map.servers)
    assert sorted(p.server_id for p in restarted.take_ready().probes) == ["a", "b", "c"]
    restarted.probe_answered("c", "c1", True, now=100.0 + TIMEOUT + 2.6)
    assert [s.up for s in restarted.map.servers] == [True, True, False]
    restarted.tick(now=100.0 + TIMEOUT + 3.0)  # later ticks are no first tick: silence counts again
    restarted.tick(now=100.0 + 2 * TIMEOUT + 2.6)
    assert [s.up for s in restarted.map.servers] == [False, False, False]


class _Store(FileMapStore):
    """A file store that records what was published when each state was saved, and refuses on demand."""

    def __init__(self, folder) -> None:
        super().__init__(folder)
        self.driver: SchedulerDriver | None = None
        self.announced: list[int] = []
        self.seen_at_save: list[tuple[int, int, int]] = []  # (state epoch, published epoch, last announced)
        self.refuse = False
        self.unreadable = False

    def load(self) -> SchedulerState | None:
        if self.unreadable:
            raise Unavailable("the store cannot be read either")
        return super().load()

    def save(self, state: SchedulerState) -> None:
        if self.refuse:
            raise Unavailable("the store refused the write")
        if self.driver is not None:
            self.seen_at_save.append((state.map.epoch, self.driver.map.epoch,
                                      self.announced[-1] if self.announced else -1))
        super().save(state)


def test_the_driver_persists_every_state_before_anyone_sees_its_map(tmp_path) -> None:
    store = _Store(tmp_path / "s")
    t = [0.0]
    driver = SchedulerDriver(SchedulerConfig(num_slots=12, replicas=1, expect_servers=3), store,
                             announce=lambda m: store.announced.append(m.epoch), clock=lambda: t[0])
    store.driver = driver
    for s in "abc":
        driver.register(s, f"h{s}:1", f"{s}1")
    assert store.seen_at_save and all(published < epoch and announced < epoch
                                      for epoch, published, announced in store.seen_at_save
                                      if epoch > published)
    assert driver.map.epoch == store.announced[-1] == FileMapStore(tmp_path / "s").load().map.epoch


def test_a_refused_write_leaves_nothing_of_the_event_visible(tmp_path) -> None:
    store = _Store(tmp_path / "s")
    t = [0.0]
    driver = SchedulerDriver(SchedulerConfig(num_slots=12, replicas=1, expect_servers=3), store,
                             announce=lambda m: store.announced.append(m.epoch), clock=lambda: t[0])
    for s in "abc":
        driver.register(s, f"h{s}:1", f"{s}1")
    before, announced = driver.map, list(store.announced)
    store.refuse = True
    with pytest.raises(Unavailable):
        driver.create_table(spec("emb"), exist_ok=False)
    assert driver.map is not before and driver.map.epoch == before.epoch  # rebuilt from the store
    assert "emb" not in driver.map.tables and "emb" not in driver.core.map.tables
    assert store.announced == announced and driver.wait_map(before.epoch, 0.0) is None
    np.testing.assert_array_equal(driver.map.copies, before.copies)
    store.refuse = False  # the store is back: the event can be made again
    _, created = driver.create_table(spec("emb"), exist_ok=False)
    assert created and "emb" in driver.map.tables and store.announced[-1] == driver.map.epoch


def test_a_refused_write_with_the_store_unreadable_keeps_the_last_saved_state(tmp_path) -> None:
    """With the store gone for reads too, the core is rebuilt from the last state saved: the map *and* the
    placement it was moving toward and the servers draining (rebuilt from the published map alone, a drain
    and a rebalance in progress were forgotten)."""
    store = _Store(tmp_path / "s")
    driver = SchedulerDriver(SchedulerConfig(num_slots=12, replicas=1, expect_servers=3), store, clock=lambda: 0.0)
    for s in "abc":
        driver.register(s, f"h{s}:1", f"{s}1")
    driver.drain("c")
    saved = FileMapStore(tmp_path / "s").load()
    assert saved.draining == ("c",)
    store.refuse = store.unreadable = True
    with pytest.raises(Unavailable):
        driver.create_table(spec("emb"), exist_ok=False)
    assert driver.core.draining == {"c"} and driver.map.epoch == saved.map.epoch
    np.testing.assert_array_equal(driver.core.state().target, saved.target)


def test_wait_probes_holds_until_the_probes_in_flight_have_answered(tmp_path) -> None:
    """A stopping scheduler must leave no gRPC call behind it (its exit would abort in gRPC's teardown):
    ``wait_probes`` returns once every probe thread has answered, or at its timeout."""
    release, asked = threading.Event(), []

    def probe(address: str) -> bool | None:
        asked.append(address)
        release.wait(10)
        return False  # a health check answered: the server is up

    t = [0.0]
    driver = SchedulerDriver(SchedulerConfig(num_slots=12, replicas=1, expect_servers=3), FileMapStore(tmp_path / "s"),
                             probe=probe, clock=lambda: t[0])
    for s in "abc":
        driver.register(s, f"h{s}:1", f"{s}1")
    t[0] = 1.5  # every server silent past a third of the heartbeat timeout: each is probed
    driver.tick()
    deadline = time.monotonic() + 10
    while len(asked) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(asked) == ["ha:1", "hb:1", "hc:1"]
    start = time.monotonic()
    driver.wait_probes(0.2)  # the probes still wait: it gives up at its timeout
    assert 0.15 < time.monotonic() - start < 5
    release.set()
    driver.wait_probes(10)
    assert not driver._probes  # every probe answered and was counted out


class _SlowStore(FileMapStore):
    """A store whose writes wait for ``release`` while ``hold`` is set (etcd under load), and that refuses them
    while ``refuse`` is set."""

    def __init__(self, data_dir) -> None:
        super().__init__(data_dir)
        self.hold, self.release, self.saving = threading.Event(), threading.Event(), threading.Event()
        self.refuse = False

    def save(self, state: SchedulerState) -> None:
        if self.hold.is_set():
            self.saving.set()
            assert self.release.wait(10)
        if self.refuse:
            raise Unavailable("store: write refused")
        super().save(state)


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_heartbeat_is_recorded_while_the_store_writes_and_no_unsaved_map_is_shown(tmp_path) -> None:
    """The store's write runs outside the core's lock: a heartbeat behind a slow write is recorded and answered
    at once (with the published map), while the map of the write in flight is shown to nobody, nor is the
    answer of an event that read it given, until it is saved."""
    store = _SlowStore(tmp_path / "s")
    t = [0.0]
    announced: list[int] = []
    driver = SchedulerDriver(SchedulerConfig(num_slots=12, replicas=1, expect_servers=3), store,
                             announce=lambda m: announced.append(m.epoch), clock=lambda: t[0])
    for s in "abc":
        driver.register(s, f"h{s}:1", f"{s}1")
    before = driver.map
    store.hold.set()
    creating, created = _in_thread(lambda: driver.create_table(spec("emb"), exist_ok=False))
    assert store.saving.wait(10)  # the write is in flight
    t[0] = 2.0
    beat, beaten = _in_thread(lambda: driver.heartbeat("a", "a1", before.epoch))
    beat.join(5)
    assert not beat.is_alive(), "the heartbeat waited for the store's write"
    assert beaten["value"] == (None, False) and driver.core.last_seen["a"] == 2.0
    behind, behind_out = _in_thread(lambda: driver.create_table(spec("emb"), exist_ok=True))
    behind.join(0.3)
    assert behind.is_alive(), "an answer that rests on an unsaved map was given"
    assert driver.map is before and driver.wait_map(before.epoch, 0.0) is None and announced[-1] == before.epoch
    store.hold.clear()
    store.release.set()
    for thread in (creating, behind):
        thread.join(5)
    assert created["value"][1] is True and behind_out["value"][1] is False
    assert "emb" in driver.map.tables and announced[-1] == driver.map.epoch > before.epoch
    assert driver.heartbeat("a", "a1", before.epoch) == (driver.map, False)


def test_a_refused_write_refuses_the_events_queued_behind_it(tmp_path) -> None:
    store = _SlowStore(tmp_path / "s")
    driver = SchedulerDriver(SchedulerConfig(num_slots=12, replicas=1, expect_servers=3), store, clock=lambda: 0.0)
    for s in "abc":
        driver.register(s, f"h{s}:1", f"{s}1")
    before = driver.map
    store.hold.set()
    first, first_out = _in_thread(lambda: driver.create_table(spec("one"), exist_ok=False))
    assert store.saving.wait(10)
    second, second_out = _in_thread(lambda: driver.create_table(spec("two"), exist_ok=False))
    time.sleep(0.2)  # the second event ran on the first's unsaved state and waits behind it
    store.refuse = True
    store.hold.clear()
    store.release.set()
    for thread in (first, second):
        thread.join(5)
    assert isinstance(first_out.get("error"), Unavailable) and isinstance(second_out.get("error"), Unavailable)
    assert driver.map.epoch == before.epoch and not {"one", "two"} & set(driver.core.map.tables)
    store.refuse = False
    _, created = driver.create_table(spec("two"), exist_ok=False)
    assert created and "two" in driver.map.tables


def test_status_describes_the_published_map_while_the_next_is_saved(tmp_path) -> None:
    """``Status`` and the metrics describe the state whose map is published (what ``GetMap`` gives), never a
    map still being saved: a drain is stepped to its end with every write held, and at each held write status
    shows the published map and what it still moves toward. (Reading the core's newest state, the step that
    reached the target read as settled while ``GetMap`` still gave the map before it, its old copies not yet
    dropped: a test that waited for "settled" then read a map 4 copies wide.)"""
    from primaries import report_all

    from tigana.ps.scheduler import placement

    store = _SlowStore(tmp_path / "s")
    t = [0.0]
    driver = SchedulerDriver(SchedulerConfig(num_slots=12, replicas=1, expect_servers=3), store, clock=lambda: t[0])
    for s in "abc":
        driver.register(s, f"h{s}:1", f"{s}1")
    driver.drain("c")
    held_at_the_end = False
    for _ in range(40):
        if driver.core.target is None:
            break
        report_all(driver)
        t[0] += 0.5
        store.release.clear()
        store.saving.clear()
        store.hold.set()
        ticking, out = _in_thread(driver.tick)
        while ticking.is_alive() and not store.saving.is_set():
            time.sleep(0.002)
        if store.saving.is_set():  # the tick's state is being written: its map is not published yet
            held_at_the_end |= driver.core.target is None  # the step that reaches the target
            published, st = driver.map, driver.status()
            assert driver.core.map.epoch > published.epoch
            assert st.map.epoch == published.epoch, (st.map.epoch, published.epoch)
            assert driver.figures()["epoch"] == published.epoch
            assert st.moving_slots == len(placement.moves(published.copies, driver.shown.target))
            if not st.moving_slots:  # reads settled: then the published map is the settled one
                assert published.width == 2 and not published.holds(2).any()
        store.hold.clear()
        store.release.set()
        ticking.join(5)
        assert "error" not in out, out
    assert driver.core.target is None and held_at_the_end
    st = driver.status()
    assert st.map.epoch == driver.map.epoch and st.moving_slots == 0 and list(st.draining) == ["c"]
    assert not driver.map.holds(2).any() and driver.map.width == 2
