"""A published model as ``tigana serve --model DIR`` serves it: every table of it (one ``LogFollower`` each) and
its dense network (a ``Scorer`` the trainer's package builds from a published dense version).

``ModelState`` is one immutable version of all of it, swapped as one attribute (``ModelFollower.state``): a
prediction reads it once, so its rows and its dense weights come from one state, never from two. A state is
made only once every table has a loaded export and a dense version is published; then every poll round that
changed a table or found a newer dense version swaps in a new one.

The scorer is built by a loader given to the follower (``tigana.trainer.predict.load_scorer`` in ``tigana
serve``): the serving package does not import torch; the trainer's package, which defines the models and the
feature hashing, does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tigana.ps.errors import InvalidArgument
from tigana.ps.serving import modeldir
from tigana.ps.serving.tables import Follower, LogFollower, TableState

log = logging.getLogger("tigana.ps.serving")

Lookup = Callable[[str, np.ndarray], np.ndarray]
"""(table, (n,) int64 ids) -> (n, dim) float32 rows of a served table (unknown ids: the default row)."""


class Scorer(Protocol):
    """A model's dense network with its feature transform: raw feature rows -> click probabilities."""

    num_dense: int
    num_sparse: int

    def predict(self, dense: np.ndarray, categorical: np.ndarray, lookup: Lookup) -> np.ndarray:
        """(n, num_dense) float32 raw dense values (NaN: missing) and (n, num_sparse) uint64 raw categorical
        values -> (n,) float32 probabilities, reading rows through ``lookup``."""
        ...


Loader = Callable[[dict[str, Any], bytes], Scorer]
"""(model.json's content, a dense version's file) -> its ``Scorer``."""


@dataclass(frozen=True, eq=False)
class ModelState:
    """One version of a served model: its tables' states, its scorer, and the dense version it was built from."""

    spec: dict[str, Any]
    tables: dict[str, TableState]
    scorer: Scorer
    version: int
    version_time: float
    loaded_time: float

    @property
    def model(self) -> str:
        return str(self.spec["model"])

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        return self.tables[table].lookup(ids)[0]

    def predict(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        return self.scorer.predict(dense, categorical, self.lookup)


class ModelFollower(Follower):
    """Keeps ``state`` (a ``ModelState`` or None) up to date with the model folder ``source`` (see the module
    docstring and ``Follower``)."""

    def __init__(self, source: str | Path, policy: str | float, loader: Loader, *, verify: bool = True,
                 on_swap: Callable[[ModelState], None] | None = None) -> None:
        super().__init__()
        self.source, self.policy, self.loader, self.verify, self.on_swap = Path(source), policy, loader, verify, on_swap
        self.state: ModelState | None = None
        self.followers: dict[str, LogFollower] = {}

    def serving(self) -> str:
        return f"version {self.state.version if self.state else None}"

    @property
    def deltas_applied(self) -> int:
        return sum(f.deltas_applied for f in self.followers.values())

    @property
    def rows_applied(self) -> int:
        return sum(f.rows_applied for f in self.followers.values())

    @property
    def apply_seconds(self) -> float:
        return sum(f.apply_seconds for f in self.followers.values())

    def poll(self) -> bool:
        spec = modeldir.read_spec(self.source)
        if spec is None:
            return False
        tables = [str(t) for t in spec["tables"]]
        if not tables:
            raise InvalidArgument(f"{self.source / modeldir.MODEL_FILE}: field 'tables' is empty")
        for table in tables:
            follower = self.followers.get(table)
            if follower is None:
                follower = self.followers[table] = LogFollower(modeldir.table_log(self.source, table), self.policy,
                                                               verify=self.verify)
            follower.poll()
        entry = modeldir.newest_dense(self.source)
        states = {t: self.followers[t].state for t in tables}
        if entry is None or any(s is None for s in states.values()):
            return False  # not servable yet: every table's first export and a dense version are needed
        cur = self.state
        version = int(entry["version"])
        if cur is not None and cur.version == version and cur.spec == spec:
            if all(states[t] is cur.tables.get(t) for t in tables):
                return False
            scorer = cur.scorer
        else:
            started = time.monotonic()
            scorer = self.loader(spec, modeldir.read_dense(self.source, entry, verify=self.verify))
            log.info("loaded dense version %d of model %r in %.2fs", version, spec["model"],
                     time.monotonic() - started)
        self.state = ModelState(spec=spec, tables=states, scorer=scorer, version=version,  # type: ignore[arg-type]
                                version_time=float(entry["time"]), loaded_time=time.time())
        if self.on_swap is not None:
            self.on_swap(self.state)
        return True
