"""Fixtures of the trainer tests (real daemons, as ``tests/conftest.py``'s; every process started is stopped by
its handle at teardown, also on failure).

- ``client``            module-scoped ``ps.Client`` of ``shard_cluster`` (unique table names per test).
- ``publish_cluster``   module-scoped ``ps.LocalCluster`` of 2 daemons with a scheduler, for publishing runs.
- ``train_published``   factory ``train_published(root, *train_args) -> Published``: what a user runs to serve a
                        trained model. It starts the ``tigana admin export --follow --model ROOT`` follower
                        (log ``follow.log`` in the test's ``tmp_path``; it runs until teardown), runs ``tigana train
                        --dataset synthetic --ps SCHEDULER --publish-dir ROOT --no-progress *train_args`` (which
                        must succeed), and waits until the newest version of the follower's publish log
                        (``versions.json``) is the model as trained: every table cut 0.5 s past the training's
                        end with no entry since that version. The
                        ``Published`` it returns also scores rows the trainer's way (``trainer_scores``).
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tigana import ps
from tigana.ps.ops.local import stop_process
from tigana.ps.serving import modeldir
from tigana.ps.serving.exportlog import read_manifest
from tigana.tools.bench.serving_sync import spawn_follow_model
from tigana.trainer.data.criteo import chunk_to_batch, criteo_salts
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.models import build_model
from tigana.trainer.types import FeatureSpec


@pytest.fixture(scope="module")
def client(shard_cluster) -> Iterator[ps.Client]:
    c = ps.connect(shard_cluster.addresses)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def publish_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ps.LocalCluster]:
    c = ps.LocalCluster(2, data_dir=tmp_path_factory.mktemp("publish-cluster"))
    try:
        yield c
    finally:
        c.close(timeout=30)


@dataclass(frozen=True)
class Published:
    """A finished publishing training run: its model directory, the spec it published, and the run itself."""

    root: Path
    spec: dict[str, Any]
    train: subprocess.CompletedProcess

    def collection(self, client: ps.Client, unseen: str | None = None) -> PSEmbeddingBags:
        """The trainer's collection of the published tables (not created: they are on the cluster), reading an
        id the tables do not hold by ``unseen`` (None: the default policy)."""
        features = [FeatureSpec(f["name"], table=f["table"], pooling=f["pooling"]) for f in self.spec["features"]]
        return PSEmbeddingBags(client, features, self.spec["dim"], fused_table=self.spec["fused_table"],
                               create=False, options=None if unseen is None else TableOptions(unseen=unseen))

    def trainer_scores(self, client: ps.Client, dense_file: bytes, chunk: Any, unseen: str | None = None
                       ) -> np.ndarray:
        """(n,) probabilities of ``chunk``'s rows the way the trainer (``tigana.trainer.evaluate``) scores them:
        the reader's batch, the model in eval mode without gradients over a collection pulling read-only from
        the shard servers, with the dense weights of ``dense_file`` (a published version's)."""
        model = build_model(self.spec["model"], self.collection(client, unseen), self.spec["num_dense"])
        model.load_dense_state_dict(torch.load(io.BytesIO(dense_file), weights_only=True)["model"])
        model.eval()
        batch = chunk_to_batch(chunk, criteo_salts(0))
        with torch.no_grad():
            return torch.sigmoid(model(batch.dense, batch.sparse).float()).numpy()


def _as_trained(root: Path, tables: list[str], after: float) -> bool:
    """Whether ``root``'s newest published version is the model as trained: every table's export log was cut at
    ``after`` or later (its manifest's time) with no entry since the version (the same ``seq``). The follower
    writes a table's manifest before the version that names it, so a manifest alone does not say the version
    is written yet."""
    versions = modeldir.read_versions(root)
    if versions is None or not versions["versions"]:
        return False
    newest = versions["versions"][-1]["tables"]
    for table in tables:
        m = read_manifest(modeldir.table_log(root, table))
        if m is None or m["time"] < after or table not in newest or newest[table]["seq"] != m["seq"]:
            return False
    return True


@pytest.fixture
def train_published(publish_cluster: ps.LocalCluster, tmp_path: Path) -> Iterator[Callable[..., Published]]:
    followers: list[subprocess.Popen] = []

    def run(root: Path, *train_args: str) -> Published:
        log_path = tmp_path / "follow.log"
        # the follower starts first and waits for the trainer's first publish
        followers.append(spawn_follow_model(publish_cluster.scheduler, root, log_path, interval=0.3))
        train = subprocess.run(
            [sys.executable, "-m", "tigana.tools.cli", "train", "--dataset", "synthetic", "--ps",
             publish_cluster.scheduler, "--publish-dir", str(root), "--no-progress", *train_args],
            capture_output=True, text=True, timeout=180)
        assert train.returncode == 0, train.stderr[-3000:]
        trained = time.time()
        spec = modeldir.read_spec(root)
        assert spec is not None, f"{root} holds no published model spec"
        deadline = time.monotonic() + 60
        while not _as_trained(root, spec["tables"], trained + 0.5):
            assert time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.1)
        return Published(root, spec, train)

    try:
        yield run
    finally:
        for proc in followers:
            stop_process(proc)
