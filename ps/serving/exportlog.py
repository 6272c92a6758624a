"""The serving export log: ``tigana admin export TABLE --follow --out DIR`` writes it, ``tigana serve --from
DIR`` (``tigana.ps.serving``) and a 20-line numpy reader (docs/serving.md) read it.

Layout of ``DIR``::

    DIR/manifest.json        the log: which entries exist and their order (schema below), replaced atomically
    DIR/full-00000001/       a full export: ids.npy, rows.npy, export.json (the `tigana admin export` format)
    DIR/delta-00000002/      the rows changed since the previous entry's cut, in the same format, and
                             deleted.npy: the ids evicted since then (tombstones)
    DIR/delta-00000003/ ...

``manifest.json``::

    {"format": "tigana-export-log", "version": 1, "log_id": "3f2a...",   # log_id: new for every fresh log
     "table": "user_id", "dim": 16,
     "seq": 7,            # the newest entry's number (entries are numbered 1, 2, ... in the order written)
     "time": 1718000000.5,  # the cut the log is complete up to (servers' clocks); empty deltas advance it too
     "written": 1718000000.7, "interval_s": 2.0, "overlap_s": 0.5, "full_every": 100,
     "base": {"path": "full-00000005", "seq": 5, "time": ..., "since": 0.0, "rows": 1000000, "seconds": 1.2},
     "deltas": [{"path": "delta-00000006", "seq": 6, "time": ..., "since": ..., "rows": 812, "seconds": 0.02},
                {"path": "delta-00000007", ...}]}

A reader loads ``base``, then applies ``deltas`` in list order (ascending ``seq``), a later row replacing an
earlier row of the same id. Ids absent from the result were never exported.

Design (what the follow loop guarantees, and why):

- **One mechanism.** Every entry is one ``checkpoint.export_table`` call: ``ExportRows`` on every primary, each
  a consistent cut taken under the table's write lock (a full export snapshots the table; a delta, given
  ``since_time``, copies only the rows whose last update is at or after it, so its cost follows the rows
  changed). An entry's ``time`` is the earliest of the primaries' cut times.
- **No gap between deltas.** Delta k+1 asks for the rows updated at or after ``T_k - overlap`` (``T_k`` the
  previous entry's cut). A row's update is stamped, under the table lock, with the primary's clock; an update
  not in cut k happened after it, so its stamp is >= that primary's cut time >= ``T_k``: delta k+1 (or a later
  one) carries the row's newest value. A row changed exactly at a boundary may appear in two deltas (overlap,
  harmless: the later one wins); it cannot be in neither. ``--overlap`` (default 0.5 s) also covers clock skew
  between servers (a slot whose primary moved to a server with a slower clock) and clock steps.
- **A failed entry loses nothing.** A failed export (a map move, a server down) is retried at the next tick
  with the same ``since``; the manifest is not touched.
- **Atomic.** An entry is written by ``export_table`` into ``DIR/.NAME.tmp-PID``, fsynced and renamed; the
  manifest is written last, atomically (``files.atomic_write``: a temp file, fsynced, renamed, ``DIR`` fsynced). A reader that
  follows the manifest never sees a half-written entry, and an entry exists before any manifest names it.
- **Empty deltas** are not kept: the folder is removed and only the manifest's ``time`` advances.
- **Tombstones.** A delta also carries ``deleted.npy``: the ids eviction (TTL, capacity) removed since the
  previous cut and the table does not hold now (each server keeps its recent removals, ``embeddings.tombstones``,
  and a copy keeps its primary's, so a failover keeps them). A reader applies a delta's rows, then forgets its
  tombstones. A server whose tombstones do not reach back to the delta's start (dropped past the limit,
  a daemon restarted, a copy of some slots begun since) says so (``deleted_complete``) and the follower
  writes a full export instead. Rows that left a server because their
  slot moved are not removed from the table: no tombstone. **Compaction**: every
  ``full_every`` deltas (default 100; 0 = never) the loop writes a new full export, which becomes the base
  (deltas before it leave the manifest). Entries older than the *previous* base are then deleted, so a reader
  that read the manifest before this compaction still finds every entry it names; a reader that finds an
  entry gone re-reads the manifest.
- **One writer, restarts.** A follower holds ``DIR/LOCK`` (flock) while open. It resumes an existing log (its
  ``seq`` and ``time``); temp folders and entries newer than the manifest (a crash between an entry's rename
  and the manifest) are removed first. A table dropped and recreated, or restored from a checkpoint, is new on
  every server: its tombstones reach back only to its creation, so the next delta is incomplete and a full
  export is written instead; a reader forgets the old table's rows (no new log needed).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from tigana.embeddings.files import FileMismatch, atomic_write, fsync_path, hold_lock, read_checked
from tigana.ps.client.checkpoint import export_table
from tigana.ps.errors import DataLoss, InvalidArgument, PSError

log = logging.getLogger("tigana.ps.serving.exportlog")

FORMAT = "tigana-export-log"
VERSION = 1
MANIFEST = "manifest.json"
_ENTRY = re.compile(r"^(full|delta)-(\d{8})$")


def entry_name(kind: str, seq: int) -> str:
    return f"{kind}-{seq:08d}"


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The log's manifest, or None when there is none yet. Raises ``DataLoss`` for an unreadable or foreign
    one (it is replaced atomically, so a reader never sees a torn file)."""
    path = Path(directory) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise DataLoss(f"export log {str(path)!r}: not JSON: {exc}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DataLoss(f"export log {str(path)!r}: unsupported format {manifest.get('format')!r} "
                       f"version {manifest.get('version')!r}")
    return manifest


def _read(folder: Path, name: str, meta: dict[str, Any], verify: bool) -> bytes:
    """One file of a log entry, checked (``verify``) against the sha256 its ``export.json`` recorded."""
    if not verify:
        return (folder / name).read_bytes()
    try:
        return read_checked(folder / name, meta["files"][name])
    except FileMismatch:
        raise DataLoss(f"export log entry {str(folder)!r}: {name} does not match its checksum") from None


def load_entry(directory: str | os.PathLike, entry: dict[str, Any], *, verify: bool = True
               ) -> tuple[np.ndarray, np.ndarray]:
    """(ids sorted int64, rows float32) of one log entry; ``verify`` checks the files' sha256 against the
    entry's ``export.json``. ``FileNotFoundError`` when a compaction removed it (re-read the manifest)."""
    folder = Path(directory) / entry["path"]
    meta = json.loads((folder / "export.json").read_text())
    files = {}
    for name in ("ids.npy", "rows.npy"):
        files[name] = _read(folder, name, meta, verify)
    ids = _npy(files["ids.npy"], folder / "ids.npy")
    rows = _npy(files["rows.npy"], folder / "rows.npy")
    if ids.dtype != np.int64 or rows.dtype != np.float32 or rows.shape != (ids.size, int(meta["dim"])):
        raise DataLoss(f"export log entry {str(folder)!r}: ids {ids.dtype}{ids.shape} and rows "
                       f"{rows.dtype}{rows.shape} do not match dim {meta['dim']}")
    return ids, rows


def _npy(raw: bytes, path: Path) -> np.ndarray:
    import io

    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as exc:
        raise DataLoss(f"{str(path)!r}: not a .npy array: {exc}") from None


def read_log(directory: str | os.PathLike, *, verify: bool = True) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """(manifest, ids, rows): the whole table as the log has it now, base then deltas (the reference reader)."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise DataLoss(f"export log {str(directory)!r}: no {MANIFEST} yet")
    ids, rows = load_entry(directory, manifest["base"], verify=verify)
    for entry in manifest["deltas"]:
        ids, rows = merge(ids, rows, *load_entry(directory, entry, verify=verify))
        gone = load_deleted(directory, entry, verify=verify)
        if gone.size:  # tombstones: the rows eviction removed
            keep = ~np.isin(ids, gone)
            ids, rows = ids[keep], rows[keep]
    return manifest, ids, rows


def load_deleted(directory: str | os.PathLike, entry: dict[str, Any], *, verify: bool = True) -> np.ndarray:
    """The tombstones of a delta (sorted int64 ids a reader forgets); empty for a full export or an entry
    written before tombstones."""
    folder = Path(directory) / entry["path"]
    meta = json.loads((folder / "export.json").read_text())
    if "deleted.npy" not in meta["files"]:
        return np.empty(0, np.int64)
    out = _npy(_read(folder, "deleted.npy", meta, verify), folder / "deleted.npy")
    if out.dtype != np.int64 or out.ndim != 1:
        raise DataLoss(f"export log entry {str(folder)!r}: deleted.npy is {out.dtype}{out.shape}, not int64 ids")
    return out


def merge(ids: np.ndarray, rows: np.ndarray, new_ids: np.ndarray, new_rows: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique ``ids`` with ``rows``, updated by sorted unique ``new_ids``/``new_rows`` (those win):
    new arrays written in one pass, O(len(ids) + len(new_ids)); the inputs are not changed."""
    if not new_ids.size:
        return ids, rows
    pos = np.searchsorted(ids, new_ids)
    exists = pos < ids.size
    exists[exists] = ids[pos[exists]] == new_ids[exists]
    fresh, update = np.flatnonzero(~exists), np.flatnonzero(exists)
    if not fresh.size:
        out_rows = rows.copy()
        out_rows[pos[update]] = new_rows[update]
        return ids, out_rows
    n = ids.size + fresh.size
    at = pos[fresh] + np.arange(fresh.size)  # where each new id lands (an id goes before the old one at pos)
    old = np.ones(n, bool)
    old[at] = False
    out_ids = np.empty(n, ids.dtype)
    out_ids[old], out_ids[at] = ids, new_ids[fresh]
    out_rows = np.empty((n, rows.shape[1]), rows.dtype)
    out_rows[old], out_rows[at] = rows, new_rows[fresh]
    if update.size:  # an old row at p moved right by the new ids inserted at or before p
        shifted = pos[update] + np.searchsorted(pos[fresh], pos[update], side="right")
        out_rows[shifted] = new_rows[update]
    return out_ids, out_rows


def _lock_log(root: Path) -> IO[str]:
    """An exclusive lock on ``root/LOCK`` for the follower's life (the kernel drops it when the process dies)."""
    f, owner = hold_lock(root / "LOCK")
    if f is None:
        raise InvalidArgument(f"export --follow: {str(root)!r} is being written by another follower ({owner})")
    return f


class ExportFollower:
    """Writes the export log of ``table`` into ``out``: a full export, then a delta every ``interval_s``.

    ``step()`` writes one entry now (tests drive it directly); ``run(stop)`` ticks until ``stop`` is set;
    ``close()`` releases the log. Not thread-safe. One follower per log: it holds an exclusive lock on
    ``out/LOCK`` while open, and a second one refuses to start (``InvalidArgument``)."""

    def __init__(self, client: Any, table: str, out: str | os.PathLike, *, interval_s: float = 2.0,
                 overlap_s: float = 0.5, full_every: int = 100) -> None:
        if interval_s <= 0:
            raise InvalidArgument(f"export --follow: --interval must be > 0 seconds, got {interval_s}")
        if overlap_s < 0:
            raise InvalidArgument(f"export --follow: --overlap must be >= 0 seconds, got {overlap_s}")
        if full_every < 0:
            raise InvalidArgument(f"export --follow: --full-every must be >= 0, got {full_every}")
        self.client, self.table, self.root = client, table, Path(out)
        self.interval_s, self.overlap_s, self.full_every = float(interval_s), float(overlap_s), int(full_every)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = _lock_log(self.root)
        try:
            self.manifest = read_manifest(self.root)
            if self.manifest is not None and self.manifest["table"] != table:
                raise InvalidArgument(f"export --follow: {str(self.root)!r} holds the log of table "
                                      f"{self.manifest['table']!r}, not {table!r}")
            self._clean()
        except BaseException:
            self.close()
            raise
        self.entries_written = 0
        self.rows_written = 0

    def close(self) -> None:
        """Release the log's lock (idempotent)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> ExportFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _clean(self) -> None:
        """Remove temp folders and entries the manifest does not know yet (a crash before it was updated)."""
        newest = int(self.manifest["seq"]) if self.manifest else 0
        for p in self.root.iterdir():
            m = _ENTRY.match(p.name)
            if p.name.startswith(".") and ".tmp-" in p.name and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.name.startswith(".") and ".tmp-" in p.name:
                p.unlink(missing_ok=True)
            elif m and int(m.group(2)) > newest:
                shutil.rmtree(p, ignore_errors=True)

    def step(self) -> dict[str, Any]:
        """Write one entry (a full export when due, else a delta) and then the manifest; returns the entry
        (``rows`` 0 and no ``path`` for an empty delta). Raises what the export raised (nothing changed)."""
        m = self.manifest
        full = m is None or (self.full_every > 0 and len(m["deltas"]) >= self.full_every)
        seq = (int(m["seq"]) if m else 0) + 1
        name = entry_name("full" if full else "delta", seq)
        since = None if full else max(float(m["time"]) - self.overlap_s, 1e-6)
        shutil.rmtree(self.root / name, ignore_errors=True)  # left by a failed manifest write: never named
        started = time.monotonic()
        meta = export_table(self.client.checkpoint_port(), self.table, self.root / name, since_time=since)
        if not full and not meta["deleted_complete"]:  # tombstones older than a server keeps: only a full export
            log.info("export log %s: tombstones since %.3f are no longer all kept; writing a full export", self.root,
                     since)
            shutil.rmtree(self.root / name, ignore_errors=True)
            full, name = True, entry_name("full", seq)
            shutil.rmtree(self.root / name, ignore_errors=True)
            meta = export_table(self.client.checkpoint_port(), self.table, self.root / name)
        entry = {"path": name, "seq": seq, "time": float(meta["time"]), "since": float(meta["since"]),
                 "rows": int(meta["rows"]), "deleted": int(meta["deleted"]),
                 "seconds": round(time.monotonic() - started, 6)}
        fsync_path(self.root)  # the entry's rename is durable before a manifest names it
        if full:
            previous = m["base"]["seq"] if m else None
            new = {"format": FORMAT, "version": VERSION, "log_id": m["log_id"] if m else uuid.uuid4().hex,
                   "table": self.table, "dim": int(meta["dim"]), "base": entry, "deltas": []}
        else:
            new = {**m, "deltas": list(m["deltas"])}
            if entry["rows"] or entry["deleted"]:
                new["deltas"].append(entry)
            else:
                shutil.rmtree(self.root / name)
                entry = {k: v for k, v in entry.items() if k != "path"}
        kept = full or entry["rows"] or entry["deleted"]
        new.update(seq=seq if kept else int(m["seq"]), time=entry["time"], written=time.time(),
                   interval_s=self.interval_s, overlap_s=self.overlap_s, full_every=self.full_every)
        atomic_write(self.root / MANIFEST, json.dumps(new, indent=1))
        self.manifest = new
        self.entries_written += 1 if kept else 0
        self.rows_written += entry["rows"]
        if full and previous is not None:
            self._prune(int(previous))
        return entry

    def _prune(self, keep_from: int) -> None:
        """Delete the entries older than ``keep_from`` (the previous base): no current manifest names them, and
        a reader of the previous manifest only needs entries from its base on."""
        for p in self.root.iterdir():
            m = _ENTRY.match(p.name)
            if m and int(m.group(2)) < keep_from:
                shutil.rmtree(p, ignore_errors=True)

    def try_step(self) -> dict[str, Any] | None:
        """``step``, but a cluster or disk problem is logged and gives None: the next tick retries the same cut
        (nothing is lost: the next entry starts at the last written cut)."""
        try:
            return self.step()
        except (PSError, OSError) as exc:
            log.warning("export of %r failed, retried in %.1fs: %s: %s", self.table, self.interval_s,
                        type(exc).__name__, exc)
            return None

    def run(self, stop: threading.Event, *, on_entry: Callable[[dict[str, Any]], None] | None = None,
            max_entries: int | None = None) -> None:
        """Write an entry every ``interval_s`` (from each entry's start) until ``stop`` is set (or
        ``max_entries`` ticks). A failed export is logged and retried at the next tick with the same cut."""
        ticks = 0
        while not stop.is_set():
            started = time.monotonic()
            entry = self.try_step()
            if entry is not None and on_entry is not None:
                on_entry(entry)
            ticks += 1
            if max_entries is not None and ticks >= max_entries:
                return
            stop.wait(max(0.0, started + self.interval_s - time.monotonic()))
