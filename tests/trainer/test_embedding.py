"""PSEmbeddingBags against real shard daemons: pooling, pushed gradients, prefetch, and step-by-step
equality with the same model on a local ``nn.EmbeddingBag`` (staleness 0, SGD)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from torch import nn

from tigana import ps
from tigana.proto import shard_pb2 as pb
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.embedding.plan import _salted, _table_salt
from tigana.trainer.loop import evaluate
from tigana.trainer.types import Batch, FeatureSpec, SparseFeatures

DIM = 4


def _name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def _features(prefix: str) -> list[FeatureSpec]:
    # a: single-hot, own table; b: multi-hot mean, shares table a; c: multi-hot sum, own table
    return [FeatureSpec(f"{prefix}a"), FeatureSpec(f"{prefix}b", table=f"{prefix}a", pooling="mean"),
            FeatureSpec(f"{prefix}c")]


def _batch(rng: np.random.Generator, prefix: str, b: int, vocab: int = 12) -> SparseFeatures:
    a = rng.integers(0, vocab, b)
    b_len = rng.integers(0, 4, b)  # empty bags allowed
    c_len = rng.integers(1, 4, b)
    values = np.concatenate([a, rng.integers(0, vocab, b_len.sum()), rng.integers(100, 100 + vocab, c_len.sum())])
    lengths = np.concatenate([np.ones(b, np.int64), b_len, c_len])
    return SparseFeatures([f"{prefix}a", f"{prefix}b", f"{prefix}c"], torch.from_numpy(values.astype(np.int64)),
                          torch.from_numpy(lengths.astype(np.int64)))


def _reference(client, sparse: SparseFeatures, features: list[FeatureSpec]) -> np.ndarray:
    """(B, F, DIM) pooled rows computed bag by bag from plain pulls (the slow, obvious way)."""
    b = sparse.batch_size
    out = np.zeros((b, len(features), DIM), np.float32)
    for f, spec in enumerate(features):
        values, offsets = sparse.feature(f)
        ends = torch.cat([offsets[1:], torch.tensor([values.numel()])])
        for i in range(b):
            ids = values[int(offsets[i]):int(ends[i])].numpy()
            if ids.size:
                rows = client.pull(spec.table_name, ids)
                out[i, f] = rows.mean(0) if spec.pooling == "mean" else rows.sum(0)
    return out


def test_forward_pools_pulled_rows(client) -> None:
    prefix = _name()
    features = _features(prefix)
    # unseen initial: the no-grad forward reads the fresh tables' rows as a training pull would create them
    coll = PSEmbeddingBags(client, features, DIM, options=TableOptions(staleness=0, unseen="initial"))
    assert coll.tables == [f"{prefix}a", f"{prefix}c"] and list(coll.parameters()) == []
    sparse = _batch(np.random.default_rng(0), prefix, 16)
    with torch.no_grad():
        out = coll(sparse)
    assert out.shape == (16, 3, DIM) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), _reference(client, sparse, features), rtol=1e-6, atol=1e-7)


def test_backward_pushes_the_row_gradients(client) -> None:
    prefix = _name()
    features = _features(prefix)
    coll = PSEmbeddingBags(client, features, DIM, options=TableOptions(optimizer=ps.SGD(lr=0.5), staleness=0))
    sparse = _batch(np.random.default_rng(1), prefix, 8)
    ids_a = np.arange(12)
    ids_c = np.arange(100, 112)
    before_a, before_c = client.pull(f"{prefix}a", ids_a), client.pull(f"{prefix}c", ids_c)
    # Local reference: EmbeddingBags holding the same rows, same pooling, same upstream gradient.
    wa = torch.tensor(before_a, requires_grad=True)
    wc = torch.tensor(before_c, requires_grad=True)
    weight = torch.randn(3, DIM, generator=torch.Generator().manual_seed(3))
    out = coll(sparse)
    (out * weight).sum().backward()
    ref = []
    for f, (w, base) in enumerate([(wa, 0), (wa, 0), (wc, 100)]):
        values, offsets = sparse.feature(f)
        ref.append(nn.functional.embedding_bag(values - base, w, offsets, mode=features[f].pooling))
    (torch.stack(ref, 1) * weight).sum().backward()
    coll.flush()
    np.testing.assert_allclose(client.pull(f"{prefix}a", ids_a), before_a - 0.5 * wa.grad.numpy(), atol=1e-6)
    np.testing.assert_allclose(client.pull(f"{prefix}c", ids_c), before_c - 0.5 * wc.grad.numpy(), atol=1e-6)
    assert coll.pushed_rows > 0


class _Tiny(nn.Module):
    """Pooled rows of 3 features + 2 dense inputs -> one logit."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings
        torch.manual_seed(7)
        self.top = nn.Sequential(nn.Linear(3 * DIM + 2, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        pooled = self.embeddings(sparse)
        return self.top(torch.cat([pooled.flatten(1), dense], 1)).squeeze(1)


class _LocalBags(nn.Module):
    """The same features on local nn.EmbeddingBag tables (ids < vocab, c's ids offset by 100)."""

    def __init__(self, features: list[FeatureSpec], rows_a: np.ndarray, rows_c: np.ndarray) -> None:
        super().__init__()
        self.features = features
        self.a = nn.EmbeddingBag.from_pretrained(torch.tensor(rows_a), freeze=False, mode="sum")
        self.c = nn.EmbeddingBag.from_pretrained(torch.tensor(rows_c), freeze=False, mode="sum")

    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        out = []
        for f, spec in enumerate(self.features):
            values, offsets = sparse.feature(f)
            bag = self.c if f == 2 else self.a
            out.append(bag(values - (100 if f == 2 else 0), offsets,
                           per_sample_weights=None) if spec.pooling == "sum" else
                       nn.functional.embedding_bag(values, bag.weight, offsets, mode="mean"))
        return torch.stack(out, 1)


def _table_rows(client, coll: PSEmbeddingBags, table: str, ids: np.ndarray) -> np.ndarray:
    """A logical table's rows as the PS holds them (through the fused table's salted ids when fused)."""
    rows = coll.table_rows(table, ids)
    if coll.fused_table is not None:
        np.testing.assert_array_equal(rows, client.pull(coll.fused_table, _salted(ids, _table_salt(table))))
    return rows


@pytest.mark.parametrize("fused", [False, True])
def test_staleness0_sgd_matches_local_embeddingbag_step_by_step(client, fused: bool) -> None:
    prefix = _name()
    features = _features(prefix)
    lr = 0.3
    ps_coll = PSEmbeddingBags(client, features, DIM, fused_table=f"{prefix}fused" if fused else None,
                              options=TableOptions(optimizer=ps.SGD(lr=lr), staleness=0, seed=5))
    ids_a, ids_c = np.arange(12), np.arange(100, 112)
    rows_a = _table_rows(client, ps_coll, f"{prefix}a", ids_a)
    rows_c = _table_rows(client, ps_coll, f"{prefix}c", ids_c)
    ps_model, local_model = _Tiny(ps_coll), _Tiny(_LocalBags(features, rows_a, rows_c))
    ps_opt = torch.optim.SGD(ps_model.parameters(), lr=lr)
    assert all(p.requires_grad for p in ps_model.parameters())
    local_opt = torch.optim.SGD(local_model.parameters(), lr=lr)
    rng = np.random.default_rng(11)
    for _ in range(8):
        sparse = _batch(rng, prefix, 16)
        dense = torch.from_numpy(rng.normal(size=(16, 2)).astype(np.float32))
        labels = torch.from_numpy((rng.random(16) < 0.5).astype(np.float32))
        for model, opt in ((ps_model, ps_opt), (local_model, local_opt)):
            opt.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
            loss.backward()
            opt.step()
        for p, q in zip(ps_model.top.parameters(), local_model.top.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        # staleness 0: the next pull sees this step's pushes
        np.testing.assert_allclose(_table_rows(client, ps_coll, f"{prefix}a", ids_a),
                                   local_model.embeddings.a.weight.detach().numpy(), atol=1e-5)
        np.testing.assert_allclose(_table_rows(client, ps_coll, f"{prefix}c", ids_c),
                                   local_model.embeddings.c.weight.detach().numpy(), atol=1e-5)
    if fused:
        assert client.list_tables().count(f"{prefix}fused") == 1 and f"{prefix}a" not in client.list_tables()


def test_prefetch_gives_the_same_rows_without_a_second_pull(client, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = _name()
    features = _features(prefix)
    coll = PSEmbeddingBags(client, features, DIM, options=TableOptions(staleness=1))
    sparse = _batch(np.random.default_rng(2), prefix, 32)
    issued: list[str] = []  # every pull the collection sends, by table
    pull_many = client.pull_many

    def counted(tables, ids, **kw):
        issued.extend(tables)
        return pull_many(tables, ids, **kw)

    monkeypatch.setattr(client, "pull_many", counted)
    with torch.no_grad():
        direct = coll(sparse)
        per_batch = len(issued)  # one pull per physical table
        pulled = coll.pulled_rows
        coll.prefetch(sparse)
        assert len(issued) == 2 * per_batch
        coll.prefetch(sparse)  # the same batch again: nothing new is pulled, nothing new is kept
        assert len(issued) == 2 * per_batch and len(coll._prefetched) == 1
        prefetched = coll(sparse)  # served by the prefetch: no pull
        assert len(issued) == 2 * per_batch and coll._prefetched == []
    assert per_batch == len(coll.tables) and coll.pulled_rows == 2 * pulled
    torch.testing.assert_close(direct, prefetched)
    strict = PSEmbeddingBags(client, features, DIM, options=TableOptions(staleness=1),
                             table_options={f"{prefix}c": TableOptions(staleness=0)}, create=False)
    strict.prefetch(sparse)  # a staleness-0 table: prefetch does nothing
    assert strict._prefetched == []


def test_bad_batches_are_refused_with_the_field_named(client) -> None:
    prefix = _name()
    coll = PSEmbeddingBags(client, _features(prefix), DIM)
    good = _batch(np.random.default_rng(3), prefix, 4)
    with pytest.raises(ValueError, match="do not match"):
        coll(SparseFeatures(["x", "y", "z"], good.values, good.lengths))
    with pytest.raises(ValueError, match="int64"):
        coll(SparseFeatures(good.keys, good.values.int(), good.lengths))
    with pytest.raises(ValueError, match="lengths sum"):
        coll(SparseFeatures(good.keys, good.values[:-1], good.lengths))
    with pytest.raises(ValueError, match="table_options"):
        PSEmbeddingBags(client, _features(prefix), DIM, table_options={"nope": TableOptions()})
    with pytest.raises(ValueError, match="staleness"):
        TableOptions(staleness=-1)
    with pytest.raises(ValueError, match="fused_table"):
        PSEmbeddingBags(client, _features(prefix), DIM, fused_table="f",
                        table_options={f"{prefix}c": TableOptions(staleness=0)})


def test_salting_keeps_tables_apart() -> None:
    ids = np.arange(-1000, 1000, dtype=np.int64)
    a, b = _salted(ids, _table_salt("a")), _salted(ids, _table_salt("b"))
    assert np.unique(a).size == ids.size and np.intersect1d(a, b).size == 0


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_rows_read_within_the_staleness_bound(client, staleness: int) -> None:
    """One id, SGD lr 1, every step pushes a gradient of 1: the value step s reads tells how many earlier
    pushes it saw, which must be at least s-1-staleness (and at most s-1)."""
    prefix = _name()
    coll = PSEmbeddingBags(client, [FeatureSpec(f"{prefix}x")], DIM,
                           options=TableOptions(optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(),
                                                      staleness=staleness))
    batches = [SparseFeatures([f"{prefix}x"], torch.tensor([7]), torch.tensor([1])) for _ in range(8)]
    seen = []
    for s, batch in enumerate(batches, start=1):
        if s < len(batches):
            coll.prefetch(batches[s])  # the next batch, as the loop does
        out = coll(batch)
        seen.append(int(round(-float(out[0, 0, 0].detach()))))  # pushes applied before the read
        out.sum().backward()
    coll.flush()
    for s, pushes in enumerate(seen, start=1):
        assert max(0, s - 1 - staleness) <= pushes <= s - 1, (staleness, seen)
    if staleness == 0:
        assert seen == list(range(8)), seen
    assert float(coll.table_rows(f"{prefix}x", np.array([7]))[0, 0]) == -8.0


@pytest.mark.parametrize("fused", [False, True])
def test_evaluation_pulls_are_read_only(client, fused: bool) -> None:
    """An evaluation pass (``loop.evaluate``: no grad, prefetching the next batch) reads held-out ids as the
    tables' ``unseen`` policy says (``initial`` here: their initial rows) without inserting them: the PS tables
    do not grow. Training pulls still insert, also of a batch prefetched read-only during evaluation."""
    prefix = _name()
    features = _features(prefix)
    coll = PSEmbeddingBags(client, features, DIM, fused_table=f"{prefix}fused" if fused else None,
                           options=TableOptions(optimizer=ps.SGD(lr=0.5), staleness=1, seed=3,
                                                      unseen="initial"))
    physical = [coll.fused_table] if fused else coll.tables
    model = _Tiny(coll)
    rng = np.random.default_rng(21)

    def batch(b: int, vocab: int) -> Batch:
        return Batch(torch.from_numpy(rng.normal(size=(b, 2)).astype(np.float32)), _batch(rng, prefix, b, vocab),
                     torch.from_numpy((rng.random(b) < 0.5).astype(np.float32)))

    for _ in range(2):  # a little training on a small vocabulary: rows exist and were updated
        train = batch(16, vocab=12)
        nn.functional.binary_cross_entropy_with_logits(model(train.dense, train.sparse), train.labels).backward()
    coll.flush()
    rows = {t: client.describe_table(t).rows for t in physical}
    assert all(n > 0 for n in rows.values())

    held_out = [batch(32, vocab=5000) for _ in range(3)]  # mostly ids the tables never saw
    pulled = coll.pulled_rows
    result = evaluate(model, iter(held_out), coll)
    assert result["eval_rows"] == 96 and 0.0 <= result["auc"] <= 1.0
    assert coll.pulled_rows > pulled and coll.steps == 2 and coll._prefetched == []
    assert {t: client.describe_table(t).rows for t in physical} == rows, "evaluation inserted rows"

    # the read-only rows are the ones a training pull reads (stored rows as stored, new ids as initialized)
    sparse = held_out[0].sparse
    with torch.no_grad():
        read_only = coll(sparse)
        coll.prefetch(sparse)  # read-only too: the training forward below must pull again, inserting
    assert {t: client.describe_table(t).rows for t in physical} == rows
    trained = coll(sparse)  # gradients enabled: a training pull (no backward, so nothing is pushed)
    torch.testing.assert_close(trained.detach(), read_only)
    grown = {t: client.describe_table(t).rows for t in physical}
    assert all(grown[t] > rows[t] for t in physical), (rows, grown)


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_table_rows_reads_without_inserting(client, fused: bool, compressed: bool) -> None:
    """``table_rows`` is an inspection: the rows of ids a table holds as stored, and of ids it never saw as
    their initial rows, with nothing inserted (it used to pull with inserts, growing the table it looked at)."""
    prefix = _name()
    coll = PSEmbeddingBags(client, _features(prefix), DIM, fused_table=f"{prefix}fused" if fused else None,
                           options=TableOptions(optimizer=ps.SGD(lr=0.5), staleness=0, seed=3,
                                                      compression="adaptive" if compressed else None))
    physical = coll.fused_table if fused else f"{prefix}a"
    trained = np.arange(6)
    coll.table_rows(f"{prefix}a", trained)  # nothing stored yet: still nothing after
    assert client.describe_table(physical).rows == 0
    sparse = SparseFeatures([f"{prefix}a", f"{prefix}b", f"{prefix}c"],
                            torch.from_numpy(np.concatenate([trained, trained, trained + 100])),
                            torch.ones(18, dtype=torch.int64))
    coll(sparse).sum().backward()  # a training pull and push store ids 0..5 (and 100..105 in table c)
    coll.flush()
    stored = client.describe_table(physical).rows
    unseen = np.arange(1000, 1050)
    rows = coll.table_rows(f"{prefix}a", np.concatenate([trained, unseen]))
    assert client.describe_table(physical).rows == stored, "table_rows inserted the rows it read"
    # the rows as the PS holds them: an exact (fp32) pull of the physical ids, after the count was checked
    client.set_compression(physical, {"pull": "fp32", "push": "fp32"})
    ids = np.concatenate([trained, unseen])
    expected = client.pull(physical, _salted(ids, _table_salt(f"{prefix}a")) if fused else ids)
    np.testing.assert_array_equal(rows, expected)
    assert not np.allclose(rows[:6], rows[6:12], atol=0.1)  # stored rows were trained; unseen ones are initial


def test_table_options_durability_creates_each_table_with_it(make_shard_cluster) -> None:
    """``TableOptions.durability`` reaches ``create_table``: a collection's tables are sync or async as asked, and
    the cluster's default where it is None (sync: its slots have a replica); any other value is refused before a
    table is made."""
    cluster = make_shard_cluster(2)  # a scheduler and one replica of every slot, as the README starts it
    prefix = _name()
    with ps.connect(cluster.target) as client:
        want = {None: pb.DURABILITY_SYNC, "sync": pb.DURABILITY_SYNC, "async": pb.DURABILITY_ASYNC}
        for durability, held in want.items():
            feature = FeatureSpec(f"{prefix}{durability}")
            PSEmbeddingBags(client, [feature], DIM, options=TableOptions(durability=durability))
            assert client._spec_pb(feature.name).durability == held, durability  # as the scheduler holds it
        with pytest.raises(ps.InvalidArgument, match="field 'durability'"):
            TableOptions(durability="eventually")
        assert not [t for t in client.list_tables() if t.endswith("eventually")]
