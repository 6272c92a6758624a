"""Cluster checkpoints, restores and serving exports on real processes (``tigana.ps.client.checkpoint``)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tigana import ps
from tigana.embeddings import RowBatch
from tigana.ps.ops import admin

pytestmark = pytest.mark.timeout(240)

READER = """
import json, sys
import numpy as np
ids = np.load(sys.argv[1] + "/ids.npy")
rows = np.load(sys.argv[1] + "/rows.npy")
meta = json.load(open(sys.argv[1] + "/export.json"))
assert rows.shape == (ids.size, meta["dim"]) and rows.dtype == np.float32 and ids.dtype == np.int64
print(json.dumps({"rows": int(ids.size), "sum": float(rows.astype(np.float64).sum()), "first": int(ids[0])}))
"""


def _all_rows(directory, table: str) -> RowBatch:
    from tigana.ps.client.checkpoint import checkpoint_rows

    rows = RowBatch.concat(list(checkpoint_rows(directory, table)))
    return rows.take(np.argsort(rows.ids))


def _train(client: ps.Client, table: str, steps: int, seed: int) -> None:
    """Pushes one at a time: pushes in flight together may be applied in either order, and Adam's steps do
    not commute, so a bit-for-bit comparison needs an order."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, 30_000, 4000)
        client.push(table, ids, rng.normal(size=(ids.size, 8)).astype(np.float32)).result()


def test_checkpoint_on_3_servers_restores_identically_on_2(shared_shard_cluster, tmp_path) -> None:
    first = shared_shard_cluster(3, replicas=1)
    with ps.connect(first.target) as client:
        client.create_table("emb", dim=8, optimizer=ps.Adam(lr=0.01), initializer=ps.Normal(std=0.1), seed=4)
        client.create_table("wide", dim=8, optimizer=ps.FTRL(alpha=0.05, l1=0.001), seed=5)
        for name in ("emb", "wide"):
            _train(client, name, 5, seed=1)
        ckpt = tmp_path / "ckpt"
        manifest = client.checkpoint(str(ckpt))
        assert set(manifest["tables"]) == {"emb", "wide"} and manifest["tables"]["emb"]["step"] > 0
        assert len(manifest["tables"]["emb"]["parts"]) == 3  # one cut per primary
        # training on without the restore, as the reference
        _train(client, "emb", 3, seed=2)
        reference = client.pull("emb", np.arange(30_000), insert=False)
    second = shared_shard_cluster(2, replicas=1)
    with ps.connect(second.target) as client:
        client.create_table("emb", dim=4)  # a table of that name with other rows: the restore replaces it
        restored = client.restore_checkpoint(str(ckpt))
        assert restored == {t: manifest["tables"][t]["rows"] for t in manifest["tables"]}
        again = tmp_path / "again"
        client.checkpoint(str(again))
        for table in ("emb", "wide"):
            a, b = _all_rows(ckpt, table), _all_rows(again, table)
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_array_equal(a.weights, b.weights)  # rows and optimizer state, bit for bit
            np.testing.assert_array_equal(a.state, b.state)
            np.testing.assert_array_equal(a.update_count, b.update_count)  # Adam's per-row step counts
        # training on after the restore gives what training on without it gave
        _train(client, "emb", 3, seed=2)
        np.testing.assert_array_equal(client.pull("emb", np.arange(30_000), insert=False), reference)
        assert admin.verify(second.scheduler)["differing"] == []


def test_a_cut_refused_on_one_server_is_taken_again_whole(shared_shard_cluster, tmp_path, monkeypatch) -> None:
    """A part that cannot be read (its server refused: a map change, a failover under ``admin checkpoint``)
    discards the round: every server's cut is released, the parts so far are removed, and a new round cuts
    every table again by the newest map; the checkpoint completes whole."""
    from tigana.ps.client.checkpoint import write

    cluster = shared_shard_cluster(2, replicas=1)
    with ps.connect(cluster.target) as client:
        client.create_table("emb", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        ids = np.arange(4000, dtype=np.int64)
        client.push("emb", ids, -np.ones((ids.size, 4), np.float32)).result()
        real, calls = write._read_parts, []

        def flaky(client_, server, cut, *args, **kw):
            calls.append(cut)
            if len(calls) == 2:  # the second server of the first round
                raise ps.WrongShard("table 'emb': field 'slots' names slots this server does not lead", epoch=1)
            return real(client_, server, cut, *args, **kw)

        monkeypatch.setattr(write, "_read_parts", flaky)
        manifest = client.checkpoint(str(tmp_path / "ckpt"))
        assert len(calls) == 4 and len(set(calls)) == 2  # two rounds of two servers
        for stats in client.server_stats("emb").values():  # no cut is left open on any server
            assert stats["emb"]["cuts_open"] == 0
    table = manifest["tables"]["emb"]
    assert table["rows"] == ids.size and len(table["parts"]) == 2
    assert len(list((tmp_path / "ckpt" / "tables" / "emb").iterdir())) == 2  # the discarded round left nothing
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    rows = _all_rows(tmp_path / "ckpt", "emb")
    np.testing.assert_array_equal(np.sort(rows.ids), ids)


def test_a_damaged_checkpoint_is_refused(shared_shard_cluster, tmp_path) -> None:
    cluster = shared_shard_cluster(2, replicas=1)
    with ps.connect(cluster.target) as client:
        client.create_table("t", dim=4)
        client.pull("t", np.arange(1000))
        ckpt = tmp_path / "ckpt"
        client.checkpoint(str(ckpt))
        with pytest.raises(ps.InvalidArgument, match="not empty"):
            client.checkpoint(str(ckpt))
        data = next(ckpt.rglob("chunk-00000.npz"))
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        before = client.pull("t", np.arange(1000), insert=False)
        client.push("t", np.arange(10), np.ones((10, 4), np.float32)).result()
        after = client.pull("t", np.arange(1000), insert=False)
        with pytest.raises(ps.DataLoss, match="checksum"):
            client.restore_checkpoint(str(ckpt))
        # refused before anything changed: the table is as it was, not dropped or half restored
        np.testing.assert_array_equal(client.pull("t", np.arange(1000), insert=False), after)
        assert not np.array_equal(before, after)


def test_export_since_of_a_table_with_spilled_rows_reads_a_cut(shared_shard_cluster, tmp_path) -> None:
    """With a spill tier the rows' update times partly live in the store: the delta is read from a
    copy-on-write cut (the lock held O(1)), not by reading every spilled row under the lock; same rows."""
    cluster = shared_shard_cluster(2, replicas=1)
    with ps.connect(cluster.target) as client:
        client.create_table("cold", dim=6, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(), memory_budget="16KiB")
        ids = np.arange(-500, 2500, dtype=np.int64)
        client.push("cold", ids, -np.ones((ids.size, 6), np.float32)).result()
        stats = client.server_stats("cold")
        assert sum(s["cold"]["rows_spilled"] for s in stats.values()) > ids.size // 2  # most rows spilled
        full = client.export("cold", str(tmp_path / "full"))
        assert full["rows"] == ids.size
        changed = np.array([7, -3, 1999, 2400], np.int64)
        client.push("cold", changed, -np.ones((changed.size, 6), np.float32)).result()
        meta = client.export("cold", str(tmp_path / "delta"), since=str(tmp_path / "full"))
        assert meta["rows"] == changed.size
        np.testing.assert_array_equal(np.load(tmp_path / "delta" / "ids.npy"), np.sort(changed))
        np.testing.assert_array_equal(np.load(tmp_path / "delta" / "rows.npy"), np.full((changed.size, 6), 2.0))


def test_export_round_trip_through_the_documented_reader(shared_shard_cluster, tmp_path) -> None:
    cluster = shared_shard_cluster(2, replicas=1)
    with ps.connect(cluster.target) as client:
        client.create_table("items", dim=6, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        ids = np.arange(-500, 2500, dtype=np.int64)
        client.push("items", ids, -np.tile(np.arange(6, dtype=np.float32), (ids.size, 1))).result()
        full = tmp_path / "full"
        meta = client.export("items", str(full))
        assert meta["rows"] == ids.size and meta["dim"] == 6
        # a reader that does not import Tigana (the README's), in a fresh interpreter
        out = subprocess.run([sys.executable, "-c", READER, str(full)], capture_output=True, text=True, check=True)
        got = json.loads(out.stdout)
        assert got == {"rows": ids.size, "sum": float(ids.size * sum(range(6))), "first": -500}
        np.testing.assert_array_equal(np.load(full / "ids.npy"), np.sort(ids))
        # --since: only the rows updated after the earlier export
        changed = np.array([7, -3, 1999], np.int64)
        client.push("items", changed, -np.ones((3, 6), np.float32)).result()
        delta = tmp_path / "delta"
        meta = client.export("items", str(delta), since=str(full))
        assert meta["rows"] == 3
        np.testing.assert_array_equal(np.load(delta / "ids.npy"), np.sort(changed))
        np.testing.assert_array_equal(np.load(delta / "rows.npy"), np.tile(np.arange(1, 7, dtype=np.float32), (3, 1)))
