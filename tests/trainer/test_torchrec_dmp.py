"""TorchRec's ``DistributedModelParallel`` over a model holding a PS drop-in: 2 gloo ranks on CPU, real shard
daemons. DMP's planner finds no TorchRec table to shard (the drop-in's tables are on the PS, it has no
parameters), so it leaves the drop-in as it is and wraps the dense layers in DDP: the dense parameters stay
equal on both ranks, each rank's row gradients reach the servers, and the loss falls."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tigana import ps
from tigana.trainer import PSEmbeddingBagCollection, TableOptions
from tigana.trainer.distributed import free_port

pytest.importorskip("torchrec", reason="TorchRec is a test dependency (make install)")

STEPS, LR = 4, 0.1


def _worker(rank: int, world: int, port: int, addresses: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    client = ps.connect(addresses)
    try:
        tables = [EmbeddingBagConfig(name="dmp_user", embedding_dim=4, num_embeddings=100, feature_names=["user"]),
                  EmbeddingBagConfig(name="dmp_item", embedding_dim=4, num_embeddings=100, feature_names=["item"])]
        ebc = PSEmbeddingBagCollection(client, tables, options=TableOptions(optimizer=ps.SGD(lr=LR), staleness=0),
                                       device=torch.device("cpu"))
        torch.manual_seed(0)  # the same dense layers on both ranks
        model = DLRM(embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[8, 4],
                     over_arch_layer_sizes=[8, 1])
        dmp = DistributedModelParallel(model, device=torch.device("cpu"))
        assert dmp.plan.plan == {}  # nothing sharded
        assert [m for m in dmp.modules() if isinstance(m, PSEmbeddingBagCollection)] == [ebc]
        optimizer = torch.optim.SGD(dmp.parameters(), lr=LR)  # the dense layers only
        own = np.arange(5, dtype=np.int64) + 50 * rank  # each rank its own ids
        before = {t: client.pull(t, np.arange(100, dtype=np.int64)) for t in ("dmp_user", "dmp_item")}
        dist.barrier()  # both ranks read the rows before either trains
        rng = np.random.default_rng(rank)
        dense = torch.from_numpy(rng.normal(size=(5, 3)).astype(np.float32))
        labels = torch.from_numpy((rng.random(5) > 0.5).astype(np.float32))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["item", "user"], values=torch.from_numpy(np.r_[own, own]),
                                                  lengths=torch.ones(10, dtype=torch.long))
        losses = []
        for _ in range(STEPS):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(1), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ebc.flush()
            losses.append(float(loss.detach()))
        assert losses[-1] < losses[0], losses
        flat = torch.cat([p.detach().reshape(-1) for p in dmp.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0)  # data-parallel dense layers
        dist.barrier()  # every rank's pushes are in
        for t in ("dmp_user", "dmp_item"):
            after = client.pull(t, np.arange(100, dtype=np.int64), insert=False)
            moved = np.flatnonzero(np.abs(after - before[t]).sum(1) > 0)
            assert moved.tolist() == [*range(5), *range(50, 55)]  # both ranks' ids, no other
        state = dmp.state_dict()  # the unwrapped DLRM's keys, the PS tables' too (100 rows: a tensor each)
        assert state["sparse_arch.embedding_bag_collection.embedding_bags.dmp_user.weight"].shape == (100, 4)
        dist.barrier()
    finally:
        client.close()
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_dmp_trains_a_model_holding_a_ps_drop_in(shard_cluster) -> None:
    mp.spawn(_worker, args=(2, free_port(), shard_cluster.addresses), nprocs=2, join=True)
