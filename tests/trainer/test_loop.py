"""The training loop in this process against real shard daemons: a checkpoint taken mid-epoch on a 2-server
cluster and resumed on another cluster of 3 servers (whose tables were tampered with first) ends exactly where
an uninterrupted run ends. The uninterrupted run and the interrupted one use one 2-server cluster, its tables
dropped in between: each starts from empty tables."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tigana import ps
from tigana.trainer.config import TrainConfig
from tigana.trainer.distributed import DistEnv
from tigana.trainer.embedding.plan import _salted, _table_salt
from tigana.trainer.loop import latest_checkpoint, load_data, train


def _config(**changes) -> TrainConfig:
    base = TrainConfig(model="deepfm", dataset="synthetic", synthetic_rows=3000, synthetic_vocab=500,
                       batch_size=250, eval_batch_size=1000, epochs=2, staleness=0, seed=3, progress=False,
                       embedding_optimizer="adagrad", embedding_lr=0.05)
    return base.replace(**changes)


def _tamper(addresses: list[str], config: TrainConfig) -> None:
    data = load_data(config)
    with ps.connect(addresses[0] if len(addresses) == 1 else addresses) as client:
        for batch in data.train_batches(0):
            sparse = batch.sparse
            for f, name in enumerate(sparse.keys):
                values, _ = sparse.feature(f)
                ids = _salted(np.unique(values.numpy()), _table_salt(config.table_prefix + name))
                client.push("r_deepfm_synthetic_fused", ids, np.full((ids.size, 16), 5.0, np.float32))


@pytest.mark.timeout(240)
def test_resume_from_a_mid_epoch_checkpoint_matches_an_uninterrupted_run(shared_shard_cluster, tmp_path) -> None:
    cluster = shared_shard_cluster(2)
    full = train(_config(table_prefix="r_"), DistEnv(), None, [cluster.target])
    assert full["steps"] == 24 and full["eval_rows"] == 600 and 0.5 < full["auc"] <= 1.0
    with ps.connect(cluster.target) as client:  # the interrupted run starts from empty tables, as the full one did
        for table in client.list_tables():
            client.drop_table(table)

    ckpt = tmp_path / "ckpt"
    first = train(_config(table_prefix="r_", max_steps=17, checkpoint_dir=str(ckpt), logdir=str(tmp_path / "tb")),
                  DistEnv(), None, [cluster.target])
    assert first["steps"] == 17
    path = latest_checkpoint(ckpt)
    assert path is not None and path.name == "step-000000017"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["epoch"] == 1 and meta["batch_in_epoch"] == 5 and (path / meta["ps_checkpoint"] / "manifest.json").exists()
    assert any((tmp_path / "tb").iterdir())  # TensorBoard event file

    with ps.LocalCluster(shards=3) as cluster:
        # Another cluster, of another size, whose tables hold other rows (a short run, then every row the run
        # uses damaged): only restoring the checkpoint can bring the right rows back.
        train(_config(table_prefix="r_", max_steps=5), DistEnv(), None, [cluster.target])
        _tamper([cluster.target], _config(table_prefix="r_"))
        resumed = train(_config(table_prefix="r_", checkpoint_dir=str(ckpt), resume="latest"), DistEnv(), None,
                        [cluster.target])
    assert resumed["steps"] == 24 and resumed["resumed_from"] == str(path)
    assert resumed["auc"] == pytest.approx(full["auc"], abs=1e-6)
    assert resumed["logloss"] == pytest.approx(full["logloss"], abs=1e-6)
    assert latest_checkpoint(ckpt).name == "step-000000024"
