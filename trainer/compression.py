"""Adaptive wire compression of one PS table, chosen at run time from the measured error, with an accuracy
guard that backs off to full precision.

Pushes (gradients), each step, vectorized over the batch's U distinct ids:

1. error feedback: ``a = g + e[id]``, where ``e`` holds what earlier pushes did not deliver;
2. top-k: the rows sent are the ``ceil(density * U)`` largest ``||a||``, every row whose gradient has waited
   ``max_delay`` steps (in the batch or not), and rows the store has no room for; the others stay in ``e``;
3. codec: the cheapest of int8, fp16, fp32 whose **measured** relative error ``||a_S - Q(a_S)|| / ||a_S||`` on
   the rows sent is within ``max_error`` (``Q`` is the wire codec's own round trip, so the server applies
   exactly ``Q(a_S)``); ``a_S - Q(a_S)`` stays in ``e``.

Invariant (error feedback): per id, the sum of everything pushed plus ``e`` equals the sum of every gradient
given, exactly up to float32 addition, while the store has room (past ``capacity`` rows the quantization
remainders are dropped first, never a held gradient). A gradient is held at most ``max_delay`` steps, and
``drain()`` (called by the collection's ``flush``, so before evaluation and checkpoints) sends all of ``e`` at
fp32: nothing is lost, only delayed and rounded.

Pulls (rows): int8 while the error its per-row scales imply (rms ``max|row| / (127 * sqrt(12))`` per element,
relative to the rows' norm, measured on every pull) is within ``max_error``, else fp16 (fp32 when a row is past
fp16's range); a backed-off direction measures the same figure on the rows it receives and steps back down.

**When compression backs off** (the guard):

- quantization error above ``max_error`` in a direction: that direction moves to the next more precise
  codec for ``hold_steps`` steps, then measures again;
- loss regression: the training loss's moving average (``loss_window`` steps) rises above
  ``(1 + loss_tolerance)`` times its best value so far: both directions go to fp32 with dense pushes
  (density 1, no delay, ``e`` delivered) for ``hold_steps`` steps, then compression resumes.

Not thread-safe: one compressor per PS table, called from the collection's trainer thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tigana.ps import InvalidArgument
from tigana.ps.wire import data as wire
from tigana.trainer.slots import SlotIndex

__all__ = ["CODECS", "AdaptiveCompressor", "AdaptiveConfig", "PushPlan", "round_trip"]

CODECS = ("int8", "fp16", "fp32")  # cheapest first; the guard moves right
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of ``AdaptiveCompressor`` (see the module docstring)."""

    max_error: float = 0.02        # relative L2 quantization error a codec may cost, per direction
    density: float = 0.08          # fraction of a step's rows pushed at once (top-k); the rest wait
    max_delay: int = 10            # steps a held gradient may wait before it is pushed
    loss_tolerance: float = 0.05   # relative rise of the loss's moving average over its best that trips
    loss_window: int = 20          # steps of that moving average (also the warm-up before the guard arms)
    hold_steps: int = 50           # steps a tripped guard keeps the more precise setting
    capacity: int = 1 << 20        # rows of error-feedback state kept

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise InvalidArgument(f"adaptive compression: field {name!r} {what}, got {getattr(self, name)!r}")

        need(0 < self.max_error < 1, "max_error", "must be in (0, 1)")
        need(0 < self.density <= 1, "density", "must be in (0, 1]")
        need(self.max_delay >= 1, "max_delay", "must be >= 1")
        need(self.loss_tolerance > 0, "loss_tolerance", "must be > 0")
        need(self.loss_window >= 1, "loss_window", "must be >= 1")
        need(self.hold_steps >= 1, "hold_steps", "must be >= 1")
        need(self.capacity >= 1, "capacity", "must be >= 1")


@dataclass
class PushPlan:
    """What to push this step: ``grads`` are already the codec's round trip of what is delivered."""

    ids: np.ndarray      # (k,) int64 distinct
    grads: np.ndarray    # (k, dim) float32
    codec: str           # wire codec name (int8, fp16, fp32)


def round_trip(rows: np.ndarray, codec: str, *, table: str = "") -> np.ndarray:
    """(n, dim) float32 as the server decodes them after this client encodes them in ``codec``."""
    rows = np.ascontiguousarray(rows, np.float32)
    if codec == "fp32" or rows.shape[0] == 0:
        return rows.copy()
    code = wire.codec_of(codec)
    data, scales = wire.encode_block(rows, code)
    raw = wire.RawRows(code, rows.shape[1], memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1)),
                       memoryview(b"" if scales is None else np.ascontiguousarray(scales).tobytes()), 0)
    return np.array(wire.decode_block(raw, rows.shape[0], rows.shape[1], table=table), np.float32)


def _relative_error(rows: np.ndarray, approx: np.ndarray) -> float:
    norm = float(np.sqrt(np.square(rows, dtype=np.float64).sum()))
    if norm == 0.0:
        return 0.0
    return float(np.sqrt(np.square(rows - approx, dtype=np.float64).sum())) / norm


def int8_error_estimate(rows: np.ndarray) -> float:
    """Relative rms error int8 with per-row scales costs ``rows`` (uniform rounding: Δ²/12 per element,
    Δ = max|row| / 127), computable from the rows a pull received in any codec."""
    if rows.size == 0:
        return 0.0
    r = np.asarray(rows, np.float32)
    norm2 = float(np.square(r, dtype=np.float64).sum())
    if norm2 == 0.0:
        return 0.0
    step = np.abs(r).max(axis=1).astype(np.float64) / 127.0
    return math.sqrt(float((step * step).sum()) * r.shape[1] / 12.0 / norm2)


class _Direction:
    """One direction's codec: the cheapest allowed level, raised by the guard for ``hold`` steps."""

    def __init__(self) -> None:
        self.level = 0           # index into CODECS
        self.hold_until = 0      # step until which ``level`` may not go down
        self.trips = 0

    def codec(self) -> str:
        return CODECS[self.level]

    def back_off(self, level: int, step: int, hold: int) -> None:
        if level > self.level:
            self.trips += 1
        self.level = max(self.level, min(level, len(CODECS) - 1))
        self.hold_until = step + hold

    def may_relax(self, step: int) -> bool:
        return step >= self.hold_until


class AdaptiveCompressor:
    """Adaptive compression of one PS table's pulls and pushes (rows of width ``dim``)."""

    def __init__(self, dim: int, config: AdaptiveConfig | None = None, *, table: str = "") -> None:
        if dim < 1:
            raise InvalidArgument(f"table {table!r}: field 'dim' must be >= 1, got {dim!r}")
        self.config = config or AdaptiveConfig()
        self.dim, self.table = int(dim), table
        self.step = 0
        self.index = SlotIndex(self.config.capacity)
        self.residual = np.zeros((self.config.capacity, self.dim), np.float32)
        # step at which the oldest undelivered gradient of the slot was given; -1: only a quantization remainder
        self.since = np.full(self.config.capacity, -1, np.int64)
        self.push_dir, self.pull_dir = _Direction(), _Direction()
        self.full_until = 0       # loss guard: fp32 dense until this step
        self.loss_trips = 0
        self._ema: float | None = None
        self._best = math.inf
        self._losses = 0
        self.counts = {"rows_given": 0, "rows_sent": 0, "rows_forced": 0, "remainders_dropped": 0}
        self.codec_steps = {c: 0 for c in CODECS}
        self.last_push_error = 0.0
        self.last_pull_error = 0.0

    # ------------------------------------------------------------------ state
    @property
    def full_precision(self) -> bool:
        """Whether the loss guard holds everything at fp32 with dense pushes now."""
        return self.step < self.full_until

    @property
    def pull_codec(self) -> str:
        return "fp32" if self.full_precision else self.pull_dir.codec()

    @property
    def held_rows(self) -> int:
        """Rows whose gradient waits in the error-feedback store."""
        used = self.index.used_slots()
        return int((self.since[used] >= 0).sum())

    # ------------------------------------------------------------------ pushes
    def plan_push(self, ids: np.ndarray, grads: np.ndarray) -> PushPlan:
        """This step's push for the distinct ``ids`` ((U,) int64) and their gradients ((U, dim) float32)."""
        ids = np.asarray(ids, np.int64)
        grads = np.asarray(grads, np.float32)
        if grads.shape != (ids.shape[0], self.dim):
            raise InvalidArgument(f"table {self.table!r}: field 'grads' has shape {grads.shape}, expected "
                                  f"({ids.shape[0]}, {self.dim})")
        cfg = self.config
        self.step += 1
        step = self.step
        u = ids.shape[0]
        self.counts["rows_given"] += u
        # 1. error feedback: fold the batch's remainders into its gradients; those rows leave the store
        slots = self.index.find(ids)
        had = np.flatnonzero(slots >= 0)
        acc = grads.copy()
        since = np.full(u, step, np.int64)
        if had.size:
            s = slots[had]
            acc[had] += self.residual[s]
            since[had] = np.where(self.since[s] >= 0, self.since[s], step)
            self.index.remove(s)
        # 2. which rows go now
        full = self.full_precision
        send = np.ones(u, bool) if full else since <= step - cfg.max_delay
        if not full and u:
            k = min(u, math.ceil(cfg.density * u))
            norms = np.einsum("ij,ij->i", acc, acc)
            send[np.argpartition(-norms, k - 1)[:k]] = True
        used = self.index.used_slots()
        if full:
            forced = used  # every remainder is delivered while the guard holds
        else:
            forced = used[(self.since[used] >= 0) & (self.since[used] <= step - cfg.max_delay)]
        held = np.flatnonzero(~send)
        room = self.index.free + forced.shape[0]
        if held.shape[0] > room:  # make room: drop quantization remainders first, then send the excess
            quant = used[self.since[used] < 0]
            drop = quant[:held.shape[0] - room]
            self.index.remove(drop)
            self.counts["remainders_dropped"] += int(drop.shape[0])
            room += drop.shape[0]
            if held.shape[0] > room:
                send[held[room:]] = True
                held = held[:room]
        forced_ids = self.index.id_of_slot[forced].copy()
        forced_rows = self.residual[forced].copy()
        self.index.remove(forced)
        self.counts["rows_forced"] += int(forced.shape[0])
        out_ids = np.concatenate([ids[send], forced_ids])
        out = np.concatenate([acc[send], forced_rows]) if forced.shape[0] else acc[send]
        # 3. the codec, from the error measured on exactly these rows
        codec, sent = self._choose_codec(out, full)
        self.codec_steps[codec] += 1
        self.counts["rows_sent"] += int(out_ids.shape[0])
        # the held gradients, then the quantization remainders (as room allows)
        if held.shape[0]:
            s = self.index.add(ids[held])
            self.residual[s] = acc[held]
            self.since[s] = since[held]
        if codec != "fp32" and out_ids.shape[0]:
            rem = out - sent
            nz = np.flatnonzero(np.any(rem != 0, axis=1))
            fit = nz[:self.index.free]
            self.counts["remainders_dropped"] += int(nz.shape[0] - fit.shape[0])
            if fit.shape[0]:
                s = self.index.add(out_ids[fit])
                self.residual[s] = rem[fit]
                self.since[s] = -1
        return PushPlan(out_ids, sent, codec)

    def _choose_codec(self, rows: np.ndarray, full: bool) -> tuple[str, np.ndarray]:
        """The cheapest codec allowed whose measured error on ``rows`` is within bound, and the round trip."""
        d = self.push_dir
        if full:
            return "fp32", rows
        if d.may_relax(self.step):
            d.level = 0
        while True:
            codec = d.codec()
            if codec == "fp32":
                self.last_push_error = 0.0
                return codec, rows
            sent = round_trip(rows, codec, table=self.table)
            err = _relative_error(rows, sent)
            if err <= self.config.max_error:
                self.last_push_error = err
                return codec, sent
            d.back_off(d.level + 1, self.step, self.config.hold_steps)

    def drain(self) -> PushPlan | None:
        """Everything the store holds (held gradients and remainders) as one fp32 push; the store empties."""
        used = self.index.used_slots()
        if used.shape[0] == 0:
            return None
        plan = PushPlan(self.index.id_of_slot[used].copy(), self.residual[used].copy(), "fp32")
        self.index.remove(used.copy())
        self.counts["rows_sent"] += int(used.shape[0])
        return plan

    # ------------------------------------------------------------------ pulls and the loss
    def observe_pull(self, rows: np.ndarray) -> None:
        """Measure, on rows just pulled, the error int8 costs them; back off or step down accordingly."""
        if rows.size == 0 or self.full_precision:
            return
        d = self.pull_dir
        err = int8_error_estimate(rows)
        self.last_pull_error = err
        if err > self.config.max_error:
            fp16_ok = float(np.abs(rows).max()) < _FP16_MAX
            d.back_off(1 if fp16_ok else 2, self.step, self.config.hold_steps)
        elif d.level and d.may_relax(self.step):
            d.level = 0

    def observe_loss(self, loss: float) -> None:
        """One training step's loss: trips the guard on a regression of its moving average."""
        if not math.isfinite(loss):
            self._trip()
            return
        cfg = self.config
        alpha = 2.0 / (cfg.loss_window + 1)
        self._ema = loss if self._ema is None else self._ema + alpha * (loss - self._ema)
        self._losses += 1
        if self._losses < cfg.loss_window:
            return
        if self._ema > self._best * (1 + cfg.loss_tolerance) and not self.full_precision:
            self._trip()
        self._best = min(self._best, self._ema)

    def _trip(self) -> None:
        self.loss_trips += 1
        self.full_until = self.step + self.config.hold_steps
        if self._ema is not None:
            self._best = self._ema  # the rise that tripped is the new reference: only a further one trips

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "codec_steps": dict(self.codec_steps), "push_codec": self.push_dir.codec(),
                "pull_codec": self.pull_codec, "push_trips": self.push_dir.trips, "pull_trips": self.pull_dir.trips,
                "loss_trips": self.loss_trips, "held_rows": self.held_rows,
                "last_push_error": self.last_push_error, "last_pull_error": self.last_pull_error}
