"""``tigana admin top``: the frame ``render`` draws from a status dict, and ``--once`` as an operator runs it
(the CLI as a child process) against a real cluster (``LocalCluster``: a scheduler and 2 daemons, 1 replica)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console, RenderableType

from tigana import ps
from tigana.ps.ops import admin
from tigana.tools.admin_top import render, run_top

CLI = [sys.executable, "-m", "tigana.tools.cli", "admin"]


def _text(renderable: RenderableType) -> str:
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 - closed below
    console.print(renderable)
    console.file.close()
    return console.export_text()


def test_render_shows_every_server_with_rows_load_and_lag() -> None:
    status = {"cluster_id": "c0ffee", "epoch": 42, "num_slots": 4096, "replicas": 1, "degraded_slots": 7,
              "unavailable_slots": 0, "moving_slots": 3, "draining": ["s2"], "tables": ["users", "items"],
              "servers": [
                  {"id": "s1", "address": "10.0.0.1:7101", "up": True, "primaries": 2048, "replicas": 2041,
                   "catching_up": 7, "last_heartbeat_s": 0.4,
                   "stats": {"rows": 1_500_000, "bytes": 3 << 30, "request_rate": 300_000,
                             "replication_lag_items": 12, "replication_lag_s": 1.5}},
                  {"id": "s2", "address": "10.0.0.2:7101", "up": True, "primaries": 2048, "replicas": 2048,
                   "catching_up": 0, "last_heartbeat_s": 0.2,
                   "stats": {"rows": 1_400_000, "bytes": 2 << 30, "request_rate": 100_000}},
                  {"id": "s3", "address": "10.0.0.3:7101", "up": False, "primaries": 0, "replicas": 0,
                   "catching_up": 0, "last_heartbeat_s": -1.0, "stats": {}}]}
    text = _text(render(status, now="12:00:00"))
    assert "cluster c0ffee" in text and "epoch 42" in text and "degraded 7" in text and "moving 3" in text
    assert "12:00:00" in text and "users, items" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in
             ("s1", "s2", "s3")}
    assert set(lines) == {"s1", "s2", "s3"}
    assert "1.5M" in lines["s1"] and "3.0 GiB" in lines["s1"] and "300.0k" in lines["s1"] and "75%" in lines["s1"]
    assert " 12 " in lines["s1"] and "1.5" in lines["s1"] and "0.4s" in lines["s1"]
    assert "draining" in lines["s2"] and "25%" in lines["s2"]
    assert "DEAD" in lines["s3"]
    assert "not reachable" in _text(render(None))


@pytest.mark.timeout(180)
def test_top_once_against_a_real_cluster(make_shard_cluster) -> None:
    cluster = make_shard_cluster(2, replicas=1)
    with ps.connect(cluster.target) as client:
        client.create_table("top", 8)
        ids = np.arange(3000, dtype=np.int64)
        client.push("top", ids, np.ones((ids.size, 8), np.float32)).result()
        client.pull("top", ids)
    admin.wait_for(lambda: sum(s["stats"].get("rows", 0) for s in admin.cluster_status(
        cluster.scheduler)["servers"]) >= 2 * 3000, 30, "heartbeats carrying the rows")

    env = {k: v for k, v in os.environ.items() if k != "TIGANA_SCHEDULER"}
    out = subprocess.run([*CLI, "--scheduler", cluster.scheduler, "top", "--once"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    status = admin.cluster_status(cluster.scheduler)
    assert f"cluster {status['cluster_id']}" in out.stdout and "tables: top" in out.stdout
    for server in status["servers"]:
        row = next(line for line in out.stdout.splitlines() if line.split()[:1] == [server["id"]])
        assert server["address"] in row and " up " in row

    out = subprocess.run([*CLI, "--scheduler", cluster.scheduler, "--json", "top", "--once"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["action"] == "top" and len(report["servers"]) == 2
    assert sum(s["stats"]["rows"] for s in report["servers"]) >= 6000  # every row on a primary and a replica
    assert "cluster " in out.stderr  # the frame goes to stderr with --json

    # the live loop, in process, for two frames
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 - closed below
    try:
        last = run_top(cluster.scheduler, interval=0.1, console=console, frames=2)
    finally:
        console.file.close()
    assert last is not None and last["epoch"] >= status["epoch"]

    bad = subprocess.run([*CLI, "--scheduler", "127.0.0.1:1", "top", "--once"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert bad.returncode == 1 and "not reachable" in bad.stderr + bad.stdout
