"""Admission of new ids: after ``min_count`` sightings and/or with a probability, deterministically.

Sightings of ids not yet in the table are counted in a compact counter table (a ``HashIndex`` whose values are
the counts: 12 bytes per tracked id, cleared when it tracks more than ``Admission.max_tracked`` ids so the long
tail cannot grow it without bound). With ``probability`` < 1 an id is admitted when a hash of
(seed, id, sighting count) falls below it: replicas that see the same pulls admit the same ids.
Not thread-safe: the owning table holds its lock.
"""

from __future__ import annotations

import numpy as np

from tigana.embeddings.config import Admission
from tigana.embeddings.hashtable import Backend, HashIndex
from tigana.embeddings.initializers import uniform_bits, unit_interval
from tigana.embeddings.mixing import mix64

_SALT = 0x41444D4954  # "ADMIT"
_INT32_MAX = np.iinfo(np.int32).max


def is_open(admission: Admission) -> bool:
    """True when every new id is admitted at once (no counting needed)."""
    return admission.min_count <= 1 and admission.probability >= 1.0


class AdmissionFilter:
    """Decides which new ids a table stores."""

    def __init__(self, admission: Admission, seed: int, *, backend: Backend = "auto") -> None:
        self.admission = admission
        self.seed = seed
        self._counts = HashIndex(backend=backend)

    def __len__(self) -> int:
        return len(self._counts)

    @property
    def nbytes(self) -> int:
        return self._counts.nbytes

    def admit(self, ids: np.ndarray, sightings: np.ndarray) -> np.ndarray:
        """Unique absent ids seen ``sightings`` times more -> bool mask of the ids to store now."""
        if is_open(self.admission):
            return np.ones(ids.shape[0], bool)
        pos, count = self._counts.positions(ids)
        known = pos >= 0
        total = np.minimum(sightings.astype(np.int64) + np.where(known, count, 0), _INT32_MAX)
        admitted = total >= max(1, self.admission.min_count)
        if self.admission.probability < 1.0:
            keyed = ids.astype(np.int64).view(np.uint64) ^ mix64(total.astype(np.uint64))
            u = unit_interval(uniform_bits(self.seed, keyed.view(np.int64), 1, salt=_SALT)[:, 0])
            admitted &= u < self.admission.probability
        self._counts.set_values(pos[known & ~admitted], total[known & ~admitted])
        self._counts.delete(ids[known & admitted])
        fresh = ~known & ~admitted
        if len(self._counts) + int(fresh.sum()) > self.admission.max_tracked:
            self._counts.clear()
        self._counts.insert(ids[fresh], total[fresh])
        return admitted

    def forget(self, ids: np.ndarray) -> None:
        """Drop the counts of ids (e.g. inserted by import)."""
        if len(self._counts):
            self._counts.delete(ids)
