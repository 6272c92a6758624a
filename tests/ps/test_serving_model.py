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

from tigana.embeddings import EmbeddingTable, Normal, TableConfig
from tigana.ps.errors import DataLoss, InvalidArgument
from tigana.ps.serving import ServeConfig, modeldir
from tigana.ps.serving.exportlog import read_manifest
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
    rows and which weights a prediction used. Its canary is an .npz of (dense, categorical, labels)."""

    loads = 0

    def __init__(self, spec: dict, dense_file: bytes) -> None:
        LinearScorer.loads += 1
        self.num_dense, self.num_sparse = spec["num_dense"], spec["num_sparse"]
        self.table = spec["tables"][0]
        self.w = np.frombuffer(dense_file, np.float32)
        self.finite = bool(np.isfinite(self.w).all())

    def predict(self, dense: np.ndarray, categorical: np.ndarray, lookup) -> np.ndarray:
        rows = lookup(self.table, categorical.reshape(-1).view(np.int64)).reshape(len(dense), self.num_sparse, -1)
        with np.errstate(invalid="ignore", over="ignore"):  # the gate's tests score weights of inf
            z = dense @ self.w + rows[:, :, 0].sum(axis=1)
            return (1 / (1 + np.exp(-z))).astype(np.float32)

    def canary_auc(self, path: str, lookup) -> float:
        c = np.load(path)
        p, y = self.predict(c["dense"], c["categorical"], lookup), c["labels"]
        pos, neg = p[y == 1], p[y == 0]  # the probability a positive outranks a negative (ties count half)
        return float(((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean())


SPEC = {"model": "linear", "tables": ["emb"], "num_dense": 2, "num_sparse": 1}
DENSE = np.array([[2.0, 7.0], [0.0, 0.0]], np.float32)
CATS = np.array([[1], [3]], np.uint64)  # id 3 is unknown until a delta writes it: the default row (zeros)


def _version(root: Path) -> dict | None:
    """What the follower (``export --follow --model``) does after a round: a version of the logs as they are."""
    return modeldir.publish_version(root, {"emb": read_manifest(modeldir.table_log(root, "emb"))})


def _expected(w: list[float], row3: float) -> np.ndarray:
    return 1 / (1 + np.exp(-(DENSE @ np.array(w) + np.array([1.0, row3]))))


def test_versions_go_live_whole_and_a_delta_reuses_the_loaded_dense_network(tmp_path: Path) -> None:
    root = tmp_path / "model"
    LinearScorer.loads = 0
    follower = ModelFollower(root, "zeros", LinearScorer)
    assert not follower.poll() and follower.state is None  # nothing yet
    modeldir.write_spec(root, SPEC)
    log = modeldir.table_log(root, "emb")
    _write_entry(log, "full", 1, np.array([1, 2]), np.array([[1.0, 0], [2.0, 0]]), 10.0)
    modeldir.publish_dense(root, 20, np.array([0.5, 0.0], np.float32).tobytes())
    assert not follower.poll() and follower.state is None  # nothing in the publish log yet
    assert _version(root)["version"] == 1 and _version(root) is None  # nothing changed: no second version
    assert follower.poll()
    first = follower.state
    assert (first.version, first.step, first.model, sorted(first.tables)) == (1, 20, "linear", ["emb"])
    np.testing.assert_allclose(first.predict(DENSE, CATS), _expected([0.5, 0], 0.0), rtol=1e-6)
    assert not follower.poll()

    # entries written after the newest version wait for the version that names them
    _write_entry(log, "delta", 2, np.array([3]), np.array([[4.0, 0]]), 11.0)
    assert not follower.poll() and follower.state is first
    assert _version(root)["version"] == 2 and follower.poll()
    second = follower.state
    assert second.scorer is first.scorer and LinearScorer.loads == 1  # same dense version: not loaded again
    np.testing.assert_allclose(first.predict(DENSE, CATS), _expected([0.5, 0], 0.0), rtol=1e-6)  # unchanged
    np.testing.assert_allclose(second.predict(DENSE, CATS), _expected([0.5, 0], 4.0), rtol=1e-6)

    modeldir.publish_dense(root, 40, np.array([0.0, 1.0], np.float32).tobytes())
    assert _version(root)["version"] == 3 and follower.poll()
    third = follower.state
    assert (third.version, third.step, LinearScorer.loads) == (3, 40, 2) and third.tables == second.tables

    # a damaged dense file: the version is not served, the served one stays
    entry = modeldir.publish_dense(root, 60, np.array([9.0, 9.0], np.float32).tobytes())
    (root / modeldir.DENSE_DIR / entry["path"]).write_bytes(np.array([1.0, 1.0], np.float32).tobytes())
    _version(root)
    with pytest.raises(DataLoss, match="sha256"):
        follower.poll()
    assert follower.state is third


def test_the_gate_refuses_non_finite_and_worse_versions_and_rollback_pins_one(tmp_path: Path) -> None:
    root = tmp_path / "model"
    canary = tmp_path / "canary.npz"
    # the canary's positives have high dense values: a model weighting them up ranks it well
    np.savez(canary, dense=np.array([[3, 0], [2, 0], [-1, 0], [-2, 0]], np.float32),
             categorical=np.array([[1], [1], [1], [1]], np.uint64), labels=np.array([1, 1, 0, 0]))
    follower = ModelFollower(root, "zeros", LinearScorer, canary=str(canary), max_auc_drop=0.1, keep=2)
    modeldir.write_spec(root, SPEC)
    log = modeldir.table_log(root, "emb")
    _write_entry(log, "full", 1, np.array([1, 2]), np.array([[1.0, 0], [2.0, 0]]), 10.0)
    modeldir.publish_dense(root, 10, np.array([1.0, 0.0], np.float32).tobytes())
    _version(root)
    assert follower.poll() and follower.state.version == 1 and follower.state.canary_auc == 1.0

    _write_entry(log, "delta", 2, np.array([2]), np.array([[np.nan, 0]]), 11.0)  # a NaN row
    assert _version(root)["version"] == 2
    assert not follower.poll() and follower.state.version == 1 and "NaN" in follower.refused[2]
    _write_entry(log, "delta", 3, np.array([5]), np.array([[1.0, 0]]), 12.0)  # still holds the NaN row
    _version(root)
    assert not follower.poll() and follower.state.version == 1 and 3 in follower.refused
    _write_entry(log, "delta", 4, np.array([2]), np.array([[2.0, 0]]), 13.0)  # the row written finite again
    _version(root)
    assert follower.poll() and follower.state.version == 4

    modeldir.publish_dense(root, 20, np.array([np.inf, 0.0], np.float32).tobytes())  # diverged weights
    _version(root)
    assert not follower.poll() and follower.state.version == 4 and "dense weights" in follower.refused[5]
    modeldir.publish_dense(root, 30, np.array([-1.0, 0.0], np.float32).tobytes())  # ranks the canary backwards
    _version(root)
    assert not follower.poll() and follower.state.version == 4 and "canary AUC 0.0000" in follower.refused[6]
    modeldir.publish_dense(root, 40, np.array([2.0, 0.0], np.float32).tobytes())
    _version(root)
    assert follower.poll() and follower.state.version == 7
    seven = follower.state

    # rollback: one version back from the newest pins 6; the newest this server accepted at or before it is 4
    # (held: the same state object, a swap); then to an older one no longer held (rebuilt from the logs); resume
    assert modeldir.rollback(root) == 6
    held = follower._held[4]
    assert follower.poll() and follower.state is held and follower.pinned
    assert not follower.poll()
    assert modeldir.rollback(root, to=1) == 1
    assert follower.poll() and follower.state.version == 1 and follower.pinned
    np.testing.assert_allclose(follower.state.predict(DENSE, CATS), _expected([1, 0], 0.0), rtol=1e-6)
    with pytest.raises(InvalidArgument, match="not a kept version"):
        modeldir.rollback(root, to=99)
    first_dense = modeldir.read_versions(root)["versions"][0]["dense"]["path"]
    moved = root / modeldir.DENSE_DIR / first_dense
    moved.rename(moved.with_suffix(".away"))  # as --publish-keep drops an old dense version
    with pytest.raises(InvalidArgument, match="no longer kept"):
        modeldir.rollback(root, to=1)
    moved.with_suffix(".away").rename(moved)
    modeldir.resume(root)
    assert follower.poll() and follower.state.version == 7 and not follower.pinned
    assert follower.state is not seven  # keep=2: no longer held, rebuilt from the logs, the same model
    np.testing.assert_array_equal(follower.state.predict(DENSE, CATS), seven.predict(DENSE, CATS))

    # two versions between polls: the older is built on the way (held, not scored) and, gone live by a
    # rollback, gets its canary AUC, which the next version's gate compares with
    modeldir.publish_dense(root, 50, np.array([1.5, 0.0], np.float32).tobytes())
    _version(root)
    modeldir.publish_dense(root, 60, np.array([3.0, 0.0], np.float32).tobytes())
    _version(root)
    assert follower.poll() and follower.state.version == 9 and 8 in follower._held
    assert follower._held[8].canary_auc != follower._held[8].canary_auc  # NaN: not scored on the way
    modeldir.rollback(root, to=8)
    assert follower.poll() and follower.state.version == 8 and follower.state.canary_auc == 1.0
    modeldir.publish_dense(root, 70, np.array([-3.0, 0.0], np.float32).tobytes())
    _version(root)
    modeldir.resume(root)
    assert follower.poll() and follower.state.version == 9  # 10 ranks the canary backwards: refused, 9 next
    assert "canary AUC" in follower.refused[10] and not follower.poll()


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
    with pytest.raises(InvalidArgument, match="canary"):
        ServeConfig(model="b", canary="/nonexistent/canary.tsv")
    with pytest.raises(InvalidArgument, match="needs --model"):
        ServeConfig(source="a", canary=__file__)


def test_unknown_ids_read_as_the_models_unseen_policy_unless_serve_says_otherwise(tmp_path: Path) -> None:
    """With no ``--unseen``, an id the tables lack reads as ``model.json``'s ``unseen`` (the trainer's evaluation
    setting); ``initial`` gives the row a shard server's read-only pull gives it (the table's initializer and
    seed, named in ``model.json``)."""
    root = tmp_path / "model"
    spec = {**SPEC, "dim": 2, "unseen": "initial",
            "initializers": {"emb": {"kind": "normal", "mean": 0.0, "std": 0.5, "seed": 7}}}
    modeldir.write_spec(root, spec)
    _write_entry(modeldir.table_log(root, "emb"), "full", 1, np.array([1, 2]), np.array([[1.0, 0], [2.0, 0]]), 10.0)
    modeldir.publish_dense(root, 20, np.array([0.5, 0.0], np.float32).tobytes())
    _version(root)
    query = np.array([1, 5, 2, 6], np.int64)
    shard = EmbeddingTable(TableConfig("emb", dim=2, initializer=Normal(std=0.5), seed=7))
    want = shard.pull(query, insert=False)  # the shard server's read-only pull: unknown ids at their initial rows
    follower = ModelFollower(root, None, LinearScorer)
    assert follower.poll()
    np.testing.assert_array_equal(follower.state.lookup("emb", query)[[0, 2]], [[1.0, 0], [2.0, 0]])
    np.testing.assert_allclose(follower.state.lookup("emb", query)[[1, 3]], want[[1, 3]], rtol=0, atol=1e-7)
    np.testing.assert_allclose(follower.state.predict(DENSE, np.array([[1], [6]], np.uint64)),
                               _expected([0.5, 0], float(want[3, 0])), rtol=1e-6)
    constant = ModelFollower(root, "0.25", LinearScorer)  # --unseen 0.25
    assert constant.poll()
    assert (constant.state.lookup("emb", query)[[1, 3]] == 0.25).all()
    bare = ModelFollower(root, "initial", LinearScorer)  # a model.json that names no initializer: refused
    modeldir_spec = root / modeldir.MODEL_FILE
    modeldir_spec.write_text(modeldir_spec.read_text().replace('"initializers"', '"other"'))
    with pytest.raises(InvalidArgument, match="initial.*initializer"):
        bare.poll()
    assert bare.state is None


def test_serve_refuses_an_unseen_policy_the_trainer_cannot_share() -> None:
    with pytest.raises(InvalidArgument, match="--unseen must be 'zeros', 'initial' or a finite number"):
        ServeConfig(model="b", unseen="median")
    with pytest.raises(InvalidArgument, match="mean is for --from"):
        ServeConfig(model="b", unseen="mean")
    with pytest.raises(InvalidArgument, match="initial needs --model"):
        ServeConfig(source="a", unseen="initial")
    assert ServeConfig(source="a", unseen="mean").unseen == "mean" and ServeConfig(model="b").unseen == ""
