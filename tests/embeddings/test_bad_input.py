"""Every bad input raises InvalidArgument naming the table and the field, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from tigana import embeddings as emb
from tigana.embeddings import _kernels
from tigana.embeddings.config import INITIALIZERS, OPTIMIZERS, from_kind

BACKENDS = ["numpy"] + (["numba"] if _kernels.AVAILABLE else [])
DIM = 4
ok_ids = np.array([1, 2, 2])
ok_grads = np.ones((3, DIM), np.float32)
nan_grads = ok_grads.copy()
nan_grads[2, 1] = np.nan
inf_grads = ok_grads.copy()
inf_grads[0, 0] = -np.inf
good_batch = emb.RowBatch(np.array([9]), np.ones((1, DIM), np.float32), np.zeros((1, DIM), np.float32),
                          np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1))


def _batch(**changes) -> emb.RowBatch:
    fields = {f: getattr(good_batch, f) for f in ("ids", "weights", "state", "update_count", "last_step",
                                                   "last_time")}
    fields.update(changes)
    return emb.RowBatch(**fields)


CASES = {
    "ids 2-D": (lambda t: t.pull(np.ones((2, 2), np.int64)), "ids"),
    "ids float": (lambda t: t.pull(np.array([1.0, 2.0])), "ids"),
    "ids strings": (lambda t: t.contains(np.array(["a"])), "ids"),
    "ids above int64": (lambda t: t.delete(np.array([2**64 - 1], np.uint64)), "ids"),
    "push ids float": (lambda t: t.push(np.array([1.5, 2, 2]), ok_grads), "ids"),
    "grads int": (lambda t: t.push(ok_ids, np.ones((3, DIM), np.int32)), "grads"),
    "grads 1-D": (lambda t: t.push(ok_ids, np.ones(3 * DIM, np.float32)), "grads"),
    "grads rows": (lambda t: t.push(ok_ids, np.ones((2, DIM), np.float32)), "grads"),
    "grads dim": (lambda t: t.push(ok_ids, np.ones((3, DIM + 1), np.float32)), "grads"),
    "grads NaN": (lambda t: t.push(ok_ids, nan_grads), "grads"),
    "grads Inf": (lambda t: t.push(ok_ids, inf_grads), "grads"),
    "grads overflow to inf": (lambda t: t.push(ok_ids, np.full((3, DIM), 1e300)), "grads"),
    "duplicate ids' grads sum to inf": (lambda t: t.push(ok_ids, np.full((3, DIM), 3e38, np.float32)), "grads"),
    "step negative": (lambda t: t.push(ok_ids, ok_grads, step=-1), "step"),
    "import not a batch": (lambda t: t.import_rows("rows"), "batch"),
    "import dup ids": (lambda t: t.import_rows(_batch(ids=np.array([9, 9]), weights=np.ones((2, DIM)),
                                                      state=np.zeros((2, DIM)), update_count=np.zeros(2),
                                                      last_step=np.zeros(2), last_time=np.zeros(2))),
                       "batch.ids"),
    "import weights dim": (lambda t: t.import_rows(_batch(weights=np.ones((1, DIM + 1), np.float32))),
                           "batch.weights"),
    "import weights NaN": (lambda t: t.import_rows(_batch(weights=np.full((1, DIM), np.nan, np.float32))),
                           "batch.weights"),
    "import state width": (lambda t: t.import_rows(_batch(state=np.zeros((1, 1), np.float32))), "batch.state"),
    "import step shape": (lambda t: t.import_rows(_batch(last_step=np.zeros(2, np.int64))), "batch.last_step"),
    "export predicate": (lambda t: t.export_rows(predicate=lambda ids: ids), "predicate"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_rejected_and_unchanged(backend: str, case: str) -> None:
    table = emb.EmbeddingTable(emb.TableConfig("clicks", dim=DIM, optimizer=emb.Adagrad(), backend=backend))
    table.pull(np.arange(10))
    table.push(np.arange(5), np.ones((5, DIM), np.float32))
    before, rows, step = table.checksum(), len(table), table.step
    call, field = CASES[case]
    with pytest.raises(emb.InvalidArgument) as err:
        call(table)
    assert "'clicks'" in str(err.value) and repr(field) in str(err.value)
    assert table.checksum() == before and len(table) == rows and table.step == step


@pytest.mark.parametrize("kwargs, field", [
    ({"dim": 0}, "dim"), ({"dim": 2.5}, "dim"), ({"dtype": "int8"}, "dtype"), ({"name": ""}, "name"),
    ({"optimizer": "sgd"}, "optimizer"), ({"initializer": emb.SGD()}, "initializer"),
    ({"admission": emb.Admission(probability=1.5)}, "admission.probability"),
    ({"eviction": emb.Eviction(policy="fifo")}, "eviction.policy"),
    ({"eviction": emb.Eviction(max_rows=0)}, "eviction.max_rows"),
    ({"memory_budget": -1}, "memory_budget"), ({"backend": "cuda"}, "backend"),
    ({"optimizer": emb.SGD(lr=float("nan"))}, "optimizer.lr"), ({"optimizer": emb.Adagrad(lr=-0.1)}, "optimizer.lr"),
    ({"optimizer": emb.Adam(beta1=1.0)}, "optimizer.beta1"), ({"optimizer": emb.Adam(eps=-1e-8)}, "optimizer.eps"),
    ({"optimizer": emb.FTRL(alpha=0.0)}, "optimizer.alpha"), ({"optimizer": emb.FTRL(l1=-1.0)}, "optimizer.l1"),
    ({"initializer": emb.Normal(std=-0.01)}, "initializer.std"),
    ({"initializer": emb.Uniform(low=1.0, high=-1.0)}, "initializer.low"),
    ({"initializer": emb.Normal(mean=float("inf"))}, "initializer.mean"),
    ({"eviction": emb.Eviction(ttl_steps=-1)}, "eviction.ttl_steps"),
    ({"eviction": emb.Eviction(ttl_seconds=-5.0)}, "eviction.ttl_seconds"),
    ({"eviction": emb.Eviction(ttl_seconds=float("nan"))}, "eviction.ttl_seconds"),
    ({"admission": emb.Admission(min_count=2, max_tracked=0)}, "admission.max_tracked"),
])
def test_bad_config(kwargs: dict, field: str) -> None:
    args = {"name": "clicks", "dim": 4, **kwargs}
    with pytest.raises(emb.InvalidArgument) as err:
        emb.TableConfig(**args)
    assert repr(field) in str(err.value)


def test_unknown_components_and_parameters() -> None:
    with pytest.raises(emb.InvalidArgument, match=r"table 'clicks' optimizer: unknown kind 'adamw'"):
        from_kind(OPTIMIZERS, "adamw", {}, what="table 'clicks' optimizer")
    with pytest.raises(emb.InvalidArgument, match=r"unknown parameter\(s\) \['momentum'\]"):
        from_kind(OPTIMIZERS, "sgd", {"lr": 0.1, "momentum": 0.9}, what="table 'clicks' optimizer")
    with pytest.raises(emb.InvalidArgument, match=r"initializer 'normal': unknown parameter\(s\) \['sigma'\]"):
        from_kind(INITIALIZERS, "normal", {"sigma": 1.0}, what="table 'clicks' initializer")
    with pytest.raises(emb.InvalidArgument, match="'lr' must be a number"):
        from_kind(OPTIMIZERS, "adagrad", {"lr": "fast"}, what="table 'clicks' optimizer")
    assert from_kind(OPTIMIZERS, "rowwise_adagrad", {"lr": 0.5}, what="x") == emb.RowWiseAdagrad(lr=0.5)


def test_closed_table_refuses_work() -> None:
    table = emb.EmbeddingTable(emb.TableConfig("clicks", dim=DIM))
    table.close()
    table.close()
    with pytest.raises(emb.InvalidArgument, match="'clicks': closed"):
        table.pull(np.array([1]))
