"""MovieLens-100K as a click-through task: label = rating >= 4.

Reads the official GroupLens files from a directory the caller gives (``u.user``, ``u.item`` in latin-1,
``u.occupation``, and a ratings file in the ``u.data`` format: ``user \\t item \\t rating \\t timestamp``,
e.g. the official fold ``u1.base`` / ``u1.test``). The data may not be redistributed: nothing here embeds it.

Features, each with compact ids 0..cardinality-1 (so a table of ``cardinalities[name]`` rows holds every
value without hashing collisions; PS tables take the same ids):

==========  =====  ===========================================================
user_id     943    user id - 1
item_id     1682   movie id - 1
age         7      bucket of the age: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+
gender      2      M, F
occupation  21     index in u.occupation
zip         ~100   the first ``zip_prefix`` characters of the zip code (Canadian codes included)
year        ~72    release year; 0 = unknown
genres      19     multi-hot: every genre flag the movie has (1 to 6 ids per row)
==========  =====  ===========================================================

Dense features (2, float32): age / 100 and (release year - 1900) / 100 (the median year when unknown).
The whole split is loaded in memory (80,000 rows: a few MB) and served by ``InMemoryDataset``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from tigana.trainer.data.memory import InMemoryDataset, gather_bags
from tigana.trainer.types import FeatureSpec

__all__ = ["MOVIELENS_FEATURES", "MovieLens100K", "load_movielens"]

MOVIELENS_FEATURES = ["user_id", "item_id", "age", "gender", "occupation", "zip", "year", "genres"]
_AGE_EDGES = np.array([18, 25, 35, 45, 50, 56])
_NUM_GENRES = 19


@dataclass(frozen=True)
class _Side:
    """Per-user and per-item attribute tables, indexed by (id - 1)."""

    age: np.ndarray          # (users,) int64 years
    age_bucket: np.ndarray   # (users,) int64
    gender: np.ndarray       # (users,) int64
    occupation: np.ndarray   # (users,) int64
    zip: np.ndarray          # (users,) int64
    year: np.ndarray         # (items,) int64 id (0 = unknown)
    year_value: np.ndarray   # (items,) float64 release year (median when unknown)
    genre_values: np.ndarray  # CSR of genre ids per item
    genre_offsets: np.ndarray


class MovieLens100K:
    """The MovieLens-100K side files of one directory and a reader of its rating files.

    ``MovieLens100K(root).load("u1.base")`` -> InMemoryDataset with the features above; ``train()`` and
    ``test()`` are the official fold 1. Raises FileNotFoundError naming the missing file, ValueError naming
    the file, line and field of a malformed value. Read-only after construction; thread-safe.
    """

    def __init__(self, root: str | os.PathLike, *, zip_prefix: int = 2,
                 genre_pooling: Literal["sum", "mean"] = "mean") -> None:
        self.root = Path(root)
        if zip_prefix < 1:
            raise ValueError(f"zip_prefix must be at least 1, got {zip_prefix}")
        self.zip_prefix = zip_prefix
        self.genre_pooling: Literal["sum", "mean"] = genre_pooling
        self.feature_names = list(MOVIELENS_FEATURES)
        self.num_dense = 2
        self._side, self.cardinalities = self._read_side()

    def feature_specs(self) -> list[FeatureSpec]:
        """One table per feature; ``genres`` pools with ``genre_pooling``, the single-hot ones with sum."""
        return [FeatureSpec(n, pooling=self.genre_pooling if n == "genres" else "sum") for n in self.feature_names]

    def _path(self, name: str | os.PathLike) -> Path:
        p = Path(name)
        if not p.is_absolute() and not p.exists():
            p = self.root / p
        if not p.is_file():
            raise FileNotFoundError(f"movielens: {p} not found (expected the ml-100k files in {self.root})")
        return p

    def _read_side(self) -> tuple[_Side, dict[str, int]]:
        users = [line.split("|") for line in self._path("u.user").read_text(encoding="latin-1").splitlines() if line]
        items = [line.split("|") for line in self._path("u.item").read_text(encoding="latin-1").splitlines() if line]
        occ_path = self.root / "u.occupation"
        occupations = ([o for o in occ_path.read_text(encoding="latin-1").splitlines() if o] if occ_path.is_file()
                       else sorted({u[3] for u in users}))
        occ_index = {o: i for i, o in enumerate(occupations)}
        n_users = max(int(u[0]) for u in users)
        n_items = max(int(i[0]) for i in items)
        age = np.zeros(n_users, np.int64)
        gender = np.zeros(n_users, np.int64)
        occupation = np.zeros(n_users, np.int64)
        zips = [""] * n_users
        for line_no, u in enumerate(users, 1):
            if len(u) != 5:
                raise ValueError(f"movielens: u.user line {line_no} has {len(u)} fields, expected 5")
            k = int(u[0]) - 1
            age[k] = int(u[1])
            if u[2] not in ("M", "F"):
                raise ValueError(f"movielens: u.user line {line_no} field gender: {u[2]!r} is not M or F")
            gender[k] = 0 if u[2] == "M" else 1
            if u[3] not in occ_index:
                raise ValueError(f"movielens: u.user line {line_no} field occupation: unknown {u[3]!r}")
            occupation[k] = occ_index[u[3]]
            zips[k] = u[4].strip().upper()[:self.zip_prefix]
        zip_vocab = {z: i for i, z in enumerate(sorted(set(zips)))}
        zip_ids = np.array([zip_vocab[z] for z in zips], np.int64)
        years = np.zeros(n_items, np.int64)  # 0: unknown
        genres = np.zeros((n_items, _NUM_GENRES), bool)
        for line_no, it in enumerate(items, 1):
            if len(it) != 5 + _NUM_GENRES:
                raise ValueError(f"movielens: u.item line {line_no} has {len(it)} fields, expected 24")
            k = int(it[0]) - 1
            date = it[2].strip()
            years[k] = int(date[-4:]) if len(date) >= 4 and date[-4:].isdigit() else 0
            genres[k] = [g == "1" for g in it[5:]]
        genres[~genres.any(1), 0] = True  # no flag: genre 0, "unknown" (no empty bags)
        known = np.unique(years[years > 0])
        year_ids = np.where(years > 0, np.searchsorted(known, years) + 1, 0)
        median_year = float(np.median(years[years > 0])) if known.size else 1990.0
        g_rows, g_cols = np.nonzero(genres)
        genre_offsets = np.concatenate([[0], np.cumsum(genres.sum(1))]).astype(np.int64)
        side = _Side(age=age, age_bucket=np.digitize(age, _AGE_EDGES).astype(np.int64), gender=gender,
                     occupation=occupation, zip=zip_ids, year=year_ids.astype(np.int64),
                     year_value=np.where(years > 0, years, median_year).astype(np.float64),
                     genre_values=g_cols.astype(np.int64), genre_offsets=genre_offsets)
        del g_rows
        cards = {"user_id": n_users, "item_id": n_items, "age": len(_AGE_EDGES) + 1, "gender": 2,
                 "occupation": len(occupations), "zip": len(zip_vocab), "year": int(known.size) + 1,
                 "genres": _NUM_GENRES}
        return side, cards

    def ratings(self, name: str | os.PathLike) -> np.ndarray:
        """(n, 4) int64 rows (user, item, rating, timestamp) of a rating file (a name in ``root`` or a path)."""
        path = self._path(name)
        text = path.read_bytes()
        fields = np.array(text.split(), dtype=np.int64) if text.strip() else np.zeros(0, np.int64)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if fields.size != 4 * len(lines):
            bad = next(i for i, ln in enumerate(lines, 1) if len(ln.split()) != 4)
            raise ValueError(f"movielens: {path.name} line {bad} does not have 4 fields (user item rating time)")
        rows = fields.reshape(-1, 4)
        for col, field, hi in ((0, "user", self.cardinalities["user_id"]), (1, "item", self.cardinalities["item_id"]),
                               (2, "rating", 5)):
            bad = (rows[:, col] < 1) | (rows[:, col] > hi)
            if bad.any():
                line = int(np.argmax(bad)) + 1
                raise ValueError(f"movielens: {path.name} line {line} field {field}: {int(rows[line - 1, col])} "
                                 f"is outside 1..{hi}")
        return rows

    def load(self, name: str | os.PathLike) -> InMemoryDataset:
        """A rating file as an in-memory CTR data set (features in ``feature_names`` order)."""
        rows = self.ratings(name)
        s = self._side
        u = rows[:, 0] - 1
        i = rows[:, 1] - 1
        n = rows.shape[0]
        single = [u, i, s.age_bucket[u], s.gender[u], s.occupation[u], s.zip[u], s.year[i]]
        genre_values, genre_lengths = gather_bags(s.genre_values, s.genre_offsets, i)
        one = np.arange(n + 1, dtype=np.int64)
        values = [np.ascontiguousarray(v, dtype=np.int64) for v in single] + [genre_values]
        offsets = [one] * len(single) + [np.concatenate([[0], np.cumsum(genre_lengths)]).astype(np.int64)]
        dense = np.stack([s.age[u] / 100.0, (s.year_value[i] - 1900.0) / 100.0], axis=1).astype(np.float32)
        labels = (rows[:, 2] >= 4).astype(np.float32)
        return InMemoryDataset(list(self.feature_names), dense, labels, values, offsets)

    def train(self) -> InMemoryDataset:
        """The official fold-1 training split, u1.base (80,000 ratings)."""
        return self.load("u1.base")

    def test(self) -> InMemoryDataset:
        """The official fold-1 held-out split, u1.test (20,000 ratings)."""
        return self.load("u1.test")


def load_movielens(root: str | os.PathLike, split: str = "u1.base", **options: object) -> InMemoryDataset:
    """Shortcut: ``MovieLens100K(root, **options).load(split)``."""
    return MovieLens100K(root, **options).load(split)  # type: ignore[arg-type]
