"""The MovieLens-100K CTR reader on the official files (skipped without them)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tigana.trainer.data import MOVIELENS_FEATURES, MovieLens100K, load_movielens

SHARED_DATA = Path(os.environ.get("TIGANA_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
ML_DIR = SHARED_DATA / "movielens-100k" / "ml-100k"
pytestmark = pytest.mark.skipif(not (ML_DIR / "u1.base").is_file(), reason="MovieLens-100K not present")


@pytest.fixture(scope="module")
def ml() -> MovieLens100K:
    return MovieLens100K(ML_DIR)


def _naive_rows(name: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in line.split()[:3]) for line in (ML_DIR / name).read_text().splitlines()]


def test_official_split_sizes_and_label_rate(ml: MovieLens100K) -> None:
    train, test = ml.train(), ml.test()
    assert (len(train), len(test)) == (80_000, 20_000)
    for data, name in ((train, "u1.base"), (test, "u1.test")):
        ratings = np.array([r[2] for r in _naive_rows(name)])
        np.testing.assert_array_equal(data.labels, (ratings >= 4).astype(np.float32))
        assert 0.5 < data.positive_rate < 0.6
    assert len(load_movielens(ML_DIR, "u.data")) == 100_000


def test_features_and_cardinalities(ml: MovieLens100K) -> None:
    assert ml.feature_names == MOVIELENS_FEATURES
    cards = ml.cardinalities
    assert (cards["user_id"], cards["item_id"], cards["gender"], cards["occupation"], cards["genres"]) == \
        (943, 1682, 2, 21, 19)
    assert cards["age"] == 7 and 10 < cards["zip"] < 200 and 50 < cards["year"] < 100
    data = ml.train()
    for name, values in zip(data.feature_names, data.values, strict=True):
        assert values.min() >= 0 and values.max() < cards[name], name
    specs = {s.name: s for s in ml.feature_specs()}
    assert specs["genres"].pooling == "mean" and specs["user_id"].pooling == "sum"
    assert data.dense.shape == (80_000, ml.num_dense) and np.isfinite(data.dense).all()


def test_user_item_ids_and_demographics_follow_the_files(ml: MovieLens100K) -> None:
    rows = _naive_rows("u1.test")[:500]
    batch = ml.test().take(np.arange(500))
    ids = {name: batch.sparse.feature(k)[0] for k, name in enumerate(batch.sparse.keys)}
    assert ids["user_id"].tolist() == [u - 1 for u, _, _ in rows]
    assert ids["item_id"].tolist() == [i - 1 for _, i, _ in rows]
    users = {int(p[0]): p for p in (line.split("|") for line in (ML_DIR / "u.user").read_text().splitlines())}
    genders = [0 if users[u][2] == "M" else 1 for u, _, _ in rows]
    assert ids["gender"].tolist() == genders
    torch.testing.assert_close(batch.dense[:, 0], torch.tensor([int(users[u][1]) / 100 for u, _, _ in rows]))
    # Users of the same zip prefix share an id; different prefixes differ.
    prefix = [users[u][4][:2].upper() for u, _, _ in rows]
    pairs = {(p, z) for p, z in zip(prefix, ids["zip"].tolist(), strict=True)}
    assert len({p for p, _ in pairs}) == len(pairs) == len({z for _, z in pairs})


def test_genres_are_multi_hot(ml: MovieLens100K) -> None:
    items = [line.split("|") for line in (ML_DIR / "u.item").read_text(encoding="latin-1").splitlines()]
    flags = {int(it[0]): [g for g, f in enumerate(it[5:]) if f == "1"] for it in items}
    rows = _naive_rows("u1.base")[:2000]
    batch = ml.train().take(np.arange(2000))
    values, offsets = batch.sparse.feature(MOVIELENS_FEATURES.index("genres"))
    lengths = torch.diff(torch.cat([offsets, torch.tensor([values.numel()])]))
    assert lengths.tolist() == [len(flags[i]) for _, i, _ in rows]
    assert int(lengths.max()) > 1 and int(lengths.min()) >= 1
    starts = offsets.tolist()
    assert [values[s:s + n].tolist() for s, n in zip(starts, lengths.tolist(), strict=True)] == \
        [flags[i] for _, i, _ in rows]
    # every other feature is single-hot
    nf = len(MOVIELENS_FEATURES)
    single = batch.sparse.lengths.view(nf, -1)[:nf - 1]
    assert bool((single == 1).all())


def test_ranks_split_the_training_rows(ml: MovieLens100K) -> None:
    train = ml.train()
    parts = [torch.cat([b.labels for b in train.batches(4096, rank=r, world_size=3, shuffle=True, seed=1)])
             for r in range(3)]
    assert sum(p.numel() for p in parts) == 80_000
    assert max(p.numel() for p in parts) - min(p.numel() for p in parts) <= 1
    counts = [train.num_batches(4096, r, 3) for r in range(3)]
    assert counts == [len(list(train.batches(4096, rank=r, world_size=3))) for r in range(3)]


def test_bad_inputs_are_named(ml: MovieLens100K, tmp_path: Path) -> None:
    bad = tmp_path / "bad.base"
    bad.write_text("1\t1\t5\t874965758\n2\t99999\t3\t876893171\n")
    with pytest.raises(ValueError, match=r"bad.base line 2 field item: 99999 is outside 1..1682"):
        ml.load(bad)
    bad.write_text("1\t1\t5\n")
    with pytest.raises(ValueError, match=r"line 1 does not have 4 fields"):
        ml.load(bad)
    with pytest.raises(FileNotFoundError, match="u9.base"):
        ml.load("u9.base")
    with pytest.raises(FileNotFoundError, match="u.user"):
        MovieLens100K(tmp_path)
