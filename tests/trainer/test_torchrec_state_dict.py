"""The TorchRec drop-ins' state dicts, device, reset_parameters and names.

- ``load_state_dict`` of a TorchRec EBC/EC's state dict writes row i of ``embedding_bags.<table>.weight``
  (``embeddings.<table>.weight``) as id i of the PS table, so the drop-in then gives TorchRec's outputs; a bad
  one is refused naming the table, changing nothing.
- ``state_dict()`` of small bounded tables is TorchRec's (a TorchRec module loads it); of others, an entry
  saying where the rows are saved (a cluster checkpoint), which ``torch.save``/``load_state_dict`` round-trip.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from tigana import ps
from tigana.trainer import (
    PSEmbeddingBagCollection,
    PSEmbeddingBags,
    PSEmbeddingCollection,
    TableOptions,
)
from tigana.trainer.types import FeatureSpec

torchrec = pytest.importorskip("torchrec", reason="TorchRec is a test dependency (make install)")
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

ROWS = 12


def _options(optimizer: object = None) -> TableOptions:
    return TableOptions(optimizer=optimizer or ps.SGD(lr=0.1), initializer=ps.Normal(std=0.1), staleness=0)


def _bag_tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=ROWS, feature_names=["user"]),
            EmbeddingBagConfig(name="i", embedding_dim=8, num_embeddings=ROWS, feature_names=["item", "seen"],
                               pooling=PoolingType.MEAN)]


def _kjt(keys: list[str], seed: int) -> KeyedJaggedTensor:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=len(keys) * 8)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(rng.integers(0, ROWS, lengths.sum())),
                                               lengths=torch.from_numpy(lengths))


def test_loading_a_torchrec_state_dict_gives_torchrec_outputs(client: ps.Client) -> None:
    theirs = torchrec.EmbeddingBagCollection(tables=_bag_tables())
    ours = PSEmbeddingBagCollection(client, _bag_tables(), options=_options(ps.Adagrad(lr=0.1)), table_prefix="sd1_")
    kjt = _kjt(["item", "seen", "user"], 0)
    ours(kjt)  # trained rows exist before the load, and are replaced
    result = ours.load_state_dict(theirs.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values(), rtol=1e-6, atol=1e-7)
    rows = client.pull("sd1_i", np.arange(ROWS, dtype=np.int64), insert=False)
    np.testing.assert_array_equal(rows, theirs.embedding_bags["i"].weight.detach().numpy())  # bit for bit
    # and back: our state dict is TorchRec's, keys and tensors, for bounded tables this small
    state = ours.state_dict()
    assert sorted(state) == ["embedding_bags.i.weight", "embedding_bags.u.weight"]
    again = torchrec.EmbeddingBagCollection(tables=_bag_tables())
    again.load_state_dict(state)
    torch.testing.assert_close(again(kjt).values(), theirs(kjt).values())
    torch.testing.assert_close(ours.embedding_bags["u"].weight, theirs.embedding_bags["u"].weight.detach())


def test_embedding_collection_loads_torchrec_rows(client: ps.Client) -> None:
    tables = [EmbeddingConfig(name="seq", embedding_dim=4, num_embeddings=ROWS, feature_names=["hist", "cand"])]
    theirs = torchrec.EmbeddingCollection(tables=tables)
    ours = PSEmbeddingCollection(client, tables, options=_options(), table_prefix="sd2_")
    ours.load_state_dict(theirs.state_dict())
    kjt = _kjt(["cand", "hist"], 1)
    out, local = ours(kjt), theirs(kjt)
    for key in ("hist", "cand"):
        torch.testing.assert_close(out[key].values(), local[key].values())
    assert sorted(ours.state_dict()) == ["embeddings.seq.weight"]


def test_a_bad_state_dict_changes_nothing(client: ps.Client) -> None:
    ours = PSEmbeddingBagCollection(client, _bag_tables(), options=_options(), table_prefix="sd3_")
    before = {t: client.pull(f"sd3_{t}", np.arange(ROWS, dtype=np.int64)) for t in ("u", "i")}
    good = torchrec.EmbeddingBagCollection(tables=_bag_tables()).state_dict()
    bad = dict(good)
    bad["embedding_bags.i.weight"] = torch.zeros(ROWS, 5)  # the wrong dim
    with pytest.raises(ValueError, match=r"table 'i': embedding_bags\.i\.weight is \(12, 5\), expected float rows \(12, 8\)"):
        ours.load_state_dict(bad)
    bad["embedding_bags.i.weight"] = torch.full((ROWS, 8), float("nan"))
    with pytest.raises(ValueError, match="table 'i'.*NaN"):
        ours.load_state_dict(bad)
    for t in ("u", "i"):  # "u" comes first and was not written either
        np.testing.assert_array_equal(client.pull(f"sd3_{t}", np.arange(ROWS, dtype=np.int64)), before[t])
    missing = {k: v for k, v in good.items() if ".u." in k}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*embedding_bags\.i\.weight"):
        ours.load_state_dict(missing)


def test_unbounded_tables_say_how_their_rows_are_saved(client: ps.Client, tmp_path) -> None:
    tables = [EmbeddingBagConfig(name="big", embedding_dim=4, num_embeddings=ROWS, feature_names=["f"])]
    ours = PSEmbeddingBagCollection(client, tables, options=_options(), table_prefix="sd4_",
                                    checkpoint_dir=str(tmp_path))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([3, 2**40]), lengths=torch.tensor([2]))
    ours(kjt).values().sum().backward()  # id 2**40 is outside [0, num_embeddings)
    ours.flush()
    state = ours.state_dict()
    entry = state["embedding_bags.big._extra_state"]
    assert list(state) == ["embedding_bags.big._extra_state"]
    assert entry["saved_by"] == "cluster checkpoint" and entry["rows"] == 2 and "outside [0, 12)" in entry["why"]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()))  # weights_only: plain types
    trained = client.pull("sd4_big", np.array([3, 2**40]), insert=False)
    ours(kjt).values().sum().backward()  # trained further, then back to the saved rows
    ours.flush()
    assert not np.array_equal(client.pull("sd4_big", np.array([3, 2**40]), insert=False), trained)
    ours.load_state_dict(saved)
    np.testing.assert_array_equal(client.pull("sd4_big", np.array([3, 2**40]), insert=False), trained)
    # without a checkpoint_dir the entry says the cluster keeps the rows; loading it writes nothing
    plain = PSEmbeddingBagCollection(client, tables, options=_options(), table_prefix="sd4_", state_dict_rows=4)
    entry = plain.state_dict()["embedding_bags.big._extra_state"]
    assert entry["checkpoint"] is None and "over the 4 rows" in entry["why"]
    plain.load_state_dict({"embedding_bags.big._extra_state": entry})
    other = dict(entry, ps_table="elsewhere")
    with pytest.raises(ValueError, match="table 'big'.*'elsewhere'"):
        plain.load_state_dict({"embedding_bags.big._extra_state": other})


def test_device_reset_parameters_and_the_old_name(client: ps.Client) -> None:
    ours = PSEmbeddingBagCollection(client, _bag_tables(), options=_options(), table_prefix="sd5_",
                                    device=torch.device("cpu"))
    assert ours.device == torch.device("cpu") and not list(ours.parameters())
    assert sorted(ours.embedding_bags) == ["i", "u"]
    kjt = _kjt(["user", "item", "seen"], 2)
    kt = ours(kjt)
    assert kt.values().device == torch.device("cpu") and kt.values().requires_grad
    kt.values().sum().backward()  # the gradient path on the module's device
    ours.flush()
    assert ours.stats()["pushed_rows"] > 0
    trained = client.pull("sd5_u", np.arange(ROWS, dtype=np.int64), insert=False)
    ours.reset_parameters()  # the rows start again from the initializer
    assert client.describe_table("sd5_u").rows == 0
    fresh = client.pull("sd5_u", np.arange(ROWS, dtype=np.int64), insert=False)
    assert not np.array_equal(fresh, trained)
    with pytest.warns(DeprecationWarning, match="PSEmbeddingBags"):
        old = PSEmbeddingCollection(client, [FeatureSpec("sd5_old")], 4, options=_options())
    assert isinstance(old, PSEmbeddingBags)
    with pytest.warns(DeprecationWarning, match="PSEmbeddingBags"):
        from tigana.trainer.embedding import PSEmbeddingCollection as old_name
    assert old_name is PSEmbeddingBags


def test_write_rows_refuses_rows_that_do_not_fit(client: ps.Client) -> None:
    coll = PSEmbeddingBags(client, [FeatureSpec("sd6_f")], 4, options=_options())
    before = client.pull("sd6_f", np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match=r"table 'sd6_f': rows of shape \(3, 5\) for 3 ids, expected \(3, 4\)"):
        coll.write_rows("sd6_f", np.arange(3), np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError, match="table 'sd6_f': the ids to write repeat"):
        coll.write_rows("sd6_f", np.array([1, 1, 2]), np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="table 'sd6_f': the rows to write hold NaN or Inf"):
        coll.write_rows("sd6_f", np.arange(3), np.full((3, 4), np.inf, np.float32))
    with pytest.raises(ValueError, match="no table named 'nope'"):
        coll.write_rows("nope", np.arange(3), np.zeros((3, 4), np.float32))
    np.testing.assert_array_equal(client.pull("sd6_f", np.arange(3, dtype=np.int64)), before)
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert coll.write_rows("sd6_f", np.array([7, 2**62, -5]), rows) == 3  # any int64 ids
    np.testing.assert_array_equal(client.pull("sd6_f", np.array([7, 2**62, -5]), insert=False), rows)
