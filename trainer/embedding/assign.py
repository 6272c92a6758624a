"""Writing whole rows into a PS table: what ``load_state_dict`` does with a TorchRec state dict's weights.

A push carries gradients, which the table's optimizer turns into an update; loading weights needs the rows
themselves written. The client writes complete rows the way a checkpoint restore does (``ImportRows`` through
each slot's primary, replicated like pushes, retried on a map move): the given weights, the optimizer state a
fresh row starts with, no updates counted. One call for all the rows, chunked under the message limit.
"""

from __future__ import annotations

import time

import numpy as np

from tigana.embeddings import RowBatch  # the row block ImportRows carries
from tigana.embeddings.optimizers import initial_state
from tigana.ps.client.checkpoint.restore import _import  # the restore's primary-routed row import


def write_rows(client, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
    """Write ``rows`` (n, dim) float32 as the rows of int64 ``ids`` (n,) of PS table ``table`` (replacing any
    the table holds; their optimizer state restarts). Blocks until every row is acknowledged; returns n.
    Raises ``ValueError`` naming the table for rows that do not fit it, or for repeated ids."""
    info = client.describe_table(table)
    dim = int(info.config.dim)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if ids.ndim != 1 or rows.shape != (ids.shape[0], dim):
        raise ValueError(f"table {table!r}: rows of shape {rows.shape} for {ids.shape[0]} ids, expected "
                         f"({ids.shape[0]}, {dim})")
    if np.unique(ids).shape[0] != ids.shape[0]:
        raise ValueError(f"table {table!r}: the ids to write repeat")
    if not np.isfinite(rows).all():
        raise ValueError(f"table {table!r}: the rows to write hold NaN or Inf")
    n = ids.shape[0]
    if not n:
        return 0
    client.flush()  # every push of this client applied first: the written rows are not overwritten by them
    batch = RowBatch(ids=ids, weights=rows, state=initial_state(info.config.optimizer, n, dim),
                     update_count=np.zeros(n, np.int64), last_step=np.zeros(n, np.int64),
                     last_time=np.full(n, time.time(), np.float64))
    return _import(client.checkpoint_port(), table, batch, 0)
