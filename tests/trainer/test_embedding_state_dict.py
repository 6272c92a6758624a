"""PSEmbeddingBags in a model's state dict, against real shard daemons: ``torch.save(model.state_dict())`` and
``load_state_dict`` bring back the rows (a bounded table's tensor, a cluster checkpoint otherwise), a bad entry
is refused naming the table with nothing written, and the training loop's ``dense_state_dict`` leaves the
tables out without reading them."""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from tigana import ps
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.models import build_model
from tigana.trainer.types import FeatureSpec, SparseFeatures

DIM = 4
VOCAB = 12
NUM_DENSE = 3


def _collection(client: ps.Client, prefix: str, **kwargs: object) -> PSEmbeddingBags:
    # a: single-hot, ids in [0, VOCAB); b: multi-hot, reads a's table; c: ids in [100, 100 + VOCAB)
    features = [FeatureSpec(f"{prefix}a"), FeatureSpec(f"{prefix}b", table=f"{prefix}a", pooling="mean"),
                FeatureSpec(f"{prefix}c")]
    options = TableOptions(optimizer=ps.SGD(lr=0.5), initializer=ps.Normal(std=0.1), staleness=0)
    return PSEmbeddingBags(client, features, DIM, options=options, **kwargs)  # type: ignore[arg-type]


def _batch(prefix: str, seed: int, b: int = 8) -> tuple[torch.Tensor, SparseFeatures, torch.Tensor]:
    rng = np.random.default_rng(seed)
    b_len = rng.integers(1, 4, b)
    values = np.concatenate([rng.integers(0, VOCAB, b), rng.integers(0, VOCAB, b_len.sum()),
                             rng.integers(100, 100 + VOCAB, b)])
    lengths = np.concatenate([np.ones(b, np.int64), b_len, np.ones(b, np.int64)])
    sparse = SparseFeatures([f"{prefix}a", f"{prefix}b", f"{prefix}c"], torch.from_numpy(values),
                            torch.from_numpy(lengths))
    return (torch.from_numpy(rng.normal(size=(b, NUM_DENSE)).astype(np.float32)), sparse,
            torch.from_numpy(rng.integers(0, 2, b).astype(np.float32)))


def _train(model: torch.nn.Module, prefix: str, seeds: range) -> None:
    optimizer = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    for seed in seeds:
        dense, sparse, labels = _batch(prefix, seed)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.embeddings.flush()


def _rows(client: ps.Client, prefix: str) -> dict[str, np.ndarray]:
    return {"a": client.pull(f"{prefix}a", np.arange(VOCAB, dtype=np.int64), insert=False),
            "c": client.pull(f"{prefix}c", np.arange(100, 100 + VOCAB, dtype=np.int64), insert=False)}


def _logits(model: torch.nn.Module, prefix: str) -> torch.Tensor:
    model.eval()
    try:
        with torch.no_grad():
            return model(*_batch(prefix, 0)[:2])
    finally:
        model.train()


def _saved(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)  # plain types and tensors only


def test_torch_save_of_a_model_state_dict_round_trips_the_rows(client: ps.Client, tmp_path: Path) -> None:
    prefix = f"s{uuid.uuid4().hex[:8]}_"
    coll = _collection(client, prefix, num_embeddings={f"{prefix}a": VOCAB}, checkpoint_dir=str(tmp_path))
    model = build_model("dlrm", coll, NUM_DENSE, bottom=(8,), top=(8,))
    _train(model, prefix, range(3))
    # the training loop's dense checkpoint: no table entry, and no table read or checkpoint written for it
    dense = model.dense_state_dict()
    assert dense and not [k for k in dense if k.startswith("embeddings.")] and not os.listdir(tmp_path)

    state = model.state_dict()
    a, c = f"embeddings.embedding_bags.{prefix}a.", f"embeddings.embedding_bags.{prefix}c."
    assert sorted(k for k in state if k.startswith("embeddings.")) == [a + "weight", c + "_extra_state"]
    rows, logits = _rows(client, prefix), _logits(model, prefix)
    np.testing.assert_array_equal(state[a + "weight"].numpy(), rows["a"])  # the bounded table: its (12, 4) rows
    entry = state[c + "_extra_state"]
    assert entry["ps_table"] == f"{prefix}c" and entry["rows"] == client.describe_table(f"{prefix}c").rows
    assert entry["checkpoint"] is not None and "not bounded" in entry["why"]
    saved = _saved(state)

    _train(model, prefix, range(3, 6))  # rows and dense layers move on, then back to the saved ones
    moved = _rows(client, prefix)
    assert not np.array_equal(moved["a"], rows["a"]) and not np.array_equal(moved["c"], rows["c"])
    result = model.load_state_dict(saved)  # strict
    assert not result.missing_keys and not result.unexpected_keys
    for table, before in _rows(client, prefix).items():
        np.testing.assert_array_equal(before, rows[table])
    torch.testing.assert_close(_logits(model, prefix), logits, rtol=0, atol=0)


def test_a_bad_entry_is_refused_naming_the_table_and_changes_nothing(client: ps.Client, tmp_path: Path) -> None:
    prefix = f"s{uuid.uuid4().hex[:8]}_"
    coll = _collection(client, prefix, num_embeddings={f"{prefix}a": VOCAB})
    model = build_model("dlrm", coll, NUM_DENSE, bottom=(8,), top=(8,))
    _train(model, prefix, range(2))
    good = _saved(model.state_dict())
    a, c = f"embeddings.embedding_bags.{prefix}a.", f"embeddings.embedding_bags.{prefix}c."
    assert good[c + "_extra_state"]["checkpoint"] is None  # no checkpoint_dir: the rows stay on the cluster
    rows, dense = _rows(client, prefix), {k: v.clone() for k, v in model.dense_state_dict().items()}
    changed = {k: (v + 1 if k in dense else v) for k, v in good.items()}  # a load would show in the dense layers

    for key, value, message in [
            (a + "weight", torch.zeros(VOCAB, DIM + 1), rf"table '{prefix}a': .*is \(12, 5\), expected float rows \(12, 4\)"),
            (a + "weight", torch.zeros(VOCAB + 1, DIM), rf"table '{prefix}a': .*is \(13, 4\)"),
            (a + "weight", torch.full((VOCAB, DIM), float("nan")), rf"table '{prefix}a': .*NaN"),
            (c + "_extra_state", dict(good[c + "_extra_state"], ps_table="elsewhere"), rf"table '{prefix}c': .*'elsewhere'"),
            (c + "_extra_state", {"rows": 3}, rf"table '{prefix}c': .*is not a tigana.ps-table/1 entry")]:
        with pytest.raises(ValueError, match=message):
            model.load_state_dict(dict(changed, **{key: value}))
    for table, now in _rows(client, prefix).items():
        np.testing.assert_array_equal(now, rows[table])
    for k, v in model.dense_state_dict().items():
        assert torch.equal(v, dense[k]), k
    with pytest.raises(RuntimeError, match=rf"Missing key\(s\).*{a}weight"):
        model.load_state_dict({k: v for k, v in good.items() if not k.startswith(a)})
    with pytest.raises(RuntimeError, match=rf"Unexpected key\(s\).*embeddings\.embedding_bags\.{prefix}z\.weight"):
        model.load_state_dict(dict(good, **{f"embeddings.embedding_bags.{prefix}z.weight": torch.zeros(1, DIM)}))
    with pytest.raises(ValueError, match=rf"num_embeddings names tables no feature reads: \['{prefix}z'\]"):
        _collection(client, prefix, num_embeddings={f"{prefix}z": VOCAB})


def test_a_fused_collection_saves_its_ps_table_once(client: ps.Client, tmp_path: Path) -> None:
    prefix = f"s{uuid.uuid4().hex[:8]}_"
    fused = f"{prefix}fused"
    coll = _collection(client, prefix, fused_table=fused, checkpoint_dir=str(tmp_path))
    model = build_model("dlrm", coll, NUM_DENSE, bottom=(8,), top=(8,))
    _train(model, prefix, range(2))
    ids = np.arange(VOCAB, dtype=np.int64)
    rows = coll.table_rows(f"{prefix}a", ids), coll.table_rows(f"{prefix}c", ids + 100)
    state = _saved(model.state_dict())
    key = f"embeddings.embedding_bags.{fused}._extra_state"
    assert [k for k in state if k.startswith("embeddings.")] == [key] and len(os.listdir(tmp_path)) == 1
    assert state[key]["ps_table"] == fused and "fused PS table" in state[key]["why"]
    _train(model, prefix, range(2, 4))
    model.load_state_dict(state)
    np.testing.assert_array_equal(coll.table_rows(f"{prefix}a", ids), rows[0])
    np.testing.assert_array_equal(coll.table_rows(f"{prefix}c", ids + 100), rows[1])
    with pytest.raises(ValueError, match=rf"table '{fused}': .*fused PS table"):
        model.load_state_dict(dict(state, **{f"embeddings.embedding_bags.{fused}.weight": torch.zeros(2, DIM)}))
