"""Two shard daemons as child processes (``shard_cluster``) and two in-process ones (``shard_servers``): each owns
its static slot range, serves its ids, refuses the other's, and survives bad requests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.embeddings import config as cfg
from tigana.proto import shard_pb2 as pb
from tigana.ps.ops.local import LocalCluster
from tigana.ps.routing import slot_of, split_by_owner, static_assignment
from tigana.ps.wire import data as wire


def _exercise(addresses: list[str], shard_stub, name: str) -> None:
    stubs = [shard_stub(a) for a in addresses]
    config = TableConfig(name, dim=8, optimizer=cfg.Adagrad(lr=0.1), initializer=cfg.Normal(std=0.05), seed=5)
    for stub in stubs:
        stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(config), exist_ok=True), timeout=30)
    reference = EmbeddingTable(config)
    rng = np.random.default_rng(3)
    ids = rng.integers(-(1 << 40), 1 << 40, 2000)
    grads = rng.normal(size=(len(ids), 8)).astype(np.float32)
    owners = static_assignment(len(stubs))[slot_of(ids)]
    parts = split_by_owner(owners, len(stubs))
    try:
        reference.push(ids, grads)
        got = np.empty((len(ids), 8), np.float32)
        for stub, pos in zip(stubs, parts, strict=True):
            assert len(pos) > 0
            stub.Push(pb.PushRequest(table=name, ids=wire.encode_ids(ids[pos]), grads=wire.encode_rows(grads[pos])),
                      timeout=30)
            reply = stub.Pull(pb.PullRequest(table=name, ids=wire.encode_ids(ids[pos])), timeout=30)
            got[pos] = wire.decode_rows(reply.rows, len(pos), 8, table=name)
        np.testing.assert_array_equal(got, reference.pull(ids))
    finally:
        reference.close()
    # each server refuses the other's ids and keeps serving
    for stub, pos in zip(stubs, parts[::-1], strict=True):
        with pytest.raises(grpc.RpcError) as err:
            stub.Pull(pb.PullRequest(table=name, ids=wire.encode_ids(ids[pos])), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and repr(name) in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(pb.PushRequest(table=name, ids=b"\x00" * 9), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [t.name for t in stub.ListTables(pb.ListTablesRequest(), timeout=30).tables].count(name) == 1


def test_two_daemon_processes(shard_cluster, shard_stub) -> None:
    assert len(shard_cluster.addresses) == 2 and all(shard_cluster.alive())
    _exercise(shard_cluster.addresses, shard_stub, "cluster_proc")
    assert all(shard_cluster.alive())


def test_two_in_process_servers(shard_servers, shard_stub) -> None:
    _exercise([h.address for h in shard_servers], shard_stub, "cluster_inproc")


def test_base_port_and_a_shard_that_cannot_start(make_shard_cluster, tmp_path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        with pytest.raises(RuntimeError, match="cannot bind") as err:
            LocalCluster(1, base_port=busy, data_dir=tmp_path / "busy")
        assert "shard 0 exited with code 1" in str(err.value)
    cluster = make_shard_cluster(1, base_port=busy)  # the port is free again
    assert cluster.addresses == [f"127.0.0.1:{busy}"]
    assert cluster.close() == [0]


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not installed")
def test_daemons_die_with_a_killed_parent(tmp_path) -> None:
    """A LocalCluster owner killed with SIGKILL (no chance to clean up) leaves no daemon (shard or scheduler)
    behind."""
    script = ("import sys, time\nfrom tigana.ps import LocalCluster\n"
              f"c = LocalCluster(2, data_dir={str(tmp_path)!r})\n"
              "print(' '.join(str(p.pid) for p in [*c.procs, c.scheduler_proc]), flush=True)\n"
              "time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 3  # two shard daemons and the scheduler
    finally:
        owner.kill()
        owner.wait(10)
        owner.stdout.close()
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.1)
    for p in alive:  # a failed test still stops what it started
        os.kill(p, signal.SIGKILL)
    assert alive == []


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_replicated_tables_rows_are_counted_once_at_their_primaries(make_shard_cluster) -> None:
    """``describe_table`` on a cluster with a replica of every slot: each server reports the rows of the slots it
    leads (``rows_led``, one pass over its index), so the total is the table's rows, not twice them."""
    from tigana import ps

    cluster = make_shard_cluster(2)
    with ps.connect(scheduler=cluster.scheduler) as client:
        client.wait_ready(60)
        client.create_table("counted", dim=4)
        ids = np.random.default_rng(4).integers(-(1 << 62), 1 << 62, 3000)
        client.pull("counted", ids)
        info = client.describe_table("counted")
        assert info.rows == np.unique(ids).size
        assert sum(s["rows_led"] for s in info.shards.values()) == np.unique(ids).size
