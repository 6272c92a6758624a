"""A checkpoint part: one primary's rows of one table at the cut, as chunk files of numpy arrays.

    <part>/chunk-00000.npz ...   ids (int64), weights and state (float32, or a ``quantize`` codec), update_count
                                 and last_step (uint32 where they fit, else int64), last_time (uint32 ticks of
                                 1/128 s after last_time_base where exact, else float64): up to CHUNK_ROWS rows
    <part>/deleted.npy           an incremental part's tombstones: ids removed since its base (int64)

Its manifest entry lists every file with its rows, bytes and sha256, so a damaged or missing file is found before
a restore changes anything (``verify_part``). Plain ``.npz``/``.npy``: numpy alone reads them.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tigana.embeddings import RowBatch
from tigana.embeddings.files import FileMismatch, read_checked
from tigana.ps.client.checkpoint.quantize import decode, encode
from tigana.ps.errors import DataLoss

__all__ = ["CHUNK_ROWS", "PartWriter", "iter_part", "part_deleted", "verify_part"]

CHUNK_ROWS = 65536


class PartWriter:
    """Write one part under ``root / path``: ``add`` row batches, then ``finish`` (its manifest entry)."""

    def __init__(self, root: Path, path: str, *, table: str, codec: str = "none", state_codec: str = "none") -> None:
        self.root, self.path, self.table = root, path, table
        self.codec, self.state_codec = codec, state_codec
        (root / path).mkdir(parents=True, exist_ok=True)
        self._buffered: list[RowBatch] = []
        self._count = 0
        self._files: list[dict[str, Any]] = []
        self.rows = 0

    def add(self, batch: RowBatch) -> None:
        if not len(batch):
            return
        self._buffered.append(batch)
        self._count += len(batch)
        if self._count >= CHUNK_ROWS:
            self._flush()

    def _flush(self) -> None:
        if not self._buffered:
            return
        rows = RowBatch.concat(self._buffered) if len(self._buffered) > 1 else self._buffered[0]
        self._buffered, self._count = [], 0
        arrays = {"ids": np.ascontiguousarray(rows.ids, "<i8"), **_narrow("update_count", rows.update_count),
                  **_narrow("last_step", rows.last_step), **_ticks("last_time", rows.last_time)}
        arrays.update(encode(rows.weights, self.codec, table=self.table, field="weights"))
        arrays.update(encode(rows.state, self.state_codec, table=self.table, field="state"))
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        self._write(f"chunk-{len(self._files):05d}.npz", buf.getvalue(), len(rows))
        self.rows += len(rows)

    def _write(self, name: str, data: bytes, rows: int) -> None:
        (self.root / self.path / name).write_bytes(data)
        self._files.append({"file": name, "rows": rows, "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest()})

    def finish(self, deleted: np.ndarray | None = None) -> dict[str, Any]:
        """Write what is buffered (and the tombstones); the part's manifest entry (without server or slots)."""
        self._flush()
        entry: dict[str, Any] = {"path": self.path, "rows": self.rows, "chunks": self._files, "deleted": 0}
        if deleted is not None and deleted.size:
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(deleted, "<i8"))
            data = buf.getvalue()
            (self.root / self.path / "deleted.npy").write_bytes(data)
            entry["deleted"] = int(deleted.size)
            entry["deleted_file"] = {"file": "deleted.npy", "rows": int(deleted.size), "bytes": len(data),
                                     "sha256": hashlib.sha256(data).hexdigest()}
        entry["bytes"] = sum(f["bytes"] for f in self._files) + entry.get("deleted_file", {}).get("bytes", 0)
        return entry


def _narrow(field: str, values: np.ndarray) -> dict[str, np.ndarray]:
    """Counters as uint32 where they fit (exact; int64 otherwise)."""
    if values.size and (values.min() < 0 or values.max() > 0xFFFFFFFF):
        return {field: values.astype("<i8")}
    return {field: values.astype("<u4")}


def _ticks(field: str, times: np.ndarray) -> dict[str, np.ndarray]:
    """Update times (whole 1/128 s ticks in the engine) as uint32 ticks after a float64 base where that is
    exact; float64 otherwise."""
    if times.size:
        base = float(np.floor(times.min()))
        ticks = (times - base) * 128.0
        if ticks.max() <= 0xFFFFFFFF and (ticks == np.floor(ticks)).all():
            return {field: ticks.astype("<u4"), f"{field}_base": np.array([base])}
    return {field: times.astype("<f8")}


def _files(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return list(entry["chunks"]) + ([entry["deleted_file"]] if "deleted_file" in entry else [])


def _read(root: Path, entry: dict[str, Any], f: dict[str, Any]) -> bytes:
    path = root / entry["path"] / f["file"]
    try:
        return read_checked(path, f["sha256"], f["bytes"])
    except OSError as exc:
        raise DataLoss(f"checkpoint {str(root)!r}: {entry['path']}/{f['file']} is unreadable: {exc}") from None
    except FileMismatch:
        raise DataLoss(f"checkpoint {str(root)!r}: {entry['path']}/{f['file']} does not match its checksum") from None


def verify_part(root: Path, entry: dict[str, Any]) -> None:
    """Check every file of the part against its size and sha256 (``DataLoss`` naming the file)."""
    for f in _files(entry):
        _read(root, entry, f)


def iter_part(root: Path, entry: dict[str, Any], *, dim: int, state_width: int) -> Iterator[RowBatch]:
    """The part's rows, chunk by chunk, decoded to float32 (each file checked as it is read)."""
    for f in entry["chunks"]:
        with np.load(io.BytesIO(_read(root, entry, f))) as z:
            arrays = {k: z[k] for k in z.files}
        weights, state = decode(arrays, "weights"), decode(arrays, "state")
        if weights.shape[1:] != (dim,) or state.shape[1:] != (state_width,):
            raise DataLoss(f"checkpoint {str(root)!r}: {entry['path']}/{f['file']} holds rows of width "
                           f"{weights.shape[1:]}/{state.shape[1:]}, the table {dim}/{state_width}")
        times = arrays["last_time"].astype(np.float64)
        if "last_time_base" in arrays:
            times = times / 128.0 + float(arrays["last_time_base"][0])
        yield RowBatch(arrays["ids"].astype(np.int64), weights, state, arrays["update_count"].astype(np.int64),
                       arrays["last_step"].astype(np.int64), times)


def part_deleted(root: Path, entry: dict[str, Any]) -> np.ndarray:
    """An incremental part's tombstones (sorted ids)."""
    if "deleted_file" not in entry:
        return np.empty(0, np.int64)
    return np.load(io.BytesIO(_read(root, entry, entry["deleted_file"]))).astype(np.int64)
