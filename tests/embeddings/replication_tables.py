"""Tables for the tests of what the storage engine offers replication: the backends, ids at the int64 edges,
admission and eviction settings, a table's rows and sighting counts as comparable values, and ``replicate``
(one call's ``Changes`` shipped to a replica as tigana.ps does)."""

from __future__ import annotations

import numpy as np

from tigana import embeddings as emb
from tigana.embeddings import _kernels

BACKENDS = ["numpy"] + (["numba"] if _kernels.AVAILABLE else [])
DIM = 4
EDGES = [0, -1, 2**63 - 1, -(2**63)]
ADMISSIONS = {"open": emb.Admission(), "min2": emb.Admission(min_count=2)}
EVICTIONS = {
    "cap_lru": emb.Eviction(max_rows=8),
    "cap_lfu": emb.Eviction(max_rows=8, policy="lfu"),
    "ttl": emb.Eviction(ttl_steps=3),
    "cap_ttl": emb.Eviction(max_rows=8, ttl_steps=3),
}


def never(ids: np.ndarray) -> np.ndarray:
    return np.zeros(len(ids), bool)


def config(backend: str, **kw) -> emb.TableConfig:
    kw.setdefault("optimizer", emb.Adagrad(lr=0.1))
    kw.setdefault("initializer", emb.Uniform(-1, 1))
    return emb.TableConfig("clicks", dim=DIM, backend=backend, **kw)


def row_bytes(backend: str, **kw) -> int:
    """Resident bytes of one row (slab columns + its share of the hash index)."""
    t = emb.EmbeddingTable(config(backend, **kw))
    try:
        return int(t.stats()["row_bytes"]) + 18
    finally:
        t.close()


def admission_counts(table: emb.EmbeddingTable) -> dict[int, int]:
    """The sighting counts of ids not yet admitted (the state a replica must mirror to fail over)."""
    ids, counts = table._admission._counts.items()
    return dict(zip(ids.tolist(), counts.tolist(), strict=True))


def rows_by_id(table: emb.EmbeddingTable) -> dict[int, tuple]:
    return rows_of_batch(table.export_rows())


def replicate(primary: emb.EmbeddingTable, replica: emb.EmbeddingTable, changes: emb.Changes) -> None:
    """Ship what one call on ``primary`` changed to ``replica``, as tigana.ps does: the rows a push exported
    as it wrote them (checked against the rows read back), else the written rows read back."""
    deleted = changes.deleted_ids()
    deleted = deleted[~primary.contains(deleted)]
    rows = changes.written_rows(primary.rows_of)
    if changes.rows is not None:
        check_export(primary, changes, deleted)
    replica.apply_changes(rows=rows, deleted=deleted, sightings=changes.sighting_arrays(), step=primary.step)


def check_export(table: emb.EmbeddingTable, changes: emb.Changes, deleted: np.ndarray) -> None:
    """A call's own export of its rows is what reading them back gives, bit for bit, metadata included; it
    names every id written once, and the ids it holds that are no longer stored are among the removals."""
    exported = changes.rows
    written = changes.written_ids()
    assert exported is not None and np.unique(exported.ids).size == len(exported)
    assert set(exported.ids.tolist()) == set(written.tolist())
    back = rows_of_batch(table.rows_of(written))
    mine = rows_of_batch(exported)
    assert {i: mine[i] for i in back} == back
    assert set(mine) - set(back) <= set(deleted.tolist())


def rows_of_batch(rows: emb.RowBatch) -> dict[int, tuple]:
    return {i: (rows.weights[k].tobytes(), rows.state[k].tobytes(), int(rows.update_count[k]),
                int(rows.last_step[k]), float(rows.last_time[k])) for k, i in enumerate(rows.ids.tolist())}


def zeros(n: int) -> np.ndarray:
    return np.zeros((n, DIM), np.float32)
