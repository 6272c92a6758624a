"""The data path of ``Client``: ``pull`` and ``push`` (asynchronous, bounded per server), ``flush``, and the
client's session (client id and seq) and counters.

Inputs are numpy arrays or torch tensors (converted without importing torch), checked (dtype, shape,
NaN/Inf) before anything is sent, so a bad batch changes nothing. A pull waits for this client's own pushes
per the table's staleness bound (``tablestate``); the operations themselves (routing, parts, re-routing)
are ``inflight``'s. A failed push is raised by the next call (once) and by ``flush``.

Thread-safety: every method may be called from any thread; futures complete on gRPC callback threads.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from concurrent import futures as cf
from typing import Any

import numpy as np

from tigana.embeddings.errors import InvalidArgument as EngineInvalidArgument
from tigana.embeddings.unseen import Unseen
from tigana.ps import _kernels
from tigana.ps.client._fields import ClientFields
from tigana.ps.client.inflight import Attempt, PullOp, PushOp, new_future
from tigana.ps.client.tablestate import Countdown, after_own_pushes
from tigana.ps.errors import InvalidArgument, PSError
from tigana.ps.session import client_stamp

log = logging.getLogger("tigana.ps.client")


class DataPath(ClientFields):
    """``pull``, ``push`` and ``flush`` (see the module docstring)."""

    def pull(self, table: str, ids: Any, *, insert: bool = True, unseen: str | Unseen | None = None
             ) -> np.ndarray:
        """Rows of ``ids`` (int64 numpy array or torch tensor; any values, duplicates allowed) as float32
        ``ids.shape + (dim,)``, in the order of ids. Waits for this client's pushes per the staleness bound.
        ``insert=False`` (evaluation): nothing is inserted or counted toward admission, and ids the table
        lacks read as ``unseen`` says (``zeros``, ``initial`` or a number: ``tigana.embeddings.unseen``;
        None: ``initial``, the row the table's initializer gives them)."""
        return self.pull_async(table, ids, insert=insert, unseen=unseen).result()

    def pull_async(self, table: str, ids: Any, *, insert: bool = True, unseen: str | Unseen | None = None
                   ) -> cf.Future:
        """Like ``pull`` but returns at once a future of the rows (to prefetch the next batch)."""
        return self.pull_many([table], [ids], insert=insert, unseen=unseen)[0]

    def push(self, table: str, ids: Any, grads: Any) -> cf.Future:
        """Send gradients of ``ids`` ((n,) ints) as ``grads`` ((n, dim) float, numpy or torch; duplicates are
        summed). Returns at once a future of the rows applied; blocks only while ``max_pushes_in_flight``
        messages to a server are outstanding. Inputs are checked (dtype, shape, NaN/Inf) before anything is
        sent, so a bad batch changes nothing. A failed earlier push raises here (and at ``flush``)."""
        self._raise_stored()
        st = self._state(table)
        ids = _as_ids(ids, table).reshape(-1)
        grads = _as_grads(grads, ids, st.dim, table)
        fut = new_future()
        if ids.size == 0:
            fut.set_result(0)
            return fut
        route = self._route
        uniq, summed, starts, in_range = route.group(np.ascontiguousarray(ids), grads)
        if not in_range:
            _check_finite(grads, summed, table)
        PushOp(self, st, fut, uniq, summed, starts, route, self._next_seq(), self._attempt()).start()
        return fut

    def pull_many(self, tables: Sequence[str], ids: Sequence[Any], *, insert: bool = True,
                  unique: bool = False, unseen: str | Unseen | None = None) -> list[cf.Future]:
        """``pull_async`` of several tables at once: a future of each table's rows, in the order of
        ``tables``. Every table's ids are grouped in one pass, and each server gets one message holding its
        part of every table (a step of a model with many tables costs about what one fused table costs).
        ``unique=True``: every ``ids[t]`` is already free of duplicates (a trainer's plan), so the client does
        not deduplicate them again. ``insert`` and ``unseen``: as in ``pull``. Inputs are checked before
        anything is sent."""
        self._raise_stored()
        if len(tables) != len(ids):
            raise InvalidArgument(f"pull_many: field 'ids' has {len(ids)} entries for {len(tables)} tables")
        policy = ""
        if unseen is not None:
            if insert:
                raise InvalidArgument(f"pull of {list(tables)}: field 'unseen' applies to read-only pulls "
                                      "(insert=False); an inserting pull stores an id's initial row")
            try:
                policy = str(unseen if isinstance(unseen, Unseen) else Unseen.parse(unseen, what="field 'unseen'"))
            except EngineInvalidArgument as exc:
                raise InvalidArgument(f"pull of {list(tables)}: {exc}") from None
        states = [self._state(t) for t in tables]
        arrays = [_as_ids(a, t) for a, t in zip(ids, tables, strict=True)]
        futs = [new_future() for _ in tables]
        flat = [np.ascontiguousarray(a.reshape(-1)) for a in arrays]
        route = self._route
        grouped = _group_many(route, flat, None, unique)
        attempt = self._attempt()
        ops = []
        uniq, ub, starts, src, bounds = grouped
        for t, (st, a, fut) in enumerate(zip(states, arrays, futs, strict=True)):
            if a.size == 0:
                fut.set_result(np.empty(a.shape + (st.dim,), np.float32))
                continue
            parts = (route, uniq[ub[t]:ub[t + 1]], starts[t], src[bounds[t]:bounds[t + 1]])
            ops.append(PullOp(self, st, fut, flat[t], a.shape, attempt, read_only=not insert, grouped=parts,
                              unseen=policy))

        def start() -> None:  # here, or in the thread that completes the last push the bound waits for
            with self._frames_held():
                for op in ops:
                    op.start()
        after_own_pushes([op.st for op in ops], start)
        return futs

    def push_many(self, tables: Sequence[str], ids: Sequence[Any], grads: Sequence[Any], *,
                  unique: bool = False) -> list[cf.Future]:
        """``push`` to several tables at once: a future of each table's rows applied, in the order of
        ``tables``. Grouped in one pass, one message to each server for all of its parts (under one of its
        push permits). ``unique`` as in ``pull_many``. Every table's inputs are checked before anything is
        sent, so a bad entry refuses the whole call and changes nothing."""
        self._raise_stored()
        if not len(tables) == len(ids) == len(grads):
            raise InvalidArgument(f"push_many: {len(tables)} tables, {len(ids)} id arrays and {len(grads)} "
                                  "gradient arrays; expected one of each per table")
        states = [self._state(t) for t in tables]
        flat = [np.ascontiguousarray(_as_ids(a, t).reshape(-1)) for a, t in zip(ids, tables, strict=True)]
        rows = [_as_grads(g, a, st.dim, t) for g, a, st, t in zip(grads, flat, states, tables, strict=True)]
        route = self._route
        by_dim: dict[int, list[int]] = {}
        for t, st in enumerate(states):
            by_dim.setdefault(st.dim, []).append(t)
        parts: dict[int, tuple] = {}
        for group in by_dim.values():  # one kernel call per row width
            uniq, sums, ub, starts, in_range, bounds = _group_many(route, [flat[t] for t in group],
                                                                   [rows[t] for t in group], unique)
            for j, t in enumerate(group):
                if not in_range[j]:
                    _check_finite(rows[t], sums[ub[j]:ub[j + 1]], tables[t])
                parts[t] = (uniq[ub[j]:ub[j + 1]], sums[ub[j]:ub[j + 1]], starts[j])
        futs = [new_future() for _ in tables]
        attempt = self._attempt()
        with self._frames_held(permits=True):
            for t, (st, fut) in enumerate(zip(states, futs, strict=True)):
                if flat[t].size == 0:
                    fut.set_result(0)
                    continue
                uniq, summed, starts = parts[t]
                PushOp(self, st, fut, uniq, summed, starts, route, self._next_seq(), attempt, permit=False).start()
        return futs

    @contextlib.contextmanager
    def _frames_held(self, permits: bool = False) -> Iterator[None]:
        """Parts this thread sends meanwhile are held, then sent as one message per server: one multi-table
        frame holding every table's part for it (``Exchange.send_many``), each part still settled, re-routed
        and retried on its own by its operation. ``permits``
        (pushes): the message takes one of the server's push permits, freed when all its parts are answered."""
        held: list = []
        self._hold.frames = held
        try:
            yield
        finally:
            self._hold.frames = None
            by_server: dict[Any, list] = {}
            for server, kind, request, done in held:
                by_server.setdefault(server, []).append((kind, request, done))
            for server, items in by_server.items():
                if permits:
                    server.permits.acquire()  # back-pressure: one bundle is one message
                    items = _release_when_answered(server, items)
                server.send_many(items, self.config.timeout_s, self._note_retry)

    def flush(self) -> None:
        """Wait for every push in flight; raise the first push error not raised yet."""
        with self._tables_lock:
            tables = list(self._tables.values())
        pending: list[cf.Future] = []
        for st in tables:
            with st.lock:
                pending.extend(st.pending.values())
        cf.wait(pending)
        with self._stats_lock:
            errors, self._push_errors = self._push_errors, []
            self._unraised = []
        if errors:
            raise errors[0]

    def _raise_stored(self) -> None:
        """Raise (once) a push error that arrived since the last call, instead of only at ``flush``."""
        if not self._unraised:
            return
        with self._stats_lock:
            errors, self._unraised = self._unraised, []
            self._push_errors = [e for e in self._push_errors if e not in errors]
        if errors:
            raise errors[0]

    def _push_failed(self, error: PSError) -> None:
        with self._stats_lock:
            self._counters["push_errors"] += 1
            self._push_errors.append(error)
            self._unraised.append(error)

    def _attempt(self) -> Attempt:
        limit = self.config.failover_timeout_s if self._maps is not None else self.config.timeout_s * \
            self.config.max_attempts
        return Attempt(1, self._ports.clock() + limit)

    def _next_seq(self) -> int:
        with self._seq_lock:
            return next(self._seq)

    def _new_session(self, refused_id: str, horizon: int) -> str:
        """The client id to send under after ``refused_id`` was refused as unknown (``UnknownClient``) at a
        window whose horizon is ``horizon``: a new session stamped above it, made once however many parts
        were refused (pushes already in flight keep their own ids)."""
        with self._seq_lock:
            if self.client_id == refused_id or client_stamp(self.client_id) <= horizon:
                self.client_id = self._ports.new_session(max(horizon, client_stamp(self.client_id)))
            return self.client_id

    def _under_replicated(self, table: str) -> None:
        """A sync push was acknowledged with fewer in-sync copies than the cluster keeps: counted in
        ``stats()["pushes_under_replicated"]`` and logged at most once a minute (never silent)."""
        now = self._ports.clock()
        with self._stats_lock:
            self._counters["pushes_under_replicated"] += 1
            warn = now - self._warned_under_replicated > 60.0
            if warn:
                self._warned_under_replicated = now
        if warn:
            log.warning("table %r: a sync push was acknowledged while a slot of it had fewer in-sync copies than the "
                        "cluster keeps (a copy is being built, or too few servers are up): losing its primary now "
                        "may lose it. create_table(min_copies=2) refuses such pushes instead.", table)

    def _note_retry(self) -> None:
        with self._stats_lock:
            self._counters["retries"] += 1

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._counters[k] += v


def _group_many(route: Any, ids: list[np.ndarray], grads: list[np.ndarray] | None, unique: bool) -> tuple:
    """Every table's ids (and gradient rows) grouped by ``route`` in one kernel call: pull (uniq, ubounds,
    starts, src, bounds), push (uniq, sums, ubounds, starts, in_range, bounds); see ``_kernels``."""
    bounds = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([a.shape[0] for a in ids], out=bounds[1:])
    cat = np.concatenate(ids) if len(ids) != 1 else ids[0]
    if grads is None:
        return (*_kernels.dedup_grouped_many(cat, bounds, route.key_of_slot, route.num_slots, unique), bounds)
    rows = np.concatenate(grads) if len(grads) != 1 else grads[0]
    return (*_kernels.dedup_sum_grouped_many(cat, rows, bounds, route.key_of_slot, route.num_slots, unique), bounds)


def _release_when_answered(server: Any, items: list) -> list:
    """``items`` whose ``done`` callbacks free one of ``server``'s push permits once all have run."""
    countdown = Countdown(len(items), server.permits.release)

    def wrap(done: Any) -> Any:
        def once(reply: Any, error: PSError | None) -> None:
            countdown.one()
            done(reply, error)
        return once
    return [(kind, request, wrap(done)) for kind, request, done in items]


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor, without importing torch
        t = x.detach()
        if t.is_floating_point() and str(t.dtype) not in ("torch.float32", "torch.float64", "torch.float16"):
            t = t.float()
        return t.cpu().numpy()
    return np.asarray(x)


def _as_ids(ids: Any, table: str) -> np.ndarray:
    a = _to_numpy(ids)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise InvalidArgument(f"table {table!r}: field 'ids' must be an integer array, got dtype {a.dtype}")
    if a.dtype == np.uint64:
        return a.view(np.int64)  # the same 64 bits
    return a.astype(np.int64, copy=False)


def _as_grads(grads: Any, ids: np.ndarray, dim: int, table: str) -> np.ndarray:
    g = _to_numpy(grads)
    if g.dtype.kind != "f":
        raise InvalidArgument(f"table {table!r}: field 'grads' must be a float array, got dtype {g.dtype}")
    if g.shape not in (ids.shape + (dim,), (ids.size, dim)):
        raise InvalidArgument(f"table {table!r}: field 'grads' has shape {tuple(g.shape)}, expected "
                              f"{ids.shape + (dim,)} (ids shape + dim {dim})")
    return np.ascontiguousarray(g.reshape(ids.size, dim), dtype=np.float32)


def _check_finite(grads: np.ndarray, summed: np.ndarray, table: str) -> None:
    """Run when some summed row is out of range: a NaN or Inf in the input, or a gradient (summed over
    duplicate ids) of magnitude 2**64 or more, whose square overflows float32 (Adagrad's, Adam's and FTRL's
    second moments would become Inf, the row's weights NaN). Either is refused here, before anything is
    sent, so no server applies its part of the batch. Smaller gradients that would still overflow a row's
    state are refused by each server for its part (``tigana.embeddings``: nothing applied there)."""
    bad = ~np.isfinite(grads).all(axis=1)
    if bad.any():
        raise InvalidArgument(f"table {table!r}: field 'grads' has NaN or Inf in {int(bad.sum())} row(s), "
                              f"first at position {int(np.flatnonzero(bad)[0])}; nothing was pushed")
    huge = (np.abs(summed) >= _kernels.GRAD_LIMIT).any(axis=1)
    if huge.any():
        raise InvalidArgument(f"table {table!r}: field 'grads' has {int(huge.sum())} row(s) of magnitude 2**64 "
                              f"(1.8e19) or more (summed over repeated ids), whose square overflows float32: an "
                              f"optimizer would write Inf; nothing was pushed")
