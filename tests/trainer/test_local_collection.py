"""LocalEmbeddingCollection against a plain-Python pooling reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.trainer.local import LocalEmbeddingCollection
from tigana.trainer.types import FeatureSpec, SparseFeatures


def _sparse(keys: list[str], bags: list[list[list[int]]]) -> SparseFeatures:
    """bags[f][b] = ids of feature f, sample b."""
    values = [v for feature in bags for bag in feature for v in bag]
    lengths = [len(bag) for feature in bags for bag in feature]
    return SparseFeatures(keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))


def _reference(coll: LocalEmbeddingCollection, bags: list[list[list[int]]]) -> torch.Tensor:
    weights = coll.table_weights()
    out = torch.zeros(len(bags[0]), len(bags), coll.dim)
    for f, spec in enumerate(coll.features):
        table = weights[spec.table_name]
        for b, bag in enumerate(bags[f]):
            rows = [table[i % table.shape[0]] for i in bag]
            if rows:
                pooled = torch.stack(rows).sum(0)
                out[b, f] = pooled / len(rows) if spec.pooling == "mean" else pooled
    return out


FEATURES = [FeatureSpec("user"), FeatureSpec("item", table="shared"), FeatureSpec("genre", table="shared",
                                                                                    pooling="mean")]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6).flatmap(lambda b: st.lists(
    st.lists(st.lists(st.integers(-2**63, 2**63 - 1), max_size=3), min_size=b, max_size=b), min_size=3, max_size=3)))
def test_pooling_matches_reference(bags: list[list[list[int]]]) -> None:
    coll = LocalEmbeddingCollection(FEATURES, 4, {"user": 7, "shared": 11}, seed=1)
    got = coll(_sparse(["user", "item", "genre"], bags))
    assert got.shape == (len(bags[0]), 3, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(coll, bags))


def test_shared_tables_key_order_and_gradients() -> None:
    coll = LocalEmbeddingCollection(FEATURES, 3, {"user": 5, "shared": 6}, seed=0)
    assert sorted(coll.tables) == ["shared", "user"]
    bags = [[[1], [2]], [[3], [3]], [[3, 4], []]]
    ordered = coll(_sparse(["user", "item", "genre"], bags))
    shuffled = coll(_sparse(["genre", "user", "item", "extra"], [bags[2], bags[0], bags[1], [[0], [0]]]))
    torch.testing.assert_close(ordered, shuffled)
    torch.testing.assert_close(ordered[0, 1], ordered[1, 1])  # same id, same table row
    ordered.sum().backward()
    grad = coll.tables["shared"].weight.grad
    # row 3: item twice (1 + 1) and genre's mean bag once (1/2); row 4: the other half; row 0 unused.
    torch.testing.assert_close(grad[3], torch.full((3,), 2.5))
    torch.testing.assert_close(grad[4], torch.full((3,), 0.5))
    assert float(grad[0].abs().sum()) == 0.0


def test_initial_weights_and_errors() -> None:
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    coll = LocalEmbeddingCollection([FeatureSpec("a")], 3, 4, weights={"a": w})
    torch.testing.assert_close(coll.table_weights()["a"], w)
    out = coll(_sparse(["a"], [[[5], [0, 1]]]))  # 5 mod 4 = 1
    torch.testing.assert_close(out[:, 0], torch.stack([w[1], w[0] + w[1]]))
    with pytest.raises(ValueError, match=r"table 'a': weights have shape \(3, 3\), expected \(4, 3\)"):
        coll.load_weights({"a": w[:3]})
    with pytest.raises(ValueError, match="no table named 'b'"):
        coll.load_weights({"b": w})
    torch.testing.assert_close(coll.table_weights()["a"], w)  # nothing changed
    with pytest.raises(ValueError, match=r"sparse features \['a'\] are missing"):
        coll(_sparse(["z"], [[[1]]]))
    with pytest.raises(ValueError, match="no entry for table 'b'"):
        LocalEmbeddingCollection([FeatureSpec("b")], 3, {"a": 4})
    a = LocalEmbeddingCollection([FeatureSpec("a")], 3, 4, seed=7).table_weights()["a"]
    b = LocalEmbeddingCollection([FeatureSpec("a")], 3, 4, seed=7).table_weights()["a"]
    torch.testing.assert_close(a, b)


def test_sparse_gradients_train_with_sgd() -> None:
    coll = LocalEmbeddingCollection([FeatureSpec("a")], 2, 10, sparse_grad=True, seed=0)
    before = coll.table_weights()["a"]
    opt = torch.optim.SGD(coll.parameters(), lr=0.5)
    coll(_sparse(["a"], [[[2], [3]]])).sum().backward()
    assert coll.tables["a"].weight.grad.is_sparse
    opt.step()
    after = coll.table_weights()["a"]
    torch.testing.assert_close(after[[2, 3]], before[[2, 3]] - 0.5)
    torch.testing.assert_close(after[[0, 1, 4]], before[[0, 1, 4]])
