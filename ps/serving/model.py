"""A published model as ``tigana serve --model DIR`` serves it: every table of it (one ``LogFollower`` each) and
its dense network (a ``Scorer`` the trainer's package builds from a published dense version), one version of
the publish log at a time (``tigana.ps.serving.modeldir``).

``ModelState`` is one immutable version of all of it, swapped as one attribute (``ModelFollower.state``): a
prediction reads it once, so its rows and its dense weights come from one version, never from two.

Which version is served:

- **The newest the gate accepts.** A version newer than the served one is built beside it (every table's log
  applied up to the version's position, its dense version loaded or reused) and checked before it goes live:
  a row or a dense weight that is NaN or infinite refuses it; with a canary file, so does an AUC on it below
  the served version's by more than ``max_auc_drop``. A refused version is logged, counted and never tried
  again; the newest version newer than the served one that passes goes live, else the served one stays.
- **A pinned one.** ``tigana admin publish rollback`` writes ``live.json``: every server swaps at its next
  poll to the newest version at or before the pin that its gate accepts. The last ``keep`` versions are held
  in memory (the served ones and those published between two polls, built on the way: the same deltas), so
  going back to one of them is a swap of one attribute; an older one is rebuilt from the logs. A version
  going live by a rollback is checked for non-finite values only: going back is the operator's choice, not a
  worse AUC. A refused version never
  answers, pinned or not. ``publish resume`` removes the pin.

The scorer is built by a loader given to the follower (``tigana.trainer.predict.load_scorer`` in ``tigana
serve``): the serving package does not import torch; the trainer's package, which defines the models and the
feature hashing, does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tigana.embeddings.config import INITIALIZERS, from_kind
from tigana.embeddings.initializers import initial_rows
from tigana.ps.errors import DataLoss, InvalidArgument
from tigana.ps.serving import modeldir
from tigana.ps.serving.tables import Follower, Initial, LogFollower, Policy, TableState, default_policy

log = logging.getLogger("tigana.ps.serving")

Lookup = Callable[[str, np.ndarray], np.ndarray]
"""(table, (n,) int64 ids) -> (n, dim) float32 rows of a served table (unknown ids: as its unseen policy says)."""


class Scorer(Protocol):
    """A model's dense network with its feature transform: raw feature rows -> click probabilities."""

    num_dense: int
    num_sparse: int
    finite: bool  # every dense weight is finite

    def predict(self, dense: np.ndarray, categorical: np.ndarray, lookup: Lookup) -> np.ndarray:
        """(n, num_dense) float32 raw dense values (NaN: missing) and (n, num_sparse) uint64 raw categorical
        values -> (n,) float32 probabilities, reading rows through ``lookup``."""
        ...

    def canary_auc(self, path: str, lookup: Lookup) -> float:
        """The AUC of this model on the labelled rows of ``path`` (the training data's file format)."""
        ...


Loader = Callable[[dict[str, Any], bytes], Scorer]
"""(model.json's content, a dense version's file) -> its ``Scorer``."""


@dataclass(frozen=True, eq=False)
class ModelState:
    """One version of a served model: its tables' states, its scorer, and the publish log entry it was built
    from."""

    spec: dict[str, Any]
    tables: dict[str, TableState]
    scorer: Scorer
    version: int
    step: int             # the training step of its dense weights
    version_time: float   # the cut it is complete up to
    loaded_time: float
    canary_auc: float = float("nan")

    @property
    def model(self) -> str:
        return str(self.spec["model"])

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        return self.tables[table].lookup(ids)[0]

    def predict(self, dense: np.ndarray, categorical: np.ndarray) -> np.ndarray:
        return self.scorer.predict(dense, categorical, self.lookup)


def _initial_of(spec: dict[str, Any], table: str) -> Initial | None:
    """The initial rows of ``table`` as its shard servers compute them, from ``model.json``'s
    ``initializers`` (``{table: {"kind": ..., <parameters>, "seed": ...}}``); None where it names none."""
    init = dict(spec.get("initializers", {}).get(table) or {})
    if not init:
        return None
    kind, seed, dim = str(init.pop("kind")), int(init.pop("seed", 0)), int(spec["dim"])
    initializer = from_kind(INITIALIZERS, kind, init, what=f"model.json: table {table!r}: initializer")
    return lambda ids: initial_rows(initializer, seed, ids, dim)


class ModelFollower(Follower):
    """Keeps ``state`` (a ``ModelState`` or None) on the version of the model folder ``source`` to serve (see
    the module docstring and ``Follower``). ``canary``: a labelled file the gate scores each new version on;
    ``keep``: versions held for an instant rollback."""

    def __init__(self, source: str | Path, policy: Policy | None, loader: Loader, *, verify: bool = True,
                 on_swap: Callable[[ModelState], None] | None = None, canary: str = "",
                 max_auc_drop: float = 0.01, keep: int = 10) -> None:
        super().__init__()
        self.source, self.policy, self.loader, self.verify, self.on_swap = Path(source), policy, loader, verify, on_swap
        self.canary, self.max_auc_drop, self.keep = canary, max_auc_drop, keep
        self.state: ModelState | None = None
        self.pinned = False
        self.followers: dict[str, LogFollower] = {}
        self.refused: dict[int, str] = {}  # version -> why the gate refused it
        self._held: dict[int, ModelState] = {}  # the last versions built (served or between), oldest first
        self._checked: set[int] = set()  # held versions the gate accepted
        self._scorers: dict[str, Scorer] = {}  # dense sha256 -> its scorer (the held versions' and the newest)

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
        published = modeldir.read_versions(self.source)
        if spec is None or published is None or not published["versions"]:
            return False
        entries = {int(v["version"]): v for v in published["versions"]}
        live = modeldir.read_live(self.source)
        cur = self.state
        self.pinned = live is not None
        if live is not None:  # a rollback: the newest version at or before the pin that passes the gate
            known = {v for v in (*entries, *self._held) if v <= live and v not in self.refused}
            if not known:
                raise InvalidArgument(f"{self.source / modeldir.LIVE_FILE}: pins version {live}; no version at or "
                                      "before it is kept or acceptable")
            candidates = sorted(known, reverse=True)
        else:  # the newest version newer than the served one that the gate accepts
            newer = sorted(v for v in entries if v not in self.refused and (cur is None or v > cur.version))
            for v in newer[-self.keep:-1]:  # the versions between, held for a rollback: the same deltas applied
                if v not in self._held:
                    self._hold(self._build(spec, entries[v], score=False))
            candidates = newer[::-1]
        for target in candidates:
            if cur is not None and cur.version == target:
                return False
            state = self._held.get(target)
            if state is None or target not in self._checked:
                state = state or self._build(spec, entries[target])
                # the operator chose to go back: only a broken version is refused then, not a worse AUC
                why = self._refusal(state, cur if live is None else None)
                if why:
                    self.refused[target] = why
                    self._held.pop(target, None)
                    log.error("model version %d refused, serving %s: %s", target,
                              cur.version if cur is not None else "nothing", why)
                    continue
                self._checked.add(target)
            if self.canary and state.canary_auc != state.canary_auc:  # built on the way, unscored: the next
                # version's gate compares with the live one's AUC
                state = dataclasses.replace(state, canary_auc=state.scorer.canary_auc(self.canary, state.lookup))
            self._hold(state)
            self.state = state
            log.info("serving model %r version %d (step %d)%s", state.model, state.version, state.step,
                     " (pinned by a rollback)" if live is not None else "")
            if self.on_swap is not None:
                self.on_swap(state)
            return True
        return False

    def _hold(self, state: ModelState) -> None:
        """Hold ``state`` as the newest of the last ``keep`` versions (a rollback to one of them is a swap)."""
        self._held.pop(state.version, None)
        self._held[state.version] = state
        while len(self._held) > self.keep:
            self._checked.discard(self._held.pop(next(iter(self._held))).version)
        held_dense = {id(s.scorer) for s in self._held.values()}
        self._scorers = {k: v for k, v in self._scorers.items() if id(v) in held_dense}

    def _build(self, spec: dict[str, Any], entry: dict[str, Any], score: bool = True) -> ModelState:
        """The state of publish log entry ``entry``: each table's log applied up to its position, its dense
        version's scorer (loaded once per dense version); ``score``: its canary AUC too."""
        tables: dict[str, TableState] = {}
        for table, position in entry["tables"].items():
            follower = self.followers.get(table)
            if follower is None:
                if self.policy is None:  # the trainer's: its evaluation read unseen ids so
                    self.policy = default_policy(spec.get("unseen", "zeros"))
                follower = self.followers[table] = LogFollower(modeldir.table_log(self.source, table), self.policy,
                                                               verify=self.verify, initial=_initial_of(spec, table))
            follower.poll(upto=int(position["seq"]))
            got = follower.state
            if got is None or got.log_id != position["log_id"] or got.seq != int(position["seq"]):
                raise DataLoss(f"model version {entry['version']}: table {table!r} at entry {position['seq']} of log "
                               f"{position['log_id']}; its log has {got.seq if got else None} of "
                               f"{got.log_id if got else None}")
            tables[table] = got
        dense = entry["dense"]
        scorer = self._scorers.get(dense["sha256"])
        if scorer is None:
            started = time.monotonic()
            scorer = self.loader(spec, modeldir.read_dense(self.source, dense, verify=self.verify))
            self._scorers[dense["sha256"]] = scorer
            log.info("loaded dense weights of step %d of model %r in %.2fs", int(dense["version"]), spec["model"],
                     time.monotonic() - started)
        state = ModelState(spec=spec, tables=tables, scorer=scorer, version=int(entry["version"]),
                           step=int(entry["step"]), version_time=float(entry["time"]), loaded_time=time.time())
        if self.canary and score:
            state = dataclasses.replace(state, canary_auc=scorer.canary_auc(self.canary, state.lookup))
        return state

    def _refusal(self, new: ModelState, live: ModelState | None) -> str:
        """Why the gate refuses ``new`` against the ``live`` version ('' when it goes live)."""
        bad = {t: int(s.bad_ids.size) for t, s in new.tables.items() if s.bad_ids.size}
        if bad:
            return f"rows holding NaN or infinity: {bad}"
        if not new.scorer.finite:
            return f"dense weights of step {new.step} hold NaN or infinity"
        if self.canary and live is not None and not new.canary_auc >= live.canary_auc - self.max_auc_drop:
            return (f"canary AUC {new.canary_auc:.4f} is below the served version's {live.canary_auc:.4f} by more "
                    f"than {self.max_auc_drop}")
        return ""
