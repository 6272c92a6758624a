"""Hierarchical sparse aggregation: the ranks of one node merge their pushes at the node leader; the tables
end up exactly where direct pushes from every rank would put them (real gloo ranks, real shard daemons)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tigana import ps
from tigana.trainer.distributed import free_port, init_distributed, read_env, shutdown
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.types import FeatureSpec, SparseFeatures

DIM, LR, VOCAB = 4, 0.5, 20


def _worker(rank: int, world: int, port: int, addresses: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    groups = init_distributed(read_env(ranks_per_node=world), backend="gloo")
    client = ps.connect(addresses)
    try:
        features = [FeatureSpec("agg_u"), FeatureSpec("agg_g", pooling="mean")]
        coll = PSEmbeddingBags(client, features, DIM, aggregate_group=groups.sparse_node,
                               options=TableOptions(optimizer=ps.SGD(lr=LR), staleness=0))
        rng = np.random.default_rng(rank)
        b = 10
        u = rng.integers(0, VOCAB, b)          # overlapping ids across ranks
        g_len = rng.integers(1, 4, b)
        values = torch.from_numpy(np.concatenate([u, rng.integers(0, VOCAB, g_len.sum())]).astype(np.int64))
        lengths = torch.from_numpy(np.concatenate([np.ones(b), g_len]).astype(np.int64))
        sparse = SparseFeatures(["agg_u", "agg_g"], values, lengths)
        ids = np.arange(VOCAB)
        before = {t: client.pull(t, ids) for t in ("agg_u", "agg_g")}
        dist.barrier()
        weight = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank))
        (coll(sparse) * weight).sum().backward()
        # This rank's own gradient, from local bags holding the same rows.
        expected = {}
        for f, t in enumerate(("agg_u", "agg_g")):
            w = torch.tensor(before[t], requires_grad=True)
            v, o = sparse.feature(f)
            (torch.nn.functional.embedding_bag(v, w, o, mode=features[f].pooling) * weight[f]).sum().backward()
            summed = w.grad.clone()
            dist.all_reduce(summed)
            expected[t] = before[t] - LR * summed.numpy()
        coll.flush()
        dist.barrier()  # every push of the node is in
        if rank == 0:
            assert coll.pushed_rows > 0
            for t in ("agg_u", "agg_g"):
                np.testing.assert_allclose(client.pull(t, ids), expected[t], atol=1e-5)
        else:
            assert coll.pushed_rows == 0  # the leader pushed for it
        dist.barrier()
    finally:
        client.close()
        shutdown()


@pytest.mark.timeout(180)
def test_node_ranks_merge_pushes_at_the_leader() -> None:
    with ps.LocalCluster(shards=2) as cluster:
        mp.spawn(_worker, args=(2, free_port(), [cluster.target]), nprocs=2, join=True)
