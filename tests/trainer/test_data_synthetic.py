"""The synthetic Criteo-format generator and the in-memory data set, against simple references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchmetrics.functional.classification import binary_auroc

from tigana.trainer.data import (
    NUM_DENSE,
    NUM_SPARSE,
    InMemoryDataset,
    SyntheticConfig,
    SyntheticCriteo,
    gather_bags,
    rank_rows,
    zipf_ranks,
)


def _ids(batch) -> torch.Tensor:  # noqa: ANN001
    return batch.sparse.values.view(len(batch.sparse.keys), -1).T


def test_seeded_and_regenerable_by_range() -> None:
    a, b = SyntheticCriteo(seed=5, block_rows=500), SyntheticCriteo(seed=5, block_rows=500)
    whole = a.batch(0, 2000)
    part = b.batch(700, 1300)
    assert torch.equal(_ids(whole)[700:1300], _ids(part))
    assert torch.equal(whole.dense[700:1300], part.dense) and torch.equal(whole.labels[700:1300], part.labels)
    other = SyntheticCriteo(seed=6, block_rows=500).batch(0, 2000)
    assert not torch.equal(_ids(whole), _ids(other))
    assert whole.dense.shape == (2000, NUM_DENSE) and _ids(whole).shape == (2000, NUM_SPARSE)


def test_label_is_learnable_and_near_the_asked_rate() -> None:
    gen = SyntheticCriteo(SyntheticConfig(positive_rate=0.3, seed=1))
    n = 20_000
    labels = gen.batch(0, n).labels
    assert abs(float(labels.mean()) - 0.3) < 0.03
    auc = float(binary_auroc(torch.from_numpy(gen.hidden_logits(0, n)), labels.long()))
    assert auc > 0.75
    # A simple additive model of per-id click rates, fitted on the first half, beats chance on the second.
    ids = _ids(gen.batch(0, n)).numpy()
    y = labels.numpy()
    half = n // 2
    score = np.zeros(n - half)
    for f in range(gen.config.informative):
        uniq, inv = np.unique(ids[:, f], return_inverse=True)
        clicks = np.bincount(inv[:half], weights=y[:half], minlength=uniq.size)
        seen = np.bincount(inv[:half], minlength=uniq.size)
        rate = (clicks + 10 * y[:half].mean()) / (seen + 10)
        score += np.log(rate[inv[half:]] / (1 - rate[inv[half:]]))
    assert float(binary_auroc(torch.from_numpy(score), torch.from_numpy(y[half:]).long())) > 0.62


def test_ids_are_zipf_skewed() -> None:
    u = np.random.default_rng(0).random(200_000)
    ranks = zipf_ranks(u, 10_000, 1.1)
    assert ranks.min() >= 0 and ranks.max() < 10_000
    counts = np.bincount(ranks, minlength=10_000)
    # P(k) ~ (k+1)^-1.1: rank 0 is drawn far more often than rank 9 (about 10^1.1 = 12.6 times).
    assert 6 < counts[0] / max(counts[9], 1) < 25
    assert counts[:100].sum() > counts[100:].sum() * 0.5
    assert (zipf_ranks(u[:1000], 50, 1.0) < 50).all()


def test_compact_ids_fit_their_tables() -> None:
    gen = SyntheticCriteo(vocab_sizes=(5, 50, 500), num_dense=3, id_mode="compact", sparse_missing_rate=0.2)
    ids = _ids(gen.batch(0, 3000))
    cards = gen.cardinalities
    for f, name in enumerate(gen.feature_names):
        assert int(ids[:, f].min()) >= 0 and int(ids[:, f].max()) < cards[name]
    assert int(ids[:, 0].max()) == 5  # the missing id is the last row
    with pytest.raises(ValueError, match="needs 13 dense and 26 sparse"):
        gen.write_tsv("/dev/null", 10)


@settings(max_examples=10, deadline=None)
@given(world_size=st.integers(1, 4), batch_size=st.integers(1, 700), rows=st.integers(1, 2500))
def test_streamed_rank_parts_cover_the_rows_once(world_size: int, batch_size: int, rows: int) -> None:
    gen = SyntheticCriteo(seed=2, block_rows=256, vocab_sizes=(1000,) * 3, num_dense=2, id_mode="compact")
    reference = gen.batch(100, 100 + rows)
    parts = []
    for rank in range(world_size):
        batches = list(gen.batches(batch_size, rows, rank=rank, world_size=world_size, start=100))
        assert all(len(b) == batch_size for b in batches[:-1])
        parts += [torch.cat([b.labels[:, None], b.dense, _ids(b).double()], 1) for b in batches]
    got = torch.cat(parts)
    ref = torch.cat([reference.labels[:, None], reference.dense, _ids(reference).double()], 1)
    assert got.shape == ref.shape
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, ref.tolist()))


def test_dataset_equals_streamed_rows() -> None:
    gen = SyntheticCriteo(seed=4, block_rows=300)
    data = gen.dataset(1000)
    streamed = torch.cat([_ids(b) for b in gen.batches(128, 1000)])
    assert torch.equal(_ids(data.take(np.arange(1000))), streamed)
    assert len(data) == 1000 and data.num_dense == NUM_DENSE


# ------------------------------------------------------------------------------------- in-memory set
@given(st.lists(st.lists(st.integers(0, 99), max_size=4), min_size=1, max_size=30), st.data())
def test_gather_bags_matches_a_python_reference(bags: list[list[int]], data: st.DataObject) -> None:
    values = np.array([v for bag in bags for v in bag], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
    rows = np.array(data.draw(st.lists(st.integers(0, len(bags) - 1), max_size=40)), dtype=np.int64)
    got_values, got_lengths = gather_bags(values, offsets, rows)
    assert got_values.tolist() == [v for r in rows for v in bags[r]]
    assert got_lengths.tolist() == [len(bags[r]) for r in rows]


@given(n=st.integers(0, 300), world_size=st.integers(1, 7), shuffle=st.booleans(), epoch=st.integers(0, 3))
def test_rank_rows_partition(n: int, world_size: int, shuffle: bool, epoch: int) -> None:
    parts = [rank_rows(n, r, world_size, shuffle=shuffle, seed=9, epoch=epoch) for r in range(world_size)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_in_memory_batches_multi_hot_subset_and_errors() -> None:
    bags = [[1, 2], [], [3], [4, 5, 6]]
    values = np.array([v for b in bags for v in b], np.int64)
    offsets = np.array([0, 2, 2, 3, 6], np.int64)
    data = InMemoryDataset(["a", "b"], np.arange(8, dtype=np.float32).reshape(4, 2), np.array([0, 1, 1, 0]),
                           [np.array([10, 11, 12, 13]), values], [np.arange(5), offsets])
    batch = data.take(np.array([3, 1, 0]))
    assert batch.sparse.keys == ["a", "b"]
    assert batch.sparse.values.tolist() == [13, 11, 10, 4, 5, 6, 1, 2]
    assert batch.sparse.lengths.tolist() == [1, 1, 1, 3, 0, 2]
    assert batch.labels.tolist() == [0.0, 1.0, 0.0] and batch.dense[0].tolist() == [6.0, 7.0]
    sub = data.subset(np.array([3, 0]))
    assert sub.take(np.arange(2)).sparse.values.tolist() == [13, 10, 4, 5, 6, 1, 2]
    assert [len(b) for b in data.batches(3)] == [3, 1]
    assert [len(b) for b in data.batches(3, drop_last=True)] == [3]
    with pytest.raises(ValueError, match="feature 'b': offsets"):
        InMemoryDataset(["a", "b"], np.zeros((4, 2)), np.zeros(4), [np.arange(4), values], [np.arange(5), offsets[:-1]])
    with pytest.raises(ValueError, match="rank 3 is outside world_size 3"):
        list(data.batches(2, rank=3, world_size=3))
