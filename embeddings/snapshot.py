"""Crash-safe full and incremental snapshots of one table, and the table config's JSON form.

Public API::

    path = write_snapshot(root, table="user_id", config=config_to_dict(cfg), rows=batches_or_batch,
                          deleted_ids=None, incremental=False, meta={"step": 1200}, state_width=1)
    latest_snapshot(root) -> Path | None          # newest complete snapshot in root
    list_snapshots(root) -> list[Path]            # complete snapshots, oldest first
    read_manifest(path) -> dict                   # one snapshot's verified manifest
    config, rows, meta = read_snapshot(path)      # path: a snapshot, or a root (then its latest)
    for batch in iter_snapshot_rows(path): ...    # the same rows, streamed batch by batch
    read_extra(path, "dedup") -> bytes | None     # a caller file stored with the snapshot (checksummed)
    config_to_dict(TableConfig) -> dict; config_from_dict(dict) -> TableConfig
    cleanup_temp(root) -> int                     # remove temp dirs left by dead writers

Layout: ``root/00000001-full/``, ``root/00000002-incr/``, ... (sequence numbers sort by name). Each holds
``rows/data.mdb`` (a ``RowStore``: every record carries a CRC-32), ``deleted.npy`` (int64 ids deleted since
the parent; incremental only) and ``manifest.json``: format version, table, kind, sequence, parent name,
dim, state width, row and deletion counts, the config dict, caller meta (the table step...), the size and
sha256 of every file, and the sha256 of the manifest itself. ``extra/<name>`` holds caller files given as
``extra_files`` (state that must change atomically with the rows, such as the exactly-once window).

Atomicity: a snapshot is written into ``root/.tmp-<seq>-<kind>-<pid>-<token>/``, every file and the
directory fsynced, then renamed into place and ``root`` fsynced. A crash mid-write leaves only a temp dir,
which readers never look at and the next writer deletes (when its writer process is gone).

Chains: an incremental snapshot holds the rows changed since its parent (the latest snapshot in root when
it was written) and the ids deleted since. Restoring applies the full snapshot and then each increment in
order: first its deletions, then its rows. ``read_snapshot`` verifies every file checksum of the whole
chain before returning anything, and every record's CRC as it decodes it.

Errors: no snapshot, a missing parent or a broken chain raise ``SnapshotNotFound``; a checksum or size
mismatch raises ``CorruptStore`` naming the file (and the id for a bad record); a full disk while writing
raises ``StorageFull`` and leaves no snapshot. Functions are thread-safe for distinct roots; two writers
on one root at once are not supported.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tigana.embeddings import config as _config
from tigana.embeddings.changes import sorted_unique
from tigana.embeddings.errors import CorruptStore, InvalidArgument, SnapshotNotFound, StorageFull
from tigana.embeddings.files import FileMismatch, publish_folder, read_checked
from tigana.embeddings.lmdbstore import RowStore
from tigana.embeddings.rows import RowBatch

__all__ = [
    "cleanup_temp", "config_from_dict", "config_to_dict", "iter_snapshot_rows", "latest_snapshot",
    "list_snapshots", "read_extra", "read_manifest", "read_snapshot", "write_snapshot",
]

FORMAT = "tigana-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
ROWS_DIR = "rows"
DELETED_FILE = "deleted.npy"
EXTRA_DIR = "extra"
_EXTRA_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_NAME = re.compile(r"^(\d{8})-(full|incr)$")
_TEMP = re.compile(r"^\.tmp-\d{8}-(full|incr)-(\d+)-[0-9a-f]+$")
_KIND = {"full": "full", "incremental": "incr"}


# --- config <-> dict -------------------------------------------------------------------------------------
def config_to_dict(config: _config.TableConfig) -> dict[str, Any]:
    """A JSON-ready dict of a TableConfig; ``config_from_dict`` inverts it."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in ("optimizer", "initializer"):
            value = {"kind": value.kind, "params": value.params()}
        elif dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        out[f.name] = value
    return out


def config_from_dict(data: dict[str, Any]) -> _config.TableConfig:
    """Rebuild a TableConfig; unknown fields or kinds raise InvalidArgument naming them."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"table config: expected a dict, got {type(data).__name__}")
    name = data.get("name", "?")
    fields = {f.name for f in dataclasses.fields(_config.TableConfig)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise InvalidArgument(f"table {name!r}: unknown config field(s) {unknown}")
    kwargs = dict(data)
    for field, registry in (("optimizer", _config.OPTIMIZERS), ("initializer", _config.INITIALIZERS)):
        if field in kwargs:
            spec = kwargs[field]
            if not isinstance(spec, dict) or "kind" not in spec:
                raise InvalidArgument(f"table {name!r}: field {field!r} must be {{'kind': ..., 'params': ...}}")
            kwargs[field] = _config.from_kind(registry, spec["kind"], dict(spec.get("params", {})),
                                              what=f"table {name!r} {field}")
    for field, cls in (("admission", _config.Admission), ("eviction", _config.Eviction)):
        if field in kwargs:
            try:
                kwargs[field] = cls(**kwargs[field])
            except TypeError as exc:
                raise InvalidArgument(f"table {name!r}: field {field!r}: {exc}") from exc
    try:
        return _config.TableConfig(**kwargs)
    except TypeError as exc:
        raise InvalidArgument(f"table {name!r}: bad config: {exc}") from exc


# --- listing ---------------------------------------------------------------------------------------------
def list_snapshots(root: str | Path) -> list[Path]:
    """Complete snapshots in ``root``, oldest first (temp dirs of unfinished writes are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name)


def latest_snapshot(root: str | Path) -> Path | None:
    """The newest complete snapshot in ``root``, or None."""
    snaps = list_snapshots(root)
    return snaps[-1] if snaps else None


def cleanup_temp(root: str | Path) -> int:
    """Delete temp dirs in ``root`` whose writer process is gone; returns how many were removed."""
    root = Path(root)
    removed = 0
    if not root.is_dir():
        return 0
    for p in root.iterdir():
        m = _TEMP.match(p.name)
        if m and not _alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- writing ---------------------------------------------------------------------------------------------
def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _batches(rows: Iterable[RowBatch] | RowBatch) -> Iterable[RowBatch]:
    return [rows] if isinstance(rows, RowBatch) else rows


def write_snapshot(root: str | Path, *, table: str, config: dict[str, Any],
                   rows: Iterable[RowBatch] | RowBatch, deleted_ids: np.ndarray | None = None,
                   incremental: bool = False, meta: dict[str, Any] | None = None,
                   state_width: int | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write one snapshot under ``root`` atomically and return its path.

    ``config``: the table's config dict (``config_to_dict``; needs ``dim``). ``rows``: a RowBatch or an
    iterable of them (for a full snapshot: every row; for an incremental one: the rows changed since the
    previous snapshot in root); the last of duplicate ids wins. ``deleted_ids``: (k,) int64 ids deleted
    since the previous snapshot (incremental only). ``meta``: JSON-ready extras (the table step...), given
    back by ``read_snapshot``. ``state_width``: optimizer state columns; inferred from the first batch
    when None (0 for no rows). ``extra_files``: {name: bytes} stored in the snapshot and checksummed with
    it (``read_extra``), so caller state becomes visible atomically with the rows. Raises SnapshotNotFound for an incremental snapshot without a previous
    one, InvalidArgument for bad rows (naming table and field), StorageFull when the disk is full.
    """
    root = Path(root)
    if "dim" not in config:
        raise InvalidArgument(f"table {table!r}: field 'config' has no 'dim'")
    dim = int(config["dim"])
    deleted = np.zeros(0, np.int64) if deleted_ids is None else np.asarray(deleted_ids)
    if deleted.ndim != 1 or (deleted.size and deleted.dtype.kind not in "iu"):
        raise InvalidArgument(f"table {table!r}: field 'deleted_ids' must be a 1-D int64 array, "
                              f"got {deleted.dtype} with shape {deleted.shape}")
    if deleted.size and not incremental:
        raise InvalidArgument(f"table {table!r}: field 'deleted_ids' is only valid for an incremental snapshot")
    deleted = sorted_unique(deleted.astype(np.int64))
    extra_files = dict(extra_files or {})
    for name, data in extra_files.items():
        # fullmatch: ``$`` would also match before a trailing newline; "." and ".." name directories
        if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name) or name in (".", ".."):
            raise InvalidArgument(f"table {table!r}: field 'extra_files' has a bad name {name!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"table {table!r}: field 'extra_files' entry {name!r} must be bytes, "
                                  f"got {type(data).__name__}")
    try:
        json.dumps(meta or {})
        json.dumps(config)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"table {table!r}: field 'meta'/'config' is not JSON-serializable: {exc}") from exc

    root.mkdir(parents=True, exist_ok=True)
    cleanup_temp(root)
    existing = list_snapshots(root)
    parent = existing[-1] if existing else None
    if incremental:
        if parent is None:
            raise SnapshotNotFound(f"table {table!r}: incremental snapshot needs a previous snapshot in {root}")
        parent_manifest = read_manifest(parent)
        if parent_manifest["table"] != table or parent_manifest["dim"] != dim:
            raise InvalidArgument(
                f"table {table!r}: field 'incremental': latest snapshot {parent} belongs to table "
                f"{parent_manifest['table']!r} with dim {parent_manifest['dim']}")
    seq = int(_NAME.match(parent.name).group(1)) + 1 if parent else 1
    kind = "incremental" if incremental else "full"
    name = f"{seq:08d}-{_KIND[kind]}"
    tmp = root / f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}"
    final = root / name

    batches = iter(_batches(rows))
    first = next(batches, None)
    if state_width is None:
        state_width = 0 if first is None else int(np.asarray(first.state).reshape(len(first), -1).shape[1])
    try:
        tmp.mkdir()
        store = RowStore(tmp / ROWS_DIR, table=table, dim=dim, state_width=state_width, lock=False,
                         readahead=True, map_size=_initial_map_size(first, dim, state_width))
        try:
            if first is not None:
                store.put(first)
                for batch in batches:
                    store.put(batch)
            row_count = len(store)
            store.sync()
        finally:
            store.close()
        files = [f"{ROWS_DIR}/data.mdb"]
        if incremental:
            with open(tmp / DELETED_FILE, "wb") as f:
                np.save(f, deleted)
            files.append(DELETED_FILE)
        if extra_files:
            (tmp / EXTRA_DIR).mkdir()
            for name, data in sorted(extra_files.items()):
                (tmp / EXTRA_DIR / name).write_bytes(data)
                files.append(f"{EXTRA_DIR}/{name}")
        manifest: dict[str, Any] = {
            "format": FORMAT, "version": FORMAT_VERSION, "table": table, "kind": kind, "sequence": seq,
            "parent": parent.name if incremental and parent else None, "created": time.time(),
            "dim": dim, "state_width": state_width, "rows": row_count, "deleted": int(deleted.size),
            "config": config, "meta": meta or {},
            "files": {rel: {"bytes": (tmp / rel).stat().st_size, "sha256": _file_digest(tmp / rel)}
                      for rel in files},
        }
        manifest["manifest_sha256"] = _manifest_digest(manifest)
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        publish_folder(tmp, final)  # every file fsynced, renamed into place, ``root`` fsynced
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise StorageFull(f"table {table!r}: disk full writing snapshot {tmp}: {exc}") from exc
        raise
    return final


def _initial_map_size(first: RowBatch | None, dim: int, state_width: int) -> int:
    # Sized for the first batch with room to spare; RowStore doubles it as more batches arrive.
    rows = 0 if first is None else len(first)
    need = rows * (8 + 32 + 4 * (dim + state_width) + 64) * 2
    return max(1 << 24, 1 << int(need).bit_length())


# --- reading ---------------------------------------------------------------------------------------------
def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the snapshot at ``path`` after checking its own checksum and format."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise SnapshotNotFound(f"no snapshot at {path} (missing {MANIFEST})")
    try:
        manifest = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptStore(f"snapshot manifest {file} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CorruptStore(f"snapshot manifest {file} failed its checksum")
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CorruptStore(f"snapshot manifest {file}: unsupported format "
                           f"{manifest.get('format')!r} version {manifest.get('version')!r}")
    return manifest


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = latest_snapshot(path)
    if latest is None:
        raise SnapshotNotFound(f"no snapshot at {path}")
    return latest


def _chain(path: Path) -> list[tuple[Path, dict[str, Any]]]:
    """[(path, manifest)] from the full snapshot to ``path``; every file checksum verified."""
    chain = [(path, read_manifest(path))]
    while chain[-1][1]["kind"] == "incremental":
        child, manifest = chain[-1]
        parent_name = manifest.get("parent")
        parent = child.parent / str(parent_name)
        m = _NAME.match(str(parent_name))
        if m is None or int(m.group(1)) >= manifest["sequence"] or not (parent / MANIFEST).is_file():
            raise SnapshotNotFound(f"snapshot {child} needs its parent {parent}, which is missing or invalid")
        parent_manifest = read_manifest(parent)
        if parent_manifest["table"] != manifest["table"] or parent_manifest["dim"] != manifest["dim"] \
                or parent_manifest["state_width"] != manifest["state_width"]:
            raise SnapshotNotFound(f"snapshot {child}: parent {parent} belongs to another table or layout")
        chain.append((parent, parent_manifest))
    chain.reverse()
    for snap, manifest in chain:
        for rel, expect in manifest["files"].items():
            file = snap / rel
            if not file.is_file():
                raise CorruptStore(f"snapshot {snap}: file {file} is missing")
            size = file.stat().st_size
            if size != expect["bytes"]:
                raise CorruptStore(f"snapshot file {file} is {size} bytes, its manifest says {expect['bytes']}")
            if _file_digest(file) != expect["sha256"]:
                raise CorruptStore(f"snapshot file {file} failed its sha256 checksum")
    return chain


def _read_deleted(snap: Path, manifest: dict[str, Any]) -> np.ndarray:
    if manifest["kind"] != "incremental":
        return np.zeros(0, np.int64)
    file = snap / DELETED_FILE
    try:
        deleted = np.load(file, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise CorruptStore(f"snapshot file {file} cannot be read: {exc}") from exc
    if deleted.dtype != np.int64 or deleted.ndim != 1:
        raise CorruptStore(f"snapshot file {file} holds {deleted.dtype} {deleted.shape}, expected (k,) int64")
    return deleted


def iter_snapshot_rows(path: str | Path, batch_size: int = 65536) -> Iterator[RowBatch]:
    """The rows of the snapshot at ``path`` (or root's latest) with its chain applied, in no set order.

    Every file of the chain is verified before the first batch. Streams the full snapshot; memory grows
    only with the ids of the increments (newer snapshots are read first, and their ids shadow older rows).
    """
    chain = _chain(_resolve(path))
    shadow = np.zeros(0, np.int64)  # sorted ids set by a newer snapshot (rows or deletions)
    for snap, manifest in reversed(chain):
        seen = []
        store = RowStore(snap / ROWS_DIR, table=manifest["table"], dim=manifest["dim"],
                         state_width=manifest["state_width"], readonly=True, lock=False, readahead=True)
        try:
            for batch in store.iter_batches(batch_size):
                if manifest["kind"] == "incremental":
                    seen.append(batch.ids)
                keep = ~np.isin(batch.ids, shadow, assume_unique=False) if shadow.size else None
                out = batch if keep is None else batch.take(keep)
                if len(out):
                    yield out
            if len(store) != manifest["rows"]:
                raise CorruptStore(f"snapshot {snap}: {store.file} holds {len(store)} rows, "
                                   f"its manifest says {manifest['rows']}")
        finally:
            store.close()
        if manifest["kind"] == "incremental":
            shadow = sorted_unique(np.concatenate([shadow, _read_deleted(snap, manifest), *seen]))


def read_extra(path: str | Path, name: str) -> bytes | None:
    """The caller file ``name`` stored with the snapshot at ``path`` (or root's latest), checked against its
    manifest checksum; None when the snapshot has none of that name."""
    snap = _resolve(path)
    manifest = read_manifest(snap)
    rel = f"{EXTRA_DIR}/{name}"
    expect = manifest["files"].get(rel)
    if expect is None:
        return None
    file = snap / rel
    try:
        return read_checked(file, expect["sha256"], expect["bytes"])
    except OSError as exc:
        raise CorruptStore(f"snapshot file {file} cannot be read: {exc}") from exc
    except FileMismatch:
        raise CorruptStore(f"snapshot file {file} failed its sha256 checksum") from None


def read_snapshot(path: str | Path) -> tuple[dict[str, Any], RowBatch, dict[str, Any]]:
    """-> (config dict, every row with the chain applied, meta) of the snapshot at ``path``.

    ``path`` may be a snapshot directory or a root (then its latest snapshot). Config and meta are the
    newest snapshot's. Rows come back in no set order; the RowBatch has the snapshot's dim/state width.
    """
    snap = _resolve(path)
    manifest = read_manifest(snap)
    batches = list(iter_snapshot_rows(snap))
    rows = RowBatch.concat(batches) if batches else RowBatch.empty(manifest["dim"], manifest["state_width"])
    return manifest["config"], rows, manifest["meta"]
