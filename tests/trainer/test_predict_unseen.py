"""Served scores equal the trainer's evaluation on held-out rows whose ids were never trained (``unseen``).

Real processes, started as a user starts them: a cluster, ``tigana admin export --follow --model DIR``,
``tigana train --publish-dir DIR`` (seeded synthetic Criteo-format rows; its held-out fifth draws many ids the
training rows never did), then ``tigana serve --model DIR``. The served probabilities of the held-out rows
give the AUC and logloss ``tigana train`` printed from ``tigana.trainer.evaluate``, and equal row by row the
trainer's scoring path (a ``PSEmbeddingBags`` reading the shard servers read-only, the published dense
weights), for the policy the model was trained with (zeros) and for ``--unseen initial``. Every process a test
starts, it stops by its handle."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from tigana import ps
from tigana.ps.ops.local import stop_process
from tigana.ps.serving import ServingClient, modeldir
from tigana.tools.bench.serving_sync import spawn_serve, wait_serving
from tigana.trainer.data.criteo import criteo_salts
from tigana.trainer.data.hashing import hash_values
from tigana.trainer.data.synthetic import CRITEO_KAGGLE_CARDINALITIES, SyntheticCriteo

pytestmark = pytest.mark.timeout(240)

VOCAB = 3_000
ROWS = 4096  # 8 steps of 512; the held-out rows are the next 819 the generator draws


def _raw(chunk) -> tuple[np.ndarray, np.ndarray]:
    dense = chunk.ints.astype(np.float32)
    dense[chunk.int_missing] = np.nan
    return dense, chunk.raw


def _rows_with_unseen(serving: ServingClient, client: ps.Client, published, chunk) -> np.ndarray:
    """(n,) bool: the rows of ``chunk`` with at least one categorical id the served tables do not hold."""
    collection = published.collection(client)
    ids = hash_values(chunk.raw, criteo_salts(0))  # (n, 26) as the reader hashes them
    unseen = np.zeros(chunk.raw.shape, bool)
    for f, feature in enumerate(collection.features):
        table, ps_ids = collection.ps_ids(feature.table_name, ids[:, f])
        unseen[:, f] = ~serving.lookup(ps_ids, table=table)[1]
    return unseen.any(axis=1)


def test_served_scores_equal_the_trainers_evaluation_with_unseen_ids(
        publish_cluster: ps.LocalCluster, train_published, tmp_path: Path) -> None:
    root = tmp_path / "published"
    procs: list[subprocess.Popen] = []
    try:
        # rows that start at std 0.3 (not 0.01) make the row an unseen id reads weigh on the scores, as a trained
        # model's larger weights did on real data (probabilities moved by up to 0.25 there): reading them as the
        # initial rows moves this AUC by 9e-4 and the logloss by 0.19 (at 0.01: 3e-4 and 3e-4, near the bound)
        published = train_published(root, "--synthetic-rows", str(ROWS), "--synthetic-vocab", str(VOCAB),
                                    "--publish-every", "4", "--init-std", "0.3")
        spec = published.spec
        evaluation = json.loads(published.train.stdout.strip().splitlines()[-1])  # tigana.trainer.evaluate's
        newest = modeldir.read_versions(root)["versions"][-1]
        dense_file = modeldir.read_dense(root, modeldir.read_dense_manifest(root)["versions"][-1])

        gen = SyntheticCriteo(vocab_sizes=tuple(min(v, VOCAB) for v in CRITEO_KAGGLE_CARDINALITIES), seed=0)
        held = gen.chunk(ROWS, ROWS + ROWS // 5)  # the trainer's held-out rows
        assert evaluation["eval_rows"] == held.labels.shape[0]
        serve, address = spawn_serve(root, tmp_path / "serve.log", model=True)  # the model's policy
        procs.append(serve)
        wait_serving(address, timeout=60)
        with ServingClient(address) as serving, ps.connect(publish_cluster.target) as client:
            deadline = time.monotonic() + 30
            while serving.info().version < newest["version"]:
                assert time.monotonic() < deadline, "the newest version never went live"
                time.sleep(0.02)
            assert serving.info().default_row == "zeros"  # the model's policy, as Info reports it
            unseen = _rows_with_unseen(serving, client, published, held)
            assert unseen.sum() >= 50 and (~unseen).sum() >= 50, unseen.mean()  # rows with and without a new id
            served, _ = serving.predict(*_raw(held))

            # the trainer's evaluation: its AUC and logloss are the served scores'
            labels = torch.from_numpy(held.labels)
            probabilities = torch.from_numpy(served.copy()).double()
            auc = float(binary_auroc(torch.from_numpy(served.copy()), labels))
            logloss = float(torch.nn.functional.binary_cross_entropy(probabilities, labels.double()))
            # (a pair of rows scored within 2e-6 of each other may order differently: 1e-4, not 0)
            assert auc == pytest.approx(evaluation["auc"], abs=1e-4), (auc, evaluation)
            # the served probabilities are float32, the trainer's loss comes from the logits: near 0 or 1 a
            # probability's rounding (spacing(p)) moves its row's log loss by up to spacing(p) / p (or / (1 - p));
            # these rows reach 0.9999994, where that is 0.1 (the logloss moved by up to 9e-5 between the two)
            p, y = served.astype(np.float64), held.labels > 0.5
            rounding = float(np.mean(np.spacing(served).astype(np.float64) / np.where(y, p, 1 - p)))
            assert np.isfinite(rounding) and rounding < 1e-3, rounding
            assert logloss == pytest.approx(evaluation["logloss"], abs=rounding + 1e-6), (logloss, evaluation, rounding)
            # and row by row, rows with an unseen id included, for the policy the model was trained with
            assert spec["unseen"] == "zeros"  # the default, published with the model
            want = published.trainer_scores(client, dense_file, held, "zeros")
            np.testing.assert_allclose(served, want, rtol=0, atol=2e-6)

            # the initializer's rows, in both places
            serve_initial, address_initial = spawn_serve(root, tmp_path / "serve-initial.log", model=True,
                                                         extra=["--unseen", "initial"])
            procs.append(serve_initial)
            wait_serving(address_initial, timeout=60)
            with ServingClient(address_initial) as initial:
                deadline = time.monotonic() + 30
                while initial.info().version < newest["version"]:
                    assert time.monotonic() < deadline, "the newest version never went live"
                    time.sleep(0.02)
                assert initial.info().default_row == "initial"
                served_initial, _ = initial.predict(*_raw(held))
            want = published.trainer_scores(client, dense_file, held, "initial")
            np.testing.assert_allclose(served_initial, want, rtol=0, atol=2e-6)
            # the policies differ on exactly the rows with an unseen id
            np.testing.assert_array_equal(served_initial[~unseen], served[~unseen])
            assert (served_initial[unseen] != served[unseen]).mean() > 0.9
    finally:
        for proc in procs:
            stop_process(proc)
