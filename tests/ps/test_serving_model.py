"""The published model's folder (``modeldir``) and ``ModelFollower``'s versions, in process: when a model
becomes servable, which changes swap a new state in, that a table's delta reuses the loaded dense network and a
new dense version replaces it, and that a damaged version changes nothing. The scorer here is a small linear
one (the ``Loader`` interface); ``tests/trainer/test_predict.py`` serves a trained model through the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tigana.ps.errors import DataLoss, InvalidArgument
from tigana.ps.serving import ServeConfig, modeldir
from tigana.ps.serving.model import ModelFollower


def _write_entry(log: Path, kind: str, seq: int, ids: np.ndarray, rows: np.ndarray, t: float) -> dict:
    """One export log entry and the manifest naming it (the layout ``exportlog`` documents)."""
    name = f"{kind}-{seq:08d}"
    folder = log / name
    folder.mkdir(parents=True)
    np.save(folder / "ids.npy", ids.astype(np.int64))
    np.save(folder / "rows.npy", rows.astype(np.float32))
    files = {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in ("ids.npy", "rows.npy")}
    (folder / "export.json").write_text(json.dumps({"dim": rows.shape[1], "files": files}))
    entry = {"path": name, "seq": seq, "time": t, "since": 0.0, "rows": int(ids.size), "seconds": 0.0}
    m = json.loads((log / "manifest.json").read_text()) if (log / "manifest.json").exists() else None
    if kind == "full":
        m = {"format": "tigana-export-log", "version": 1, "log_id": "test", "table": log.name,
             "dim": rows.shape[1], "base": entry, "deltas": []}
    else:
        m["deltas"].append(entry)
    m.update(seq=seq, time=t)
    (log / "manifest.json").write_text(json.dumps(m))
    return entry


class LinearScorer:
    """p = sigmoid(w . dense + sum of the first element of each categorical value's row): enough to see which
    rows and which weights a prediction used."""

    loads = 0

    def __init__(self, spec: dict, dense_file: bytes) -> None:
        LinearScorer.loads += 1
        self.num_dense, self.num_sparse = spec["num_dense"], spec["num_sparse"]
        self.table = spec["tables"][0]
        self.w = np.frombuffer(dense_file, np.float32)

    def predict(self, dense: np.ndarray, categorical: np.ndarray, lookup) -> np.ndarray:
        rows = lookup(self.table, categorical.reshape(-1).view(np.int64)).reshape(len(dense), self.num_sparse, -1)
        z = dense @ self.w + rows[:, :, 0].sum(axis=1)
        return (1 / (1 + np.exp(-z))).astype(np.float32)


SPEC = {"model": "linear", "tables": ["emb"], "num_dense": 2, "num_sparse": 1}


def test_a_model_is_served_once_every_part_is_published_and_swaps_whole_versions(tmp_path: Path) -> None:
    root = tmp_path / "model"
    LinearScorer.loads = 0
    follower = ModelFollower(root, "zeros", LinearScorer)
    assert not follower.poll() and follower.state is None  # nothing yet
    modeldir.write_spec(root, SPEC)
    log = modeldir.table_log(root, "emb")
    _write_entry(log, "full", 1, np.array([1, 2]), np.array([[1.0, 0], [2.0, 0]]), 10.0)
    assert not follower.poll() and follower.state is None  # no dense version yet
    modeldir.publish_dense(root, 20, np.array([0.5, 0.0], np.float32).tobytes())
    assert follower.poll()
    first = follower.state
    assert (first.version, first.model, sorted(first.tables)) == (20, "linear", ["emb"])
    dense = np.array([[2.0, 7.0], [0.0, 0.0]], np.float32)
    cats = np.array([[1], [3]], np.uint64)  # id 3 is unknown: the default row (zeros)
    np.testing.assert_allclose(first.predict(dense, cats), 1 / (1 + np.exp(-np.array([2.0, 0.0]))), rtol=1e-6)
    assert not follower.poll()  # nothing new: the same state object stays

    # a table delta: a new state, the dense network reused (not loaded again)
    _write_entry(log, "delta", 2, np.array([3]), np.array([[4.0, 0]]), 11.0)
    assert follower.poll()
    second = follower.state
    assert second is not first and second.scorer is first.scorer and LinearScorer.loads == 1
    assert second.version == 20 and first.predict(dense, cats)[1] == pytest.approx(0.5)  # the old one unchanged
    assert second.predict(dense, cats)[1] == pytest.approx(1 / (1 + np.exp(-4.0)))

    # a new dense version: loaded once, the tables as they were
    modeldir.publish_dense(root, 40, np.array([0.0, 1.0], np.float32).tobytes())
    assert follower.poll()
    third = follower.state
    assert third.version == 40 and LinearScorer.loads == 2 and third.tables == second.tables
    assert third.predict(dense, cats)[0] == pytest.approx(1 / (1 + np.exp(-(7.0 + 1.0))))

    # a damaged version is refused and the served one stays
    entry = modeldir.publish_dense(root, 60, np.array([9.0, 9.0], np.float32).tobytes())
    (root / modeldir.DENSE_DIR / entry["path"]).write_bytes(np.array([1.0, 1.0], np.float32).tobytes())
    with pytest.raises(DataLoss, match="sha256"):
        follower.poll()
    assert follower.state is third


def test_publish_dense_keeps_the_newest_versions_and_refuses_going_back(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        modeldir.publish_dense(tmp_path, step, bytes([step]), keep=2)
    m = modeldir.read_dense_manifest(tmp_path)
    assert [v["version"] for v in m["versions"]] == [20, 30]
    assert sorted(p.name for p in (tmp_path / modeldir.DENSE_DIR).glob("dense-*.pt")) == \
        ["dense-000000020.pt", "dense-000000030.pt"]  # the dropped version's file is gone
    assert modeldir.read_dense(tmp_path, modeldir.newest_dense(tmp_path)) == bytes([30])
    modeldir.publish_dense(tmp_path, 30, bytes([31]), keep=2)  # a resumed job publishes the same step again
    assert modeldir.read_dense(tmp_path, modeldir.newest_dense(tmp_path)) == bytes([31])
    with pytest.raises(InvalidArgument, match="below the newest"):
        modeldir.publish_dense(tmp_path, 25, b"x")
    with pytest.raises(InvalidArgument, match="missing"):
        modeldir.write_spec(tmp_path, {"model": "m"})
    (tmp_path / modeldir.MODEL_FILE).write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(DataLoss, match="format"):
        modeldir.read_spec(tmp_path)


def test_serve_takes_exactly_one_source() -> None:
    with pytest.raises(InvalidArgument, match="exactly one"):
        ServeConfig()
    with pytest.raises(InvalidArgument, match="exactly one"):
        ServeConfig(source="a", model="b")
    with pytest.raises(InvalidArgument, match="max-rows"):
        ServeConfig(model="b", max_rows=0)
    assert ServeConfig(model="b").max_rows == 65_536
