"""The first second of a cluster: a client that connects to a scheduler before any shard server has
registered (a cold server compiles its kernels for seconds) waits for the scheduler's first map within its
deadline, by a long poll, and past it gets ``Unavailable`` saying why. A real scheduler and a real server, in
process."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tigana import ps
from tigana.ps.errors import Unavailable
from tigana.ps.ops import admin
from tigana.ps.ops.local import free_port
from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import start_server


@pytest.fixture
def scheduler(tmp_path):
    sched = start_scheduler(SchedulerConfig(data_dir=str(tmp_path / "sched"), replicas=0, heartbeat_timeout_s=5.0))
    try:
        yield sched
    finally:
        sched.close()


def test_connect_with_no_server_registered_waits_its_deadline_then_says_why(scheduler) -> None:
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="no shard server has registered with the scheduler yet"):
        ps.connect(scheduler=scheduler.address, timeout_s=1.5)
    took = time.monotonic() - t0
    assert 1.4 <= took < 10.0, took  # the whole deadline, not an answer at once
    with pytest.raises(Unavailable, match="no shard server has registered with the scheduler yet"):
        admin.shard_map(scheduler.address)  # what verify, rebalance and move-slot read first


def test_a_client_connected_before_the_first_server_registers_uses_the_cluster_at_once(scheduler, tmp_path) -> None:
    got: dict[str, object] = {}

    def connect() -> None:
        try:
            got["client"] = ps.connect(scheduler.address, timeout_s=60)  # one address: asked if a scheduler
        except BaseException as exc:  # noqa: BLE001 - reported below
            got["error"] = exc

    thread = threading.Thread(target=connect)
    thread.start()
    server = None
    try:
        time.sleep(0.5)  # the client is waiting on the scheduler's empty map
        assert "error" not in got, got.get("error")
        server = start_server(ServerConfig(port=0, data_dir=str(tmp_path / "s0"), scheduler=scheduler.address,
                                           drain_grace_s=1.0))
        thread.join(60)
        assert not thread.is_alive()
        assert "error" not in got, got.get("error")
        client = got["client"]
        assert isinstance(client, ps.Client)
        with client:
            assert client.epoch >= 1
            client.create_table("first", dim=4, initializer=ps.Zeros())
            ids = np.arange(8)
            client.push("first", ids, np.ones((8, 4), np.float32)).result()
            client.flush()
            rows = client.pull("first", ids)
            assert rows.shape == (8, 4) and np.all(rows != 0), rows
    finally:
        thread.join(60)
        if isinstance(got.get("client"), ps.Client):
            got["client"].close()  # idempotent
        if server is not None:
            server.close(grace=1.0)


def test_connect_to_one_address_waits_for_a_scheduler_still_starting(tmp_path) -> None:
    """``connect("host:port")`` a moment before the scheduler's port opens: the address is waited for and
    used as the scheduler it is, not taken for a static shard list of one."""
    port = free_port()
    got: dict[str, object] = {}

    def connect() -> None:
        try:
            got["client"] = ps.connect(f"127.0.0.1:{port}", timeout_s=30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            got["error"] = exc

    thread = threading.Thread(target=connect)
    thread.start()
    sched = server = None
    try:
        time.sleep(0.5)
        sched = start_scheduler(SchedulerConfig(port=port, data_dir=str(tmp_path / "sched"), replicas=0))
        server = start_server(ServerConfig(port=0, data_dir=str(tmp_path / "s0"), scheduler=sched.address,
                                           drain_grace_s=1.0))
        thread.join(60)
        assert "error" not in got, got.get("error")
        client = got["client"]
        assert isinstance(client, ps.Client)
        with client:
            assert client.scheduler == f"127.0.0.1:{port}"
    finally:
        thread.join(60)
        if isinstance(got.get("client"), ps.Client):
            got["client"].close()
        if server is not None:
            server.close(grace=1.0)
        if sched is not None:
            sched.close()
