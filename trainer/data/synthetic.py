"""Seeded synthetic click logs in the Criteo format, with a label a model can learn.

Rows come in blocks of ``block_rows``; block j is drawn from ``numpy.random.default_rng([seed, j])``, so any
row range can be regenerated alone and every process gets the same rows. Per row:

- categorical field f: a popularity rank r in [0, V_f) drawn from a bounded Zipf law P(r) ~ (r+1)^-s
  (inverse CDF of the continuous power law, O(1) memory however large V_f), missing with a small rate.
  Its Criteo-style 32-bit "hex value" is a seeded hash of (f, r); ids are then made exactly as the
  Criteo reader makes them (``hashing.hash_values`` with the C1..C26 salts), or, with
  ``id_mode="compact"``, the rank itself (missing: V_f) so tables of ``cardinalities`` rows never collide.
- integer field d: floor of a log-normal count (I2 shifted down by 2, so it goes negative like the real one),
  missing with a set rate; dense features are the reader's log(x + 3) transform of it.
- label: Bernoulli(sigmoid(z)) with a hidden logistic model
  z = b + sum_f a * w_f(r_f) + c * w'_0(r_0) * w'_1(r_1) + sum_d v_d * dense_d
  where w, w' are fixed pseudo-random per-(feature, rank) weights in [-sqrt(3), sqrt(3)], over the first
  ``informative`` fields; b is calibrated once so the click rate is near ``positive_rate``.

``write_tsv`` writes the same rows as DAC text, so ``CriteoReader`` reading the file returns batches equal to
``batches``/``dataset`` (the round trip the tests check). Objects are immutable after construction; every
method may be called from several threads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tigana.trainer.data.criteo import (
    DENSE_NAMES,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_NAMES,
    CriteoChunk,
    criteo_salts,
    format_dac,
    ids_to_batch,
    transform_dense,
)
from tigana.trainer.data.hashing import MISSING_RAW, feature_salt, hash_values, mix64
from tigana.trainer.data.memory import InMemoryDataset
from tigana.trainer.types import Batch, FeatureSpec

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "SyntheticConfig", "SyntheticCriteo", "zipf_ranks"]

CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306,
    10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
"""Distinct values of C1..C26 in the Kaggle Criteo training set (public figures), the default shape of vocabularies."""

IdMode = Literal["hashed", "compact"]


def _default_vocab() -> tuple[int, ...]:
    return tuple(min(v, 100_000) for v in CRITEO_KAGGLE_CARDINALITIES)


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape and randomness of a synthetic set. ``vocab_sizes`` has one entry per categorical field; the
    Criteo file format needs 26 of them (and ``num_dense`` 13)."""

    vocab_sizes: tuple[int, ...] = field(default_factory=_default_vocab)
    num_dense: int = NUM_DENSE
    zipf_exponent: float = 1.05
    dense_missing_rate: float = 0.2
    sparse_missing_rate: float = 0.03
    positive_rate: float = 0.25
    signal: float = 1.5          # std of the hidden model's sparse first-order part
    interaction: float = 0.7     # scale of its pairwise term between fields 0 and 1
    informative: int = 8         # fields that carry signal
    id_mode: IdMode = "hashed"
    seed: int = 0
    block_rows: int = 4096

    def __post_init__(self) -> None:
        if not self.vocab_sizes or min(self.vocab_sizes) < 1:
            raise ValueError(f"vocab_sizes must be positive, got {self.vocab_sizes}")
        if self.zipf_exponent <= 0:
            raise ValueError(f"zipf_exponent must be positive, got {self.zipf_exponent}")
        if self.id_mode not in ("hashed", "compact"):
            raise ValueError(f"id_mode must be 'hashed' or 'compact', got {self.id_mode!r}")
        if self.block_rows < 1 or self.num_dense < 0:
            raise ValueError("block_rows must be positive and num_dense non-negative")


def zipf_ranks(u: np.ndarray, vocab: int, exponent: float) -> np.ndarray:
    """Uniform(0,1) draws -> int64 ranks in [0, vocab), P(rank k) ~ (k+1)^-exponent (continuous inverse CDF)."""
    if abs(exponent - 1.0) < 1e-9:
        x = np.power(float(vocab + 1), u)
    else:
        one_minus = 1.0 - exponent
        x = np.power(1.0 + u * (float(vocab + 1) ** one_minus - 1.0), 1.0 / one_minus)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, vocab - 1)


def _unit_weights(ranks: np.ndarray, salt: np.ndarray) -> np.ndarray:
    """Fixed pseudo-random weights, uniform on [-sqrt(3), sqrt(3)] (variance 1), per (salt, rank)."""
    bits = mix64(ranks.astype(np.uint64) ^ salt) >> np.uint64(11)
    return (bits.astype(np.float64) * 2.0 ** -53 * 2.0 - 1.0) * np.sqrt(3.0)


@dataclass
class _Block:
    chunk: CriteoChunk
    ranks: np.ndarray   # (n, F) int64, -1 where missing
    logits: np.ndarray  # (n,) hidden model


class SyntheticCriteo:
    """A deterministic synthetic Criteo-format set; see the module docstring."""

    def __init__(self, config: SyntheticConfig | None = None, **overrides: object) -> None:
        base = config or SyntheticConfig()
        self.config = SyntheticConfig(**{**base.__dict__, **overrides}) if overrides else base
        cfg = self.config
        self.num_sparse = len(cfg.vocab_sizes)
        self.num_dense = cfg.num_dense
        names = SPARSE_NAMES if self.num_sparse == NUM_SPARSE else [f"C{i + 1}" for i in range(self.num_sparse)]
        self.feature_names: list[str] = list(names)
        self.dense_names = DENSE_NAMES[:cfg.num_dense] if cfg.num_dense <= NUM_DENSE else \
            [f"I{i + 1}" for i in range(cfg.num_dense)]
        self._vocab = np.array(cfg.vocab_sizes, dtype=np.int64)
        self._raw_salts = np.array([feature_salt(f"synthetic-raw:{n}", cfg.seed) for n in names], np.uint64)
        self._w_salts = np.array([feature_salt(f"synthetic-w:{n}", cfg.seed) for n in names], np.uint64)
        self._x_salts = np.array([feature_salt(f"synthetic-x:{n}", cfg.seed) for n in names], np.uint64)
        self._id_salts = criteo_salts(0) if self.num_sparse == NUM_SPARSE else \
            np.array([feature_salt(n) for n in names], np.uint64)
        params = np.random.default_rng([cfg.seed, 2**31 - 1])
        self._mu = params.uniform(0.0, 4.0, cfg.num_dense)
        self._sigma = params.uniform(0.5, 1.5, cfg.num_dense)
        self._dense_w = params.normal(0.0, 0.3, cfg.num_dense)
        self._bias = 0.0
        self._bias = self._calibrate_bias()

    @property
    def cardinalities(self) -> dict[str, int]:
        """Rows a table needs per feature in ``id_mode="compact"`` (ranks plus one missing id)."""
        return {n: int(v) + 1 for n, v in zip(self.feature_names, self._vocab, strict=True)}

    def feature_specs(self, pooling: Literal["sum", "mean"] = "sum") -> list[FeatureSpec]:
        return [FeatureSpec(n, pooling=pooling) for n in self.feature_names]

    # -- generation ---------------------------------------------------------------------------------
    def _block(self, j: int, bias: float | None = None) -> _Block:
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, j])
        n, f = cfg.block_rows, self.num_sparse
        u = rng.random((n, f))
        ranks = np.empty((n, f), dtype=np.int64)
        for k in range(f):  # a loop over the 26 fields; each step is vectorized over the block's rows
            ranks[:, k] = zipf_ranks(u[:, k], int(self._vocab[k]), cfg.zipf_exponent)
        cat_missing = rng.random((n, f)) < cfg.sparse_missing_rate
        raw = mix64(ranks.astype(np.uint64) ^ self._raw_salts) & np.uint64(0xFFFF_FFFF)
        raw[cat_missing] = MISSING_RAW
        ranks[cat_missing] = -1
        ints = np.floor(rng.lognormal(self._mu, self._sigma, (n, cfg.num_dense))).astype(np.int64)
        if cfg.num_dense > 1:
            ints[:, 1] -= 2
        int_missing = rng.random((n, cfg.num_dense)) < cfg.dense_missing_rate
        ints[int_missing] = 0
        dense = transform_dense(ints, "log3")
        k_inf = max(1, min(cfg.informative, f))
        w = _unit_weights(np.maximum(ranks[:, :k_inf], 0), self._w_salts[:k_inf])
        w[cat_missing[:, :k_inf]] = 0.0
        z = (bias if bias is not None else self._bias) + cfg.signal / np.sqrt(k_inf) * w.sum(1)
        if f >= 2:
            pair = _unit_weights(np.maximum(ranks[:, :2], 0), self._x_salts[:2])
            pair[cat_missing[:, :2]] = 0.0
            z += cfg.interaction * pair[:, 0] * pair[:, 1]
        if cfg.num_dense:
            z += (dense - 1.5) @ self._dense_w
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-z))).astype(np.int64)
        return _Block(CriteoChunk(labels, ints, int_missing, raw, cat_missing), ranks, z)

    def _calibrate_bias(self) -> float:
        """Bias b so that the mean click probability of block 0 is ``positive_rate`` (bisection)."""
        z0 = self._block(0, bias=0.0).logits
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.mean(1.0 / (1.0 + np.exp(-(z0 + mid)))) < self.config.positive_rate:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def _rows(self, start: int, stop: int) -> _Block:
        b = self.config.block_rows
        blocks = [self._block(j) for j in range(start // b, -(-stop // b))]
        lo = start - (start // b) * b
        sl = slice(lo, lo + stop - start)
        return _Block(CriteoChunk(*(np.concatenate([getattr(x.chunk, k) for x in blocks])[sl] for k in
                                    ("labels", "ints", "int_missing", "raw", "cat_missing"))),
                      np.concatenate([x.ranks for x in blocks])[sl], np.concatenate([x.logits for x in blocks])[sl])

    def _ids(self, block: _Block) -> np.ndarray:
        if self.config.id_mode == "compact":
            return np.where(block.ranks < 0, self._vocab, block.ranks)
        return hash_values(block.chunk.raw, self._id_salts)

    # -- public views ---------------------------------------------------------------------------------
    def chunk(self, start: int, stop: int) -> CriteoChunk:
        """Rows [start, stop) as parsed Criteo fields (what ``CriteoReader.chunks`` would give for them)."""
        return self._rows(start, stop).chunk

    def hidden_logits(self, start: int, stop: int) -> np.ndarray:
        """(stop-start,) float64 logits of the hidden model that drew the labels: the Bayes-optimal scorer."""
        return self._rows(start, stop).logits

    def to_batch(self, block: _Block) -> Batch:
        return ids_to_batch(transform_dense(block.chunk.ints, "log3"), self._ids(block), block.chunk.labels,
                            self.feature_names)

    def batch(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) as one Batch."""
        return self.to_batch(self._rows(start, stop))

    def dataset(self, num_rows: int, start: int = 0) -> InMemoryDataset:
        """Rows [start, start + num_rows) held in memory (ranked, shuffled batches via its ``batches``)."""
        block = self._rows(start, start + num_rows)
        return InMemoryDataset.single_hot(self.feature_names, transform_dense(block.chunk.ints, "log3"),
                                          self._ids(block), block.chunk.labels.astype(np.float32))

    def batches(self, batch_size: int, num_rows: int, *, rank: int = 0, world_size: int = 1, start: int = 0,
                drop_last: bool = False) -> Iterator[Batch]:
        """Stream rows [start, start + num_rows) without holding them: rank r takes blocks r, r+W, ...
        (blocks counted from ``start``) and cuts its rows into batches in order."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        b = self.config.block_rows
        pending: list[_Block] = []
        count = 0
        for k in range(rank, -(-num_rows // b), world_size):
            lo = start + k * b
            pending.append(self._rows(lo, min(lo + b, start + num_rows)))
            count += len(pending[-1].chunk)
            if count >= batch_size:
                merged = _concat_blocks(pending)
                full = count - count % batch_size
                for s in range(0, full, batch_size):
                    yield self.to_batch(_slice_block(merged, slice(s, s + batch_size)))
                rest = _slice_block(merged, slice(full, None))
                pending, count = ([rest] if len(rest.chunk) else []), len(rest.chunk)
        if count and not drop_last:
            yield self.to_batch(_concat_blocks(pending))

    def write_tsv(self, path: str | os.PathLike, num_rows: int, start: int = 0) -> None:
        """Write rows [start, start + num_rows) as a DAC text file (label, I1..I13, C1..C26, tab separated)."""
        if self.num_sparse != NUM_SPARSE or self.num_dense != NUM_DENSE:
            raise ValueError(f"the Criteo file format needs 13 dense and 26 sparse fields, this set has "
                             f"{self.num_dense} and {self.num_sparse}")
        b = self.config.block_rows
        with open(path, "wb") as out:
            for lo in range(start, start + num_rows, b):
                out.write(format_dac(self.chunk(lo, min(lo + b, start + num_rows))))


def _slice_block(block: _Block, sl: slice) -> _Block:
    c = block.chunk
    return _Block(CriteoChunk(c.labels[sl], c.ints[sl], c.int_missing[sl], c.raw[sl], c.cat_missing[sl]),
                  block.ranks[sl], block.logits[sl])


def _concat_blocks(blocks: list[_Block]) -> _Block:
    if len(blocks) == 1:
        return blocks[0]
    return _Block(CriteoChunk(*(np.concatenate([getattr(x.chunk, k) for x in blocks]) for k in
                                ("labels", "ints", "int_missing", "raw", "cat_missing"))),
                  np.concatenate([x.ranks for x in blocks]), np.concatenate([x.logits for x in blocks]))
