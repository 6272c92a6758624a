"""What a read-only lookup answers for an id a table does not hold (never trained, not admitted, or evicted):
one policy, shared by the trainer's evaluation (read-only pulls, answered by the shard servers) and
``tigana serve`` (its export-log tables), so that a served score is the score evaluation gives.

``Unseen.parse(text)`` reads the setting both take (``unseen`` in a training config, ``--unseen`` of
``tigana serve``); ``Unseen.rows`` builds the rows it names. The values:

- ``zeros`` (the default): every element 0, so an unseen id adds nothing to a pooled feature;
- a number, e.g. ``0.01``: every element that number (float32);
- ``initial``: the row the table's initializer would give the id (``initializers.initial_rows``, a pure
  function of the table's seed and the id), the row it starts from if training ever inserts it.

Example::

    policy = Unseen.parse("zeros")
    rows[~found] = policy.rows(ids[~found], dim)   # (k,) int64 -> (k, dim) float32
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tigana.embeddings.errors import InvalidArgument

__all__ = ["INITIAL", "Unseen"]

INITIAL = "initial"


@dataclass(frozen=True)
class Unseen:
    """The policy: ``value`` fills every element of an unseen id's row; None means the initializer's row."""

    value: float | None = 0.0

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def parse(text: str | float, *, what: str = "unseen") -> Unseen:
        """``zeros``, ``initial`` or a finite number (a float, or text that reads as one). Raises
        ``InvalidArgument`` naming ``what`` for anything else."""
        if text == "zeros":
            return Unseen(0.0)
        if text == INITIAL:
            return Unseen(None)
        try:
            value = float(text) if isinstance(text, (str, int, float)) and not isinstance(text, bool) else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise InvalidArgument(f"{what} must be 'zeros', 'initial' or a finite number, got {text!r}")
        return Unseen(value)

    def __str__(self) -> str:
        """The text ``parse`` reads back to this policy."""
        if self.value is None:
            return INITIAL
        return "zeros" if self.value == 0.0 else repr(float(self.value))

    def rows(self, ids: np.ndarray, dim: int,
             initial: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """(k,) int64 ids -> (k, dim) float32 rows. ``initial`` (ids -> their initial rows) is needed only by
        the ``initial`` policy (a ``ValueError`` without it)."""
        if self.value is None:
            if initial is None:
                raise ValueError("unseen 'initial' needs the table's initializer")
            return np.asarray(initial(ids), np.float32)
        return np.full((ids.shape[0], dim), self.value, np.float32)
