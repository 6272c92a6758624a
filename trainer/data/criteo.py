"""Streaming reader for Criteo click logs (Display Advertising Challenge text format).

Each line: ``label \\t I1 .. I13 \\t C1 .. C26``: a 0/1 click label, 13 integer counts and 26 categorical
values written as hex (8 digits in the released data). Any field but the label may be empty. The Kaggle
competition's CSV variant (header ``Id,Label,I1,...,C26``, comma separated, an extra leading ``Id``) is
detected from its header and read the same way. Rows whose trailing empty fields were stripped are padded.

Preprocessing (as TorchRec's Criteo pipeline does it): a missing integer is 0, then the value is
compressed with ``log(x + 3)``; the few negative counts (I2 goes down to -2 or -3) are clamped at -2 first
so the result stays finite and non-negative. A categorical hex value becomes an int64 id by
``tigana.trainer.data.hashing.hash_values`` with the feature's salt; an empty value becomes the feature's
fixed missing id.

The file is read in byte blocks (a few MiB), parsed with whole-block numpy operations: separator positions
give a (rows, fields) matrix of byte ranges, each column of digits is decoded in one pass over at most 16
digit positions. Nothing row by row in Python.

Ranks: with ``partition="bytes"`` (default; for large files) rank r owns the lines that *start* in its
byte range [size*r/W, size*(r+1)/W); with ``partition="rows"`` it reads the whole file and keeps lines
r, r+W, ... Either way the ranks' parts are disjoint and cover every line once. Byte ranges give ranks
about, not exactly, the same number of rows: a distributed loop must agree on a common step count.

A reader object is not thread-safe; iterate it from one thread. Iterating again re-reads the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from tigana.trainer.data.hashing import MISSING_RAW, feature_salt, hash_values
from tigana.trainer.types import Batch, FeatureSpec, SparseFeatures

__all__ = [
    "DENSE_NAMES", "NUM_DENSE", "NUM_SPARSE", "SPARSE_NAMES", "CriteoChunk", "CriteoFormatError", "CriteoReader",
    "chunk_to_batch", "criteo_feature_specs", "criteo_salts", "format_dac", "has_labels", "ids_to_batch",
    "parse_criteo", "transform_dense",
]

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]

DenseTransform = Literal["log3", "log1p", "none"]
Partition = Literal["bytes", "rows"]
Format = Literal["auto", "dac", "kaggle_csv"]

_TAB, _COMMA, _NL = 9, 44, 10
_DEC = np.full(256, 255, dtype=np.uint8)
_DEC[48:58] = np.arange(10, dtype=np.uint8)
_HEX = _DEC.copy()
_HEX[97:103] = np.arange(10, 16, dtype=np.uint8)  # a-f
_HEX[65:71] = np.arange(10, 16, dtype=np.uint8)  # A-F


def criteo_feature_specs(pooling: Literal["sum", "mean"] = "sum") -> list[FeatureSpec]:
    """One table per categorical field, named C1..C26."""
    return [FeatureSpec(name, pooling=pooling) for name in SPARSE_NAMES]


def transform_dense(ints: np.ndarray, kind: DenseTransform = "log3") -> np.ndarray:
    """(n, 13) int64 counts (missing already 0) -> (n, 13) float32.

    log3:  log(max(x, -2) + 3)  (TorchRec's transform; the clamp keeps rare large negatives finite)
    log1p: log(1 + max(x, 0))   (the original DLRM reference's)
    none:  x as float32
    """
    if kind == "log3":
        return np.log(np.maximum(ints, -2).astype(np.float64) + 3.0).astype(np.float32)
    if kind == "log1p":
        return np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32)
    if kind == "none":
        return ints.astype(np.float32)
    raise ValueError(f"unknown dense transform {kind!r}: use log3, log1p or none")


@dataclass
class CriteoChunk:
    """Parsed rows of one block, before transforms.

    labels:      (n,) int64 0/1
    ints:        (n, 13) int64, 0 where missing
    int_missing: (n, 13) bool
    raw:         (n, 26) uint64 hex values, MISSING_RAW where missing
    cat_missing: (n, 26) bool
    """

    labels: np.ndarray
    ints: np.ndarray
    int_missing: np.ndarray
    raw: np.ndarray
    cat_missing: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class CriteoFormatError(ValueError):
    """A line of a Criteo file does not parse; the message names the field and the line's byte offset."""


def _field_matrix(buf: np.ndarray, sep: int, num_fields: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges of every field: (starts, ends), each (n_lines, num_fields) int64 into ``buf``.

    ``buf`` holds whole lines, each ending in '\\n'. Lines with fewer fields get empty trailing fields;
    a line with more fields is an error.
    """
    newlines = np.flatnonzero(buf == _NL)
    n = newlines.shape[0]
    seps = np.flatnonzero((buf == sep) | (buf == _NL))
    line_of = np.searchsorted(newlines, seps)
    counts = np.bincount(line_of, minlength=n)
    line_starts = np.concatenate([[0], newlines[:-1] + 1]).astype(np.int64)
    if n and int(counts.max()) > num_fields:
        bad = int(np.argmax(counts > num_fields))
        raise CriteoFormatError(f"criteo: line at byte {base + int(line_starts[bad])} has {int(counts[bad])} "
                                f"fields, expected {num_fields}")
    if n and int(counts.min()) == num_fields:
        ends = seps.reshape(n, num_fields)
    else:
        first = np.searchsorted(line_of, np.arange(n))
        column = np.arange(seps.shape[0]) - first[line_of]
        ends = np.repeat(newlines[:, None], num_fields, axis=1)
        ends[line_of, column] = seps
    starts = np.empty_like(ends)
    starts[:, 0] = line_starts
    starts[:, 1:] = ends[:, :-1] + 1
    return np.minimum(starts, ends), ends


def _decode(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, *, hexadecimal: bool, names: list[str],
            line_base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode (n, k) fields of digits -> (values, missing). Decimal fields may start with '-'.

    Decimal values are int64; hex values are uint64. Raises CriteoFormatError naming the first bad field.
    """
    n, k = starts.shape
    lengths = ends - starts
    missing = lengths == 0
    limit = 16 if hexadecimal else 18
    width = int(lengths.max()) if lengths.size else 0
    if width > limit:
        row, col = np.unravel_index(int(np.argmax(lengths)), lengths.shape)
        raise CriteoFormatError(f"criteo: field {names[col]} of the line at byte {int(line_base[row])} has "
                                f"{width} characters, more than {limit}")
    if width == 0:
        zeros = np.zeros((n, k), dtype=np.uint64 if hexadecimal else np.int64)
        return zeros, missing
    pos = np.arange(width)
    index = np.minimum(starts[..., None] + pos, buf.shape[0] - 1)
    chars = buf[index]  # (n, k, width) uint8
    inside = pos < lengths[..., None]
    negative = np.zeros((n, k), dtype=bool) if hexadecimal else (chars[..., 0] == 45) & ~missing  # '-'
    is_digit = inside.copy()
    is_digit[..., 0] &= ~negative
    digits = (_HEX if hexadecimal else _DEC)[chars]
    bad = (is_digit & (digits == 255)).any(-1) | (negative & (lengths == 1))
    if bad.any():
        row, col = np.argwhere(bad)[0]
        text = bytes(buf[starts[row, col]:ends[row, col]]).decode("latin-1")
        kind = "hexadecimal" if hexadecimal else "decimal integer"
        raise CriteoFormatError(f"criteo: field {names[col]} of the line at byte {int(line_base[row])}: "
                                f"{text!r} is not a {kind}")
    if hexadecimal:
        value = np.zeros((n, k), dtype=np.uint64)
        four = np.uint64(4)
        for p in range(width):
            value = np.where(is_digit[..., p], (value << four) | digits[..., p].astype(np.uint64), value)
        return value, missing
    value = np.zeros((n, k), dtype=np.int64)
    for p in range(width):
        value = np.where(is_digit[..., p], value * 10 + digits[..., p], value)
    return np.where(negative, -value, value), missing


def parse_criteo(block: bytes, *, kaggle_csv: bool = False, base: int = 0) -> CriteoChunk:
    """Parse whole lines (``block`` ends with a newline or at the end of the file). ``base``: the block's
    byte offset in its file, for error messages. Blank lines are skipped; '\\r\\n' line ends are accepted."""
    if b"\r" in block:
        block = block.replace(b"\r", b"")
    if block and not block.endswith(b"\n"):
        block += b"\n"
    buf = np.frombuffer(block, dtype=np.uint8)
    lead = 2 if kaggle_csv else 1  # label column index + 1
    num_fields = lead + NUM_DENSE + NUM_SPARSE
    starts, ends = _field_matrix(buf, _COMMA if kaggle_csv else _TAB, num_fields, base)
    # Blank lines parse as a row of empty fields: drop them.
    keep = (ends[:, -1] - starts[:, 0]) > 0
    if not keep.all():
        starts, ends = starts[keep], ends[keep]
    return _parse_fields(buf, starts, ends, lead, base)


def _parse_fields(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, lead: int, base: int) -> CriteoChunk:
    line_base = base + starts[:, 0]
    label_col = lead - 1
    label_len = ends[:, label_col] - starts[:, label_col]
    label_char = buf[np.minimum(starts[:, label_col], buf.shape[0] - 1)] if buf.size else np.zeros(0, np.uint8)
    bad = (label_len != 1) | ((label_char != 48) & (label_char != 49))
    if bad.any():
        row = int(np.argmax(bad))
        text = bytes(buf[starts[row, label_col]:ends[row, label_col]]).decode("latin-1")
        raise CriteoFormatError(f"criteo: field label of the line at byte {int(line_base[row])}: {text!r} "
                                "is not 0 or 1")
    dense_cols = slice(lead, lead + NUM_DENSE)
    cat_cols = slice(lead + NUM_DENSE, lead + NUM_DENSE + NUM_SPARSE)
    ints, int_missing = _decode(buf, starts[:, dense_cols], ends[:, dense_cols], hexadecimal=False,
                                names=DENSE_NAMES, line_base=line_base)
    raw, cat_missing = _decode(buf, starts[:, cat_cols], ends[:, cat_cols], hexadecimal=True,
                               names=SPARSE_NAMES, line_base=line_base)
    raw[cat_missing] = MISSING_RAW
    return CriteoChunk((label_char == 49).astype(np.int64), ints, int_missing, raw, cat_missing)


def format_dac(chunk: CriteoChunk) -> bytes:
    """Rows -> DAC text lines (the inverse of ``parse_criteo``; hex written as 8 lowercase digits or more).

    For writing test and synthetic files; a Python loop over rows, not meant for hot paths."""
    ints = chunk.ints.astype(str)
    ints[chunk.int_missing] = ""
    cats = np.char.zfill(np.char.lower(np.array([f"{v:x}" for v in chunk.raw.ravel()]).reshape(chunk.raw.shape)), 8)
    cats[chunk.cat_missing] = ""
    labels = chunk.labels.astype(str)
    lines = ["\t".join([lab, *i, *c]) for lab, i, c in zip(labels, ints.tolist(), cats.tolist(), strict=True)]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def has_labels(path: str | os.PathLike, sample_bytes: int = 1 << 16) -> bool:
    """Whether the rows of a Criteo file start with a click label, from its first ``sample_bytes``.

    The Kaggle DAC download's ``test.txt`` has none: 39 tab-separated fields (13 counts, 26 categories) where a
    labelled line has 40; the Kaggle CSV's ``test.csv`` header is ``Id,I1,...`` with no ``Label``. Read as
    labelled, such a file fails at its first count that is not 0 or 1, or mislabels rows silently. A file is
    labelled when some sampled line has every field; not when every line has all fields but one (that
    layout); else (trailing empty fields stripped) when every line's first field is 0 or 1. An empty file
    counts as labelled (it has no rows to mislabel)."""
    with open(path, "rb") as f:
        sample = f.read(sample_bytes)
    lines = sample.replace(b"\r", b"").split(b"\n")
    if len(sample) == sample_bytes and len(lines) > 1:
        lines = lines[:-1]  # cut at the end of the sample
    lines = [line for line in lines if line]
    if not lines:
        return True
    first = lines[0].lower()
    if first.startswith(b"id,"):  # the Kaggle CSV's header names its columns
        return first.split(b",")[1].strip() == b"label"
    csv = b"," in first and b"\t" not in first
    lead = 2 if csv else 1  # the label's column + 1
    fields = [line.split(b"," if csv else b"\t") for line in lines]
    full = lead + NUM_DENSE + NUM_SPARSE
    widths = {len(f) for f in fields}
    if max(widths) >= full:
        return True
    if widths == {full - 1}:
        return False
    return all(len(f) >= lead and f[lead - 1] in (b"0", b"1") for f in fields)


class CriteoReader:
    """Iterable of ``Batch`` over a Criteo file (DAC tab-separated text or the Kaggle CSV).

    Batch: dense (B, 13) float32 transformed counts; sparse keys C1..C26, single-hot int64 ids;
    labels (B,) float32. The last batch is short unless ``drop_last``.

    ``max_rows`` caps the rows this rank yields; ``salt_seed`` changes every feature's salt (default 0 is
    what the synthetic generator uses, so its in-memory rows equal what this reader reads back).
    """

    def __init__(self, path: str | os.PathLike, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 partition: Partition = "bytes", drop_last: bool = False, dense_transform: DenseTransform = "log3",
                 fmt: Format = "auto", salt_seed: int = 0, block_bytes: int = 2 << 20,
                 max_rows: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if partition not in ("bytes", "rows"):
            raise ValueError(f"partition must be 'bytes' or 'rows', got {partition!r}")
        transform_dense(np.zeros((1, NUM_DENSE), np.int64), dense_transform)  # validates the name
        self.path = os.fspath(path)
        self.batch_size = batch_size
        self.rank, self.world_size, self.partition = rank, world_size, partition
        self.drop_last = drop_last
        self.dense_transform: DenseTransform = dense_transform
        self.block_bytes = max(int(block_bytes), 1 << 10)
        self.max_rows = max_rows
        self.feature_names = list(SPARSE_NAMES)
        self.num_dense = NUM_DENSE
        self.salts = criteo_salts(salt_seed)
        with open(self.path, "rb") as f:
            first = f.readline()
        header = first.lower().startswith(b"id,label")
        if fmt == "auto":
            fmt = "kaggle_csv" if header or (b"," in first and b"\t" not in first) else "dac"
        self.kaggle_csv = fmt == "kaggle_csv"
        self._header_bytes = len(first) if header else 0

    def chunks(self) -> Iterator[CriteoChunk]:
        """This rank's rows, block by block, parsed but not transformed."""
        size = os.path.getsize(self.path)
        if self.partition == "bytes":
            start, end = size * self.rank // self.world_size, size * (self.rank + 1) // self.world_size
        else:
            start, end = 0, size
        row_index = 0  # lines seen so far, for partition="rows"
        with open(self.path, "rb") as f:
            pos = start
            if start > 0:
                f.seek(start - 1)
                pos = start - 1 + len(f.readline())  # skip the line a previous rank owns
            if pos < self._header_bytes:
                f.seek(self._header_bytes)
                pos = self._header_bytes
            else:
                f.seek(pos)
            carry = b""
            while pos < end or carry:
                block = f.read(self.block_bytes)
                data = carry + block
                base = pos - len(carry)
                if block:
                    cut = data.rfind(b"\n") + 1
                    if cut == 0:  # one line longer than a block: read on
                        carry, pos = data, pos + len(block)
                        continue
                else:
                    cut = len(data)  # the file's last line has no newline
                limit = end - base  # lines starting at or after this offset belong to the next rank
                if limit <= 0:
                    return
                done = not block
                if limit < cut:
                    last_nl = data.find(b"\n", max(limit - 1, 0))
                    cut = len(data) if last_nl < 0 else last_nl + 1
                    done = True
                lines, carry = data[:cut], data[cut:]
                pos += len(block)
                if lines:
                    chunk = parse_criteo(lines, kaggle_csv=self.kaggle_csv, base=base)
                    if self.partition == "rows":
                        rows = np.arange(row_index, row_index + len(chunk))
                        row_index += len(chunk)
                        chunk = _select(chunk, (rows % self.world_size) == self.rank)
                    if len(chunk):
                        yield chunk
                if done:
                    return

    def __iter__(self) -> Iterator[Batch]:
        pending: list[CriteoChunk] = []
        pending_rows = 0
        remaining = self.max_rows if self.max_rows is not None else -1
        for chunk in self.chunks():
            if remaining >= 0:
                if remaining == 0:
                    break
                chunk = _select(chunk, np.arange(len(chunk)) < remaining)
                remaining -= len(chunk)
            pending.append(chunk)
            pending_rows += len(chunk)
            if pending_rows >= self.batch_size:
                merged = _concat(pending)
                full = pending_rows - pending_rows % self.batch_size
                for s in range(0, full, self.batch_size):
                    yield self.to_batch(_select(merged, slice(s, s + self.batch_size)))
                rest = _select(merged, slice(full, None))
                pending, pending_rows = ([rest] if len(rest) else []), len(rest)
        if pending_rows and not self.drop_last:
            yield self.to_batch(_concat(pending))

    def to_batch(self, chunk: CriteoChunk) -> Batch:
        """Transform parsed rows into a Batch (dense log transform, salted id hashing)."""
        return chunk_to_batch(chunk, self.salts, self.dense_transform)


def criteo_salts(salt_seed: int = 0) -> np.ndarray:
    """(26,) uint64 salts of C1..C26."""
    return np.array([feature_salt(name, salt_seed) for name in SPARSE_NAMES], dtype=np.uint64)


def chunk_to_batch(chunk: CriteoChunk, salts: np.ndarray, dense_transform: DenseTransform = "log3") -> Batch:
    """Parsed rows -> Batch: dense (n, 13) transformed, sparse C1..C26 single-hot salted ids, labels float."""
    ids = hash_values(chunk.raw, salts)  # (n, 26) int64
    return ids_to_batch(transform_dense(chunk.ints, dense_transform), ids, chunk.labels, SPARSE_NAMES)


def ids_to_batch(dense: np.ndarray, ids: np.ndarray, labels: np.ndarray, names: list[str]) -> Batch:
    """(n, D) float32 dense, (n, F) int64 single-hot ids, (n,) labels -> Batch (feature-major sparse)."""
    n, f = ids.shape
    sparse = SparseFeatures(keys=list(names), values=torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),
                            lengths=torch.ones(n * f, dtype=torch.int64))
    return Batch(dense=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), sparse=sparse,
                 labels=torch.from_numpy(labels.astype(np.float32)))


def _select(chunk: CriteoChunk, rows: np.ndarray | slice) -> CriteoChunk:
    return CriteoChunk(chunk.labels[rows], chunk.ints[rows], chunk.int_missing[rows], chunk.raw[rows],
                       chunk.cat_missing[rows])


def _concat(chunks: list[CriteoChunk]) -> CriteoChunk:
    if len(chunks) == 1:
        return chunks[0]
    return CriteoChunk(*(np.concatenate([getattr(c, f) for c in chunks])
                         for f in ("labels", "ints", "int_missing", "raw", "cat_missing")))
