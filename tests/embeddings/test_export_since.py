"""``EmbeddingTable.export_rows(since=...)``: the rows a serving delta carries (updated or inserted at or after a
time), resident and spilled alike, against a record of when each id was last written."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tigana.embeddings import SGD, EmbeddingTable, TableConfig, Zeros

DIM = 4


@pytest.mark.parametrize("spill", [False, True])
def test_export_since_selects_the_rows_written_after_a_cut(tmp_path: Path, spill: bool) -> None:
    kw = {"memory_budget": 600, "spill_dir": str(tmp_path / "spill")} if spill else {}
    table = EmbeddingTable(TableConfig("t", dim=DIM, optimizer=SGD(lr=1.0), initializer=Zeros(), **kw))
    try:
        rng = np.random.default_rng(3)
        table.push(np.arange(200), np.ones((200, DIM), np.float32))
        time.sleep(0.02)  # past the 1/128 s a row's time is rounded up to (embeddings/slab.py)
        cut = time.time()
        changed = np.unique(rng.integers(0, 400, 60))  # some stored, some new (inserted by the push)
        table.push(changed, np.ones((changed.size, DIM), np.float32))
        got = table.export_rows(since=cut)
        np.testing.assert_array_equal(got.ids, changed)  # sorted, exactly the rows written after the cut
        np.testing.assert_array_equal(got.weights, table.pull(changed, insert=False))
        assert (got.last_time >= cut).all()
        # with a predicate and ids, as the shard server and a caller combine them
        odd = table.export_rows(lambda ids: ids % 2 == 1, since=cut)
        np.testing.assert_array_equal(odd.ids, changed[changed % 2 == 1])
        some = table.export_rows(ids=np.array([changed[0], 10_000]), since=cut)
        np.testing.assert_array_equal(some.ids, changed[:1])
        assert len(table.export_rows(since=time.time() + 60)) == 0
        assert len(table.export_rows(since=0.0)) == len(table)
    finally:
        table.close()
