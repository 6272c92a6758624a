"""`tigana admin` as an operator runs it: a real cluster (``LocalCluster``: a scheduler and 3 daemons, 1 replica)
and the CLI as a child process, given the scheduler by ``--scheduler`` or ``TIGANA_SCHEDULER``. Each test
starts one cluster and makes all its CLI calls against it; the two that move nothing (status and errors, data)
share one (``shared_shard_cluster``: every table dropped between them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tigana import ps
from tigana.proto import scheduler_pb2 as spb
from tigana.ps.ops import admin
from tigana.ps.scheduler import SchedulerConfig, start_scheduler

pytestmark = pytest.mark.timeout(180)

CLI = [sys.executable, "-m", "tigana.tools.cli", "admin"]
TABLE = "emb"
IDS = np.arange(5000, dtype=np.int64)


class Admin:
    """Runs ``tigana admin`` against one scheduler; keeps the last result."""

    def __init__(self, scheduler: str) -> None:
        self.scheduler = scheduler

    def __call__(self, *args: str, scheduler: str | None = "", env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess:
        """``scheduler``: "" for this cluster's (as --scheduler), None for no --scheduler flag at all."""
        flags = [] if scheduler is None else ["--scheduler", scheduler or self.scheduler]
        full_env = {k: v for k, v in os.environ.items() if k != "TIGANA_SCHEDULER"}
        full_env.update(env or {})
        return subprocess.run([*CLI, *flags, "--timeout", "90", *args], capture_output=True, text=True,
                              timeout=timeout, env=full_env)

    def json(self, *args: str, ok: bool = True, **kwargs) -> dict:
        """Run with ``--json``: the last stdout line is the report; the exit status matches ``ok``."""
        out = self("--json", *args, **kwargs)
        assert out.returncode == (0 if ok else 1), (args, out.returncode, out.stdout[-2000:], out.stderr[-2000:])
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["ok"] is ok and report["action"] == args[0], report
        return report


def _cluster(make_cluster, **kwargs):
    cluster = make_cluster(3, replicas=1, **kwargs)
    with ps.connect(cluster.target) as client:
        client.create_table(TABLE, 8)
        grads = np.random.default_rng(0).normal(size=(IDS.size, 8)).astype(np.float32)
        client.push(TABLE, IDS, grads).result()
    return cluster, Admin(cluster.scheduler)


def _pull(scheduler: str) -> np.ndarray:
    with ps.connect(scheduler=scheduler) as client:
        return client.pull(TABLE, IDS, insert=False)


def _held(scheduler: str, server_id: str) -> int:
    reply = admin.status(scheduler)
    s = next(s for s in reply.servers if s.info.id == server_id)
    return s.primaries + s.replicas + s.catching_up


def _settled(scheduler: str) -> bool:
    reply = admin.status(scheduler)
    return (not reply.unavailable_slots and not reply.degraded_slots and not reply.moving_slots
            and not sum(s.catching_up for s in reply.servers))


# --- reading: status, verify; errors -----------------------------------------------------------------------
def test_status_verify_and_errors(shared_shard_cluster, tmp_path: Path) -> None:
    cluster, run = _cluster(shared_shard_cluster)
    ids = [cluster.server_id(i) for i in range(3)]

    out = run("status")
    assert out.returncode == 0, out.stderr
    assert "cluster " in out.stdout and "4096 slots" in out.stdout and "1 replica(s)" in out.stdout
    for sid, address in zip(ids, cluster.addresses, strict=True):
        line = next(x for x in out.stdout.splitlines() if x.startswith(sid))
        assert address in line and " up " in line
    assert f"tables: {TABLE}" in out.stdout

    status = run.json("status")
    assert isinstance(status["epoch"], int) and status["epoch"] > 0
    assert sorted(s["id"] for s in status["servers"]) == sorted(ids)
    assert all(s["up"] for s in status["servers"])
    assert sum(s["primaries"] for s in status["servers"]) == 4096
    assert status["tables"] == [TABLE] and status["degraded_slots"] == 0 and status["draining"] == []

    # the scheduler from the environment
    env_status = run.json("status", scheduler=None, env={"TIGANA_SCHEDULER": cluster.scheduler})
    assert env_status["cluster_id"] == status["cluster_id"]

    report = run.json("verify")
    assert report["slots_differing"] == 0 and report["differing"] == [] and report["unreachable"] == []
    assert report["copies_checked"] == 4096  # one replica of every slot
    assert run.json("verify", "--table", TABLE)["slots_differing"] == 0

    # errors: non-zero exit, a message on stderr
    out = run("status", scheduler=None)
    assert out.returncode == 2 and "no scheduler" in out.stderr and "TIGANA_SCHEDULER" in out.stderr
    epoch = admin.shard_map(cluster.scheduler).epoch
    out = run("move-slot", "5", "--to", "no-such-server")
    assert out.returncode == 1 and "no-such-server" in out.stderr and "no such server" in out.stderr, out.stderr
    report = run.json("move-slot", "5", "--to", ids[0], "--from", "nobody", ok=False)
    assert "nobody" in report["error"] and "InvalidArgument" in report["error"]
    report = run.json("move-slot", "4096", "--to", ids[0], ok=False)
    assert "'slot'" in report["error"]
    assert admin.shard_map(cluster.scheduler).epoch == epoch  # refused moves change nothing
    # tables: creating one that exists as asked is a no-op; a different one, or exist_ok=False, is refused
    # naming the table (and the fields that differ); dropping a missing one answers False
    with ps.connect(scheduler=cluster.scheduler) as client:
        assert client.create_table(TABLE, 8).dim == 8
        with pytest.raises(ps.TableExists, match=f"table '{TABLE}' already exists .*exist_ok"):
            client.create_table(TABLE, 8, exist_ok=False)
        with pytest.raises(ps.TableExists, match=f"table '{TABLE}' already exists with a different spec.*dim"):
            client.create_table(TABLE, 16)
        assert client.drop_table("no-such-table") is False
        assert client.list_tables() == [TABLE]
    assert admin.shard_map(cluster.scheduler).epoch == epoch
    full = tmp_path / "not-empty"
    full.mkdir()
    (full / "something").write_text("x")
    out = run("checkpoint", "--dir", str(full))
    assert out.returncode == 1 and "not empty" in out.stderr, out.stderr
    assert sorted(p.name for p in full.iterdir()) == ["something"]
    t = time.monotonic()
    out = run("status", scheduler="127.0.0.1:1")  # nothing listens there
    assert out.returncode == 1 and "not reachable" in out.stderr, out.stderr
    assert time.monotonic() - t < 30


# --- placement: move-slot, drain, rebalance ------------------------------------------------------------------
def test_move_slot_drain_and_rebalance(make_shard_cluster) -> None:
    # placement left to the operator: an undrained server stays empty until `rebalance`
    cluster, run = _cluster(make_shard_cluster, scheduler_args=["--no-auto-rebalance"])
    scheduler = cluster.scheduler
    ids = [cluster.server_id(i) for i in range(3)]
    before = _pull(scheduler)

    # move-slot: slot 5's primary to a server that holds no copy of it (data moves, then the role)
    m = admin.shard_map(scheduler)
    to = next(s.id for i, s in enumerate(m.servers) if not m.holds(i)[5])  # map order, not shard order
    assert to in ids
    report = run.json("move-slot", "5", "--to", to, "--primary")
    assert report["moves"] == 1
    m = admin.shard_map(scheduler)
    assert m.servers[int(m.copies[5, 0])].id == to
    assert (m.copies[5] >= 0).sum() == 2 and (m.states[5] == 0).all()
    # the same command again (and without --primary: the primary's copy to where it is): a no-op that says so
    for again in (["--primary"], []):
        out = run("move-slot", "5", "--to", to, *again)
        assert out.returncode == 0 and f"server {to} already leads slot 5: nothing to move" in out.stdout, out
    report = run.json("move-slot", "5", "--to", to, "--primary")
    assert report["moves"] == 0 and report["note"] == f"server {to} already leads slot 5: nothing to move"
    # a refusal names what holds: the replica's server cannot take the primary's copy (--primary would swap)
    replica = m.servers[int(m.copies[5, 1])].id
    report = run.json("move-slot", "5", "--to", replica, ok=False)
    assert f"server '{replica}' already holds a copy of slot 5 ({to} leads it, {replica} holds an in-sync " \
           "copy)" in report["error"], report
    assert admin.shard_map(scheduler).epoch == m.epoch  # the no-ops and the refusal changed nothing

    # drain: the server ends holding nothing, and stays draining; then undrain
    victim = to
    report = run.json("drain", victim)
    assert report["moves"] > 0
    assert _held(scheduler, victim) == 0
    m = admin.shard_map(scheduler)
    assert not m.holds(m.index_of(victim)).any() and ((m.copies >= 0).sum(axis=1) == 2).all()
    assert run.json("status")["draining"] == [victim]
    epoch = admin.shard_map(scheduler).epoch
    report = run.json("drain", victim)  # again: already done
    assert report["moves"] == 0 and report["note"] == f"server {victim} is already drained: it holds nothing"
    assert admin.shard_map(scheduler).epoch == epoch
    out = run("drain", victim, "--undrain")
    assert out.returncode == 0, out.stderr
    assert f"undrained {victim}" in out.stdout
    assert run.json("status")["draining"] == []
    out = run("drain", victim, "--undrain")  # again: nothing to undo
    assert out.returncode == 0 and f"server {victim} is not draining: nothing to undo" in out.stdout, out
    assert _held(scheduler, victim) == 0  # undrain alone moves nothing back

    # rebalance --plan: the moves and the predicted load, nothing applied
    m0 = admin.shard_map(scheduler)
    plan = run.json("rebalance", "--plan")
    assert plan["moves"] > 0 and plan["bytes_moved"] > 0
    assert plan["load_after"]["max"] < plan["load_before"]["max"]
    assert plan["load_after"]["mean"] == pytest.approx(plan["load_before"]["mean"])
    m1 = admin.shard_map(scheduler)
    assert m1.epoch == m0.epoch
    np.testing.assert_array_equal(m1.copies, m0.copies)
    assert admin.status(scheduler).moving_slots == 0
    out = run("rebalance", "--plan")  # the readable report
    assert out.returncode == 0 and "move(s)" in out.stdout and "load max/mean" in out.stdout, out.stdout

    # rebalance: applied, waited for; the drained server gets its share back
    applied = run.json("rebalance")
    assert applied["moves"] > 0
    assert _settled(scheduler)
    m2 = admin.shard_map(scheduler)
    assert m2.epoch > m1.epoch
    assert m2.holds(m2.index_of(victim)).any()
    # the plan evens the measured load (rows and request rate), not slot counts
    assert applied["load_after"]["max"] <= 1.1 * applied["load_after"]["mean"], applied
    assert applied["load_after"]["max"] < applied["load_before"]["max"]
    assert run.json("verify")["slots_differing"] == 0
    np.testing.assert_array_equal(_pull(scheduler), before)  # nothing lost in the moves

    # rebalance on a load it already balanced (rows held, no request rates): a no-op that says so
    measured = admin.slot_load(scheduler)
    rows_only = spb.SlotLoad(rows=measured.rows, bytes=measured.bytes)
    admin.rebalance(scheduler, load=rows_only)
    admin.wait_for(lambda: _settled(scheduler), timeout_s=90, what="the rebalance by rows")
    epoch = admin.shard_map(scheduler).epoch
    again = admin.rebalance(scheduler, load=rows_only)
    assert len(again.moves) == 0 and again.note == "the placement is balanced already: nothing to move"
    assert admin.shard_map(scheduler).epoch == epoch and _settled(scheduler)


# --- data: checkpoint, export, restore -----------------------------------------------------------------------
def test_checkpoint_export_restore(shared_shard_cluster, tmp_path: Path) -> None:
    cluster, run = _cluster(shared_shard_cluster)
    scheduler = cluster.scheduler
    before = _pull(scheduler)
    ckpt, export = tmp_path / "ckpt", tmp_path / "export"

    report = run.json("checkpoint", "--dir", str(ckpt))
    assert report["rows"] == {TABLE: IDS.size} and report["dir"] == str(ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == "tigana-checkpoint" and manifest["tables"][TABLE]["rows"] == IDS.size

    out = run("export", TABLE, "--out", str(export))
    assert out.returncode == 0, out.stderr
    assert f"exported {IDS.size} row(s)" in out.stdout
    ids, rows = np.load(export / "ids.npy"), np.load(export / "rows.npy")
    np.testing.assert_array_equal(ids, IDS)
    np.testing.assert_array_equal(rows, before)

    # change every row, then restore: the checkpoint's rows are back
    with ps.connect(scheduler=scheduler) as client:
        client.push(TABLE, IDS, np.ones((IDS.size, 8), np.float32)).result()
    assert not np.array_equal(_pull(scheduler), before)
    report = run.json("restore", str(ckpt))
    assert report["rows"] == {TABLE: IDS.size}
    np.testing.assert_array_equal(_pull(scheduler), before)
    assert run.json("verify")["slots_differing"] == 0

    # a second checkpoint into the same (now non-empty) folder is refused
    report = run.json("checkpoint", "--dir", str(ckpt), ok=False)
    assert "not empty" in report["error"]


# --- the scheduler stops promptly with clients long-polling ---------------------------------------------------
def test_scheduler_close_wakes_pending_long_polls() -> None:
    """A client's ``GetMap`` long poll (10 s by default) must not hold a stopping scheduler: its handler thread
    would keep the process alive until the poll's end (every ``LocalCluster.close`` after a client paid that)."""
    handle = start_scheduler(SchedulerConfig(num_slots=8))
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(handle.core.wait_map(handle.core.map.epoch, 30.0)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()
    t = time.monotonic()
    handle.close()
    waiter.join(5.0)
    assert not waiter.is_alive() and got == [None]
    assert time.monotonic() - t < 5.0
