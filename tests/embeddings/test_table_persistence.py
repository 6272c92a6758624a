"""Table-level persistence: spill to disk past a memory budget, snapshots and restore, against a
table that keeps everything in memory (itself checked against a dict model in test_table.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spill_records import corrupt_spilled

from tigana import embeddings as emb
from tigana.embeddings import _kernels

BACKENDS = ["numpy"] + (["numba"] if _kernels.AVAILABLE else [])
DIM = 4
ids_st = st.lists(st.one_of(st.sampled_from([0, -1, 2**63 - 1, -(2**63)]), st.integers(-40, 40)),
                  min_size=1, max_size=25)
op_st = st.tuples(st.sampled_from(["pull", "push", "push", "delete", "full", "incr", "export"]), ids_st)


def _config(backend: str, **kw) -> emb.TableConfig:
    return emb.TableConfig("clicks", dim=DIM, optimizer=emb.Adam(lr=0.1), initializer=emb.Uniform(),
                           backend=backend, **kw)


def _row_bytes(backend: str) -> int:
    return emb.EmbeddingTable(_config(backend)).stats()["row_bytes"] + 18


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_st, min_size=1, max_size=18))
def test_spill_and_snapshots_match_memory_table(tmp_path_factory, backend: str, ops) -> None:
    root = tmp_path_factory.mktemp("snaps")
    spill_dir = tmp_path_factory.mktemp("spill")
    budget = 12 * _row_bytes(backend)  # about 12 resident rows; the rest spill
    spilling = emb.EmbeddingTable(_config(backend, memory_budget=budget, spill_dir=str(spill_dir)))
    reference = emb.EmbeddingTable(_config(backend))
    snapshots: list[tuple[Path, str, int]] = []
    rng = np.random.default_rng(len(ops))
    try:
        for op, ids in ops:
            arr = np.array(ids, np.int64)
            if op == "pull":
                np.testing.assert_array_equal(spilling.pull(arr), reference.pull(arr))
            elif op == "push":
                grads = rng.normal(size=(arr.size, DIM)).astype(np.float32)
                assert spilling.push(arr, grads) == reference.push(arr, grads)
            elif op == "delete":
                assert spilling.delete(arr) == reference.delete(arr)
            elif op == "export":
                a, b = spilling.export_rows(ids=arr), reference.export_rows(ids=arr)
                assert a.ids.tolist() == b.ids.tolist()
                np.testing.assert_array_equal(a.weights, b.weights)
                np.testing.assert_array_equal(a.state, b.state)
                np.testing.assert_array_equal(a.update_count, b.update_count)
            else:
                path = spilling.snapshot(root, incremental=op == "incr")
                snapshots.append((path, reference.checksum(), reference.step))
            assert len(spilling) == len(reference)
            assert spilling.contains(arr).tolist() == reference.contains(arr).tolist()
            assert spilling.stats()["rows_resident"] <= 13
        assert spilling.checksum() == reference.checksum()
        stats = spilling.stats()
        assert stats["rows_resident"] + stats["rows_spilled"] == len(reference)
        for path, checksum, step in snapshots:
            restored = emb.EmbeddingTable.restore(path)
            try:
                assert restored.checksum() == checksum and restored.step == step
                assert restored.config == spilling.config
            finally:
                restored.close()
    finally:
        spilling.close()
    assert os.listdir(spill_dir) == []  # close removes the spill store


@pytest.mark.parametrize("backend", BACKENDS)
def test_incremental_chain_restores_each_point(tmp_path: Path, backend: str) -> None:
    table = emb.EmbeddingTable(_config(backend))
    rng = np.random.default_rng(3)
    expected = []
    for round_ in range(4):
        ids = rng.integers(0, 500, 300)
        table.pull(ids)
        table.push(ids, rng.normal(size=(300, DIM)).astype(np.float32))
        table.delete(rng.integers(0, 500, 40))
        path = table.snapshot(tmp_path, incremental=round_ > 0)
        expected.append((path, table.checksum(), len(table)))
    kinds = [p.name.split("-")[1] for p, _, _ in expected]
    assert kinds == ["full", "incr", "incr", "incr"]
    for path, checksum, rows in expected:
        restored = emb.EmbeddingTable.restore(path)
        assert restored.checksum() == checksum and len(restored) == rows
    latest = emb.EmbeddingTable.restore(tmp_path)  # a root means its latest snapshot
    assert latest.checksum() == expected[-1][1] and latest.step == table.step
    # the restored table continues the chain
    latest.push(np.array([1]), np.ones((1, DIM), np.float32))
    nxt = latest.snapshot(tmp_path, incremental=True)
    assert nxt.name.endswith("-incr")
    assert emb.EmbeddingTable.restore(nxt).checksum() == latest.checksum()


def test_incremental_only_holds_changes(tmp_path: Path) -> None:
    from tigana.embeddings import snapshot as snap

    table = emb.EmbeddingTable(_config("auto"))
    table.pull(np.arange(1000))
    table.snapshot(tmp_path)
    table.push(np.array([5, 6]), np.ones((2, DIM), np.float32))
    table.delete(np.array([7, 8, 9]))
    path = table.snapshot(tmp_path, incremental=True)
    manifest = snap.read_manifest(path)
    assert manifest["rows"] == 2 and manifest["deleted"] == 3


def test_incremental_elsewhere_falls_back_to_full(tmp_path: Path) -> None:
    table = emb.EmbeddingTable(_config("auto"))
    table.pull(np.arange(10))
    table.snapshot(tmp_path / "a")
    other = table.snapshot(tmp_path / "b", incremental=True)
    assert other.name.endswith("-full")
    assert emb.EmbeddingTable.restore(other).checksum() == table.checksum()


def test_restore_missing_snapshot(tmp_path: Path) -> None:
    with pytest.raises(emb.SnapshotNotFound):
        emb.EmbeddingTable.restore(tmp_path / "nothing")


@pytest.mark.parametrize("backend", BACKENDS)
def test_spilled_rows_come_back_and_keep_state(tmp_path: Path, backend: str) -> None:
    budget = 50 * _row_bytes(backend)
    table = emb.EmbeddingTable(_config(backend, memory_budget=budget, spill_dir=str(tmp_path)))
    reference = emb.EmbeddingTable(_config(backend))
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, 400, 64)
        g = rng.normal(size=(64, DIM)).astype(np.float32)
        for t in (table, reference):
            t.pull(ids)
            t.push(ids, g)
    stats = table.stats()
    assert stats["rows_spilled"] > 300 and stats["rows_resident"] <= 50 and stats["spills"] > 0
    assert stats["unspills"] > 0
    everything = np.arange(400)
    np.testing.assert_array_equal(table.pull(everything, insert=False), reference.pull(everything, insert=False))
    a, b = table.export_rows(predicate=lambda x: x % 3 == 0), reference.export_rows(predicate=lambda x: x % 3 == 0)
    assert a.ids.tolist() == b.ids.tolist()
    np.testing.assert_array_equal(a.state, b.state)
    assert table.checksum() == reference.checksum()
    table.close()


def test_full_disk_while_spilling_keeps_the_applied_push(tmp_path: Path, monkeypatch) -> None:
    budget = 20 * _row_bytes("auto")
    table = emb.EmbeddingTable(_config("auto", memory_budget=budget, spill_dir=str(tmp_path)))
    reference = emb.EmbeddingTable(_config("auto"))

    def full(batch):
        raise emb.StorageFull("table 'clicks': disk full writing spill store")

    monkeypatch.setattr(table._spill, "write", full)
    ids = np.arange(100)
    grads = np.ones((100, DIM), np.float32)
    for t in (table, reference):
        assert t.push(ids, grads) == 100  # applied, and no error although the spill failed
    stats = table.stats()
    assert stats["spill_failures"] >= 1 and stats["rows_resident"] == 100 and stats["rows_spilled"] == 0
    assert table.checksum() == reference.checksum()
    monkeypatch.undo()
    table.pull(np.array([1]))  # the next call spills
    assert table.stats()["rows_resident"] <= 20 and table.checksum() == reference.checksum()
    table.close()


def test_corrupt_spilled_row_raises_naming_file_and_id(tmp_path: Path) -> None:
    budget = 20 * _row_bytes("auto")
    table = emb.EmbeddingTable(_config("auto", memory_budget=budget, spill_dir=str(tmp_path)))
    table.pull(np.arange(100))
    spilled = corrupt_spilled(table, int(table._spilled.items()[0][0]))
    before = len(table)
    with pytest.raises(emb.CorruptStore) as err:
        table.pull(np.array([spilled, 1]))
    assert str(spilled) in str(err.value) and str(table._spill.file) in str(err.value)
    assert len(table) == before and table.contains(np.array([spilled]))[0]
    with pytest.raises(emb.CorruptStore):
        table.checksum()
    table.close()
