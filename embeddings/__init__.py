"""tigana.embeddings — the storage engine: sparse embedding tables keyed by arbitrary int64 ids.

A table maps ids to rows (float32, or float16/bfloat16 storage) through a growable hash index, initializes
missing rows deterministically from (seed, id), applies sparse optimizers to deduplicated gradient batches,
admits and evicts rows, spills cold rows to a file on disk past a memory budget, and writes crash-safe full and
incremental snapshots. Whole-table reads (snapshots, full exports, checksums) go through a ``Cut``
(``table.cut()``): the rows at one point in the write order, read in chunks while writes go on. No networking:
``tigana.ps`` serves these tables.

Example::

    from tigana import embeddings as emb
    table = emb.EmbeddingTable(emb.TableConfig("user_id", dim=16, optimizer=emb.RowWiseAdagrad(lr=0.05)))
    rows = table.pull(ids)            # (n,) int64 -> (n, 16) float32
    table.push(ids, grads)            # grads (n, 16) float32; duplicates are summed
"""

from tigana.embeddings._checksum import row_digests
from tigana.embeddings._persisting import PendingSnapshot
from tigana.embeddings.changes import Changes
from tigana.embeddings.config import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Admission,
    Eviction,
    Initializer,
    Normal,
    Optimizer,
    RowWiseAdagrad,
    TableConfig,
    Uniform,
    Zeros,
)
from tigana.embeddings.cut import Cut
from tigana.embeddings.errors import (
    CorruptStore,
    EmbeddingError,
    InvalidArgument,
    SnapshotNotFound,
    StorageError,
    StorageFull,
)
from tigana.embeddings.hashtable import HashIndex
from tigana.embeddings.rows import RowBatch
from tigana.embeddings.table import EmbeddingTable

__all__ = [
    "FTRL", "SGD", "Adagrad", "Adam", "Admission", "Changes", "CorruptStore", "Cut", "EmbeddingError",
    "EmbeddingTable",
    "Eviction", "HashIndex", "Initializer", "InvalidArgument", "Normal", "Optimizer", "PendingSnapshot", "RowBatch",
    "RowWiseAdagrad", "SnapshotNotFound", "StorageError", "StorageFull", "TableConfig", "Uniform", "Zeros",
    "row_digests",
]
