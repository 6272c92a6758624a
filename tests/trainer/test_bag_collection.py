"""PSEmbeddingBagCollection, the drop-in for TorchRec's EmbeddingBagCollection, against local training.

With SGD and staleness 0 a step through the PS is the step of local ``nn.EmbeddingBag`` tables that start from
the same rows: the pooled rows, the loss and the rows after each step match. Two ways:
- our own types (``tigana.trainer.keyed``): tables of different dims, SUM and MEAN pooling, features fed in
  another order than the tables list them; always runs;
- TorchRec's: its DLRM example model on its ``EmbeddingBagCollection``, against the same DLRM on ours built
  from the same ``EmbeddingBagConfig`` list and fed the same ``KeyedJaggedTensor``s; skipped without TorchRec.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from tigana import ps
from tigana.trainer import TableOptions
from tigana.trainer.bag_collection import PSEmbeddingBagCollection
from tigana.trainer.keyed import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType

LR = 0.1
ROWS = 50  # ids 0..49 per table
STEPS = 5


def _options(seed: int) -> TableOptions:
    return TableOptions(optimizer=ps.SGD(lr=LR), initializer=ps.Normal(std=0.1), staleness=0, seed=seed)


def _batch(rng: np.random.Generator, keys: list[str], batch: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    lengths = rng.integers(0, 4, size=len(keys) * batch)  # 0..3 ids per bag, empty bags included
    values = rng.integers(0, ROWS, size=int(lengths.sum()))
    return keys, torch.from_numpy(values).long(), torch.from_numpy(lengths).long()


def _local_bags(client: ps.Client, tables: list, prefix: str) -> dict[str, nn.EmbeddingBag]:
    """A local nn.EmbeddingBag per table, starting from the PS table's rows."""
    bags = {}
    for t in tables:
        pooling = str(getattr(t.pooling, "value", t.pooling)).lower()
        bag = nn.EmbeddingBag(ROWS, t.embedding_dim, mode=pooling)
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(client.pull(prefix + t.name, np.arange(ROWS, dtype=np.int64))))
        bags[t.name] = bag
    return bags


def _local_pool(bags: dict[str, nn.EmbeddingBag], tables: list, keys: list[str], values: torch.Tensor,
                lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    batch = lengths.numel() // len(keys)
    per_key = lengths.view(len(keys), batch)
    starts = np.concatenate([[0], np.cumsum(per_key.sum(1).numpy())])
    out = {}
    for t in tables:
        for f in t.feature_names:
            i = keys.index(f)
            v = values[starts[i]:starts[i + 1]]
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), per_key[i].cumsum(0)[:-1]])
            out[f] = bags[t.name](v, offsets)
    return out


def test_per_table_dims_and_pooling_match_local_training_step_by_step(client: ps.Client) -> None:
    tables = [EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=4, name="t_user", feature_names=["user"]),
              EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=8, name="t_item", feature_names=["item", "seen"],
                                 pooling=PoolingType.MEAN),
              EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=4, name="t_ctx", feature_names=["ctx"])]
    ebc = PSEmbeddingBagCollection(client, tables, options=_options(3), table_prefix="ebc1_")
    assert ebc.embedding_bag_configs() == tables and not list(ebc.parameters())
    bags = _local_bags(client, tables, "ebc1_")
    head_ps = nn.Linear(4 + 8 + 8 + 4, 1)
    head_local = copy.deepcopy(head_ps)
    opt_ps = torch.optim.SGD(head_ps.parameters(), lr=LR)
    opt_local = torch.optim.SGD([*head_local.parameters(), *(b.weight for b in bags.values())], lr=LR)
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        keys, values, lengths = _batch(rng, ["seen", "ctx", "user", "item"], batch=16)  # not the tables' order
        kt = ebc(KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths))
        assert isinstance(kt, KeyedTensor)
        assert kt.keys() == ["user", "item", "seen", "ctx"] and kt.length_per_key() == [4, 8, 8, 4]
        local = _local_pool(bags, tables, keys, values, lengths)
        for f, rows in kt.to_dict().items():
            torch.testing.assert_close(rows, local[f], rtol=1e-5, atol=1e-6)
        target = torch.ones(16, 1)
        loss_ps = nn.functional.mse_loss(head_ps(kt.values()), target)
        order = kt.keys()  # a list (TorchRec's method), not a dict view
        loss_local = nn.functional.mse_loss(head_local(torch.cat([local[f] for f in order], 1)), target)
        torch.testing.assert_close(loss_ps, loss_local, rtol=1e-5, atol=1e-6)
        for opt, loss in ((opt_ps, loss_ps), (opt_local, loss_local)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        ebc.flush()
    for t in tables:  # the rows after the last step
        rows = client.pull("ebc1_" + t.name, np.arange(ROWS, dtype=np.int64), insert=False)
        np.testing.assert_allclose(rows, bags[t.name].weight.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_bad_tables_and_batches_are_refused(client: ps.Client) -> None:
    t = EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=4, name="t", feature_names=["a"])
    with pytest.raises(ValueError, match="distinct"):
        PSEmbeddingBagCollection(client, [t, t])
    ebc = PSEmbeddingBagCollection(client, [t], options=_options(1), table_prefix="ebc2_")
    with pytest.raises(ValueError, match="lacks features"):
        ebc(KeyedJaggedTensor(["b"], torch.tensor([1]), torch.tensor([1])))
    with pytest.raises(KeyError, match=r"lacks features \['a'\]"):  # a KeyError too, as TorchRec's
        ebc(KeyedJaggedTensor(["b"], torch.tensor([1]), torch.tensor([1])))


def test_shared_features_and_tables_named_after_their_feature(client: ps.Client) -> None:
    """A table without feature_names reads the feature named after it; a feature two tables read gives the keys
    feature@table (TorchRec's rules), with our own types."""
    tables = [EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=4, name="user"),
              EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=4, name="t_a", feature_names=["item"]),
              EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=8, name="t_b", feature_names=["item"])]
    ebc = PSEmbeddingBagCollection(client, tables, options=_options(2), table_prefix="ebc3_")
    assert tables[0].feature_names == ["user"]
    kt = ebc(KeyedJaggedTensor(["item", "user"], torch.tensor([3, 4, 5]), torch.tensor([1, 1, 0, 1])))
    assert kt.keys() == ["user", "item@t_a", "item@t_b"] and kt.length_per_key() == [4, 4, 8]
    rows = {t: torch.from_numpy(client.pull(f"ebc3_{t}", np.arange(6, dtype=np.int64), insert=False))
            for t in ("user", "t_a", "t_b")}
    torch.testing.assert_close(kt["user"], torch.stack([torch.zeros(4), rows["user"][5]]))
    torch.testing.assert_close(kt["item@t_a"], rows["t_a"][[3, 4]])
    torch.testing.assert_close(kt["item@t_b"], rows["t_b"][[3, 4]])


def test_torchrec_dlrm_matches_local_training_step_by_step(client: ps.Client) -> None:
    torchrec = pytest.importorskip("torchrec", reason="TorchRec is optional (make bench-peers installs it)")
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig as TorchRecConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchRecKJT
    from torchrec.sparse.jagged_tensor import KeyedTensor as TorchRecKeyedTensor

    dim = 8
    tables = [TorchRecConfig(name="t_cat0", embedding_dim=dim, num_embeddings=ROWS, feature_names=["cat0"]),
              TorchRecConfig(name="t_cat1", embedding_dim=dim, num_embeddings=ROWS, feature_names=["cat1", "cat2"])]
    ebc_ps = PSEmbeddingBagCollection(client, tables, options=_options(5), table_prefix="dlrm_")
    ebc_local = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    with torch.no_grad():  # the same starting rows
        for t in tables:
            rows = client.pull("dlrm_" + t.name, np.arange(ROWS, dtype=np.int64))
            ebc_local.embedding_bags[t.name].weight.copy_(torch.from_numpy(rows))
    torch.manual_seed(0)
    model_ps = DLRM(embedding_bag_collection=ebc_ps, dense_in_features=4, dense_arch_layer_sizes=[16, dim],
                    over_arch_layer_sizes=[16, 1])
    model_local = DLRM(embedding_bag_collection=ebc_local, dense_in_features=4, dense_arch_layer_sizes=[16, dim],
                       over_arch_layer_sizes=[16, 1])
    model_local.dense_arch.load_state_dict(model_ps.dense_arch.state_dict())
    model_local.over_arch.load_state_dict(model_ps.over_arch.state_dict())
    opt_ps = torch.optim.SGD(model_ps.parameters(), lr=LR)  # the dense layers only: the tables are on the PS
    opt_local = torch.optim.SGD(model_local.parameters(), lr=LR)
    assert len(list(model_local.parameters())) == len(list(model_ps.parameters())) + len(tables)
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        keys, values, lengths = _batch(rng, ["cat0", "cat1", "cat2"], batch=16)
        kjt = TorchRecKJT.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        dense = torch.from_numpy(rng.normal(size=(16, 4)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, size=16).astype(np.float32))
        assert isinstance(ebc_ps(kjt), TorchRecKeyedTensor)
        logits_ps, logits_local = model_ps(dense, kjt).squeeze(1), model_local(dense, kjt).squeeze(1)
        torch.testing.assert_close(logits_ps, logits_local, rtol=1e-5, atol=1e-6)
        loss_ps = nn.functional.binary_cross_entropy_with_logits(logits_ps, labels)
        loss_local = nn.functional.binary_cross_entropy_with_logits(logits_local, labels)
        for opt, loss in ((opt_ps, loss_ps), (opt_local, loss_local)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        ebc_ps.flush()
    for t in tables:
        rows = client.pull("dlrm_" + t.name, np.arange(ROWS, dtype=np.int64), insert=False)
        np.testing.assert_allclose(rows, ebc_local.embedding_bags[t.name].weight.detach().numpy(), rtol=1e-5,
                                   atol=1e-6)
