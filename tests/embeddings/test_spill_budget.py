"""The memory budget covers the resident rows and the in-memory index of spilled ids: as the spill tier grows,
fewer rows stay resident, so the engine's memory stays within the budget however many rows spill."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tigana import embeddings as emb
from tigana.embeddings._spilling import _INDEX_BYTES_PER_ROW


def test_the_index_of_spilled_ids_counts_against_the_budget(tmp_path: Path) -> None:
    budget = 8 << 20
    t = emb.EmbeddingTable(emb.TableConfig("t", dim=8, optimizer=emb.RowWiseAdagrad(), initializer=emb.Zeros(),
                                           memory_budget=budget, spill_dir=str(tmp_path)))
    try:
        per_row = t._slab.row_nbytes + _INDEX_BYTES_PER_ROW
        for start in range(0, 200_000, 4096):
            t.pull(np.arange(start, start + 4096))
            resident = len(t._index) * per_row + t._spilled.nbytes
            assert resident <= budget, (start, resident)
        st = t.stats()
        assert st["rows_spilled"] > 100_000 and st["rows_resident"] < budget // per_row
        assert st["rows"] == 49 * 4096
        np.testing.assert_array_equal(t.pull(np.arange(10), insert=False), np.zeros((10, 8), np.float32))
    finally:
        t.close()
