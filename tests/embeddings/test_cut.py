"""Cuts (copy-on-write reads of a whole table): a cut read in chunks while writes go on holds exactly the rows of
the table at the moment it was opened, and so do snapshots written that way (full and incremental chains);
a write completes while a cut is being read."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana import embeddings as emb
from tigana.embeddings import cut
from tigana.embeddings import snapshot as snapshot_module

DIM = 4
# an hour ago in whole ticks of 1/128 s: a time a slab keeps bit for bit (embeddings/slab.py)
IMPORTED_AT = float(int(time.time()) - 3600) + 0.5
ROW_BYTES = DIM * 4 + 21 + 18  # SGD: no optimizer state; + the row's share of the index

ids_st = st.lists(st.integers(0, 40), max_size=10)
write_op_st = st.one_of(  # the writes a table takes from its callers
    st.tuples(st.just("push"), ids_st, st.integers(-3, 3)),
    st.tuples(st.just("pull"), ids_st, st.none()),
    st.tuples(st.just("delete"), ids_st, st.none()),
    st.tuples(st.just("import"), ids_st, st.integers(-3, 3)),
)
op_st = st.one_of(
    write_op_st,
    st.tuples(st.just("evict"), st.none(), st.none()),
    st.tuples(st.just("read"), st.none(), st.integers(1, 3)),
)
kind_st = st.sampled_from(["plain", "spill", "cap", "bf16", "numpy", "adagrad"])


def make_table(kind: str, spill_dir: str) -> emb.EmbeddingTable:
    kw: dict = {}
    optimizer = emb.SGD(lr=1.0)
    if kind in ("spill", "cap"):
        kw.update(memory_budget=10 * ROW_BYTES, spill_dir=spill_dir)
    if kind == "cap":
        kw.update(eviction=emb.Eviction(max_rows=25))
    if kind == "bf16":
        kw.update(dtype="bfloat16")
    if kind == "numpy":
        kw.update(backend="numpy", memory_budget=12 * ROW_BYTES, spill_dir=spill_dir)
    if kind == "adagrad":
        optimizer = emb.RowWiseAdagrad(lr=0.5)
    return emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, optimizer=optimizer, initializer=emb.Normal(std=0.1),
                                              seed=3, **kw))


def state_of(table: emb.EmbeddingTable) -> emb.RowBatch:
    """Every stored row, sorted by id, read by id (not through a cut)."""
    rows = table.rows_of(np.sort(table.stored_ids()))
    return rows.take(np.argsort(rows.ids))


def sorted_rows(batches: list[emb.RowBatch], dim: int, width: int) -> emb.RowBatch:
    rows = emb.RowBatch.concat(batches) if batches else emb.RowBatch.empty(dim, width)
    return rows.take(np.argsort(rows.ids))


def assert_same(got: emb.RowBatch, want: emb.RowBatch) -> None:
    assert got.ids.tolist() == want.ids.tolist()
    for field in ("weights", "state", "update_count", "last_step", "last_time"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


def rows_held(c: emb.Cut) -> int:
    """Rows the cut keeps in RAM: the saved copies of rows changed since its opening and the rows removed from
    the table before it read them."""
    saved = c._saved.high_water - c._saved._n_free
    return saved + sum(len(rows) for rows, _ in c._removed)


def apply(table: emb.EmbeddingTable, op: str, ids: list[int] | None, arg: int | None) -> None:
    a = np.array(ids or [], np.int64)
    if op == "push":
        table.push(a, np.full((a.size, DIM), float(arg), np.float32) + a[:, None] % 3)
    elif op == "pull":
        table.pull(a)
    elif op == "delete":
        table.delete(a)
    elif op == "import":
        u = np.unique(a)
        w = np.full((u.size, DIM), float(arg), np.float32)
        table.import_rows(emb.RowBatch(u, w, np.zeros((u.size, table.state_width), np.float32),
                                       np.full(u.size, 7), np.full(u.size, 9), np.full(u.size, IMPORTED_AT)))
    elif op == "evict":
        table.evict()


@given(kind=kind_st, before=st.lists(op_st, max_size=15), during=st.lists(op_st, max_size=30),
       chunk=st.integers(1, 8), in_order=st.booleans())
@settings(max_examples=150, deadline=None)
def test_a_cut_read_between_writes_holds_the_table_at_its_opening(kind, before, during, chunk, in_order) -> None:
    with tempfile.TemporaryDirectory() as d:
        table = make_table(kind, d)
        try:
            for op, ids, arg in before:
                if op != "read":
                    apply(table, op, ids, arg)
            want = state_of(table)
            c = table.cut()
            reader = c.batches(chunk, in_order=in_order)
            got: list[emb.RowBatch] = []
            gone = 0  # rows that left the table (deleted, evicted) while the cut was open
            with mock.patch.object(cut, "ORDERED_ROWS", chunk):
                for op, ids, arg in during:
                    if op == "read":
                        for _ in range(arg):
                            got.extend(b for b in [next(reader, None)] if b is not None)
                    else:
                        stored = set(table.stored_ids().tolist())
                        apply(table, op, ids, arg)
                        gone += len(stored - set(table.stored_ids().tolist()))
                    # the cut keeps in RAM only saved copies of resident rows and rows gone from the table: a row
                    # that spilled, or left the spill tier, is read from the file
                    assert rows_held(c) <= len(table._index) + gone
                got.extend(reader)
            if in_order and got:  # ascending, but for the rows that left before they were read: parked (from the
                # spill file), then removed, each batch ascending
                assert all((np.diff(b.ids) > 0).all() for b in got)
                assert sum(int(b.ids[0] < a.ids[-1]) for a, b in zip(got[:-1], got[1:], strict=True)) <= 2
            assert_same(sorted_rows(got, DIM, table.state_width), want)
            assert table._cuts == []  # read to the end: writes no longer pay for it
        finally:
            table.close()


def _interleaving_writer(writes: list[Callable[[], None]]) -> Callable:
    """A ``write_snapshot`` that runs the queued writes between the batches it stores."""
    real = snapshot_module.write_snapshot

    def write(root, *, rows, **kw):
        def between():
            for batch in rows:
                yield batch
                if writes:
                    writes.pop(0)()
        return real(root, rows=between(), **kw)
    return write


@given(kind=kind_st, rounds=st.lists(st.tuples(st.lists(op_st, max_size=10), st.lists(op_st, max_size=10),
                                               st.booleans()), min_size=1, max_size=4))
@settings(max_examples=40, deadline=None)
def test_snapshots_written_while_writes_go_on_restore_the_table_at_their_cut(kind, rounds) -> None:
    with tempfile.TemporaryDirectory() as d:
        root, table = Path(d) / "snaps", make_table(kind, str(Path(d) / "spill"))
        expected: list[tuple[Path, emb.RowBatch, int]] = []
        writes: list[Callable[[], None]] = []
        try:
            with mock.patch.object(cut, "CUT_BUCKETS", 2), mock.patch.object(cut, "ORDERED_ROWS", 2), \
                    mock.patch.object(snapshot_module, "write_snapshot", _interleaving_writer(writes)):
                for before, during, incremental in rounds:
                    for op, ids, arg in before:
                        apply(table, op, ids, arg)
                    want, step = state_of(table), table.step
                    writes[:] = [lambda o=o: apply(table, *o) for o in during if o[0] != "read"]
                    path = table.snapshot(root, incremental=incremental)
                    for w in writes:  # the ones the writer had no batch left to run between
                        w()
                    writes.clear()
                    expected.append((path, want, step))
            for path, want, step in expected:
                restored = emb.EmbeddingTable.restore(path)
                assert_same(state_of(restored), want)
                assert restored.step == step
                restored.close()
        finally:
            table.close()


def test_a_push_completes_while_a_large_cut_is_being_read() -> None:
    """The reader holds the table's lock only per chunk: a push from another thread, issued while the reader
    is between two chunks, completes before the reader is let go on."""
    table = emb.EmbeddingTable(emb.TableConfig("big", dim=DIM, optimizer=emb.SGD(lr=1.0), initializer=emb.Zeros()))
    ids = np.arange(200_000, dtype=np.int64)
    table.push(ids, np.ones((ids.size, DIM), np.float32))
    want = state_of(table)
    c = table.cut()
    reader = c.batches()
    got = [next(reader)]  # the reader now waits between chunks
    pushed = threading.Event()
    hot = ids[::7]

    def push() -> None:
        table.push(hot, np.ones((hot.size, DIM), np.float32))
        pushed.set()

    writer = threading.Thread(target=push)
    writer.start()
    writer.join(120)  # not a timing assertion: only that it ends (it would hang if the cut held the lock)
    assert pushed.is_set() and not writer.is_alive()
    got.extend(reader)
    assert_same(sorted_rows(got, DIM, 0), want)  # the cut: before the push
    np.testing.assert_array_equal(table.pull(hot[:3]), np.full((3, DIM), -2.0, np.float32))  # the table: after
    table.close()


def test_a_snapshot_of_the_table_is_written_while_a_push_completes(tmp_path: Path) -> None:
    table = emb.EmbeddingTable(emb.TableConfig("big", dim=DIM, optimizer=emb.SGD(lr=1.0), initializer=emb.Zeros()))
    ids = np.arange(100_000, dtype=np.int64)
    table.push(ids, np.ones((ids.size, DIM), np.float32))
    reading, pushed = threading.Event(), threading.Event()
    real = snapshot_module.write_snapshot

    def paused(root, *, rows, **kw):
        def gated():
            for k, batch in enumerate(rows):
                yield batch
                if k == 0:
                    reading.set()
                    assert pushed.wait(120)
        return real(root, rows=gated(), **kw)

    out: list[Path] = []
    with mock.patch.object(snapshot_module, "write_snapshot", paused), \
            mock.patch.object(cut, "ORDERED_ROWS", 1000):
        snapper = threading.Thread(target=lambda: out.append(table.snapshot(tmp_path)))
        snapper.start()
        assert reading.wait(120)
        table.push(ids[:10], np.ones((10, DIM), np.float32))  # would wait for the snapshot if it held the lock
        pushed.set()
        snapper.join(120)
    assert out and emb.EmbeddingTable.restore(out[0]).pull(ids[:10]).tolist() == [[-1.0] * DIM] * 10
    increment = table.snapshot(tmp_path, incremental=True)  # the push after the cut is the next increment
    assert increment.name.endswith("-incr")
    assert emb.EmbeddingTable.restore(increment).pull(ids[:10]).tolist() == [[-2.0] * DIM] * 10
    table.close()


def test_a_cut_closed_early_stops_costing_writes_and_cannot_be_read() -> None:
    table = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM))
    table.pull(np.arange(100))
    with table.cut() as c:
        assert table._cuts == [c]
    assert table._cuts == []
    try:
        list(c.batches())
    except emb.InvalidArgument as exc:
        assert "cut" in str(exc)
    else:
        raise AssertionError("a closed cut was read")
    table.close()


def test_checksums_of_a_cut_match_the_table_checksum() -> None:
    a = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, seed=1))
    b = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, seed=1))
    a.pull(np.arange(500))
    b.pull(np.arange(500)[::-1])
    c = a.cut()
    sums, counts = c.checksums_by(lambda ids: ids % 7, 7)
    assert c.checksum() == a.checksum() == b.checksum() and counts.sum() == 500
    np.testing.assert_array_equal(sums, b.checksums_by(lambda ids: ids % 7, 7)[0])
    a.push(np.array([3]), np.ones((1, DIM), np.float32))
    assert a.checksum() != b.checksum()
