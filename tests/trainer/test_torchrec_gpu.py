"""The TorchRec drop-ins on a GPU: outputs on the module's CUDA device (rows copied from pinned memory without
blocking), gradients back to the servers; the same outputs and rows as the same module on the CPU, step by
step. Skipped where CUDA is not available. Run alone on a GPU machine:

    .venv/bin/python -m pytest -q -p no:randomly tests/trainer/test_torchrec_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tigana import ps
from tigana.trainer import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
    PSEmbeddingBagCollection,
    PSEmbeddingCollection,
    TableOptions,
)
from tigana.trainer.embedding.collection import _to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _options() -> TableOptions:  # the same seed: both prefixes' tables start from the same rows
    return TableOptions(optimizer=ps.SGD(lr=0.1), initializer=ps.Normal(std=0.1), staleness=0, seed=9)


def _batch(rng: np.random.Generator, weighted: bool) -> KeyedJaggedTensor:
    lengths = rng.integers(0, 4, size=2 * 8)
    n = int(lengths.sum())
    return KeyedJaggedTensor(["a", "b"], torch.from_numpy(rng.integers(0, 20, n)), torch.from_numpy(lengths),
                             torch.from_numpy(rng.uniform(0.5, 2, n).astype(np.float32)) if weighted else None)


def test_pinned_non_blocking_copy() -> None:
    rows = torch.randn(7, 4)
    out = _to_device(rows, torch.device("cuda"))
    torch.cuda.synchronize()
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), rows)


@pytest.mark.parametrize("weighted", [False, True])
def test_bag_collection_on_cuda_matches_cpu(client: ps.Client, weighted: bool) -> None:
    def make(prefix: str, device: str) -> PSEmbeddingBagCollection:
        tables = [EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="t", feature_names=["a", "b"],
                                     pooling=PoolingType.SUM)]
        return PSEmbeddingBagCollection(client, tables, is_weighted=weighted, options=_options(),
                                        table_prefix=prefix, device=device)

    gpu, cpu = make(f"gpu{int(weighted)}_", "cuda"), make(f"cpu{int(weighted)}_", "cpu")
    assert gpu.device.type == "cuda"
    rng = np.random.default_rng(0)
    for _ in range(3):
        kjt = _batch(rng, weighted)
        out_gpu, out_cpu = gpu(kjt).values(), cpu(kjt).values()
        assert out_gpu.device.type == "cuda" and out_cpu.device.type == "cpu"
        torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-5, atol=1e-6)
        (out_gpu ** 2).sum().backward()
        (out_cpu ** 2).sum().backward()
        gpu.flush()
        cpu.flush()
    ids = np.arange(20, dtype=np.int64)
    np.testing.assert_allclose(client.pull(f"gpu{int(weighted)}_t", ids, insert=False),
                               client.pull(f"cpu{int(weighted)}_t", ids, insert=False), rtol=1e-5, atol=1e-6)


def test_embedding_collection_on_cuda(client: ps.Client) -> None:
    tables = [EmbeddingConfig(num_embeddings=20, embedding_dim=4, name="s", feature_names=["a", "b"])]
    gpu = PSEmbeddingCollection(client, tables, options=_options(), table_prefix="gpu_ec_", device="cuda")
    cpu = PSEmbeddingCollection(client, tables, options=_options(), table_prefix="cpu_ec_")
    kjt = _batch(np.random.default_rng(1), False)
    out_gpu, out_cpu = gpu(kjt), cpu(kjt)
    for key in ("a", "b"):
        assert out_gpu[key].values().device.type == "cuda"
        torch.testing.assert_close(out_gpu[key].values().cpu(), out_cpu[key].values())
    sum(jt.values().sum() for jt in out_gpu.values()).backward()
    gpu.flush()
    assert gpu.stats()["pushed_rows"] > 0
