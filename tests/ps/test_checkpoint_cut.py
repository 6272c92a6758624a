"""Cluster cuts, incremental and quantized checkpoints on real processes (``tigana.ps.client.checkpoint``): a cut
taken while trainers push is consistent row by row and across servers, an incremental chain restores exactly
what a full checkpoint of the same moment does, and ``--quantize`` keeps the optimizer state exact."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tigana import ps
from tigana.embeddings import RowBatch
from tigana.ps import routing
from tigana.ps.client.checkpoint import checkpoint_rows
from tigana.ps.client.checkpoint.write import SINCE_MARGIN_S
from tigana.ps.ops import admin
from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import start_server

pytestmark = pytest.mark.timeout(240)

LR, DIM = 0.1, 4


def _rows(directory, table: str) -> RowBatch:
    batches = list(checkpoint_rows(directory, table))
    if not batches:
        return RowBatch.empty(DIM, 0)
    rows = RowBatch.concat(batches)
    return rows.take(np.argsort(rows.ids))


def _adagrad_path(n: int) -> np.ndarray:
    """The weight of an Adagrad row (zeros, no initial accumulator) after 1..n pushes of gradient 1, in
    float32 as the engine computes it: index k is the weight after k updates."""
    w = np.zeros(n + 1, np.float32)
    for k in range(1, n + 1):
        w[k] = w[k - 1] - np.float32(LR) * np.float32(1.0) / (np.sqrt(np.float32(k)) + np.float32(1e-10))
    return w


def _check_rows_agree(rows: RowBatch) -> None:
    """Every row's weights, optimizer state and update count are of the same write: with gradient 1 each
    push adds 1 to every state element and moves the weights one step further down a known path."""
    n = rows.update_count
    assert n.max() > 0
    np.testing.assert_array_equal(rows.state, np.repeat(n[:, None].astype(np.float32), DIM, axis=1))
    path = _adagrad_path(int(n.max()))
    np.testing.assert_allclose(rows.weights, np.repeat(path[n][:, None], DIM, axis=1), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_during_async_training_restores_rows_whose_weights_and_state_agree(shared_shard_cluster,
                                                                                        tmp_path) -> None:
    cluster = shared_shard_cluster(2, replicas=1)
    stop = threading.Event()
    errors: list[BaseException] = []
    with ps.connect(cluster.target) as client:
        client.create_table("emb", dim=DIM, optimizer=ps.Adagrad(lr=LR), initializer=ps.Zeros(),
                            durability="async", staleness=None)

        def trainer(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                with ps.connect(cluster.target) as own:
                    while not stop.is_set():
                        ids = rng.choice(5000, 400, replace=False)
                        own.push("emb", ids, np.ones((ids.size, DIM), np.float32))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=trainer, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        try:
            while client.describe_table("emb").stats.get("rows", 0) < 3000:
                stop.wait(0.05)
            manifests = [client.checkpoint(str(tmp_path / f"c{k}")) for k in range(3)]  # while pushes go on
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
    assert all(m["tables"]["emb"]["rows"] > 0 for m in manifests)
    for k in range(3):
        _check_rows_agree(_rows(tmp_path / f"c{k}", "emb"))
    # restored onto three servers, the rows read back agree too, and are the checkpoint's bit for bit
    other = shared_shard_cluster(3, replicas=1)
    with ps.connect(other.target) as client:
        client.restore_checkpoint(str(tmp_path / "c2"))
        client.checkpoint(str(tmp_path / "again"))
    a, b = _rows(tmp_path / "c2", "emb"), _rows(tmp_path / "again", "emb")
    _check_rows_agree(b)
    for field in ("ids", "weights", "state", "update_count"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_the_cut_holds_a_write_only_with_the_writes_acknowledged_before_it(shared_shard_cluster, tmp_path) -> None:
    """One trainer pushes row a (on one server) and, once that is acknowledged, row b (on the other), over and
    over. A cut of the whole cluster at one point holds b's k-th push only with a's k-th: n_b <= n_a <= n_b + 1.
    (Cut server by server, a's server may be cut before b's while the trainer goes on: n_b > n_a.)"""
    cluster = shared_shard_cluster(2, replicas=1)
    stop = threading.Event()
    with ps.connect(cluster.target) as client:
        client.create_table("t", dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(), staleness=None)
        primary = client._route.primary_of_slot
        slots = routing.slot_of(np.arange(10_000, dtype=np.int64), client.config.num_slots)
        a = int(np.flatnonzero(primary[slots] == primary[slots[0]])[0])
        b = int(np.flatnonzero(primary[slots] != primary[slots[0]])[0])

        def trainer() -> None:
            with ps.connect(cluster.target) as own:
                while not stop.is_set():
                    for row in (a, b):
                        own.push("t", np.array([row]), -np.ones((1, 2), np.float32)).result()

        thread = threading.Thread(target=trainer)
        thread.start()
        try:
            for k in range(8):
                client.checkpoint(str(tmp_path / f"c{k}"))
        finally:
            stop.set()
            thread.join()
    for k in range(8):
        rows = _rows(tmp_path / f"c{k}", "t")
        n = dict(zip(rows.ids.tolist(), rows.update_count.tolist(), strict=True))
        n_a, n_b = n.get(a, 0), n.get(b, 0)
        assert n_b <= n_a <= n_b + 1, (k, n_a, n_b)


def test_an_incremental_chain_restores_what_a_full_checkpoint_of_the_same_moment_does(shared_shard_cluster,
                                                                                     tmp_path) -> None:
    cluster = shared_shard_cluster(2, replicas=1)
    root = tmp_path / "ckpts"
    with ps.connect(cluster.target) as client:
        client.create_table("emb", dim=8, optimizer=ps.Adam(lr=0.01), initializer=ps.Normal(std=0.1), seed=3)
        client.create_table("capped", dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(),
                            eviction=ps.Eviction(max_rows=400))  # per shard: pushes below evict rows
        rng = np.random.default_rng(0)
        client.push("emb", np.arange(20_000), rng.normal(size=(20_000, 8)).astype(np.float32)).result()
        client.push("capped", np.arange(600), -np.ones((600, 2), np.float32)).result()
        time.sleep(SINCE_MARGIN_S + 0.05)  # rows written within the margin before a base are read again
        first = client.checkpoint(str(root / "c0"), incremental=True)  # nothing beside it: a full one
        assert first["kind"] == "full" and first["base"] is None
        for k in range(1, 4):
            ids = rng.choice(20_000, 200, replace=False)  # 1 % of the rows
            client.push("emb", ids, rng.normal(size=(ids.size, 8)).astype(np.float32)).result()
            client.push("capped", np.arange(1000 * k, 1000 * k + 300), -np.ones((300, 2), np.float32)).result()
            time.sleep(SINCE_MARGIN_S + 0.05)
            m = client.checkpoint(str(root / f"c{k}"), incremental=True)
            assert m["kind"] == "incremental" and m["base"]["path"] == f"../c{k - 1}"
            assert m["tables"]["emb"]["rows"] == 200  # the changed rows, not the table
            assert m["tables"]["capped"]["deleted"] > 0  # tombstones of the rows the cap evicted
            assert m["bytes"] < first["bytes"] / 4
        full = client.checkpoint(str(tmp_path / "full"))  # no write since c3: the same moment
        cap_rows = full["tables"]["capped"]["rows"]
    for table in ("emb", "capped"):
        a, b = _rows(root / "c3", table), _rows(tmp_path / "full", table)
        for field in ("ids", "weights", "state", "update_count", "last_step"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    # the chain restored through the CLI onto a cluster of another size gives the same rows
    other = shared_shard_cluster(3, replicas=1)
    out = subprocess.run([sys.executable, "-m", "tigana.tools.cli", "admin", "--scheduler", other.scheduler, "--json",
                          "restore", str(root / "c3")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["rows"] == {"emb": 20_000, "capped": cap_rows}
    with ps.connect(other.target) as client:
        client.checkpoint(str(tmp_path / "again"))
    a, b = _rows(tmp_path / "full", "emb"), _rows(tmp_path / "again", "emb")
    np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(a.state, b.state)
    # a broken chain is refused before anything changes
    (root / "c1" / "manifest.json").write_text((root / "c1" / "manifest.json").read_text() + " ")
    with ps.connect(other.target) as client, pytest.raises(ps.DataLoss, match="base"):
        client.restore_checkpoint(str(root / "c3"))


def test_quantized_checkpoints_through_the_cli(shared_shard_cluster, tmp_path) -> None:
    """``tigana admin checkpoint --incremental --quantize int8``: weights within half a step of their row's
    range, optimizer state exact; fp16 within fp16's precision; a row fp16 cannot carry is refused."""
    cluster = shared_shard_cluster(2, replicas=1)
    with ps.connect(cluster.target) as client:
        client.create_table("emb", dim=16, optimizer=ps.RowWiseAdagrad(lr=0.05), initializer=ps.Normal(std=0.1))
        rng = np.random.default_rng(1)
        client.push("emb", np.arange(30_000), rng.normal(size=(30_000, 16)).astype(np.float32)).result()
        time.sleep(SINCE_MARGIN_S + 0.05)
        client.checkpoint(str(tmp_path / "exact"))

    def admin(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "tigana.tools.cli", "admin", "--scheduler", cluster.scheduler, "--json",
                              "checkpoint", *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    q8 = admin("--dir", str(tmp_path / "q8"), "--quantize", "int8")
    admin("--dir", str(tmp_path / "f16"), "--quantize", "fp16")
    q16 = admin("--dir", str(tmp_path / "q16"), "--quantize", "fp16", "--base", str(tmp_path / "exact"),
                "--incremental")
    exact_bytes = json.loads((tmp_path / "exact" / "manifest.json").read_text())["bytes"]
    assert q8["kind"] == "full" and q8["quantize"] == "int8" and q8["bytes"] < 0.6 * exact_bytes  # ids and counters stay
    assert q16["kind"] == "incremental" and q16["rows"] == {"emb": 0}  # nothing changed since its base
    exact, rows8 = _rows(tmp_path / "exact", "emb"), _rows(tmp_path / "q8", "emb")
    np.testing.assert_array_equal(rows8.ids, exact.ids)
    np.testing.assert_array_equal(rows8.state, exact.state)  # the optimizer state stays exact
    step = (exact.weights.max(axis=1) - exact.weights.min(axis=1)) / 255
    assert (np.abs(rows8.weights - exact.weights) <= step[:, None] * 0.5001 + 1e-7).all()
    rows16 = _rows(tmp_path / "f16", "emb")
    np.testing.assert_array_equal(rows16.state, exact.state)
    np.testing.assert_array_equal(rows16.weights, exact.weights.astype(np.float16).astype(np.float32))
    with ps.connect(cluster.target) as client:
        client.create_table("bad", dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        client.push("bad", np.arange(3), np.array([[-1e6, 0], [1, 1], [2, 2]], np.float32)).result()
        with pytest.raises(ps.InvalidArgument, match="'bad'.*'weights'.*fp16's range"):
            client.checkpoint(str(tmp_path / "refused"), quantize="fp16")
        assert not (tmp_path / "refused").exists()
        for stats in client.server_stats("bad").values():
            assert stats["bad"]["cuts_open"] == 0


def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_incremental_holds_the_rows_of_a_server_whose_clock_is_behind(tmp_path) -> None:
    """A server whose clock is an hour behind led nothing in the base (it held copies); a hand-over makes it the
    primary of a slot, and the rows it writes there carry times an hour before the base's cut. The incremental
    checkpoint must still hold them: it read the rows updated since the earliest of the base's clocks (less
    0.1 s) and left them out. Now log positions and the map decide: a slot written since the base by a primary
    that did not lead it then makes that server's part full."""
    sched = start_scheduler(SchedulerConfig(data_dir=str(tmp_path / "sched"), replicas=1, heartbeat_timeout_s=5.0,
                                            auto_rebalance=False))
    servers = []
    try:
        def server(name: str):
            handle = start_server(ServerConfig(port=0, data_dir=str(tmp_path / name), scheduler=sched.address,
                                               drain_grace_s=1.0))
            servers.append(handle)
            assert handle.wait_ready(30)
            return handle

        server("x")
        _until(lambda: (sched.core.map.copies[:, 0] >= 0).all(), "no placement")
        with ps.connect(scheduler=sched.address) as client:
            client.create_table("t", dim=DIM, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
            ids = np.arange(20_000, dtype=np.int64)
            client.push("t", ids, -np.ones((ids.size, DIM), np.float32)).result()
            y = server("y")
            _until(lambda: (sched.core.map.copies >= 0).all() and (sched.core.map.states == routing.IN_SYNC).all(),
                   "y's copies never caught up")
            time.sleep(SINCE_MARGIN_S + 0.05)
            base = client.checkpoint(str(tmp_path / "c" / "c0"))
            assert list(base["cut"]["servers"]) == [servers[0].address]  # y led nothing
            behind = lambda: time.time() - 3600.0  # noqa: E731
            y.service.cuts.wall_clock = behind
            for hosted in (h for _, h in y.service.tables.items()):
                hosted.table.wall_clock = behind
            slot = 5
            admin.move_slot(sched.address, slot, y.service.server_id, primary=True)
            me = sched.core.map.index_of(y.service.server_id)
            _until(lambda: sched.core.map.copies[slot, 0] == me and y.service.epoch == sched.core.map.epoch,
                   "the hand-over did not finish")
            mine = ids[routing.slot_of(ids) == slot]
            assert mine.size
            client.push("t", mine, -np.ones((mine.size, DIM), np.float32)).result()
            inc = client.checkpoint(str(tmp_path / "c" / "c1"), incremental=True)
            client.checkpoint(str(tmp_path / "full"))
        assert inc["kind"] == "incremental"
        parts = {p["server"]: p for p in inc["tables"]["t"]["parts"]}
        assert parts[y.address]["full"]  # y wrote slot 5, which it did not lead in the base
        assert not parts[servers[0].address]["full"] and parts[servers[0].address]["rows"] == 0  # x: nothing new
        chain, want = _rows(tmp_path / "c" / "c1", "t"), _rows(tmp_path / "full", "t")
        assert (chain.update_count[np.isin(chain.ids, mine)] == 2).all()
        for field in ("ids", "weights", "update_count"):
            np.testing.assert_array_equal(getattr(chain, field), getattr(want, field))
    finally:
        for handle in servers:
            handle.close(grace=1.0)
        sched.close()
