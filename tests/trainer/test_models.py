"""The CTR models: shapes, gradients, dense/embedding parameter split, learning, interaction pieces."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.trainer.data import SyntheticCriteo
from tigana.trainer.local import LocalEmbeddingCollection
from tigana.trainer.models import MODELS, CTRModel, DCNv2, build_model, dot_interaction, fm_interaction
from tigana.trainer.types import Batch, FeatureSpec, SparseFeatures

NAMES = sorted(MODELS)
SMALL = {"deepfm": {"hidden": (32, 16)}, "wide_deep": {"hidden": (32, 16)}, "dcn_v2": {"hidden": (32, 16)},
         "dlrm": {"bottom": (8,), "top": (32, 16)}}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> object:
    """Tiny matrices: one torch thread is fastest, and the cores are shared (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _setup(num_dense: int = 3, dim: int = 8, seed: int = 0) -> tuple[SyntheticCriteo, LocalEmbeddingCollection]:
    gen = SyntheticCriteo(vocab_sizes=(50, 40, 30, 20), num_dense=num_dense, id_mode="compact", seed=seed,
                          signal=2.5, informative=4, block_rows=512)
    coll = LocalEmbeddingCollection(gen.feature_specs(), dim, gen.cardinalities, init_std=0.05, seed=seed)
    return gen, coll


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("num_dense", [0, 3])
def test_forward_backward_shapes(name: str, num_dense: int) -> None:
    torch.manual_seed(0)
    gen, coll = _setup(num_dense)
    model = build_model(name, coll, num_dense)
    batch = gen.batch(0, 16)
    logits = model(batch.dense, batch.sparse)
    assert logits.shape == (16,) and logits.dtype == torch.float32
    F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    dense = dict(model.dense_named_parameters())
    assert dense and all(p.grad is not None for p in dense.values())
    assert all(coll_p.grad is not None for coll_p in coll.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_dense_parameters_exclude_the_tables(name: str) -> None:
    _, coll = _setup()
    model = build_model(name, coll, 3)
    table_ids = {id(p) for p in coll.parameters()}
    dense_ids = {id(p) for p in model.dense_parameters()}
    assert not table_ids & dense_ids
    assert table_ids | dense_ids == {id(p) for p in model.parameters()}
    assert sorted(model.embedding_parameter_names()) == sorted(f"embeddings.{n}" for n, _ in coll.named_parameters())
    state = model.dense_state_dict()
    assert state and not any(k.startswith("embeddings.") for k in state)
    clone = build_model(name, _setup(seed=1)[1], 3)
    clone.load_dense_state_dict(state)
    for (k, v), (k2, v2) in zip(state.items(), clone.dense_state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)
    with pytest.raises(ValueError, match="dense state mismatch"):
        clone.load_dense_state_dict({k: v for k, v in itertools.islice(state.items(), 1)})


@pytest.mark.parametrize("name", NAMES)
def test_a_few_steps_reduce_the_loss(name: str) -> None:
    torch.manual_seed(0)
    gen, coll = _setup()
    model = build_model(name, coll, 3, **SMALL[name])
    batch = gen.batch(0, 256)
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=3e-3)
    table_opt = torch.optim.Adagrad(coll.parameters(), lr=0.1)

    def loss() -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)

    first = float(loss().detach())
    for _ in range(25):
        dense_opt.zero_grad()
        table_opt.zero_grad()
        value = loss()
        value.backward()
        dense_opt.step()
        table_opt.step()
    assert float(loss().detach()) < 0.9 * first


def test_wide_collection_is_used_and_kept_out_of_dense_parameters() -> None:
    gen, coll = _setup()
    wide = LocalEmbeddingCollection(gen.feature_specs(), 1, gen.cardinalities, seed=3)
    batch = gen.batch(0, 8)
    for name in NAMES:
        model = build_model(name, coll, 3, wide=wide)
        base = model(batch.dense, batch.sparse)
        with torch.no_grad():
            for bag in wide.tables.values():
                bag.weight.add_(1.0)
        shifted = model(batch.dense, batch.sparse)
        torch.testing.assert_close(shifted - base, torch.full((8,), 4.0))  # +1 per feature, 4 features
        assert not {id(p) for p in wide.parameters()} & {id(p) for p in model.dense_parameters()}
        assert any(n.startswith("wide.") for n in model.embedding_parameter_names())
    with pytest.raises(ValueError, match="dim 1"):
        build_model("deepfm", coll, 3, wide=coll)


def test_registry_and_input_checks() -> None:
    _, coll = _setup()
    assert set(MODELS) == {"deepfm", "dlrm", "wide_deep", "dcn_v2"}
    assert isinstance(build_model("DCN-v2", coll, 3, low_rank=4, structure="parallel"), DCNv2)
    with pytest.raises(ValueError, match="unknown model 'fm'"):
        build_model("fm", coll, 3)
    model = build_model("dlrm", coll, 3)
    batch = SyntheticCriteo(vocab_sizes=(50, 40, 30, 20), num_dense=2, id_mode="compact").batch(0, 4)
    with pytest.raises(ValueError, match=r"dense has shape \(4, 2\), expected \(4, 3\)"):
        model(batch.dense, batch.sparse)
    with pytest.raises(TypeError, match="embedding collection"):
        build_model("deepfm", object(), 3)  # type: ignore[arg-type]


def test_models_accept_a_plain_collection_object() -> None:
    """Anything with feature_names, dim and __call__ works (the parameter-server collection is one)."""

    class Fixed:
        feature_names = ["a", "b"]
        dim = 4

        def __call__(self, sparse: SparseFeatures) -> torch.Tensor:
            return torch.ones(sparse.batch_size, 2, 4)

    model = build_model("deepfm", Fixed(), 1)
    assert isinstance(model, CTRModel) and model.embedding_parameter_names() == []
    sparse = SparseFeatures(["a", "b"], torch.zeros(6, dtype=torch.int64), torch.ones(6, dtype=torch.int64))
    batch = Batch(torch.zeros(3, 1), sparse, torch.zeros(3))
    assert model(batch.dense, batch.sparse).shape == (3,)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 5))
def test_interactions_match_pairwise_sums(b: int, n: int, d: int) -> None:
    x = torch.randn(b, n, d, dtype=torch.float64)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    fm = torch.stack([sum((x[s, i] * x[s, j]).sum() for i, j in pairs) if pairs else torch.tensor(0.0,
                      dtype=torch.float64) for s in range(b)])
    torch.testing.assert_close(fm_interaction(x), fm)
    dots = dot_interaction(x)
    assert dots.shape == (b, len(pairs))
    for k, (i, j) in enumerate(pairs):
        torch.testing.assert_close(dots[:, k], (x[:, i] * x[:, j]).sum(-1))


def test_local_and_functional_feature_specs_agree() -> None:
    """A model over a collection whose features share one table trains that table once per use."""
    coll = LocalEmbeddingCollection([FeatureSpec("x", table="t"), FeatureSpec("y", table="t")], 4, 16, seed=0)
    model = build_model("wide_deep", coll, 0)
    sparse = SparseFeatures(["x", "y"], torch.tensor([1, 2, 1, 3]), torch.ones(4, dtype=torch.int64))
    model(torch.zeros(2, 0), sparse).sum().backward()
    grad = coll.tables["t"].weight.grad
    assert grad[[1, 2, 3]].abs().sum() > 0 and grad[[0, 4]].abs().sum() == 0
