"""Serving a trained model's predictions on real processes, started as a user starts them: a cluster, ``tigana
admin export --follow --model DIR`` before training, ``tigana train --publish-dir DIR``, then ``tigana serve
--model DIR``. Its answers are held to the trainer's own path: the data reader's hashing (``chunk_to_batch``)
and a ``PSEmbeddingBags`` pulling the same rows from the shard servers, with the published dense weights.
Every process a test starts, it stops by its handle."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tigana import ps
from tigana.ps.ops.local import stop_process
from tigana.ps.serving import ServingClient, modeldir
from tigana.tools.bench.serving_sync import spawn_serve, wait_serving
from tigana.trainer.data.synthetic import CRITEO_KAGGLE_CARDINALITIES, SyntheticCriteo

pytestmark = pytest.mark.timeout(240)

VOCAB = 20_000
ROWS = 20_000  # 40 steps of 512: versions published at steps 20 and 40


def _raw(chunk) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's rows as a serving client sends them: integer fields with NaN where missing, categorical values
    raw (MISSING_RAW where missing)."""
    dense = chunk.ints.astype(np.float32)
    dense[chunk.int_missing] = np.nan
    return dense, chunk.raw


def _admin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tigana.tools.cli", "admin", *args], capture_output=True, text=True,
                          timeout=60)


class _Load:
    """A client predicting ``dense, categorical`` back to back on its own thread until ``stop()``, which
    returns every (version, probabilities) answered, in order, and raises the first error if a request failed."""

    def __init__(self, address: str, dense: np.ndarray, categorical: np.ndarray) -> None:
        self.answers: list[tuple[int, np.ndarray]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, dense, categorical), daemon=True)
        self._thread.start()

    def _run(self, address: str, dense: np.ndarray, categorical: np.ndarray) -> None:
        try:
            with ServingClient(address) as serving:
                while not self._stop.is_set():
                    got, version = serving.predict(dense, categorical)
                    self.answers.append((version, got))
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> list[tuple[int, np.ndarray]]:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.error is not None:
            raise self.error
        return self.answers


def _wait_info(serving: ServingClient, ready, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not ready(info := serving.info()):
        assert time.monotonic() < deadline, (what, info)
        time.sleep(0.02)
    return info


def test_a_published_model_is_served_gated_and_rolled_back_as_the_trainer_scores(
        publish_cluster: ps.LocalCluster, train_published, tmp_path: Path) -> None:
    root = tmp_path / "published"
    procs: list[subprocess.Popen] = []
    try:
        # the follower has cut every table after the last acknowledged push (its rounds since changed nothing,
        # so the newest version is the model as trained)
        published = train_published(root, "--synthetic-rows", str(ROWS), "--synthetic-vocab", str(VOCAB),
                                    "--publish-every", "20")
        spec = published.spec
        assert spec["tables"] == ["deepfm_synthetic_fused"] and spec["num_sparse"] == 26
        dense_log = modeldir.read_dense_manifest(root)
        assert [v["version"] for v in dense_log["versions"]] == [20, 40]  # every 20 steps; the end is step 40
        newest = modeldir.read_versions(root)["versions"][-1]
        assert newest["step"] == 40 and list(newest["tables"]) == spec["tables"]

        gen = SyntheticCriteo(vocab_sizes=tuple(min(v, VOCAB) for v in CRITEO_KAGGLE_CARDINALITIES), seed=0)
        canary = tmp_path / "canary.tsv"
        gen.write_tsv(canary, 2000, start=ROWS)  # held-out rows, labelled, in the training data's format
        serve, address = spawn_serve(root, tmp_path / "serve.log", model=True,
                                     extra=["--max-rows", "1000", "--canary", str(canary), "--max-auc-drop", "1"])
        procs.append(serve)
        wait_serving(address, timeout=60)
        chunk = gen.chunk(0, 512)  # training rows: every id is in the table
        assert chunk.int_missing.any() and chunk.cat_missing.any()
        with ServingClient(address) as serving, ps.connect(publish_cluster.target) as client:
            info = _wait_info(serving, lambda i: i.version >= newest["version"], "the newest version")
            assert (info.model, info.step, list(info.tables)) == ("deepfm", 40, spec["tables"])
            assert (info.num_dense, info.num_sparse, info.pinned, info.versions_refused) == (13, 26, False, 0)
            assert 0.55 < info.canary_auc <= 1.0
            live = info.version
            probabilities, version = serving.predict(*_raw(chunk))
            assert version == live
            want = published.trainer_scores(client, modeldir.read_dense(root, dense_log["versions"][-1]), chunk)
            np.testing.assert_allclose(probabilities, want, rtol=0, atol=2e-6)
            assert 0.05 < float(probabilities.mean()) < 0.95

            # bad input: an error naming the field, nothing else changes
            dense, raw = _raw(gen.chunk(0, 4))
            with pytest.raises(ps.InvalidArgument, match="field 'dense'"):
                serving.predict(dense[:, :12], raw)
            with pytest.raises(ps.InvalidArgument, match="field 'categorical'"):
                serving.predict(dense, raw[:, :25])
            with pytest.raises(ps.InvalidArgument, match="field 'rows'"):
                serving.predict(*_raw(gen.chunk(0, 1001)))
            ids = np.arange(5, dtype=np.int64)
            with pytest.raises(ps.InvalidArgument, match="field 'table'"):
                serving.lookup(ids, table="nope")
            assert serving.lookup(ids, table=spec["tables"][0])[0].shape == (5, 16)

            # a diverged trainer publishes NaN weights: the follower makes a version of them, the gate refuses
            # it, and no prediction ever comes from it
            state = torch.load(io.BytesIO(modeldir.read_dense(root, dense_log["versions"][-1])), weights_only=True)
            first = next(k for k, v in state["model"].items() if v.is_floating_point())
            state["model"][first] = state["model"][first] * float("nan")
            buf = io.BytesIO()
            torch.save(state, buf)
            modeldir.publish_dense(root, 41, buf.getvalue())
            deadline = time.monotonic() + 30
            while serving.info().versions_refused < 1:
                got, version = serving.predict(*_raw(chunk))
                assert version == live and np.array_equal(got, probabilities)
                assert time.monotonic() < deadline
            assert serving.info().version == live and modeldir.read_versions(root)["versions"][-1]["step"] == 41

            # a newer version goes live: the step-20 dense weights published again as step 42 (the follower has
            # made a version of every dense version it saw, but a fast trainer may publish steps 20 and 40 within
            # one of its rounds; this one comes after both, whatever the timing)
            modeldir.publish_dense(root, 42, modeldir.read_dense(root, dense_log["versions"][0]))
            info = _wait_info(serving, lambda i: i.step == 42, "the step-42 version")
            newer = info.version
            assert newer > live and not info.pinned
            newest_probabilities, version = serving.predict(*_raw(chunk))
            assert version == newer and not np.allclose(newest_probabilities, probabilities, atol=1e-4)

            # rollback to the version before it (step 40) and back, under load: a client predicting all along gets
            # an answer to every request, each from the live version or the one rolled back to, in that order
            load = _Load(address, *_raw(chunk))
            rolled = _admin("publish", "rollback", "--model", str(root), "--to", str(live))
            assert rolled.returncode == 0, rolled.stderr
            info = _wait_info(serving, lambda i: i.version == live, "the rollback")
            assert info.pinned and info.step == 40
            older, version = serving.predict(*_raw(chunk))
            assert version == live and np.array_equal(older, probabilities)
            resumed = _admin("publish", "resume", "--model", str(root))
            assert resumed.returncode == 0, resumed.stderr
            info = _wait_info(serving, lambda i: i.version == newer and not i.pinned, "the resume")
            again, version = serving.predict(*_raw(chunk))
            assert version == newer and np.array_equal(again, newest_probabilities)
            deadline = time.monotonic() + 30
            while not (load.answers and load.answers[-1][0] == newer) and load.error is None:
                assert time.monotonic() < deadline, "the loaded client saw no answer since the resume"
                time.sleep(0.01)
            answered = load.stop()
            assert {v for v, _ in answered} <= {newer, live}
            switches = [i for i in range(1, len(answered)) if answered[i][0] != answered[i - 1][0]]
            assert [answered[i][0] for i in [0, *switches]] == [newer, live, newer]  # one swap each way
            for v, got in answered:  # and each answer is that version's own
                assert np.array_equal(got, newest_probabilities if v == newer else probabilities)
        assert serve.poll() is None
    finally:
        for proc in procs:
            stop_process(proc)
