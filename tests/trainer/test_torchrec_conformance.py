"""The TorchRec drop-ins against TorchRec itself: ``PSEmbeddingBagCollection`` against
``torchrec.EmbeddingBagCollection`` and ``PSEmbeddingCollection`` against ``torchrec.EmbeddingCollection``.

Both sides start from the same rows (TorchRec's row j is the PS row of the j-th id of the table's vocabulary,
so ids near +-2**63 are compared too) and are fed the same random ``KeyedJaggedTensor`` batches (TorchRec's
with the ids mapped to row numbers): every pooling, weighted and unweighted, empty bags, repeated ids, keys
in another order than the tables list them plus keys nobody reads, a table without ``feature_names`` and a
feature read by two tables. They train side by side (SGD, staleness 0) and must give the same outputs, losses
and rows; a batch lacking a feature is refused by both with a ``KeyError``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tigana import ps
from tigana.trainer import PSEmbeddingBagCollection, PSEmbeddingCollection, TableOptions

torchrec = pytest.importorskip("torchrec", reason="TorchRec is a test dependency (make install)")
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor  # noqa: E402

LR = 0.05
STEPS = 3
BATCH = 6
# ids 0..9 and ids at the ends of int64: every table's vocabulary
VOCAB = np.sort(np.concatenate([np.arange(10), [2**63 - 1, 2**63 - 2, -2**63, -2**63 + 1, 2**62 + 7]])
                ).astype(np.int64)
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _options(seed: int) -> TableOptions:
    return TableOptions(optimizer=ps.SGD(lr=LR), initializer=ps.Normal(std=0.1), staleness=0, seed=seed)


def _batch(rng: np.random.Generator, keys: list[str], weighted: bool) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """(the PS's batch, TorchRec's): 0..3 ids a bag (empty bags, repeated ids), ids drawn from VOCAB (TorchRec's
    mapped to their row numbers), weights in [0.5, 2) when ``weighted``."""
    lengths = rng.integers(0, 4, size=len(keys) * BATCH)
    rows = rng.integers(0, VOCAB.shape[0], size=int(lengths.sum()))
    rows[: min(2, rows.shape[0])] = rows[0] if rows.shape[0] else 0  # a repeated id in one bag
    weights = torch.from_numpy(rng.uniform(0.5, 2.0, rows.shape[0]).astype(np.float32)) if weighted else None
    lengths_t = torch.from_numpy(lengths).long()
    ours = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(VOCAB[rows]), lengths=lengths_t,
                                               weights=weights)
    theirs = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(rows).long(), lengths=lengths_t,
                                                 weights=weights)
    return ours, theirs


def _same_start(client: ps.Client, prefix: str, tables: list, local: torch.nn.ModuleDict) -> None:
    """TorchRec's row j := the PS row of VOCAB[j] (inserted now, as a training pull would)."""
    with torch.no_grad():
        for t in tables:
            local[t.name].weight.copy_(torch.from_numpy(client.pull(prefix + t.name, VOCAB)))


def _check_rows(client: ps.Client, prefix: str, tables: list, local: torch.nn.ModuleDict) -> None:
    for t in tables:
        np.testing.assert_allclose(client.pull(prefix + t.name, VOCAB, insert=False),
                                   local[t.name].weight.detach().numpy(), **TOL)


def _bag_tables(pooling: PoolingType) -> list[EmbeddingBagConfig]:
    """t_plain reads the feature named after it; "a" is read by two tables (keys a@t_wide, a@t_other)."""
    n = VOCAB.shape[0]
    return [EmbeddingBagConfig(name="t_plain", embedding_dim=4, num_embeddings=n, pooling=pooling),
            EmbeddingBagConfig(name="t_wide", embedding_dim=8, num_embeddings=n, feature_names=["a", "b"],
                               pooling=pooling),
            EmbeddingBagConfig(name="t_other", embedding_dim=4, num_embeddings=n, feature_names=["a"],
                               pooling=PoolingType.SUM)]


def _sgd_step(loss: torch.Tensor, local_loss: torch.Tensor, ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """One step of both: ours pushes its gradients to the PS (flushed), TorchRec's rows take plain SGD."""
    loss.backward()
    local_loss.backward()
    with torch.no_grad():
        for p in theirs.parameters():
            p -= LR * p.grad
            p.grad = None
    ours.flush()


def _missing_features_refused(rng: np.random.Generator, ours: torch.nn.Module, theirs: torch.nn.Module,
                              weighted: bool) -> None:
    """A batch lacking features both read: ours names them, TorchRec raises a KeyError too."""
    with pytest.raises(KeyError, match="lacks features"):
        ours(_batch(rng, ["a", "t_plain"], weighted)[0])
    with pytest.raises(KeyError):
        theirs(_batch(rng, ["a", "t_plain"], weighted)[1])


@pytest.mark.parametrize(("pooling", "weighted"), [(PoolingType.SUM, False), (PoolingType.MEAN, False),
                                                   (PoolingType.SUM, True)])
def test_bag_collection_trains_as_torchrec(client: ps.Client, pooling: PoolingType, weighted: bool) -> None:
    prefix = f"conf_{pooling.value}_{int(weighted)}_"
    tables = _bag_tables(pooling)
    ours = PSEmbeddingBagCollection(client, _bag_tables(pooling), is_weighted=weighted, options=_options(3),
                                    table_prefix=prefix)
    theirs = torchrec.EmbeddingBagCollection(tables=tables, is_weighted=weighted)
    assert ours.is_weighted() is theirs.is_weighted() is weighted
    assert [t.feature_names for t in ours.embedding_bag_configs()] == [["t_plain"], ["a", "b"], ["a"]]
    _same_start(client, prefix, tables, theirs.embedding_bags)
    rng = np.random.default_rng(0)
    for step in range(STEPS):
        # keys in another order than the tables', and one no table reads
        batch, local_batch = _batch(rng, ["b", "unread", "a", "t_plain"] if step % 2 else
                                    ["a", "t_plain", "b", "unread"], weighted)
        kt, local_kt = ours(batch), theirs(local_batch)
        assert isinstance(kt, KeyedTensor)
        assert kt.keys() == local_kt.keys() == ["t_plain", "a@t_wide", "b", "a@t_other"]
        assert kt.length_per_key() == local_kt.length_per_key() == [4, 8, 8, 4]
        torch.testing.assert_close(kt.values(), local_kt.values(), **TOL)
        loss, local_loss = ((kt.values() - 0.1) ** 2).sum(), ((local_kt.values() - 0.1) ** 2).sum()
        torch.testing.assert_close(loss, local_loss, **TOL)
        _sgd_step(loss, local_loss, ours, theirs)
    _check_rows(client, prefix, tables, theirs.embedding_bags)
    _missing_features_refused(rng, ours, theirs, weighted)


def test_weighted_refusals_match_torchrec(client: ps.Client) -> None:
    tables = [EmbeddingBagConfig(name="t_mean", embedding_dim=4, num_embeddings=10, feature_names=["m"],
                                 pooling=PoolingType.MEAN)]
    ours = PSEmbeddingBagCollection(client, tables, is_weighted=True, options=_options(1), table_prefix="refuse_")
    theirs = torchrec.EmbeddingBagCollection(tables=tables, is_weighted=True)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["m"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]),
                                              weights=torch.tensor([0.5, 2.0]))
    with pytest.raises(NotImplementedError):
        theirs(kjt)
    with pytest.raises(NotImplementedError, match=r"\['t_mean'\].*SUM"):
        ours(kjt)
    assert ours.stats()["pulled_rows"] == 0  # refused before any pull
    sums = [EmbeddingBagConfig(name="t_sum", embedding_dim=4, num_embeddings=10, feature_names=["m"])]
    unweighted = KeyedJaggedTensor.from_lengths_sync(keys=["m"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="is_weighted=True.*no weights"):
        PSEmbeddingBagCollection(client, sums, is_weighted=True, options=_options(1), table_prefix="refuse_")(unweighted)
    # an unweighted collection ignores a batch's weights, as TorchRec's does
    plain = PSEmbeddingBagCollection(client, sums, options=_options(1), table_prefix="refuse_")
    torch.testing.assert_close(plain(kjt).values(), plain(KeyedJaggedTensor.from_lengths_sync(
        keys=["m"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]))).values())


def _ec_tables() -> list[EmbeddingConfig]:
    n = VOCAB.shape[0]
    return [EmbeddingConfig(name="t_plain", embedding_dim=4, num_embeddings=n),
            EmbeddingConfig(name="t_seq", embedding_dim=4, num_embeddings=n, feature_names=["a", "b"]),
            EmbeddingConfig(name="t_other", embedding_dim=4, num_embeddings=n, feature_names=["a"])]


@pytest.mark.parametrize("need_indices", [False, True])
def test_embedding_collection_trains_as_torchrec(client: ps.Client, need_indices: bool) -> None:
    prefix = f"conf_ec{int(need_indices)}_"
    tables = _ec_tables()
    ours = PSEmbeddingCollection(client, _ec_tables(), need_indices=need_indices, options=_options(4),
                                 table_prefix=prefix)
    theirs = torchrec.EmbeddingCollection(tables=tables, need_indices=need_indices)
    assert ours.embedding_names_by_table() == theirs.embedding_names_by_table() == [["t_plain"], ["a@t_seq", "b"],
                                                                                    ["a@t_other"]]
    assert ours.embedding_dim() == 4 and ours.need_indices() is need_indices
    _same_start(client, prefix, tables, theirs.embeddings)
    rng = np.random.default_rng(1)
    for step in range(STEPS):
        # weights in the batch: an EmbeddingCollection ignores them
        batch, local_batch = _batch(rng, ["b", "t_plain", "unread", "a"] if step % 2 else ["a", "b", "t_plain"],
                                    weighted=True)
        out, local = ours(batch), theirs(local_batch)
        assert list(out) == list(local) == ["t_plain", "a@t_seq", "b", "a@t_other"]
        loss = local_loss = 0
        for key, jt in out.items():
            assert isinstance(jt, JaggedTensor)
            torch.testing.assert_close(jt.values(), local[key].values(), **TOL)
            torch.testing.assert_close(jt.lengths(), local[key].lengths())
            if need_indices:  # the ids themselves (TorchRec's: its row numbers)
                feature = key.split("@")[0]
                torch.testing.assert_close(jt.weights(), batch[feature].values())
            else:
                assert jt.weights_or_none() is None and local[key].weights_or_none() is None
            loss = loss + ((jt.values() - 0.1) ** 2).sum()
            local_loss = local_loss + ((local[key].values() - 0.1) ** 2).sum()
        torch.testing.assert_close(loss, local_loss, **TOL)
        _sgd_step(loss, local_loss, ours, theirs)
    _check_rows(client, prefix, tables, theirs.embeddings)
    _missing_features_refused(rng, ours, theirs, False)


def test_embedding_collection_empty_batch_and_refusals(client: ps.Client) -> None:
    ours = PSEmbeddingCollection(client, _ec_tables(), options=_options(5), table_prefix="ec_empty_")
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b", "t_plain"], values=torch.zeros(0, dtype=torch.long),
                                              lengths=torch.zeros(6, dtype=torch.long))
    out = ours(kjt)
    assert [tuple(jt.values().shape) for jt in out.values()] == [(0, 4)] * 4
    assert ours.stats()["pulled_rows"] == 0
    mixed = [EmbeddingConfig(name="x", embedding_dim=4, num_embeddings=5),
             EmbeddingConfig(name="y", embedding_dim=8, num_embeddings=5)]
    with pytest.raises(ValueError, match="same embedding dimension"):
        torchrec.EmbeddingCollection(tables=mixed)
    with pytest.raises(ValueError, match="same embedding dimension"):
        PSEmbeddingCollection(client, mixed, options=_options(5), table_prefix="ec_bad_")
    assert "ec_bad_x" not in client.list_tables()  # refused before any table was created


def test_variable_batch_per_feature_is_refused(client: ps.Client) -> None:
    tables = [EmbeddingBagConfig(name="t_vbe", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"])]
    ours = PSEmbeddingBagCollection(client, tables, options=_options(6), table_prefix="vbe_")
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]),
                            stride_per_key_per_rank=[[2], [1]])  # a: 2 samples, b: 1
    with pytest.raises(ValueError, match="batch size per feature"):
        ours(kjt)
    assert ours.stats()["pulled_rows"] == 0
