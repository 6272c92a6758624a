"""The state every room of ``EmbeddingTable`` shares, and the input checks they all use.

``EmbeddingTable`` is assembled from one mixin per concept (``_spilling``, ``_evicting``, ``_exporting``,
``_persisting``, ``cut``), each a subclass of ``TableFields``, which declares the fields the table's
``__init__`` sets and the methods one room calls in another, so that each room reads (and type-checks) alone.
Not thread-safe on its own: every caller holds the table's lock, except the pure input checks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tigana.embeddings._slotpins import SlotPins
from tigana.embeddings.changes import Changes, unique
from tigana.embeddings.config import TableConfig
from tigana.embeddings.errors import InvalidArgument
from tigana.embeddings.partitioned import PartitionedIndex
from tigana.embeddings.rows import RowBatch
from tigana.embeddings.slab import ACCESS_MAX, Slab

if TYPE_CHECKING:
    from tigana.embeddings import admission
    from tigana.embeddings.cut import Cut
    from tigana.embeddings.spillfile import SpillFile
    from tigana.embeddings.tombstones import Tombstones

_INT64_MAX = np.iinfo(np.int64).max


class TableFields:
    """Fields of one table (set by ``EmbeddingTable.__init__``) and its input checks."""

    config: TableConfig
    _backend: str
    _lock: threading.RLock
    _width: int
    _index: PartitionedIndex  # resident ids -> slab positions (grows a part at a time)
    _slab: Slab
    _admission: admission.AdmissionFilter
    _open_admission: bool
    _step: int
    _clock: int  # access clock: +1 per pull/push (``_tick``), stamped into last_access
    _deleted: list[np.ndarray]  # ids removed since the last tracked snapshot (only while there is one)
    _pending_marks: tuple[int, ...]  # marks, besides the current one, of rows a failed snapshot gave back
    _spill: SpillFile | None
    _spilled: PartitionedIndex  # ids living only in the spill file -> their slot in it (grows a part at a time)
    _spill_marks: np.ndarray  # uint8 per spill slot: the dirty mark its row spilled with
    _spill_pins: SlotPins  # spill slots open cuts still read from (kept from reuse until they have)
    _budget_rows: int
    _budget_bytes: int
    _budget_warned: bool  # the spilled-id index overran the budget and was logged once
    _spill_path: Path
    _last_snapshot: Path | None
    _finalizer: weakref.finalize | None
    _last_ttl_scan: tuple[int, float]
    _closed: bool
    _changes: Changes | None
    _evictable: Callable[[np.ndarray], np.ndarray] | None
    _protected: int
    _spill_cursor: float  # where in the spilled index the eviction's next window starts (``Evicting._cursor_place``)
    _sweep_left: int
    _counters: dict[str, int]
    _corrupt: np.ndarray
    _cuts: list[Cut]  # open cuts, which writes preserve what they have not read for (``cut``)
    _snapshot_turn: threading.RLock
    _tombstones: Tombstones  # ids eviction removed, and when (serving deltas tell readers to forget them)

    if TYPE_CHECKING:  # the methods one room calls in another
        def _remove(self, ids: np.ndarray, *, tombstone: bool = False) -> int: ...
        def _maybe_spill(self) -> None: ...
        def _spill_rows(self, ids: np.ndarray, *, skip_corrupt: bool = False) -> RowBatch: ...
        def _drop_spilled(self, ids: np.ndarray, vals: np.ndarray | None = None) -> None: ...
        def _spill_marks_of(self, vals: np.ndarray) -> np.ndarray: ...
        def _note_corrupt(self, corrupt: list[int]) -> None: ...
        def _import(self, b: RowBatch) -> None: ...
        def _cow_update(self, positions: np.ndarray) -> None: ...
        def _cow_remove(self, ids: np.ndarray, positions: np.ndarray) -> None: ...
        def _cow_fresh(self, positions: np.ndarray) -> None: ...
        def _cow_unspill(self, ids: np.ndarray) -> None: ...
        def _cow_spill(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None: ...
        def _cow_move(self, ids: np.ndarray, positions: np.ndarray) -> None: ...
        def _cuts_nbytes(self) -> int: ...
        def _set_spill_marks(self, slots: np.ndarray, marks: np.ndarray) -> None: ...
        def _cow_spilled(self, ids: np.ndarray) -> None: ...
        def cut(self) -> Cut: ...
        def __len__(self) -> int: ...

    # --- properties ----------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def state_width(self) -> int:
        return self._width

    @property
    def backend(self) -> str:
        """'numba' or 'numpy': which kernels this table runs."""
        return self._backend

    @property
    def step(self) -> int:
        """Table step: +1 per push, or the ``step=`` a push gave."""
        return self._step

    def _tick(self) -> None:
        """Advance the access clock (under the lock). Rows hold it as uint32: at ``ACCESS_MAX`` the clock and
        every row's copy of it are halved, which keeps their order (once per 2**31 calls)."""
        self._clock += 1
        if self._clock > ACCESS_MAX:
            self._slab.halve_access()
            self._clock >>= 1

    # --- checks --------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"table {self.name!r}: closed")

    def _bad(self, field: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"table {self.name!r}: field {field!r} {why}")

    def _check_ids(self, ids: object, field: str = "ids") -> np.ndarray:
        try:
            a = np.asarray(ids)
        except Exception as exc:  # ragged lists and the like
            raise self._bad(field, f"is not an array of ids: {exc}") from None
        if a.ndim != 1:
            raise self._bad(field, f"must be 1-D, got shape {a.shape}")
        if a.size == 0:
            return np.empty(0, np.int64)
        if a.dtype.kind == "i":
            return np.ascontiguousarray(a, np.int64)
        if a.dtype.kind == "u":
            if a.dtype.itemsize == 8 and int(a.max()) > _INT64_MAX:
                raise self._bad(field, f"has values above 2**63-1 (max {int(a.max())})")
            return np.ascontiguousarray(a, np.int64)
        raise self._bad(field, f"must be int64 (any integer dtype), got {a.dtype}")

    def _check_grads(self, grads: object, n: int, field: str = "grads") -> np.ndarray:
        try:
            g = np.asarray(grads)
        except Exception as exc:
            raise self._bad(field, f"is not an array: {exc}") from None
        if g.dtype.kind != "f":
            raise self._bad(field, f"must be float32, got {g.dtype}")
        if g.shape != (n, self.dim):
            if g.ndim == 2 and g.shape[0] == n:
                raise self._bad(field, f"has dim {g.shape[1]} but the table's dim is {self.dim}")
            raise self._bad(field, f"must have shape ({n}, {self.dim}) to match ids, got {g.shape}")
        if g.dtype == np.float32:  # nothing to narrow (``errstate`` costs a small batch's check three times over)
            return np.ascontiguousarray(g)
        with np.errstate(over="ignore"):  # float64 beyond float32 becomes Inf, which push then rejects
            return np.ascontiguousarray(g, np.float32)

    def _check_batch(self, batch: RowBatch, *, check_values: bool = True) -> RowBatch:
        if not isinstance(batch, RowBatch):
            raise self._bad("batch", f"must be a RowBatch, got {type(batch).__name__}")
        ids = self._check_ids(batch.ids, "batch.ids")
        n = ids.shape[0]
        if unique(ids).shape[0] != n:
            raise self._bad("batch.ids", "must be unique")
        weights = self._check_grads(batch.weights, n, "batch.weights")
        if check_values and not np.isfinite(weights).all():
            raise self._bad("batch.weights", "has NaN/Inf")
        state = np.asarray(batch.state)
        if state.shape != (n, self._width) or state.dtype.kind != "f":
            raise self._bad("batch.state", f"must be float of shape ({n}, {self._width}), got {state.dtype} "
                                           f"{state.shape}")
        out = [ids, weights, np.ascontiguousarray(state, np.float32)]
        for field, dt in (("update_count", np.int64), ("last_step", np.int64), ("last_time", np.float64)):
            a = np.asarray(getattr(batch, field))
            if a.shape != (n,) or a.dtype.kind not in ("i", "u", "f"):
                raise self._bad(f"batch.{field}", f"must be numeric of shape ({n},), got {a.dtype} {a.shape}")
            out.append(a.astype(dt))
        return RowBatch(*out)
