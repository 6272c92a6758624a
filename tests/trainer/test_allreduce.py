"""Hierarchical and flat all-reduce agree: 4 real gloo ranks arranged as 2 nodes x 2, spawned on this machine."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tigana.trainer.allreduce import cross_node_bytes, flat_all_reduce, hierarchical_all_reduce, register_hook
from tigana.trainer.distributed import free_port, init_distributed, read_env, shutdown


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 1))


def _grads(groups, mode: str, compression: str, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model = DDP(_model(), bucket_cap_mb=0.001)  # tiny buckets: several hook calls per backward
    register_hook(model, groups, mode=mode, compression=compression)
    loss = nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env = read_env(ranks_per_node=2)
    groups = init_distributed(env, backend="gloo")
    try:
        assert groups.hierarchical and env.num_nodes == 2
        # Raw tensors: the sum over ranks of distinct per-rank values.
        t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
        h, f = hierarchical_all_reduce(t.clone(), groups), flat_all_reduce(t.clone())
        expected = torch.arange(1000, dtype=torch.float32) * sum(range(1, world + 1))
        torch.testing.assert_close(h, expected)
        torch.testing.assert_close(f, expected)
        # DDP gradients of different per-rank data, averaged by each hook.
        g = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(16, 12, generator=g), torch.randint(0, 2, (16,), generator=g).float()
        flat = _grads(groups, "flat", "none", x, y)
        hier = _grads(groups, "hierarchical", "none", x, y)
        for a, b in zip(flat, hier, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # The average, checked against gathering every rank's local gradient.
        model = _model()
        local = nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
        local.backward()
        for p, a in zip(model.parameters(), flat, strict=True):
            summed = p.grad.clone()
            torch.distributed.all_reduce(summed)
            torch.testing.assert_close(summed / world, a, rtol=1e-5, atol=1e-6)
        for mode in ("hierarchical", "flat"):
            compressed = _grads(groups, mode, "fp16", x, y)
            for a, b in zip(flat, compressed, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
        try:
            _grads(groups, "hierarchical", "bf16", x, y)
            raise AssertionError("bf16 on gloo should be refused")
        except ValueError as exc:
            assert "bf16" in str(exc)
    finally:
        shutdown()


@pytest.mark.timeout(180)
def test_hierarchical_matches_flat_on_2_nodes_x_2() -> None:
    mp.spawn(_worker, args=(4, free_port()), nprocs=4, join=True)


def test_cross_node_bytes_ring_model() -> None:
    assert cross_node_bytes(1000, 1, 4, "flat") == 0
    assert cross_node_bytes(1000, 2, 2, "flat") == 3000      # 2 links x 2*(3/4) x 1000
    assert cross_node_bytes(1000, 2, 2, "hierarchical") == 2000  # 2 links x 2*(1/2) x 1000
    assert cross_node_bytes(1000, 4, 8, "hierarchical") < cross_node_bytes(1000, 4, 8, "flat")
