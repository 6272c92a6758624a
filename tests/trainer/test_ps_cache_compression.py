"""The hot-row cache and adaptive compression inside ``PSEmbeddingBags``, on 2 real shard daemons.

SGD on the servers makes every row's history known from the gradients alone: with ``loss = sum(out * C)``
the gradient of a row does not depend on its value, so after k pushes a row is ``-lr * sum of its first k
gradients``. That checks, row by row, that a cached copy serves a step only while it misses at most
``staleness`` of this trainer's own pushes of that row (prefetch included), and that error feedback delivers
every gradient: after ``flush`` the rows are what uncompressed pushes would have made them."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from tigana import ps
from tigana.trainer.config import ConfigError, TrainConfig
from tigana.trainer.distributed import DistEnv
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.loop import train
from tigana.trainer.types import FeatureSpec, SparseFeatures

DIM, LR, B = 4, 0.1, 32


def _batches(steps: int, seed: int = 0) -> list[tuple[SparseFeatures, torch.Tensor]]:
    """Two single-hot features over a small, skewed vocabulary (hot ids recur every step), and C."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        a = np.minimum(rng.zipf(1.3, B) - 1, 30)
        b = rng.integers(0, 6, B)
        sparse = SparseFeatures(["a", "b"], torch.from_numpy(np.concatenate([a, b]).astype(np.int64)),
                                torch.ones(2 * B, dtype=torch.int64))
        out.append((sparse, torch.from_numpy(rng.uniform(0.5, 1.5, (B, 2, DIM)).astype(np.float32))))
    return out


def _run(coll: PSEmbeddingBags, batches, prefetch: bool = True) -> list[np.ndarray]:
    """Train on ``batches`` (loss = sum(out * C)); returns the (B, 2, DIM) rows each step read."""
    seen = []
    for t, (sparse, c) in enumerate(batches):
        if prefetch and t + 1 < len(batches):
            coll.prefetch(batches[t + 1][0])
        out = coll(sparse)
        seen.append(out.detach().numpy().copy())
        (out * c).sum().backward()
    coll.flush()
    return seen


def _history(batches) -> tuple[list[dict[tuple[int, int], np.ndarray]], list[set]]:
    """Per step t, every (feature, id)'s gradient, and the keys it touched."""
    grads, touched = [], []
    for sparse, c in batches:
        g: dict[tuple[int, int], np.ndarray] = {}
        ids = sparse.values.view(2, B).numpy()
        for f in range(2):
            for i in range(B):
                key = (f, int(ids[f, i]))
                g[key] = g.get(key, 0) + c[i, f].numpy().astype(np.float64)
        grads.append(g)
        touched.append(set(g))
    return grads, touched


@pytest.mark.parametrize("staleness, fused", [(0, True), (2, True), (3, False)])
def test_cached_rows_miss_at_most_staleness_own_pushes(client, staleness, fused) -> None:
    name = f"c{uuid.uuid4().hex[:8]}"
    features = [FeatureSpec("a", table=f"{name}_a"), FeatureSpec("b", table=f"{name}_b")]
    coll = PSEmbeddingBags(client, features, DIM, fused_table=f"{name}_f" if fused else None,
                           options=TableOptions(optimizer=ps.SGD(lr=LR), initializer=ps.Zeros(),
                                                      staleness=staleness, cache_rows=64))
    batches = _batches(14)
    seen = _run(coll, batches)
    grads, touched = _history(batches)
    for t, (sparse, _) in enumerate(batches):
        ids = sparse.values.view(2, B).numpy()
        for f in range(2):
            for i in range(B):
                key = (f, int(ids[f, i]))
                # the versions a copy may show at step t: after k pushes, missing at most `staleness` of them
                versions = []
                for k in range(t, -1, -1):
                    missed = sum(key in touched[j] for j in range(k, t))
                    if missed > staleness:
                        break
                    versions.append(-LR * sum(grads[j].get(key, 0) for j in range(k)))
                row = seen[t][i, f]
                assert any(np.allclose(row, v, atol=1e-4) for v in versions), (t, key, row, versions[:3])
    stats = coll.stats()
    served = stats["cached_rows"]
    total = sum(len(np.unique(s.values.view(2, B).numpy()[f])) for s, _ in batches for f in range(2))
    assert served + stats["pulled_rows"] == total
    if staleness == 0:
        assert served == 0  # every row a step reads, it pushes: nothing may be served again
    else:
        assert served > total // 4, stats  # the hot ids come from the cache
        hit_rate = sum(c["hits"] for c in stats["cache"].values()) / total
        assert abs(hit_rate - served / total) < 1e-9


def test_adaptive_compression_delivers_every_gradient(client) -> None:
    batches = _batches(12, seed=1)
    pushed = {}
    for compression in ("adaptive", None):
        name = f"z{uuid.uuid4().hex[:8]}"
        features = [FeatureSpec("a", table=f"{name}_a"), FeatureSpec("b", table=f"{name}_b")]
        coll = PSEmbeddingBags(client, features, DIM, fused_table=f"{name}_f",
                               options=TableOptions(optimizer=ps.SGD(lr=LR), initializer=ps.Zeros(),
                                                          staleness=1, compression=compression))
        _run(coll, batches)
        grads, _ = _history(batches)
        for f, table in enumerate(("a", "b")):
            keys = sorted({k for g in grads for k in g if k[0] == f})
            expect = np.stack([-LR * sum(g.get(k, 0) for g in grads) for k in keys])
            got = coll.table_rows(f"{name}_{table}", np.array([k[1] for k in keys]))
            np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)  # exact: int8 rounding fed back
        pushed[compression] = client.stats()["bytes_sent"][f"{name}_f"]["push"]
        if compression == "adaptive":
            comp = coll.stats()["compression"][f"{name}_f"]
            assert comp["codec_steps"]["int8"] == len(batches) and comp["rows_sent"] < comp["rows_given"]
    assert pushed["adaptive"] < 0.6 * pushed[None], pushed


def test_train_flags_reach_the_tables(shard_cluster) -> None:
    config = TrainConfig(model="deepfm", dataset="synthetic", synthetic_rows=1500, synthetic_vocab=300,
                         batch_size=250, eval_batch_size=1000, epochs=1, staleness=2, seed=1, progress=False,
                         ps_compression="adaptive", cache_rows=2000, table_prefix=f"q{uuid.uuid4().hex[:6]}_")
    result = train(config, DistEnv(), None, shard_cluster.addresses)
    assert result["steps"] == 6 and 0.0 <= result["auc"] <= 1.0
    assert 0 < result["cache_hit_rate"] < 1 and result["wire_bytes"] > 0
    (comp,) = result["compression"].values()
    assert comp["codec_steps"]["int8"] > 0 and comp["rows_sent"] <= comp["rows_given"]
    with pytest.raises(ConfigError, match="ps_compression"):
        TrainConfig(ps_compression="int4")
    with pytest.raises(ConfigError, match="cache_rows"):
        TrainConfig(cache_rows=10, sparse_aggregation=True)
