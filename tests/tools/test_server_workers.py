"""``tigana server --workers N``: N shard processes on one host under one supervisor, as a user starts them.

The flags each worker gets are checked on their own; then, on real processes started through the CLI in the
README's order and used at once: two hosts (``--domain host=a`` and ``host=b``) of two workers each make four
servers of the map whose copies of every slot stay on distinct hosts, the supervisor's port answers health
for its workers, a ``kill -9`` of a worker is a server restart (the supervisor starts it again on its folder,
under its id) that loses no acknowledged sync push, and SIGTERM to the supervisor alone drains and snapshots
every worker before it exits 0."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from tigana import ps
from tigana.ps.health import check_health
from tigana.ps.ops import admin
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import lock_data_dir
from tigana.tools.bench.ledger import PushLoop, audit, create_ledger_table
from tigana.tools.server_workers import Supervisor, worker_overrides
from tigana.tools.testing.nemesis.daemons import Daemons


def _flags(config: ServerConfig, i: int) -> dict[str, str]:
    argv = worker_overrides(config, i)
    return dict(zip(argv[::2], argv[1::2], strict=True))


def test_each_worker_gets_its_port_folder_id_advertised_address_metrics_and_budget_share() -> None:
    config = ServerConfig(port=7100, data_dir="/data", server_id="tigana-shard-0", advertise="shard-0.svc:7100",
                          metrics_port=9200, memory_budget=8 << 30, scheduler="scheduler:7000", workers=4)
    flags = [_flags(config, i) for i in range(4)]
    assert [f["--workers"] for f in flags] == ["1"] * 4
    assert [f["--port"] for f in flags] == ["7101", "7102", "7103", "7104"]  # 7100: the supervisor's health
    assert [f["--data-dir"] for f in flags] == [f"/data/worker-{i}" for i in range(4)]
    assert [f["--server-id"] for f in flags] == [f"tigana-shard-0-w{i}" for i in range(4)]
    assert [f["--advertise"] for f in flags] == [f"shard-0.svc:{7101 + i}" for i in range(4)]
    assert [f["--metrics-port"] for f in flags] == ["9200", "9201", "9202", "9203"]
    assert {f["--memory-budget"] for f in flags} == {str(2 << 30)}  # the host's budget, shared
    assert not any("--slots" in f for f in flags)  # the scheduler's map gives the slots

    # free ports everywhere, no folder, no id: each worker picks its port and keeps the id of its own folder
    free = ServerConfig(port=0, advertise="node-3:0", metrics_port=-1, scheduler="scheduler:7000", workers=2)
    assert [_flags(free, i) for i in range(2)] == [
        {"--workers": "1", "--port": "0", "--advertise": "node-3:0", "--metrics-port": "auto"}] * 2
    with pytest.raises(ValueError, match="field 'advertise' must be HOST:PORT"):
        worker_overrides(ServerConfig(advertise="node-3", scheduler="scheduler:7000", workers=2), 0)


def test_a_static_server_cuts_its_slots_into_one_contiguous_share_per_worker() -> None:
    config = ServerConfig(num_slots=16, slots="0-5,9,12-13", workers=3)
    shares = [_flags(config, i)["--slots"] for i in range(3)]
    assert shares == ["0-2", "3-5", "9,12-13"]
    every = np.zeros(16, bool)
    for share in shares:
        mask = ServerConfig(num_slots=16, slots=share).owned_slots()
        assert not (every & mask).any()
        every |= mask
    assert (every == config.owned_slots()).all()
    with pytest.raises(ValueError, match="field 'workers'"):
        worker_overrides(ServerConfig(num_slots=16, slots="3", workers=2), 0)


def test_a_data_dir_of_another_layout_is_refused_naming_what_it_holds(tmp_path) -> None:
    """A plain server on the folder of a ``--workers`` daemon, a daemon with fewer workers than its folder has,
    and ``--workers`` on a plain server's folder are refused before anything is read: each would leave the
    other layout's tables behind."""
    root = tmp_path / "data"
    for k in range(3):
        (root / f"worker-{k}").mkdir(parents=True)
    with pytest.raises(OSError, match=r"workers \[0, 1, 2\]"):
        lock_data_dir(root)  # a plain server
    with pytest.raises(OSError, match=r"workers \[2\].*more than this server's 2"):
        lock_data_dir(root, workers=2)
    lock_data_dir(root, workers=3).close()
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "server-id").write_text("abc")
    config = ServerConfig(data_dir=str(plain), workers=2, scheduler="127.0.0.1:1")
    with pytest.raises(OSError, match="holds a single server's tables"):
        Supervisor(config, ["server"], run_dir=tmp_path / "run")


def _hosts_apart(scheduler: str) -> bool:
    """Whether the map has four servers up and every slot two in-sync copies on distinct hosts."""
    m = admin.shard_map(scheduler)
    if len(m.servers) != 4 or not all(s.up for s in m.servers):
        return False
    hosts = np.array([s.domain.host for s in m.servers] + [""])  # NO_SERVER (-1) reads ""
    copies = m.copies[:, :2]
    if (copies < 0).any() or m.states[:, :2].any():  # a copy missing or catching up
        return False
    return bool((hosts[copies[:, 0]] != hosts[copies[:, 1]]).all())


@pytest.mark.timeout(240)
def test_two_hosts_of_two_workers_keep_copies_apart_restart_a_killed_worker_and_drain_on_sigterm(tmp_path) -> None:
    with Daemons(tmp_path, heartbeat_timeout_s=3.0) as d:
        d.start_scheduler(replicas=1)
        host_a = d.start_server("--workers", "2", "--domain", "host=a")
        host_b = d.start_server("--workers", "2", "--domain", "host=b")
        with ps.connect(d.scheduler_address) as client:  # at once, as the README's
            create_ledger_table(client, "ledger_sync", durability="sync")
            loop = PushLoop(client, table="ledger_sync", num_ids=2000, ids_per_push=100, in_flight=2,
                            seed=0).start()
            a, b = host_a.wait_ready(120), host_b.wait_ready(120)  # every worker of each serves
            assert len(a["workers"]) == len(b["workers"]) == 2
            for info in (a, b):  # the supervisor's port answers for all of its workers
                assert check_health(info["address"], "", timeout_s=5).serving
            admin.wait_for(lambda: _hosts_apart(d.scheduler_address), timeout_s=90,
                           what="four servers, each slot's copies on both hosts")
            status = admin.cluster_status(d.scheduler_address)
            assert status["domain_degraded_slots"] == 0 and status["domain_level"] == "host", status

            # kill -9 of one worker: its supervisor starts it again on its folder, as the same server
            victim = a["workers"][1]
            ids_before = {s.address: s.id for s in admin.shard_map(d.scheduler_address).servers}
            os.kill(victim["pid"], signal.SIGKILL)

            def restarted() -> bool:
                info = json.loads(host_a.ready_file.read_text()) if host_a.ready_file.exists() else {}
                return bool(info) and info["workers"][1]["pid"] != victim["pid"]

            deadline = time.monotonic() + 90
            while not restarted() or not check_health(a["address"], "", timeout_s=5).serving:
                assert time.monotonic() < deadline, host_a.log_tail()
                time.sleep(0.2)
            # the same server id is back in the map, up, its copies in sync again
            admin.wait_for(lambda: _hosts_apart(d.scheduler_address), timeout_s=90, what="the worker back in sync")
            back = {s.id for s in admin.shard_map(d.scheduler_address).servers}
            assert set(ids_before.values()) == back
            time.sleep(1.0)  # pushes to the cluster whole again
            loop.stop()
            result = audit(client, loop, table="ledger_sync")
            assert result.acked_pushes > 0 and result.lost == 0 and result.doubled == 0, result.as_dict()
            assert result.failed_pushes == 0, (result.as_dict(), loop.errors[:3])

        # SIGTERM to a supervisor alone: every worker of it drains and snapshots, then it exits 0
        workers = [w["pid"] for w in json.loads(host_b.ready_file.read_text())["workers"]]
        os.kill(host_b.proc.pid, signal.SIGTERM)
        assert host_b.proc.wait(120) == 0, host_b.log_tail()
        for pid in workers:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        for i in range(2):
            assert any((host_b.data_dir / f"worker-{i}").rglob("MANIFEST*")) or \
                any((host_b.data_dir / f"worker-{i}" / "snapshots").iterdir()), host_b.log_tail()
        assert "every worker drained and snapshotted" in host_b.log_tail()
