"""MovieLens-100K u1 (skipped without the data): DeepFM trained through 2 real shard daemons with asynchronous
pushes and staleness 1 reaches AUC >= 0.785 on u1.test and is within 0.005 of the same model trained locally
on nn.EmbeddingBag tables that start from the PS's initial rows."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from tigana import ps
from tigana.trainer.config import TrainConfig
from tigana.trainer.distributed import DistEnv
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.local import LocalEmbeddingCollection
from tigana.trainer.loop import evaluate, load_data, train
from tigana.trainer.models import build_model
from tigana.trainer.types import FeatureSpec

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "movielens-100k"
pytestmark = pytest.mark.skipif(not (DATA / "ml-100k" / "u1.base").is_file(),
                                reason=f"MovieLens-100K not found at {DATA}")


def _train_local(config: TrainConfig, data, init: dict[str, np.ndarray], cards: dict[str, int]) -> dict:
    features = [FeatureSpec(f.name, table=config.table_prefix + f.table_name, pooling=f.pooling)
                for f in data.features]
    local = LocalEmbeddingCollection(features, config.dim, cards, weights=init, sparse_grad=True)
    torch.manual_seed(config.seed)  # as the loop does: the same dense initialization
    model = build_model(config.model, local, data.num_dense)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=config.lr)
    sparse_opt = torch.optim.Adagrad(list(local.parameters()), lr=config.embedding_lr)
    for epoch in range(config.epochs):
        for batch in data.train_batches(epoch):
            loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
            dense_opt.zero_grad()
            sparse_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            sparse_opt.step()
    return evaluate(model, data.eval_batches())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_deepfm_through_the_ps_matches_local_and_reaches_auc() -> None:
    config = TrainConfig(model="deepfm", dataset="movielens-100k", data=str(DATA), epochs=3, batch_size=1024,
                         staleness=1, prefetch=True, embedding_lr=0.05, lr=1e-3, seed=0, progress=False,
                         table_prefix=f"ml{uuid.uuid4().hex[:6]}_")
    data = load_data(config)
    from tigana.trainer.data import MovieLens100K

    cards = {config.table_prefix + name: n for name, n in MovieLens100K(DATA / "ml-100k").cardinalities.items()}
    with ps.LocalCluster(shards=2) as cluster:
        client = ps.connect(cluster.target)
        try:
            # The PS's initial rows of every id the data can hold (the loop's own tables, created here first).
            features = [FeatureSpec(f.name, table=config.table_prefix + f.table_name, pooling=f.pooling)
                        for f in data.features]
            fused = f"{config.table_prefix}{config.model}_{config.dataset}_fused"
            probe = PSEmbeddingBags(client, features, config.dim, fused_table=fused, options=TableOptions(
                optimizer=ps.Adagrad(lr=config.embedding_lr), initializer=ps.Normal(std=config.init_std),
                staleness=config.staleness, seed=config.seed))
            init = {t: probe.table_rows(t, np.arange(cards[t])) for t in probe.tables}
            result = train(config, DistEnv(), None, [cluster.target])
        finally:
            client.close()
    local = _train_local(config, data, init, cards)
    print(f"PS auc {result['auc']:.4f} logloss {result['logloss']:.4f}; local auc {local['auc']:.4f} "
          f"logloss {local['logloss']:.4f}")
    assert result["eval_rows"] == local["eval_rows"] == 20000
    assert result["steps"] == 3 * 79
    assert result["auc"] >= 0.785, result
    assert abs(result["auc"] - local["auc"]) <= 0.005, (result, local)
