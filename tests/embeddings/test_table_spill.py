"""Table-level persistence: spill to LMDB, snapshot and restore, held against a dict reference and a twin.

The dict reference uses SGD(lr=1) with zero initial rows and integer gradients, so a row is exactly minus
the sum of its pushes; stateful optimizers are checked against a twin table that never spills.
"""

from __future__ import annotations

import copy
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.embeddings import (
    SGD,
    Adam,
    CorruptStore,
    EmbeddingTable,
    RowWiseAdagrad,
    SnapshotNotFound,
    TableConfig,
    Zeros,
)
from tigana.embeddings.snapshot import latest_snapshot, list_snapshots
from tigana.embeddings.spillfile import FILE_NAME as SPILL_FILE

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
DIM = 4
BUDGET = 600  # bytes: room for only a handful of resident rows, so most rows live in the spill file

ids_strategy = st.lists(st.one_of(st.sampled_from([0, -1, I64_MAX, I64_MIN]), st.integers(-25, 25)),
                        max_size=12)
op_strategy = st.one_of(
    st.tuples(st.just("pull"), ids_strategy, st.booleans()),
    st.tuples(st.just("push"), ids_strategy, st.integers(-4, 4)),
    st.tuples(st.just("delete"), ids_strategy, st.none()),
    st.tuples(st.just("snapshot"), st.none(), st.booleans()),
    st.tuples(st.just("restore"), st.none(), st.none()),
)


def sgd_config(**kw) -> TableConfig:
    return TableConfig("clicks", dim=DIM, optimizer=SGD(lr=1.0), initializer=Zeros(), **kw)


def grads_for(ids: np.ndarray, scale: int) -> np.ndarray:
    """Small integer-valued gradients (exact in float32 whatever the summation order)."""
    return ((ids[:, None] % 5) + np.arange(DIM) + scale).astype(np.float32)


def check_against(table: EmbeddingTable, ref: dict[int, tuple[np.ndarray, int]]) -> None:
    assert len(table) == len(ref)
    rows = table.export_rows()
    assert rows.ids.tolist() == sorted(ref)
    for k, i in enumerate(rows.ids.tolist()):
        np.testing.assert_array_equal(rows.weights[k], ref[i][0])
        assert int(rows.update_count[k]) == ref[i][1]


@given(st.lists(op_strategy, min_size=1, max_size=30))
@settings(max_examples=30, deadline=None)
def test_spilling_table_with_snapshots_matches_dict_reference(ops):
    with tempfile.TemporaryDirectory() as d:
        root, spill = Path(d) / "snaps", Path(d) / "spill"
        table = EmbeddingTable(sgd_config(memory_budget=BUDGET, spill_dir=str(spill)))
        ref: dict[int, tuple[np.ndarray, int]] = {}
        snaps: list[dict] = []
        try:
            for op, id_list, arg in ops:
                id_list = id_list or []
                ids = np.array(id_list, np.int64)
                if op == "pull":
                    got = table.pull(ids, insert=arg)
                    for k, i in enumerate(id_list):
                        expect = ref[i][0] if i in ref else np.zeros(DIM, np.float32)
                        np.testing.assert_array_equal(got[k], expect)
                    if arg:
                        for i in id_list:
                            ref.setdefault(i, (np.zeros(DIM, np.float32), 0))
                elif op == "push":
                    grads = grads_for(ids, arg)
                    table.push(ids, grads)
                    summed: dict[int, np.ndarray] = {}
                    for k, i in enumerate(id_list):
                        summed[i] = summed.get(i, np.zeros(DIM, np.float32)) + grads[k]
                    for i, g in summed.items():
                        w, n = ref.get(i, (np.zeros(DIM, np.float32), 0))
                        ref[i] = (w - g, n + 1)
                elif op == "delete":
                    assert table.delete(ids) == len(set(id_list) & set(ref))
                    for i in id_list:
                        ref.pop(i, None)
                elif op == "snapshot":
                    table.snapshot(root, incremental=arg)
                    snaps.append(copy.deepcopy(ref))
                else:
                    if not snaps:
                        with pytest.raises(SnapshotNotFound):
                            EmbeddingTable.restore(root)
                        continue
                    table.close()
                    table = EmbeddingTable.restore(root)
                    ref = copy.deepcopy(snaps[-1])
                    assert table.stats()["rows_resident"] <= max(len(ref), 10)  # the budget holds
                check_against(table, ref)
                assert table.contains(ids).tolist() == [i in ref for i in id_list]
                before = (table.stats(), len(table))
                weights, stored = table.peek(ids)  # resident, spilled and absent alike, changing nothing
                assert stored.tolist() == [i in ref for i in id_list] and (table.stats(), len(table)) == before
                for k, i in enumerate(id_list):
                    np.testing.assert_array_equal(weights[k], ref[i][0] if i in ref else np.zeros(DIM, np.float32))
            # every snapshot written, restored directly, holds its own moment's rows
            for path, state in zip(list_snapshots(root), snaps, strict=True):
                restored = EmbeddingTable.restore(path)
                try:
                    check_against(restored, state)
                finally:
                    restored.close()
        finally:
            table.close()


def test_rows_really_spill_and_come_back():
    with tempfile.TemporaryDirectory() as d:
        table = EmbeddingTable(sgd_config(memory_budget=BUDGET, spill_dir=d))
        try:
            ids = np.arange(-200, 200, dtype=np.int64) * 1_000_000_007
            table.push(ids, grads_for(ids, 1))
            stats = table.stats()
            assert stats["rows_spilled"] > 300 and stats["rows_resident"] < 50
            assert stats["rows_spilled"] + stats["rows_resident"] == len(ids) == len(table)
            weights, stored = table.peek(np.concatenate([ids, ids[:3] + 1]))  # spilled rows read where they lie
            np.testing.assert_array_equal(weights[:-3], -grads_for(ids, 1))
            assert stored[:-3].all() and not stored[-3:].any() and not weights[-3:].any()
            assert table.stats() == stats
            np.testing.assert_array_equal(table.pull(ids[::-1]), -grads_for(ids[::-1], 1))
            assert table.stats()["unspills"] > 0
        finally:
            table.close()


@pytest.mark.parametrize("optimizer", [RowWiseAdagrad(lr=0.5), Adam(lr=0.25, weight_decay=0.5)])
@given(steps=st.lists(st.tuples(ids_strategy, st.integers(-3, 3)), min_size=1, max_size=12),
       snapshot_every=st.integers(1, 4))
@settings(max_examples=15, deadline=None)
def test_stateful_optimizer_spill_and_restore_match_a_table_that_never_spills(optimizer, steps, snapshot_every):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "snaps"
        cfg = TableConfig("views", dim=DIM, optimizer=optimizer, initializer=Zeros())
        twin = EmbeddingTable(cfg)
        table = EmbeddingTable(TableConfig("views", dim=DIM, optimizer=optimizer, initializer=Zeros(),
                                           memory_budget=BUDGET, spill_dir=str(Path(d) / "spill")))
        try:
            for k, (id_list, scale) in enumerate(steps):
                ids = np.array(id_list, np.int64)
                for t in (table, twin):
                    t.push(ids, grads_for(ids, scale) / 4, step=k + 1)
                if k % snapshot_every == 0:
                    table.snapshot(root, incremental=True)
                    table.close()
                    table = EmbeddingTable.restore(root)
                a, b = table.export_rows(), twin.export_rows()
                for field in ("ids", "weights", "state", "update_count", "last_step"):
                    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
                assert table.checksum() == twin.checksum()
        finally:
            table.close()
            twin.close()


def test_corrupt_spilled_row_raises_naming_file_and_id_and_changes_nothing():
    with tempfile.TemporaryDirectory() as d:
        table = EmbeddingTable(sgd_config(memory_budget=BUDGET, spill_dir=d))
        try:
            ids = np.arange(1000, 1100, dtype=np.int64)
            table.push(ids, -(ids[:, None] + np.arange(DIM) / 8).astype(np.float32))  # unique rows
            files = list(Path(d).glob(f"*/{SPILL_FILE}"))
            assert len(files) == 1 and table.stats()["rows_spilled"] > 50
            data = bytearray(files[0].read_bytes())
            # the victim: the first of the ids whose row is in the spill file (the budget keeps one row resident)
            victim, needle, pos = next((int(i), n, data.find(n)) for i in ids[3:]
                                       for n in [(i + np.arange(DIM) / 8).astype("<f4").tobytes()]
                                       if data.find(n) >= 0)
            assert table.contains(np.array([victim])).all()
            while pos >= 0:
                data[pos + 1] ^= 0x08
                pos = data.find(needle, pos + 1)
            with open(files[0], "r+b") as f:
                f.write(bytes(data))
            before = len(table)
            with pytest.raises(CorruptStore) as err:
                table.pull(np.array([ids[0], victim]))
            assert str(files[0]) in str(err.value) and f"id {victim}" in str(err.value)
            assert len(table) == before and table.contains(np.array([victim])).all()
            np.testing.assert_array_equal(table.pull(ids[50:52]),
                                          (ids[50:52, None] + np.arange(DIM) / 8).astype(np.float32))
        finally:
            table.close()


# --- a table writer killed at a random moment ---------------------------------------------------------
_LEDGER_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from tigana.embeddings import EmbeddingTable, RowWiseAdagrad, TableConfig, Zeros
    root, spill = sys.argv[1], sys.argv[2]
    table = EmbeddingTable(TableConfig("ledger", dim=8, optimizer=RowWiseAdagrad(lr=0.5), initializer=Zeros(),
                                       memory_budget=20000, spill_dir=spill))
    step = 0
    print("start", flush=True)
    while True:
        step += 1
        rng = np.random.default_rng(step)
        ids = rng.zipf(1.3, 4000).astype(np.int64) * 2654435761 - 10**15
        grads = rng.integers(-3, 4, (4000, 8)).astype(np.float32)
        table.push(ids, grads, step=step)
        table.snapshot(root, incremental=step % 5 != 1)
""")


def _replay(steps: int) -> EmbeddingTable:
    table = EmbeddingTable(TableConfig("ledger", dim=8, optimizer=RowWiseAdagrad(lr=0.5), initializer=Zeros()))
    for step in range(1, steps + 1):
        rng = np.random.default_rng(step)
        ids = rng.zipf(1.3, 4000).astype(np.int64) * 2654435761 - 10**15
        table.push(ids, rng.integers(-3, 4, (4000, 8)).astype(np.float32), step=step)
    return table


@pytest.mark.parametrize("delay", [0.8, 2.0])
def test_table_writer_killed_mid_run_restores_a_consistent_step(delay):
    d = Path(tempfile.mkdtemp(prefix="tigana-ledger-"))
    proc = subprocess.Popen([sys.executable, "-c", _LEDGER_WRITER, str(d / "snaps"), str(d / "spill")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "start", proc.stderr.read()
        time.sleep(delay)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        latest = latest_snapshot(d / "snaps")
        if latest is None:
            return
        restored = EmbeddingTable.restore(d / "snaps")
        expected = _replay(restored.step)
        try:
            assert restored.step >= 1 and len(restored) == len(expected)
            assert restored.checksum() == expected.checksum()
            a, b = restored.export_rows(), expected.export_rows()
            np.testing.assert_array_equal(a.update_count, b.update_count)
            np.testing.assert_array_equal(a.last_step, b.last_step)
        finally:
            restored.close()
            expected.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        shutil.rmtree(d, ignore_errors=True)
