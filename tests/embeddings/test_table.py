"""EmbeddingTable against a dict-of-id -> row reference model, plus init, dtypes, admission, eviction, threads."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana import embeddings as emb
from tigana.embeddings import _kernels
from tigana.embeddings.initializers import initial_rows

BACKENDS = ["numpy"] + (["numba"] if _kernels.AVAILABLE else [])
DIM = 4
EDGES = [0, -1, 2**63 - 1, -(2**63)]
ids_st = st.lists(st.one_of(st.sampled_from(EDGES), st.integers(-20, 20)), min_size=0, max_size=30)


class Model:
    """The reference: a dict of id -> float64 row, SGD, TTL by steps; no hashing, no slab."""

    def __init__(self, config: emb.TableConfig) -> None:
        self.config, self.rows, self.last_step, self.step = config, {}, {}, 0

    def init(self, i: int) -> np.ndarray:
        return initial_rows(self.config.initializer, self.config.seed, np.array([i]), DIM)[0].astype(np.float64)

    def pull(self, ids: list[int]) -> np.ndarray:
        for i in ids:
            if i not in self.rows:
                self.rows[i], self.last_step[i] = self.init(i), self.step
        return np.array([self.rows[i] for i in ids]).reshape(len(ids), DIM)

    def push(self, ids: list[int], grads: np.ndarray) -> int:
        self.step += 1
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(ids, grads, strict=True):
            summed[i] = summed.get(i, 0.0) + g.astype(np.float64)
        for i, g in summed.items():
            self.rows[i] = self.rows.get(i, self.init(i)) - self.config.optimizer.lr * g
            self.last_step[i] = self.step
        return len(summed)

    def delete(self, ids: list[int]) -> int:
        gone = {i for i in ids if i in self.rows}
        for i in gone:
            del self.rows[i], self.last_step[i]
        return len(gone)

    def evict(self) -> int:
        ttl = self.config.eviction.ttl_steps
        old = [i for i, s in self.last_step.items() if self.step - s > ttl]
        return self.delete(old)


op_st = st.tuples(st.sampled_from(["pull", "push", "delete", "evict", "peek"]), ids_st,
                  st.integers(-4, 4))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(op_st, min_size=1, max_size=20), seed=st.integers(0, 3))
def test_matches_reference_model(backend: str, ops, seed: int) -> None:
    config = emb.TableConfig("ref", dim=DIM, optimizer=emb.SGD(lr=0.5), initializer=emb.Uniform(-1, 1),
                             seed=seed, eviction=emb.Eviction(ttl_steps=3), backend=backend)
    table, model = emb.EmbeddingTable(config), Model(config)
    # the automatic TTL pass runs every ttl_steps // 8 steps; make it follow the model exactly
    table._maybe_evict = lambda: None
    for op, ids, g in ops:
        arr = np.array(ids, np.int64)
        if op == "pull":
            np.testing.assert_allclose(table.pull(arr), model.pull(ids), rtol=1e-5, atol=1e-5)
        elif op == "peek":  # insert=False reads without storing
            expect = np.array([model.rows.get(i, model.init(i)) for i in ids]).reshape(len(ids), DIM)
            np.testing.assert_allclose(table.pull(arr, insert=False), expect, rtol=1e-5, atol=1e-5)
        elif op == "push":
            grads = np.full((len(ids), DIM), g, np.float32) + np.arange(DIM, dtype=np.float32)
            assert table.push(arr, grads) == model.push(ids, grads)
        elif op == "delete":
            assert table.delete(arr) == model.delete(ids)
        else:
            assert table.evict() == model.evict()
        assert len(table) == len(model.rows)
        assert table.contains(arr).tolist() == [i in model.rows for i in ids]
    exported = table.export_rows()
    assert exported.ids.tolist() == sorted(model.rows)
    if model.rows:
        np.testing.assert_allclose(exported.weights, [model.rows[i] for i in sorted(model.rows)], atol=1e-5)
        assert exported.last_step.tolist() == [model.last_step[i] for i in sorted(model.rows)]
    assert table.step == model.step


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_predicate_ids_and_import_roundtrip(backend: str) -> None:
    config = emb.TableConfig("t", dim=DIM, optimizer=emb.Adagrad(lr=0.1), backend=backend)
    table = emb.EmbeddingTable(config)
    ids = np.arange(-50, 50, dtype=np.int64)
    table.pull(ids)
    table.push(ids, np.ones((100, DIM), np.float32))
    even = table.export_rows(predicate=lambda x: x % 2 == 0)
    assert even.ids.tolist() == list(range(-50, 50, 2))
    some = table.export_rows(ids=np.array([7, 3, 3, 1000]))
    assert some.ids.tolist() == [3, 7]
    assert some.state.shape == (2, DIM) and (some.update_count == 1).all()
    copy = emb.EmbeddingTable(config)
    copy.import_rows(table.export_rows())
    assert copy.checksum() == table.checksum()
    assert len(copy) == 100
    copy.delete(np.array([0]))
    assert copy.checksum() != table.checksum()


def test_checksum_is_order_independent() -> None:
    config = emb.TableConfig("t", dim=DIM, initializer=emb.Normal())
    a, b = emb.EmbeddingTable(config), emb.EmbeddingTable(config)
    ids = np.array([5, -9, 2**63 - 1, 0, 77])
    a.pull(ids)
    b.pull(ids[::-1])
    b.pull(np.array([1234]))
    b.delete(np.array([1234]))
    assert a.checksum() == b.checksum()


@pytest.mark.parametrize("init", [emb.Zeros(), emb.Uniform(-0.5, 0.25), emb.Normal(0.1, 2.0)])
def test_deterministic_init_across_tables_and_backends(init) -> None:
    ids = np.array([0, -1, 2**63 - 1, -(2**63), 12345678901234])
    rows = {}
    for backend in BACKENDS:
        for seed in (7, 8):
            t = emb.EmbeddingTable(emb.TableConfig("t", dim=16, initializer=init, seed=seed, backend=backend))
            rows[backend, seed] = t.pull(ids)
            # the order and company of ids in a batch do not matter
            np.testing.assert_array_equal(t.pull(ids[::-1])[::-1], rows[backend, seed])
    for backend in BACKENDS:
        np.testing.assert_array_equal(rows[backend, 7], rows[BACKENDS[0], 7])
    if not isinstance(init, emb.Zeros):
        assert not np.array_equal(rows[BACKENDS[0], 7], rows[BACKENDS[0], 8])
        assert len(np.unique(rows[BACKENDS[0], 7])) == rows[BACKENDS[0], 7].size


def test_init_statistics() -> None:
    ids = np.arange(20000)
    u = initial_rows(emb.Uniform(-0.5, 1.5), 3, ids, 8)
    assert u.min() >= -0.5 and u.max() < 1.5 and abs(u.mean() - 0.5) < 0.01
    n = initial_rows(emb.Normal(1.0, 2.0), 3, ids, 8)
    assert abs(n.mean() - 1.0) < 0.02 and abs(n.std() - 2.0) < 0.02


def test_deterministic_init_in_another_process() -> None:
    code = ("import numpy as np; from tigana import embeddings as emb;"
            "t = emb.EmbeddingTable(emb.TableConfig('t', dim=8, seed=42));"
            "print(t.pull(np.array([3, -3, 2**63-1])).tobytes().hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    here = emb.EmbeddingTable(emb.TableConfig("other", dim=8, seed=42)).pull(np.array([3, -3, 2**63 - 1]))
    assert out.stdout.strip() == here.tobytes().hex()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_storage(backend: str, dtype: str) -> None:
    make = lambda dt: emb.EmbeddingTable(emb.TableConfig(  # noqa: E731
        "t", dim=8, dtype=dt, optimizer=emb.RowWiseAdagrad(lr=0.1), backend=backend))
    low, full = make(dtype), make("float32")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 40, 200)
    tol = 1e-2 if dtype == "bfloat16" else 1e-3
    for _ in range(5):
        g = rng.normal(size=(200, 8)).astype(np.float32)
        np.testing.assert_allclose(low.pull(ids), full.pull(ids), rtol=tol, atol=tol * 0.1)
        low.push(ids, g)
        full.push(ids, g)
    rows = low.export_rows()
    assert rows.weights.dtype == np.float32 and rows.state.dtype == np.float32
    # optimizer state stays float32: identical to the float32 table's up to the weight rounding
    np.testing.assert_allclose(rows.state, full.export_rows().state, rtol=1e-6)
    exact = emb.RowBatch(np.array([1]), np.array([[1.0, 0.5, -2.0, 0, 0, 0, 0, 3.0]], np.float32),
                         np.zeros((1, 1), np.float32), np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1))
    low.import_rows(exact)
    np.testing.assert_array_equal(low.pull(np.array([1])), exact.weights)
    assert low.stats()["row_bytes"] < full.stats()["row_bytes"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_admission_min_count(backend: str) -> None:
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, initializer=emb.Uniform(), backend=backend,
                                           admission=emb.Admission(min_count=3)))
    ids = np.array([10, 11, 11])  # 11 is seen twice per pull
    first = t.pull(ids)
    assert len(t) == 0 and t.contains(ids).tolist() == [False] * 3
    np.testing.assert_array_equal(first, initial_rows(emb.Uniform(), 0, ids, DIM))
    assert t.push(ids, np.ones((3, DIM), np.float32)) == 0  # not admitted: gradients dropped
    t.pull(ids)  # 11 reaches 4 sightings, 10 has 2
    assert t.contains(np.array([10, 11])).tolist() == [False, True]
    t.pull(np.array([10]))
    assert len(t) == 2
    assert t.stats()["admissions"] == 2


def test_admission_probability_is_deterministic() -> None:
    def admitted(seed: int, p: float) -> np.ndarray:
        t = emb.EmbeddingTable(emb.TableConfig("t", dim=2, seed=seed, admission=emb.Admission(probability=p)))
        ids = np.arange(2000)
        t.pull(ids)
        return t.contains(ids)

    a, b = admitted(1, 0.3), admitted(1, 0.3)
    assert (a == b).all() and 450 < a.sum() < 750
    assert not (admitted(2, 0.3) == a).all()
    assert admitted(1, 0.0).sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_lru_order_survives_the_access_clock_halving(backend: str) -> None:
    """Rows hold the access clock as uint32; when it runs out, clock and rows are halved and LRU still
    evicts the least recently used row (the clock is set near its end rather than run 2**32 times)."""
    from tigana.embeddings.slab import ACCESS_MAX

    lru = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, backend=backend,
                                             eviction=emb.Eviction(max_rows=10, policy="lru")))
    lru._clock = ACCESS_MAX - 12
    for i in range(25):  # the clock passes ACCESS_MAX halfway through
        lru.pull(np.array([i]))
        lru.push(np.array([i]), np.zeros((1, DIM), np.float32))
    assert lru._clock < ACCESS_MAX // 2 + 64
    assert len(lru) == 10 and lru.contains(np.arange(15, 25)).all()
    lru.pull(np.array([15]))
    lru.pull(np.array([100]))
    assert len(lru) == 10 and not lru.contains(np.array([16]))[0] and lru.contains(np.array([15, 100])).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_eviction_lru_and_lfu(backend: str) -> None:
    lru = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, backend=backend,
                                             eviction=emb.Eviction(max_rows=10, policy="lru")))
    for i in range(25):
        lru.pull(np.array([i]))
        lru.push(np.array([i]), np.zeros((1, DIM), np.float32))  # eviction runs on push
    assert len(lru) == 10 and lru.contains(np.arange(15, 25)).all()
    lru.pull(np.array([15]))  # touching 15 makes 16 the least recently used
    lru.pull(np.array([100]))  # an insert past the cap evicts at once
    assert len(lru) == 10 and not lru.contains(np.array([16]))[0] and lru.contains(np.array([15, 100])).all()
    assert lru.evict() == 0

    lfu = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, backend=backend,
                                             eviction=emb.Eviction(max_rows=5, policy="lfu")))
    hot = np.array([1, 2, 3])
    for _ in range(4):
        lfu.push(hot, np.zeros((3, DIM), np.float32))
    for i in range(10, 20):
        lfu.push(np.array([i]), np.zeros((1, DIM), np.float32))
    assert len(lfu) == 5 and lfu.contains(hot).all()
    assert lfu.stats()["evictions"] == 8


def test_ttl_seconds_and_automatic_ttl() -> None:
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, eviction=emb.Eviction(ttl_seconds=1000, ttl_steps=8)))
    with mock.patch("time.time", return_value=time.time() - 2000):  # both rows were last updated long ago
        t.push(np.array([1, 2]), np.zeros((2, DIM), np.float32))
    t.push(np.array([3]), np.zeros((1, DIM), np.float32))  # the automatic pass on push catches them
    t.evict()
    assert t.stats()["evictions"] == 2 and t.contains(np.array([1, 2, 3])).tolist() == [False, False, True]
    for _ in range(20):  # automatic: row 3 expires after 8 steps without updates
        t.push(np.array([4]), np.zeros((1, DIM), np.float32))
    assert t.contains(np.array([3, 4])).tolist() == [False, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_pushes_sum_exactly(backend: str) -> None:
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, optimizer=emb.SGD(lr=1.0), initializer=emb.Zeros(),
                                           backend=backend))
    ids = np.arange(64)

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(30):
            batch = rng.choice(ids, 40)
            t.pull(batch)
            t.push(batch, np.ones((40, DIM), np.float32))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    rows = t.export_rows()
    assert -rows.weights.sum() == 4 * 30 * 40 * DIM
    assert rows.update_count.sum() == t.stats()["rows_updated"]
    assert t.step == 120


def test_stats_and_bytes_per_row() -> None:
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=16, optimizer=emb.RowWiseAdagrad()))
    t.pull(np.arange(100_000))
    t.pull(np.arange(50_000))
    s = t.stats()
    for key in ("rows_resident", "rows_spilled", "bytes_per_row", "admissions", "evictions", "hit_rate",
                "pulls", "pushes"):
        assert key in s
    assert s["rows_resident"] == 100_000 and s["rows_spilled"] == 0
    assert s["hit_rate"] == pytest.approx(50_000 / 150_000)
    assert s["row_bytes"] == 64 + 4 + 13  # weights, row-wise state, metadata (slab docstring: no access clock)
    assert s["slot_bytes"] == s["row_bytes"]  # the old key, kept for tools/bench
    assert s["bytes_per_row"] <= 160


def test_nonfinite_skip_rows_policy() -> None:
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=2, optimizer=emb.SGD(lr=1.0), initializer=emb.Zeros(),
                                           nonfinite_grads="skip_rows"))
    grads = np.array([[1, 1], [np.nan, 0], [2, 2]], np.float32)
    assert t.push(np.array([1, 2, 3]), grads) == 2
    np.testing.assert_array_equal(t.pull(np.array([1, 2, 3]), insert=False), [[-1, -1], [0, 0], [-2, -2]])
    assert t.stats()["nonfinite_rows_skipped"] == 1
    # finite grads whose duplicate sum overflows: that id's rows are dropped too (with a NaN row beside them)
    grads = np.array([[3e38, 0], [3e38, 0], [1, 1], [np.inf, 0]], np.float32)
    assert t.push(np.array([4, 4, 5, 6]), grads) == 1
    np.testing.assert_array_equal(t.pull(np.array([4, 5]), insert=False), [[0, 0], [-1, -1]])
    assert t.stats()["nonfinite_rows_skipped"] == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_whose_duplicate_sum_overflows_are_rejected(backend: str) -> None:
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=2, optimizer=emb.SGD(lr=1.0), initializer=emb.Zeros(),
                                           backend=backend))
    big = np.full((2, 2), 3e38, np.float32)
    t.push(np.array([1, 2]), big)  # finite each, and no id repeats: applied
    before = t.checksum()
    with pytest.raises(emb.InvalidArgument, match=r"'grads' has NaN/Inf in the sum of its duplicate ids"):
        t.push(np.array([3, 3]), big)
    assert t.checksum() == before and len(t) == 2
    assert t.push(np.array([3, 3]), np.ones((2, 2), np.float32)) == 1  # small duplicates sum as before
    np.testing.assert_array_equal(t.pull(np.array([3])), [[-2, -2]])


def test_works_without_numba(tmp_path) -> None:
    """With numba unimportable the engine falls back to numpy and computes the same rows."""
    code = f"""
import sys
sys.modules["numba"] = None  # import numba now raises ImportError
import numpy as np
from tigana import embeddings as emb
t = emb.EmbeddingTable(emb.TableConfig("t", dim=4, optimizer=emb.Adam(), seed=5))
assert t.backend == "numpy"
ids = np.array([1, 2, 2, -7])
t.pull(ids)
t.push(ids, np.full((4, 4), 0.5, np.float32))
t.snapshot({str(tmp_path)!r})
print(t.pull(ids).tobytes().hex())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    here = emb.EmbeddingTable(emb.TableConfig("t", dim=4, optimizer=emb.Adam(), seed=5, backend="numpy"))
    ids = np.array([1, 2, 2, -7])
    here.pull(ids)
    here.push(ids, np.full((4, 4), 0.5, np.float32))
    assert out.stdout.strip() == here.pull(ids).tobytes().hex()
    assert emb.EmbeddingTable.restore(tmp_path).checksum() == here.checksum()


def test_the_access_clock_is_kept_only_for_tables_that_read_it(tmp_path) -> None:
    """LRU eviction and spilling order rows by their access clock; other tables keep no clock (4 bytes a
    row). A memory budget set on a running table starts the clock, and spilling then picks cold rows."""
    plain = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM))
    plain.pull(np.arange(100))
    plain.push(np.arange(10), np.zeros((10, DIM), np.float32))
    assert plain._slab.last_access.size == 0 and plain.stats()["row_bytes"] == 4 * DIM + 13
    lru = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, eviction=emb.Eviction(max_rows=50)))
    assert lru._slab.tracks_access and lru.stats()["row_bytes"] == 4 * DIM + 17
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=DIM, spill_dir=str(tmp_path / "spill")))
    t.pull(np.arange(1000))
    t.set_memory_budget(10**9)  # the clock starts: every row as if used now
    assert (t._slab.last_access[:1000] == t._clock).all()
    t.pull(np.arange(500, 1000))  # the hot half
    t.set_memory_budget(600 * (t._slab.row_nbytes + 20))
    assert t.stats()["rows_spilled"] > 0 and t.contains(np.arange(1000)).all()
    hot_resident = t._index.lookup(np.arange(500, 1000)) >= 0
    cold_resident = t._index.lookup(np.arange(500)) >= 0
    assert hot_resident.mean() > cold_resident.mean()
    for table in (plain, lru, t):
        table.close()
