"""`tigana server` and `tigana local` as users run them: real child processes, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tigana import ps
from tigana.embeddings import TableConfig
from tigana.embeddings import config as cfg
from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps.wire import data as wire

CLI = [sys.executable, "-m", "tigana.tools.cli"]
IDS = np.arange(1000, dtype=np.int64)


@contextlib.contextmanager
def _spawn(*args: str, **kwargs):
    proc = subprocess.Popen([*CLI, *args], start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        if path.exists():
            with contextlib.suppress(ValueError):
                return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(path)


def _pull(stub, name: str = "users") -> np.ndarray:
    reply = stub.Pull(pb.PullRequest(table=name, ids=wire.encode_ids(IDS)), timeout=30)
    return wire.decode_rows(reply.rows, len(IDS), 4, table=name)


def test_server_sigterm_snapshots_and_restart_restores(tmp_path: Path) -> None:
    data_dir, ready = tmp_path / "shard", tmp_path / "ready.json"
    args = ("server", "--port", "0", "--data-dir", str(data_dir), "--ready-file", str(ready),
            "--metrics-port", "auto", "--memory-budget", "64MiB")
    with _spawn(*args, stderr=subprocess.PIPE, text=True) as proc:
        info = _wait_file(ready, proc)
        assert info["pid"] == proc.pid and info["metrics_port"]
        with grpc.insecure_channel(info["address"]) as channel:
            stub = shard_pb2_grpc.ShardStub(channel)
            config = TableConfig("users", dim=4, optimizer=cfg.RowWiseAdagrad(lr=0.1))
            stub.CreateTable(pb.CreateTableRequest(spec=wire.spec_to_pb(config)), timeout=30)
            grads = np.random.default_rng(0).normal(size=(len(IDS), 4)).astype(np.float32)
            stub.Push(pb.PushRequest(table="users", ids=wire.encode_ids(IDS), grads=wire.encode_rows(grads)),
                      timeout=30)
            rows = _pull(stub)
            (before,) = stub.Stats(pb.StatsRequest(table="users"), timeout=30).tables
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()
        assert "SIGTERM" in proc.stderr.read()
    assert not ready.exists()
    assert any((data_dir / "snapshots" / "users").iterdir())

    with _spawn(*args, stderr=subprocess.DEVNULL) as proc:
        info = _wait_file(ready, proc)
        with grpc.insecure_channel(info["address"]) as channel:
            stub = shard_pb2_grpc.ShardStub(channel)
            (after,) = stub.Stats(pb.StatsRequest(table="users"), timeout=30).tables
            assert after.values["checksum"] == before.values["checksum"]
            np.testing.assert_array_equal(_pull(stub), rows)
        proc.send_signal(signal.SIGINT)  # Ctrl-C is a clean stop too
        assert proc.wait(60) == 0


def test_server_rejects_bad_flags(tmp_path: Path) -> None:
    out = subprocess.run([*CLI, "server", "--memory-budget", "lots", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "memory-budget" in out.stderr


def test_local_starts_and_stops_its_shards(tmp_path: Path) -> None:
    """``tigana local --shards 2 --replicas 1``: a scheduler and 2 shards; it prints the address to connect to
    (the scheduler's), serves a client through it, and stops every process on Ctrl-C."""
    data_dir = tmp_path / "local"
    with _spawn("local", "--shards", "2", "--replicas", "1", "--data-dir", str(data_dir), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True) as proc:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no address printed"
        target = proc.stdout.readline().strip()
        assert target.startswith("127.0.0.1:") and "," not in target
        line = proc.stdout.readline()
        assert f"scheduler {target}, 1 replica(s), 2 shard(s) serving" in line
        infos = [json.loads((data_dir / f"shard-{i}" / "ready.json").read_text()) for i in range(2)]
        pids = [info["pid"] for info in infos] + [json.loads((data_dir / "scheduler" / "ready.json").read_text())["pid"]]
        for info in infos:
            with grpc.insecure_channel(info["address"]) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with ps.connect(target) as client:  # the printed address is a scheduler: the client follows its map
            assert client.scheduler == target and client.epoch > 0
            client.create_table("cli_local", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
            client.push("cli_local", np.arange(100), -np.ones((100, 4), np.float32)).result()
            np.testing.assert_array_equal(client.pull("cli_local", np.arange(100)), np.ones((100, 4), np.float32))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0, proc.stderr.read()
        assert "exit codes [0, 0]" in proc.stderr.read()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_local_with_two_schedulers_on_etcd(tmp_path: Path) -> None:
    """``tigana local --shards 2 --schedulers 2``: an etcd, two schedulers (one leads), two shards; the printed
    address is the scheduler list, which ``ps.connect`` and ``tigana admin --scheduler`` take as it is."""
    data_dir = tmp_path / "local-ha"
    with _spawn("local", "--shards", "2", "--schedulers", "2", "--data-dir", str(data_dir), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True) as proc:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no address printed"
        target = proc.stdout.readline().strip()
        assert target.count(",") == 1 and "map in etcd://127.0.0.1:" in proc.stdout.readline()
        with ps.connect(target) as client:  # a list of schedulers: the client finds the leader
            assert client.scheduler == target
            client.create_table("ha_local", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
            client.push("ha_local", np.arange(10), -np.ones((10, 4), np.float32)).result()
        status = subprocess.run([*CLI, "admin", "--scheduler", target, "--json", "status"], capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "ha_local" in json.loads(status.stdout.splitlines()[-1])["tables"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0, proc.stderr.read()


def test_subcommand_help_lists_its_flags() -> None:
    for command, flag in (("server", "--memory-budget"), ("local", "--shards")):
        out = subprocess.run([*CLI, command, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and flag in out.stdout
