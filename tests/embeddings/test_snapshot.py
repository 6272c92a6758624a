"""Snapshots: chains against a dict reference, crash safety with a killed writer process, corruption."""

from __future__ import annotations

import json
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
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Admission,
    CorruptStore,
    Eviction,
    InvalidArgument,
    Normal,
    RowBatch,
    RowWiseAdagrad,
    SnapshotNotFound,
    TableConfig,
    Uniform,
    Zeros,
)
from tigana.embeddings.lmdbstore import RowStore
from tigana.embeddings.snapshot import (
    cleanup_temp,
    config_from_dict,
    config_to_dict,
    iter_snapshot_rows,
    latest_snapshot,
    list_snapshots,
    read_manifest,
    read_snapshot,
    write_snapshot,
)

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
DIM, SW = 4, 1
CONFIG = {"name": "t", "dim": DIM}


def make_rows(ids, version: int, dim: int = DIM, sw: int = SW) -> RowBatch:
    ids = np.asarray(ids, np.int64)
    n = ids.shape[0]
    base = (ids % 997).astype(np.float64) + version * 1000.0
    return RowBatch(ids, (base[:, None] + np.arange(dim)).astype(np.float32),
                    np.repeat(-base[:, None], sw, axis=1).astype(np.float32).reshape(n, sw),
                    np.full(n, version, np.int64), ids // 3, base / 7)


def as_dict(batch: RowBatch) -> dict[int, tuple]:
    assert len(np.unique(batch.ids)) == len(batch)
    return {int(i): (batch.weights[k].tolist(), batch.state[k].tolist(), int(batch.update_count[k]),
                     int(batch.last_step[k]), float(batch.last_time[k])) for k, i in enumerate(batch.ids)}


@pytest.fixture
def root():
    d = tempfile.mkdtemp(prefix="tigana-snap-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


# --- config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [
    TableConfig("a", dim=8),
    TableConfig("b", dim=3, optimizer=Adam(lr=0.5, beta1=0.8), initializer=Uniform(-1, 1), seed=7,
                dtype="float16", admission=Admission(min_count=3, probability=0.5),
                eviction=Eviction(ttl_steps=10, ttl_seconds=2.5, max_rows=100, policy="lfu"),
                memory_budget=1 << 20, spill_dir="/tmp/x"),
    TableConfig("c", dim=1, optimizer=FTRL(alpha=0.1, l1=1.0), initializer=Zeros()),
    TableConfig("d", dim=2, optimizer=RowWiseAdagrad(), initializer=Normal(std=0.5)),
    TableConfig("e", dim=2, optimizer=Adagrad(initial_accumulator_value=0.1)),
    TableConfig("f", dim=2, optimizer=SGD(lr=3.0)),
])
def test_config_round_trips_through_json(config):
    data = json.loads(json.dumps(config_to_dict(config)))
    assert config_from_dict(data) == config


def test_config_from_dict_names_unknown_fields():
    data = config_to_dict(TableConfig("clicks", dim=4))
    with pytest.raises(InvalidArgument, match=r"'clicks'.*colour"):
        config_from_dict({**data, "colour": "red"})
    with pytest.raises(InvalidArgument, match="momentum"):
        config_from_dict({**data, "optimizer": {"kind": "sgd", "params": {"momentum": 0.9}}})
    with pytest.raises(InvalidArgument, match="rmsprop"):
        config_from_dict({**data, "optimizer": {"kind": "rmsprop", "params": {}}})
    with pytest.raises(InvalidArgument, match="admission"):
        config_from_dict({**data, "admission": {"min_cnt": 1}})


# --- chains against a reference ---------------------------------------------------------------------
ids_strategy = st.one_of(st.sampled_from([0, -1, 1, I64_MAX, I64_MIN]), st.integers(-20, 20),
                         st.integers(I64_MIN, I64_MAX))
step_strategy = st.tuples(
    st.lists(ids_strategy, max_size=15),   # upserts
    st.lists(ids_strategy, max_size=6),    # deletions (applied after the upserts)
    st.booleans(),                         # full snapshot instead of an incremental one
    st.booleans(),                         # report deleted ids that were re-inserted too
)


@given(st.lists(step_strategy, min_size=1, max_size=6))
@settings(max_examples=25, deadline=None)
def test_snapshot_chain_restores_exactly_the_reference(steps):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        ref: dict[int, tuple] = {}
        expected: list[tuple[Path, dict[int, tuple]]] = []
        changed: set[int] = set()
        deleted: set[int] = set()
        for version, (upserts, deletions, full, report_all) in enumerate(steps):
            batch = make_rows(np.array(upserts, np.int64), version)
            ref.update(as_dict(batch.take(np.unique(batch.ids, return_index=True)[1])) if len(batch) else {})
            # the last write of an id wins; recompute from the batch in order
            for k, i in enumerate(upserts):
                ref[i] = as_dict(batch.take(np.array([k])))[i]
            changed |= set(upserts)
            for i in deletions:
                ref.pop(i, None)
            deleted |= set(deletions)
            changed -= set(deletions)
            incremental = bool(expected) and not full
            if incremental:
                ids = np.array(sorted(changed & set(ref)), np.int64)
                rows = make_rows(ids, 0)
                for k, i in enumerate(ids.tolist()):  # current values of the changed rows
                    w, s, uc, ls, lt = ref[i]
                    rows.weights[k], rows.state[k] = w, s
                    rows.update_count[k], rows.last_step[k], rows.last_time[k] = uc, ls, lt
                gone = deleted if report_all else deleted - set(ref)
                path = write_snapshot(root, table="t", config=CONFIG, rows=[rows.take(slice(0, 3)),
                                      rows.take(slice(3, None))], deleted_ids=np.array(sorted(gone), np.int64),
                                      incremental=True, meta={"step": version}, state_width=SW)
            else:
                ids = np.array(sorted(ref), np.int64)
                rows = make_rows(ids, 0)
                for k, i in enumerate(ids.tolist()):
                    w, s, uc, ls, lt = ref[i]
                    rows.weights[k], rows.state[k] = w, s
                    rows.update_count[k], rows.last_step[k], rows.last_time[k] = uc, ls, lt
                path = write_snapshot(root, table="t", config=CONFIG, rows=rows, meta={"step": version},
                                      state_width=SW)
            changed, deleted = set(), set()
            expected.append((path, dict(ref)))
        assert list_snapshots(root) == [p for p, _ in expected]
        assert latest_snapshot(root) == expected[-1][0]
        for version, (path, state) in enumerate(expected):
            config, rows, meta = read_snapshot(path)
            assert config == CONFIG and meta == {"step": version}
            assert rows.weights.shape == (len(state), DIM) and rows.state.shape == (len(state), SW)
            assert as_dict(rows) == state
            streamed = list(iter_snapshot_rows(path, batch_size=2))
            assert all(len(b) <= 2 for b in streamed)
            assert (as_dict(RowBatch.concat(streamed)) if streamed else {}) == state
        assert as_dict(read_snapshot(root)[1]) == expected[-1][1]  # a root reads as its latest


def test_manifest_records_chain_and_checksums(root):
    p1 = write_snapshot(root, table="t", config=CONFIG, rows=make_rows([1, 2, 3], 1), meta={"step": 5})
    p2 = write_snapshot(root, table="t", config=CONFIG, rows=make_rows([2], 2), deleted_ids=np.array([3]),
                        incremental=True, meta={"step": 9})
    assert (p1.name, p2.name) == ("00000001-full", "00000002-incr")
    m1, m2 = read_manifest(p1), read_manifest(p2)
    assert (m1["kind"], m1["parent"], m1["rows"]) == ("full", None, 3)
    assert (m2["kind"], m2["parent"], m2["rows"], m2["deleted"]) == ("incremental", p1.name, 1, 1)
    assert set(m2["files"]) == {"rows/data.mdb", "deleted.npy"}
    assert all(len(f["sha256"]) == 64 for f in m2["files"].values())


def test_empty_and_invalid_snapshots(root):
    with pytest.raises(SnapshotNotFound):
        read_snapshot(root)
    with pytest.raises(SnapshotNotFound, match="previous snapshot"):
        write_snapshot(root, table="t", config=CONFIG, rows=[], incremental=True)
    p = write_snapshot(root, table="t", config=CONFIG, rows=[], state_width=3)
    _, rows, _ = read_snapshot(p)
    assert len(rows) == 0 and rows.weights.shape == (0, DIM) and rows.state.shape == (0, 3)
    with pytest.raises(InvalidArgument, match="'weights'"):
        write_snapshot(root, table="t", config=CONFIG, rows=make_rows([1], 0, dim=DIM + 1))
    with pytest.raises(InvalidArgument, match="deleted_ids"):
        write_snapshot(root, table="t", config=CONFIG, rows=[], deleted_ids=np.array([1]))
    with pytest.raises(InvalidArgument, match="'other'"):
        write_snapshot(root, table="other", config=CONFIG, rows=[], incremental=True)
    assert list_snapshots(root) == [p]
    assert [x.name for x in root.iterdir()] == [p.name]  # failed writes leave no temp dirs


# --- crash safety ------------------------------------------------------------------------------------
_ENDLESS_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from tigana.embeddings import RowBatch
    from tigana.embeddings.snapshot import write_snapshot
    root, incremental = sys.argv[1], sys.argv[2] == "incr"
    def batches():
        start = 0
        while True:  # never ends: the parent kills this process mid-write
            ids = np.arange(start, start + 20000, dtype=np.int64)
            yield RowBatch(ids, np.full((len(ids), 4), 99.0, np.float32), np.zeros((len(ids), 1), np.float32),
                           np.zeros(len(ids), np.int64), np.zeros(len(ids), np.int64), np.zeros(len(ids)))
            if start == 40000:
                print("writing", flush=True)
            start += 20000
    write_snapshot(root, table="t", config={"name": "t", "dim": 4}, rows=batches(), incremental=incremental)
""")


def _run_and_kill(script: str, *args: str, wait_line: str | None = None, delay: float = 0.0) -> None:
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        if wait_line is not None:
            line = proc.stdout.readline()
            assert line.strip() == wait_line, proc.stderr.read()
        time.sleep(delay)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("kind", ["full", "incr"])
def test_writer_killed_mid_snapshot_leaves_previous_snapshot_loadable(root, kind):
    base = make_rows(np.arange(-100, 100) * 1_000_003, 1)
    good = write_snapshot(root, table="t", config=CONFIG, rows=base, meta={"step": 1})
    _run_and_kill(_ENDLESS_WRITER, str(root), kind, wait_line="writing", delay=0.2)

    temps = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(temps) == 1 and (temps[0] / "rows" / "data.mdb").stat().st_size > 1 << 20
    assert list_snapshots(root) == [good] and latest_snapshot(root) == good
    config, rows, meta = read_snapshot(root)
    assert config == CONFIG and meta == {"step": 1} and as_dict(rows) == as_dict(base)

    # The next writer removes the dead writer's leftovers and continues the chain.
    nxt = write_snapshot(root, table="t", config=CONFIG, rows=make_rows([5], 2), incremental=True)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert read_manifest(nxt)["parent"] == good.name
    assert len(read_snapshot(nxt)[1]) == len(base) + 1


_LOOP_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from tigana.embeddings import RowBatch
    from tigana.embeddings.snapshot import write_snapshot
    root = sys.argv[1]
    version = 1
    print("start", flush=True)
    while True:  # full snapshots whose every weight is the snapshot's sequence number
        ids = np.arange(30000, dtype=np.int64) * 7919 - 10**12
        n = len(ids)
        w = np.full((n, 4), float(version), np.float32)
        write_snapshot(root, table="t", config={"name": "t", "dim": 4},
                       rows=[RowBatch(ids[i:i + 5000], w[i:i + 5000], np.zeros((5000, 1), np.float32),
                                      np.zeros(5000, np.int64), np.zeros(5000, np.int64), np.zeros(5000))
                             for i in range(0, n, 5000)],
                       meta={"version": version})
        version += 1
""")


@pytest.mark.parametrize("delay", [0.15, 0.6, 1.3])
def test_writer_killed_at_a_random_moment_never_leaves_a_bad_latest(root, delay):
    _run_and_kill(_LOOP_WRITER, str(root), wait_line="start", delay=delay)
    latest = latest_snapshot(root)
    if latest is None:
        assert not list_snapshots(root)
        with pytest.raises(SnapshotNotFound):
            read_snapshot(root)
        return
    _, rows, meta = read_snapshot(latest)
    assert int(latest.name[:8]) == meta["version"]
    assert len(rows) == 30000 and np.all(rows.weights == meta["version"])
    for snap in list_snapshots(root):  # every listed snapshot is complete
        assert read_manifest(snap)["rows"] == 30000


# --- corruption --------------------------------------------------------------------------------------
@pytest.fixture
def chain(root):
    p1 = write_snapshot(root, table="t", config=CONFIG, rows=make_rows(np.arange(3000), 1))
    p2 = write_snapshot(root, table="t", config=CONFIG, rows=make_rows(np.arange(10), 2),
                        deleted_ids=np.array([20, 21]), incremental=True)
    return p1, p2


@pytest.mark.parametrize("damage", ["flip", "truncate", "append", "remove"])
def test_damaged_snapshot_file_raises_corrupt_store_naming_it(chain, damage):
    p1, p2 = chain
    file = p1 / "rows" / "data.mdb"
    data = bytearray(file.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        file.write_bytes(bytes(data))
    elif damage == "truncate":
        file.write_bytes(bytes(data[: len(data) - 4096]))
    elif damage == "append":
        file.write_bytes(bytes(data) + b"\0")
    else:
        file.unlink()
    for target in (p1, p2):  # the increment depends on the damaged full snapshot
        with pytest.raises(CorruptStore, match=str(file)):
            read_snapshot(target)


def test_damaged_deletions_or_manifest_raise_corrupt_store(chain):
    p1, p2 = chain
    deleted = p2 / "deleted.npy"
    deleted.write_bytes(deleted.read_bytes()[:-8])
    with pytest.raises(CorruptStore, match=str(deleted)):
        read_snapshot(p2)
    manifest = p1 / "manifest.json"
    data = json.loads(manifest.read_text())
    data["rows"] += 1
    manifest.write_text(json.dumps(data))
    with pytest.raises(CorruptStore, match=str(manifest)):
        read_snapshot(p1)
    manifest.write_text("{not json")
    with pytest.raises(CorruptStore, match=str(manifest)):
        read_snapshot(p1)


def test_missing_parent_raises_snapshot_not_found(chain):
    p1, p2 = chain
    shutil.rmtree(p1)
    with pytest.raises(SnapshotNotFound, match=p1.name):
        read_snapshot(p2)
    assert latest_snapshot(p1.parent) == p2


def test_bad_record_behind_valid_file_checksums_is_caught_by_its_crc(chain):
    """A record damaged before the file was hashed (say, in memory) still fails its own CRC-32."""
    p1, _ = chain
    file = p1 / "rows" / "data.mdb"
    rows = make_rows(np.arange(3000), 1)
    data = bytearray(file.read_bytes())
    # record layout: update_count i8 | last_step i8 | last_time f8 | weights | state | crc
    needle = (rows.last_step[1234].astype("<i8").tobytes() + rows.last_time[1234].astype("<f8").tobytes()
              + rows.weights[1234].tobytes() + rows.state[1234].tobytes())
    pos = data.find(needle)
    assert pos >= 0
    while pos >= 0:  # every copy (stale copy-on-write pages may hold one too)
        data[pos + 18] ^= 0x10
        pos = data.find(needle, pos + 1)
    file.write_bytes(bytes(data))
    # re-seal the manifest as a buggy writer would have
    from tigana.embeddings import snapshot as snap_mod
    manifest = json.loads((p1 / "manifest.json").read_text())
    manifest["files"]["rows/data.mdb"]["sha256"] = snap_mod._file_digest(file)
    manifest["manifest_sha256"] = snap_mod._manifest_digest(manifest)
    (p1 / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptStore, match=rf"{file}.*id 1234"):
        read_snapshot(p1)


def test_cleanup_temp_keeps_live_writers(root):
    live = root / ".tmp-00000001-full-1-abcd"  # pid 1 is alive
    dead = root / ".tmp-00000001-full-999999999-abcd"
    live.mkdir()
    dead.mkdir()
    assert cleanup_temp(root) == 1
    assert live.exists() and not dead.exists()
    assert list_snapshots(root) == []


def test_snapshot_rows_use_row_store_format(chain):
    p1, _ = chain
    with RowStore(p1 / "rows", table="t", dim=DIM, state_width=SW, readonly=True, lock=False) as store:
        assert len(store) == 3000
