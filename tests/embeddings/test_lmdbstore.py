"""RowStore (the LMDB row tier) against a dict-of-id->row reference; checksums, corruption, full map/disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.embeddings import CorruptStore, InvalidArgument, RowBatch, StorageError, StorageFull
from tigana.embeddings._checksum import crc32_rows
from tigana.embeddings.lmdbstore import RowStore

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EDGE_IDS = [0, -1, 1, I64_MAX, I64_MIN, I64_MAX - 1, I64_MIN + 1]
DIM, SW = 3, 2

ids_strategy = st.one_of(st.sampled_from(EDGE_IDS), st.integers(-5, 5), st.integers(I64_MIN, I64_MAX))


def make_rows(ids, version: int, dim: int = DIM, sw: int = SW) -> RowBatch:
    """Rows whose every field is a function of (id, version), so a reference can recompute them."""
    ids = np.asarray(ids, np.int64)
    base = (ids % 1000).astype(np.float64) + version * 1000.0
    n = ids.shape[0]
    return RowBatch(
        ids=ids,
        weights=(base[:, None] + np.arange(dim)).astype(np.float32),
        state=(-base[:, None] - np.arange(sw)).astype(np.float32).reshape(n, sw),
        update_count=ids // 7 + version,
        last_step=ids ^ version,
        last_time=base * 0.5,
    )


def as_dict(batch: RowBatch) -> dict[int, tuple]:
    return {int(i): (batch.weights[k].tolist(), batch.state[k].tolist(), int(batch.update_count[k]),
                     int(batch.last_step[k]), float(batch.last_time[k]))
            for k, i in enumerate(batch.ids)}


def store_dict(store: RowStore, batch_size: int = 7) -> dict[int, tuple]:
    out: dict[int, tuple] = {}
    prev = None
    for batch in store.iter_batches(batch_size):
        assert len(batch) <= batch_size
        if len(batch):
            assert np.all(batch.ids[1:] > batch.ids[:-1]) and (prev is None or batch.ids[0] > prev)
            prev = batch.ids[-1]
        out.update(as_dict(batch))
    return out


@pytest.fixture
def tmpdir_path():
    d = tempfile.mkdtemp(prefix="tigana-rowstore-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


# --- checksum ---------------------------------------------------------------------------------------
@given(st.integers(0, 40), st.integers(0, 70), st.integers(0, 2**32 - 1))
@settings(max_examples=40, deadline=None)
def test_crc32_rows_matches_zlib_on_both_backends(n, length, seed):
    buf = np.random.default_rng(seed).integers(0, 256, (n, length), dtype=np.uint8)
    expect = np.array([zlib.crc32(row.tobytes()) for row in buf], np.uint32)
    np.testing.assert_array_equal(crc32_rows(buf), expect)
    np.testing.assert_array_equal(crc32_rows(buf, backend="numpy"), expect)


# --- reference-model property test ------------------------------------------------------------------
op_strategy = st.tuples(st.sampled_from(["put", "get", "pop", "delete", "contains"]),
                        st.lists(ids_strategy, max_size=12))


@given(st.lists(op_strategy, min_size=1, max_size=25))
@settings(max_examples=60, deadline=None)
def test_rowstore_matches_dict_reference(ops):
    with tempfile.TemporaryDirectory() as d, RowStore(Path(d) / "s", table="t", dim=DIM, state_width=SW,
                                                      map_size=1 << 20) as store:
        ref: dict[int, tuple] = {}
        for version, (op, id_list) in enumerate(ops):
            ids = np.array(id_list, np.int64)
            if op == "put":
                batch = make_rows(ids, version)
                store.put(batch)
                ref.update(as_dict(batch))  # dict update in order: the last duplicate wins, as in the store
            elif op in ("get", "pop"):
                found, rows = getattr(store, op)(ids)
                np.testing.assert_array_equal(found, [int(i) in ref for i in id_list])
                np.testing.assert_array_equal(rows.ids, ids[found])
                for k, i in enumerate(rows.ids.tolist()):
                    assert as_dict(rows.take(np.array([k]))) == {i: ref[i]}
                if op == "pop":
                    for i in set(id_list):
                        ref.pop(i, None)
            elif op == "delete":
                expect = len({i for i in id_list if i in ref})
                assert store.delete(ids) == expect
                for i in id_list:
                    ref.pop(i, None)
            else:
                np.testing.assert_array_equal(store.contains(ids), [int(i) in ref for i in id_list])
            assert len(store) == len(ref)
        assert store_dict(store) == ref
        assert sorted(np.concatenate([np.zeros(0, np.int64), *store.iter_ids(5)]).tolist()) == sorted(ref)


def test_reopen_keeps_rows_and_refuses_other_layout(tmpdir_path):
    path = tmpdir_path / "s"
    batch = make_rows(EDGE_IDS, 1)
    with RowStore(path, table="t", dim=DIM, state_width=SW) as store:
        store.put(batch)
    with RowStore(path, table="t", dim=DIM, state_width=SW) as store:
        assert store_dict(store) == as_dict(batch)
    with RowStore(path, table="t", dim=DIM, state_width=SW, readonly=True, lock=False) as store:
        assert store_dict(store) == as_dict(batch)
    with pytest.raises(InvalidArgument, match="dim"):
        RowStore(path, table="t", dim=DIM + 1, state_width=SW)
    with pytest.raises(InvalidArgument, match="state_width"):
        RowStore(path, table="t", dim=DIM, state_width=SW + 1)


def test_bad_batches_are_rejected_and_change_nothing(tmpdir_path):
    with RowStore(tmpdir_path / "s", table="clicks", dim=DIM, state_width=SW) as store:
        store.put(make_rows([1, 2], 0))
        before = store_dict(store)
        good = make_rows([3, 4], 1)
        bad_cases = {
            "ids": RowBatch(good.ids.astype(np.float64), good.weights, good.state, good.update_count,
                            good.last_step, good.last_time),
            "weights": RowBatch(good.ids, good.weights[:, :2], good.state, good.update_count,
                                good.last_step, good.last_time),
            "state": RowBatch(good.ids, good.weights, good.state[:1], good.update_count,
                              good.last_step, good.last_time),
            "last_time": RowBatch(good.ids, good.weights, good.state, good.update_count,
                                  good.last_step, good.last_time[:, None]),
        }
        for field, batch in bad_cases.items():
            with pytest.raises(InvalidArgument, match=rf"'clicks'.*'{field}'"):
                store.put(batch)
        with pytest.raises(InvalidArgument, match="'ids'"):
            store.get(np.array([[1, 2]]))
        with pytest.raises(InvalidArgument, match="'ids'"):
            store.delete(np.array([2**64 - 1], np.uint64))
        assert store_dict(store) == before
    with pytest.raises(StorageError, match="closed"):
        store.get(np.array([1]))


# --- corruption -------------------------------------------------------------------------------------
def _flip_record(file: Path, batch: RowBatch, k: int) -> None:
    """Flip one bit of row k's weights in a raw LMDB file, found by content (in every copy: stale
    copy-on-write pages may hold it too)."""
    data = bytearray(file.read_bytes())
    needle = batch.weights[k].astype("<f4").tobytes() + batch.state[k].astype("<f4").tobytes()
    pos = data.find(needle)
    assert pos >= 0
    while pos >= 0:
        data[pos + 5] ^= 0x40
        pos = data.find(needle, pos + 1)
    file.write_bytes(bytes(data))


def test_flipped_byte_in_a_record_raises_corrupt_store_naming_file_and_id(tmpdir_path):
    path = tmpdir_path / "s"
    ids = np.arange(-50, 50, dtype=np.int64) * 9_000_000_000_000_001
    batch = make_rows(ids, 3)
    with RowStore(path, table="t", dim=DIM, state_width=SW) as store:
        store.put(batch)
    file = path / "data.mdb"
    victim = 17
    _flip_record(file, batch, victim)

    with RowStore(path, table="t", dim=DIM, state_width=SW) as store:
        bad_id = int(ids[victim])
        for call in (store.get, store.pop):
            with pytest.raises(CorruptStore) as err:
                call(ids[victim - 2: victim + 2])
            assert str(file) in str(err.value) and f"id {bad_id}" in str(err.value)
        with pytest.raises(CorruptStore, match=f"id {bad_id}"):
            list(store.iter_batches(1000))
        assert len(store) == len(ids)  # the failed pop deleted nothing
        found, rows = store.get(ids[:victim])  # healthy records still read
        assert found.all() and as_dict(rows) == as_dict(batch.take(np.arange(victim)))


@pytest.mark.parametrize("damage", ["truncate-half", "truncate-small", "empty", "garbage"])
def test_damaged_data_file_raises_corrupt_store_naming_file(tmpdir_path, damage):
    path = tmpdir_path / "s"
    with RowStore(path, table="t", dim=DIM, state_width=SW) as store:
        store.put(make_rows(np.arange(5000), 1))
    file = path / "data.mdb"
    data = file.read_bytes()
    new = {"truncate-half": data[: len(data) // 2], "truncate-small": data[:100], "empty": b"",
           "garbage": bytes(np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8))}[damage]
    file.write_bytes(new)
    with pytest.raises(CorruptStore, match=str(file)):
        RowStore(path, table="t", dim=DIM, state_width=SW)


# --- map full / disk full ---------------------------------------------------------------------------
def test_map_grows_when_uncapped(tmpdir_path):
    with RowStore(tmpdir_path / "s", table="t", dim=64, state_width=0, map_size=1 << 16) as store:
        batch = make_rows(np.arange(20000), 1, dim=64, sw=0)
        store.put(batch)
        assert len(store) == 20000 and store.stats()["map_size"] > (1 << 16)
        assert store_dict(store, 4096) == as_dict(batch)


def test_map_full_at_cap_raises_storage_full_and_writes_nothing(tmpdir_path):
    cap = 1 << 18
    path = tmpdir_path / "s"
    with RowStore(path, table="views", dim=16, state_width=1, map_size=1 << 16, max_map_size=cap) as store:
        small = make_rows(np.arange(100), 1, dim=16, sw=1)
        store.put(small)
        with pytest.raises(StorageFull) as err:
            store.put(make_rows(np.arange(50, 5050), 2, dim=16, sw=1))  # ~420 KB of records > cap
        assert "'views'" in str(err.value) and str(path / "data.mdb") in str(err.value)
        assert store.stats()["map_size"] == cap
        assert len(store) == 100 and store_dict(store, 64) == as_dict(small)
        store.put(make_rows(np.arange(100, 200), 3, dim=16, sw=1))  # still usable
        assert len(store) == 200


_DISK_FULL_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from tigana.embeddings import RowBatch, StorageFull
    from tigana.embeddings.lmdbstore import RowStore
    from tigana.embeddings.snapshot import list_snapshots, write_snapshot
    root = sys.argv[1]
    def rows(lo, hi):
        ids = np.arange(lo, hi, dtype=np.int64)
        n = hi - lo
        return RowBatch(ids, np.full((n, 32), lo, np.float32), np.zeros((n, 1), np.float32),
                        np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n))
    out = {}
    store = RowStore(root + "/spill", table="t", dim=32, state_width=1)
    done = 0
    try:
        while True:
            store.put(rows(done, done + 2000))
            done += 2000
    except StorageFull as exc:
        out["store_error"] = str(exc)
    out["store_len"] = len(store)
    out["expected_len"] = done
    found, got = store.get(np.arange(done))
    out["store_intact"] = bool(found.all() and (got.weights[:, 0] == (got.ids // 2000) * 2000).all())
    store.close()
    try:
        write_snapshot(root + "/snaps", table="t", config={"dim": 32}, rows=rows(0, 200000))
    except StorageFull as exc:
        out["snapshot_error"] = str(exc)
    import os
    out["snapshot_dir"] = sorted(os.listdir(root + "/snaps"))
    print(json.dumps(out))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("unshare") is None,
                    reason="needs Linux unshare to mount a small tmpfs")
def test_disk_full_raises_storage_full_and_keeps_data(tmpdir_path):
    mnt = tmpdir_path / "mnt"
    mnt.mkdir()
    # A private mount namespace: the 4 MiB tmpfs disappears with the child, whatever happens to it.
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
           f'mount -t tmpfs -o size=4m tmpfs "{mnt}" && exec "{sys.executable}" -c "$0" "{mnt}"',
           _DISK_FULL_SCRIPT]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 and ("mount" in err or "unshare" in err) and "Traceback" not in err:
        pytest.skip(f"cannot mount a tmpfs here: {err.strip()[:200]}")
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert "disk full" in result["store_error"] and "'t'" in result["store_error"]
    assert result["store_len"] == result["expected_len"] > 0
    assert result["store_intact"]
    assert "disk full" in result["snapshot_error"]
    assert result["snapshot_dir"] == []  # no snapshot and no temp dir left behind
    assert not os.listdir(mnt)  # the tmpfs lived only in the child's namespace
