"""The served tables of ``tigana serve``: ``TableState`` (one immutable version of a table: a sorted base and a
small overlay, looked up with ``np.searchsorted``) and ``LogFollower`` (keeps one up to date with an export
log). The design notes are ``tigana.ps.serving.server``'s."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tigana.embeddings.changes import find_sorted
from tigana.embeddings.errors import InvalidArgument as EngineInvalidArgument
from tigana.embeddings.unseen import Unseen
from tigana.ps.errors import InvalidArgument
from tigana.ps.serving import exportlog

log = logging.getLogger("tigana.ps.serving")

_FOLD_MIN_ROWS = 65536


Policy = Unseen | str
"""What an id the served table lacks reads as: an ``Unseen`` policy (the one the trainer's evaluation shares:
zeros, a number, the initializer's row), or ``"mean"`` (the mean row; ``--from`` only)."""

Initial = Callable[[np.ndarray], np.ndarray]
"""(k,) int64 ids -> (k, dim) float32: the rows a table's initializer gives them (``unseen`` initial)."""


def default_policy(text: str | float) -> Unseen | str:
    """``--unseen``: ``zeros``, ``initial``, a number (``tigana.embeddings.unseen``), or ``mean``."""
    if text == "mean":
        return "mean"
    try:
        return Unseen.parse(text, what="serve: --unseen")
    except EngineInvalidArgument as exc:
        raise InvalidArgument(f"{exc} (or 'mean' with --from)") from None


@dataclass(frozen=True, eq=False)
class TableState:
    """One immutable version of the served table (see the module doc). ``seq``: the newest log entry in it."""

    table: str
    dim: int
    ids: np.ndarray          # (n,) int64, sorted, unique: the base
    rows: np.ndarray         # (n, dim) float32
    over_ids: np.ndarray     # (m,) int64, sorted, unique: rows changed since the base was built (they win)
    over_rows: np.ndarray    # (m, dim) float32
    default_row: np.ndarray  # (dim,) float32: the mean row ("mean"), else the constant row of ``unseen``
    size: int                # distinct ids held
    seq: int
    base_seq: int
    log_id: str
    data_time: float         # the cluster cut the state is complete up to
    loaded_time: float       # this server's clock when it was built
    bad_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    # ^ sorted ids whose row holds a NaN or an infinity: a model's validation gate refuses such a state
    gone_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    # ^ sorted ids of the base that tombstones removed since it was built (they read as unknown)
    unseen: Unseen | None = None  # what an unknown id reads as (None: ``default_row``, the mean row)
    initial: Initial | None = None  # the table's initializer's rows (``unseen`` initial needs them)

    @classmethod
    def build(cls, table: str, ids: np.ndarray, rows: np.ndarray, policy: Policy | float, **meta: Any
              ) -> TableState:
        """A state with no overlay (a full load or a fold), its default row computed from ``rows``. ``policy``:
        a ``Policy``, or the text or number ``default_policy`` reads as one."""
        dim = rows.shape[1]
        if not isinstance(policy, Unseen) and policy != "mean":
            policy = default_policy(policy)
        if isinstance(policy, Unseen):
            if policy.value is None and meta.get("initial") is None:
                raise InvalidArgument(f"table {table!r}: unseen 'initial' needs the table's initializer (a model's "
                                      "model.json names it)")
            default = np.full(dim, 0.0 if policy.value is None else policy.value, np.float32)
        elif len(rows):  # "mean"
            default = rows.mean(axis=0, dtype=np.float64).astype(np.float32)
        else:
            default = np.zeros(dim, np.float32)
        meta.setdefault("bad_ids", ids[~np.isfinite(rows).all(axis=1)])
        return cls(table=table, dim=dim, ids=ids, rows=rows, over_ids=ids[:0], over_rows=rows[:0],
                   default_row=default, size=int(ids.size), loaded_time=time.time(),
                   unseen=policy if isinstance(policy, Unseen) else None, **meta)

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n,) int64 -> ((n, dim) float32 rows, (n,) bool found); unknown ids get the default row."""
        out = np.empty((ids.size, self.dim), np.float32)
        found_over = find_sorted(self.over_ids, ids)
        found_base = find_sorted(self.ids, ids)
        in_over = found_over >= 0
        in_base = (found_base >= 0) & ~in_over
        if self.gone_ids.size:
            in_base &= find_sorted(self.gone_ids, ids) < 0
        out[in_over] = self.over_rows[found_over[in_over]]
        out[in_base] = self.rows[found_base[in_base]]
        found = in_over | in_base
        if self.unseen is None:
            out[~found] = self.default_row
        elif not found.all():  # the rows the shard servers give a read-only pull of these ids
            out[~found] = self.unseen.rows(ids[~found], self.dim, self.initial)
        return out, found

    def with_delta(self, ids: np.ndarray, rows: np.ndarray, policy: Policy,
                   deleted: np.ndarray | None = None, **meta: Any) -> TableState:
        """A new state with a delta's rows (sorted unique ids) applied, then its tombstones (``deleted``,
        sorted unique ids) forgotten; folds the overlay into the base when it has grown past 1/16 of it."""
        over_ids, over_rows = exportlog.merge(self.over_ids, self.over_rows, ids, rows)
        # the delta's rows replace theirs: bad ids it wrote finite leave the set, the ones it wrote bad join it
        bad = np.union1d(np.setdiff1d(self.bad_ids, ids), ids[~np.isfinite(rows).all(axis=1)])
        gone = np.setdiff1d(self.gone_ids, ids)  # written again: back
        if deleted is not None and deleted.size:
            keep = find_sorted(deleted, over_ids) < 0
            over_ids, over_rows = over_ids[keep], over_rows[keep]
            gone = np.union1d(gone, deleted[find_sorted(self.ids, deleted) >= 0])
            bad = np.setdiff1d(bad, deleted)
        meta["bad_ids"] = bad
        if over_ids.size + gone.size >= max(_FOLD_MIN_ROWS, self.ids.size // 16):
            base_ids, base_rows = exportlog.merge(self.ids, self.rows, over_ids, over_rows)
            if gone.size:
                keep = find_sorted(gone, base_ids) < 0
                base_ids, base_rows = base_ids[keep], base_rows[keep]
            return TableState.build(self.table, base_ids, base_rows, policy, base_seq=self.base_seq,
                                    log_id=self.log_id, initial=self.initial, **meta)
        fresh = int((find_sorted(self.ids, over_ids) < 0).sum())
        return dataclasses.replace(self, over_ids=over_ids, over_rows=over_rows, gone_ids=gone,
                                   size=int(self.ids.size) - int(gone.size) + fresh, loaded_time=time.time(),
                                   **meta)


class Follower:
    """Polls a source in a thread: ``poll()`` does one round (tests call it directly) and returns whether the
    served state changed; ``start(poll_s)`` runs it every ``poll_s`` until ``stop()``. A failed round keeps the
    state it had (logged once per distinct error, kept in ``error``); an entry deleted under the reader by a
    compaction only makes the next round read the manifest again."""

    source: Path

    def __init__(self) -> None:
        self.error: str = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> bool:
        raise NotImplementedError

    def serving(self) -> str:
        """What is served now, for the log line of a failed round."""
        raise NotImplementedError

    def start(self, poll_s: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(poll_s,), name="tigana-serve-follow", daemon=True)
        self._thread.start()

    def _run(self, poll_s: float) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
                self.error = ""
            except FileNotFoundError as exc:  # an entry pruned under us by a compaction: read the manifest again
                log.info("export log entry gone (%s); re-reading the manifest", exc)
            except Exception as exc:  # noqa: BLE001 - a bad entry must not stop serving the state we have
                message = f"{type(exc).__name__}: {exc}"
                if message != self.error:
                    log.error("following %s failed (serving %s meanwhile): %s", self.source, self.serving(),
                              message)
                self.error = message
            self._stop.wait(poll_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class LogFollower(Follower):
    """Keeps ``state`` (a ``TableState`` or None) up to date with the export log in ``source`` (see
    ``Follower``)."""

    def __init__(self, source: str | Path, policy: Policy | float, *, verify: bool = True,
                 on_swap: Any = None, initial: Initial | None = None) -> None:
        super().__init__()
        if not isinstance(policy, Unseen) and policy != "mean":
            policy = default_policy(policy)
        self.source, self.policy, self.verify, self.on_swap = Path(source), policy, verify, on_swap
        self.initial = initial
        self.state: TableState | None = None
        self.deltas_applied = 0
        self.rows_applied = 0
        self.apply_seconds = 0.0

    def serving(self) -> str:
        return f"seq {self.state.seq if self.state else None}"

    def poll(self, upto: int | None = None) -> bool:
        """Read the manifest and apply what is new; True when the state changed. ``upto``: the state as of
        log entry ``upto`` exactly (a model version's position: entries after it are left for later, and a
        state past it is rebuilt from the base). Raises what reading raised (the state is unchanged then)."""
        m = exportlog.read_manifest(self.source)
        cur = self.state
        if m is None:
            return False
        if upto is None and cur is not None and m["log_id"] == cur.log_id and m["seq"] == cur.seq \
                and float(m["time"]) <= cur.data_time:
            return False
        if upto is not None and cur is not None and m["log_id"] == cur.log_id and cur.seq == upto:
            return False
        base = m["base"]
        if cur is None or m["log_id"] != cur.log_id or int(base["seq"]) != cur.base_seq or \
                (upto is not None and cur.seq > upto):
            if upto is not None and int(base["seq"]) > upto:
                raise InvalidArgument(f"export log {str(self.source)!r}: entry {upto} was compacted away (the base "
                                      f"is entry {base['seq']})")
            started = time.monotonic()
            ids, rows = exportlog.load_entry(self.source, base, verify=self.verify)
            new = TableState.build(m["table"], ids, rows, self.policy, base_seq=int(base["seq"]),
                                   log_id=m["log_id"], seq=int(base["seq"]), data_time=float(base["time"]),
                                   initial=self.initial)
            log.info("loaded %s (%d rows) of table %r in %.2fs", base["path"], ids.size, m["table"],
                     time.monotonic() - started)
            pending = m["deltas"]
        else:
            new = cur
            pending = [e for e in m["deltas"] if int(e["seq"]) > cur.seq]
        if upto is not None:
            pending = [e for e in pending if int(e["seq"]) <= upto]
        for entry in pending:
            started = time.monotonic()
            ids, rows = exportlog.load_entry(self.source, entry, verify=self.verify)
            deleted = exportlog.load_deleted(self.source, entry, verify=self.verify)
            new = new.with_delta(ids, rows, self.policy, deleted, seq=int(entry["seq"]),
                                 data_time=float(entry["time"]))
            self.deltas_applied += 1
            self.rows_applied += int(ids.size)
            self.apply_seconds += time.monotonic() - started
        if upto is None and (new.seq, new.data_time) != (int(m["seq"]), float(m["time"])):
            new = dataclasses.replace(new, seq=int(m["seq"]), data_time=float(m["time"]))  # empty deltas: time
        elif upto is not None and new.seq != upto:
            new = dataclasses.replace(new, seq=upto)  # the entries between were empty deltas
        if new is cur:
            return False
        self.state = new  # the swap: one attribute, read once per lookup
        if self.on_swap is not None:
            self.on_swap(new)
        return True
