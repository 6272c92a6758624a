"""Compile (or load from numba's cache) the kernels a shard server runs, before it joins a cluster.

A kernel is compiled on first use, and numba holds the GIL while it compiles: about 3 s for a cold process.
A server that met its first pull that way starved its own heartbeat thread, and a scheduler declared it dead
(every server of a freshly started cluster at once, when the first pushes reached them together). The
daemon therefore runs ``warm_kernels`` before it registers: the heartbeats start only afterwards.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from tigana.embeddings import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Changes,
    EmbeddingTable,
    Normal,
    RowWiseAdagrad,
    TableConfig,
)
from tigana.proto import shard_pb2 as pb
from tigana.ps import _kernels
from tigana.ps.routing import slot_of
from tigana.ps.wire import data as wire

log = logging.getLogger("tigana.ps.shard.warmup")

__all__ = ["warm_kernels"]


def warm_kernels(num_slots: int = 4096) -> float:
    """Run every hot kernel once on a few rows (in memory, no I/O): the tables' pull, push, changes, export,
    import and listing by slot for each optimizer, the wire codecs, the slot and dedup kernels (a kernel's first
    call under a table's lock held pushes while it loaded: ``SlotInfo`` at a move's start). Returns the seconds
    it took."""
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    ids = rng.integers(-(2**62), 2**62, size=64, dtype=np.int64)
    ids = np.concatenate([ids, ids[:8]])
    wanted = np.arange(num_slots) % 2 == 0
    for optimizer in (SGD(lr=0.1), Adagrad(lr=0.1), RowWiseAdagrad(lr=0.1), Adam(lr=0.01), FTRL(alpha=0.1)):
        table = EmbeddingTable(TableConfig("warm", dim=8, optimizer=optimizer, initializer=Normal(std=0.01)))
        try:
            changes = Changes()
            table.pull(ids, changes=changes)
            table.push(ids, rng.normal(size=(ids.size, 8)).astype(np.float32), changes=changes)
            rows = changes.written_rows(table.rows_of)
            table.apply_changes(rows, None, None, table.step, check_values=False)
            table.export_rows(ids=ids)
            # a slot copy's ends: the target's contains/import, the source's listing by slot, the drop after
            table.contains(ids)
            table.import_rows(rows)
            table.stored_ids_in_slots(num_slots, wanted)
            table.rows_per_slot(num_slots)
            table.delete(ids[:8])
        finally:
            table.close()
    grads = rng.normal(size=(ids.size, 8)).astype(np.float32)
    for codec in (pb.CODEC_FP32, pb.CODEC_FP16, pb.CODEC_BF16, pb.CODEC_INT8):
        raw = wire.encode_rows(grads, codec)
        wire.decode_rows(raw, ids.size, 8, table="warm", field="grads")
    group_of_slot = (np.arange(num_slots) % 2).astype(np.int32)
    slots, _, _ = _kernels.slots_foreign(ids, np.ones(num_slots, bool))
    _kernels.count_into(slots, np.zeros(num_slots))
    _kernels.first_nonfinite_row(grads.view(np.uint32))
    _kernels.dedup_grouped(ids, group_of_slot, 2)
    _kernels.dedup_sum_grouped(ids, grads, group_of_slot, 2)
    slot_of(ids, num_slots)
    seconds = time.perf_counter() - started
    log.info("kernels ready in %.2fs", seconds)
    return seconds
