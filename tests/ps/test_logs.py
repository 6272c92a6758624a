"""Structured logs: ``setup_logging`` in text and JSON, and the cluster's replication, failover and slot-move
messages naming their slots, epoch and server, in the text and as JSON fields. Failover runs on a real
in-process scheduler and two real in-process shard servers; slot moves on the scheduler's state machine."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest
from primaries import report_all

from tigana import ps
from tigana.embeddings import TableConfig
from tigana.ps.logs import JsonFormatter, event, setup_logging, slots_text
from tigana.ps.routing import TableDef
from tigana.ps.scheduler import SchedulerConfig, SchedulerDriver, start_scheduler
from tigana.ps.scheduler.stores.file import FileMapStore
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import start_server


@pytest.fixture
def restore_root() -> Iterator[None]:
    """Put the root logger's handlers and level back after a test that calls ``setup_logging``."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)


@pytest.fixture
def captured() -> Iterator[tuple[list[logging.LogRecord], io.StringIO]]:
    """Every ``tigana.ps`` record at INFO and above: the records, and the same rendered by ``JsonFormatter``."""
    records: list[logging.LogRecord] = []
    text = io.StringIO()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("tigana.ps")
    keep, as_json = Keep(), logging.StreamHandler(text)
    as_json.setFormatter(JsonFormatter())
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(keep)
    logger.addHandler(as_json)
    try:
        yield records, text
    finally:
        logger.removeHandler(keep)
        logger.removeHandler(as_json)
        logger.setLevel(level)


def test_setup_logging_writes_text_or_one_json_object_per_line(restore_root) -> None:
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    log = logging.getLogger("tigana.test.logs")
    log.debug("not shown")
    log.info("plain %d", 7, extra={"slot": 3})
    assert out.getvalue().count("\n") == 1 and "INFO tigana.test.logs: plain 7" in out.getvalue()

    out = io.StringIO()
    setup_logging("DEBUG", "json", stream=out)  # replaces the text handler
    assert sum(getattr(h, "_tigana", False) for h in logging.getLogger().handlers) == 1
    log.debug("moved %s", "slot", extra=event("slot_move", slots=[1, 2, 3, 9], epoch=np.int64(12),
                                                server=["s2", "s1"], table="users", ids=np.arange(2)))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "moved slot" and first["level"] == "DEBUG" and first["logger"] == "tigana.test.logs"
    assert first["time"].endswith("Z") and "T" in first["time"]
    assert first["event"] == "slot_move" and first["slots"] == "1-3,9" and first["slot_count"] == 4
    assert first["epoch"] == 12 and first["server"] == "s1,s2" and first["table"] == "users"
    assert first["ids"] == [0, 1]
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exception"]

    with pytest.raises(ValueError, match="log format"):
        setup_logging("INFO", "xml")
    with pytest.raises(ValueError, match="log level"):
        setup_logging("LOUD")


def test_slots_text_keeps_lines_short() -> None:
    assert slots_text([]) == "none"
    assert slots_text([5, 1, 2, 3]) == "1-3,5"
    assert slots_text(range(0, 40, 2), limit=3) == "0,2,4,... (17 more range(s))"


def _events(records: list[logging.LogRecord], name: str) -> list[logging.LogRecord]:
    return [r for r in records if getattr(r, "event", None) == name]


def _names_slots_epoch_server(r: logging.LogRecord) -> None:
    text = r.getMessage()
    assert isinstance(r.epoch, int) and f"epoch {r.epoch}" in text, text
    assert r.slots and r.slot_count > 0, text
    first = r.slots.split(",")[0]
    assert first in text, (first, text)
    for server in r.server.split(","):
        assert server in text, (server, text)


@pytest.mark.timeout(120)
def test_failover_and_replication_messages_name_slots_epoch_and_server(tmp_path, captured) -> None:
    records, rendered = captured
    sched = start_scheduler(SchedulerConfig(data_dir=str(tmp_path / "sched"), replicas=1, expect_servers=2,
                                            heartbeat_timeout_s=5.0))
    servers = []
    try:
        for i in range(2):
            servers.append(start_server(ServerConfig(port=0, data_dir=str(tmp_path / f"s{i}"), drain_grace_s=1.0,
                                                     scheduler=sched.address)))
        for h in servers:
            assert h.wait_ready(30)
        core = sched.core
        deadline = time.monotonic() + 30
        while (core.map.copies < 0).any() or core.map.summary()["degraded_slots"]:
            assert time.monotonic() < deadline, core.map.summary()
            time.sleep(0.05)
        with ps.connect(scheduler=sched.address, failover_timeout_s=10.0) as client:
            client.create_table("logs", dim=4)
            ids = np.arange(500, dtype=np.int64)
            client.push("logs", ids, np.ones((500, 4), np.float32)).result()
        dead = servers[1].service.server_id
        servers[1].close(grace=0.5)
        while all(s.up for s in core.map.servers):
            assert time.monotonic() < deadline + 30, "the scheduler did not notice the stopped server"
            core.unreachable(servers[1].address)
            time.sleep(0.1)
        # a new server: the lost copies are re-added there and built by slot copies from the primary
        servers.append(start_server(ServerConfig(port=0, data_dir=str(tmp_path / "s2"), drain_grace_s=1.0,
                                                 scheduler=sched.address)))
        assert servers[2].wait_ready(30)
        while core.map.summary()["degraded_slots"]:
            assert time.monotonic() < deadline + 60, core.map.summary()
            time.sleep(0.05)
    finally:
        for h in servers:
            h.close(grace=1.0)
        sched.close()

    # the copies lost with the dead server, re-added on the new one: slot copies sent by the primary,
    # reported caught up to the scheduler, installed by the servers
    for name in ("re_replication", "slot_copy_started", "slot_copy_sent", "copy_caught_up", "map_installed"):
        assert _events(records, name), name
        for r in _events(records, name):
            if name == "map_installed":  # the slots whose role changed, named by change in the text
                assert f"server {r.server} installed map epoch {r.epoch}:" in r.getMessage()
            elif r.slot_count:
                _names_slots_epoch_server(r)
    new_id = servers[2].service.server_id
    assert any(r.server == new_id and r.slot_count == 4096 for r in _events(records, "re_replication"))
    assert sum(r.slot_count for r in _events(records, "slot_copy_sent") if r.server == new_id) == 4096
    failover = _events(records, "failover")
    assert len(failover) == 1
    r = failover[0]
    _names_slots_epoch_server(r)
    assert r.server == dead and r.epoch <= core.map.epoch
    assert r.slot_count == 4096 // 2  # it led half of the slots; its replicas there took over
    assert r.new_primaries == servers[0].service.server_id and "declared dead" in r.getMessage()
    assert core.metrics.failovers.labels("dead")._value.get() == r.slot_count
    assert core.metrics.servers_dead._value.get() == 1

    as_json = [json.loads(line) for line in rendered.getvalue().splitlines()]
    line = next(x for x in as_json if x.get("event") == "failover")
    assert line["server"] == dead and line["epoch"] == r.epoch and line["slots"] == r.slots
    assert line["logger"] == "tigana.ps.scheduler" and line["level"] == "INFO"


class _Core:
    """A scheduler core on a fake clock (no sockets), as tests/ps/test_scheduler_core.py drives it."""

    def __init__(self, tmp_path, **config) -> None:
        self.t = [0.0]
        self.core = SchedulerDriver(SchedulerConfig(num_slots=16, heartbeat_timeout_s=3.0, replicas=1, **config),
                                  FileMapStore(tmp_path / "sched"), clock=lambda: self.t[0])

    def catch_up_all(self) -> None:
        report_all(self.core)


def test_slot_move_messages_and_counters(tmp_path, captured) -> None:
    records, _ = captured
    c = _Core(tmp_path, expect_servers=2, auto_rebalance=False)
    for s in ("a", "b", "c"):
        c.core.register(s, f"host-{s}:1", f"{s}-boot")
    c.core.create_table(TableDef(TableConfig("t", dim=4)), exist_ok=True)
    c.catch_up_all()
    m = c.core.map
    slot = int(np.flatnonzero(~m.holds(m.index_of("c")))[0])
    source = m.servers[int(m.copies[slot, 0])].id
    c.core.move_slot(slot, "c")
    c.catch_up_all()
    c.core.tick()

    (asked,) = _events(records, "move_slot")
    assert asked.slots == str(slot) and asked.source == source and asked.target == "c"
    assert f"slot {slot} from {source} to c" in asked.getMessage()
    steps = _events(records, "slot_move")
    assert steps and all(str(slot) in r.slots.split(",") for r in steps)
    for r in steps:
        _names_slots_epoch_server(r)
    (done,) = _events(records, "moves_done")
    assert done.slots == str(slot) and done.epoch == c.core.map.epoch and done.server == ",".join(sorted({source, "c"}))
    _names_slots_epoch_server(done)
    metrics = c.core.metrics
    assert metrics.slot_moves.labels("copy_started")._value.get() == 1
    assert metrics.slot_moves.labels("primary_handover")._value.get() == 1
    assert metrics.slot_moves.labels("copy_dropped")._value.get() == 1
    assert metrics.moves_completed._value.get() == 1
    assert int(c.core.map.copies[slot, 0]) == c.core.map.index_of("c")
