"""``tigana bench ps`` end to end on a tiny workload: real daemons, echo servers and (when installed) Redis."""

from __future__ import annotations

import shutil
import socket

import pytest

from tigana.tools import cli


def test_bench_ps_prints_one_json_line_per_case(bench_lines):
    argv = ["bench", "ps", "--quick", "--batch", "2048", "--num-ids", "100000", "--dims", "8", "--wire", "fp16",
            "--repeats", "1"]
    assert cli.main(argv) == 0
    lines = bench_lines()
    peers = {"in-process", "grpc-echo", "grpc-stream-echo", "ps-unary"} | (
        {"redis"} if shutil.which("redis-server") else set())
    assert {(d["case"], d["peer"]) for d in lines} == {(c, p) for c in ("pull", "push", "step") for p in peers}
    for d in lines:
        assert d["unit"] == "rows/s" and d["value"] > 0 and d["peer_value"] > 0
        assert abs(d["ratio"] - d["value"] / d["peer_value"]) <= 2e-3 * d["ratio"]  # each figure has 4 digits
        assert d["dim"] == 8 and d["wire"] == "fp16" and d["batch"] == 2048 and d["shards"] == 2
        assert d["transport"] == "stream"


def test_bench_ps_inserts_against_pushes_through_one_daemon(bench_lines):
    assert cli.main(["bench", "ps", "--inserts", "20000", "--batch", "4096", "--insert-dim", "8"]) == 0
    insert, memory = bench_lines()
    assert insert["case"] == "insert" and insert["unit"] == "rows/s" and insert["value"] > 0
    assert insert["peer"].startswith("push") and insert["peer_value"] > 0 and insert["rows"] == 4 * 4096
    assert memory["case"] == "insert.memory" and memory["rows_resident"] == 4 * 4096
    assert memory["engine_bytes_per_row"] > 8 * 4 and memory["value"] > memory["engine_bytes_per_row"]


def test_bench_ps_workers_against_one_worker_with_the_daemons_cores(bench_lines):
    """Two daemons (``--workers 2`` and ``--workers 1``), two client processes, every case's line: its rate,
    the peer's, and the cores each daemon's processes kept busy."""
    argv = ["bench", "ps", "--workers", "2", "--clients", "2", "--seconds", "0.3", "--repeats", "1", "--batch",
            "2048", "--frame-ids", "64", "--num-ids", "100000"]
    assert cli.main(argv) == 0
    lines = {d["case"]: d for d in bench_lines()}
    assert set(lines) == {"workers_push", "workers_pull", "workers_push_frames"}
    for case, d in lines.items():
        assert d["unit"] == ("frames/s" if case.endswith("frames") else "rows/s")
        assert d["value"] > 0 and d["peer_value"] > 0 and d["peer"] == "tigana server --workers 1"
        assert (d["workers"], d["clients"], d["ids_per_call"]) == (2, 2, 64 if case.endswith("frames") else 2048)
        assert d["server_cores"] > 0 and d["peer_server_cores"] > 0
    assert lines["workers_push_frames"]["frames_per_call"] == 2  # 64 random ids: each push reaches both workers


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_redis_peer_retries_when_its_port_is_taken(monkeypatch):
    """Another process can take the probed free port before redis binds it: the peer starts on a new port,
    and says why when every attempt fails."""
    from tigana.tools.bench.ps import redis_peer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port, redis_peer.free_port()])
        monkeypatch.setattr(redis_peer, "free_port", lambda: next(ports))
        peer = redis_peer.RedisPeer(shutil.which("redis-server"))
        try:
            assert peer.port != port and peer.db.ping()
        finally:
            peer.close()
        assert peer.proc.poll() is not None
        monkeypatch.setattr(redis_peer, "free_port", lambda: port)
        with pytest.raises(RuntimeError, match=f"did not start on port {port}"):
            redis_peer.RedisPeer(shutil.which("redis-server"), attempts=2)
