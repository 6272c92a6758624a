"""The folder of a published model: what ``tigana train --publish-dir DIR`` and ``tigana admin export --follow
--model DIR`` write, and ``tigana serve --model DIR`` reads.

Layout of ``DIR``::

    DIR/model.json             the model's description (the trainer writes it at its first publish)
    DIR/dense/manifest.json    the published dense weights, oldest first (schema below), replaced atomically
    DIR/dense/dense-000000120.pt   one version's dense weights (``torch.save`` of the model's dense state)
    DIR/tables/TABLE/          each table's export log (``tigana.ps.serving.exportlog``)
    DIR/versions.json          the publish log: the model's versions, each naming every table's log position
                               and one dense version (``export --follow --model`` writes it)
    DIR/live.json              only after ``tigana admin publish rollback``: the version every server serves

``model.json`` (written by the trainer, read back by its scorer in ``tigana serve``; ``tables`` is what the
follower and the server need)::

    {"format": "tigana-model", "version": 1, "model": "deepfm", "tables": ["deepfm_fused"],
     "num_dense": 13, "num_sparse": 26, ...the trainer's fields (features, salts, dim, dense transform)...}

``dense/manifest.json``::

    {"format": "tigana-dense-log", "version": 1,
     "versions": [{"version": 120, "path": "dense-000000120.pt", "time": 1718000000.5, "sha256": "..."}, ...]}

A dense version's number is the training step its weights were taken at; the manifest keeps the newest
``keep`` versions and their files (older files are deleted after the manifest no longer names them).

``versions.json`` (the publish log; one writer, the follower)::

    {"format": "tigana-publish-log", "version": 1,
     "versions": [{"version": 7, "time": 1718000000.5, "written": ..., "step": 120,
                   "dense": {<the dense manifest's entry>}, "tables": {"TABLE": {"seq": 12, "log_id": "..."}}}]}

Each entry is one atomic model version: every table as of its log entry ``seq`` (the base and the deltas up
to it) and the dense weights of ``dense``. A new entry is written after a round of the follower that
changed anything (a table's rows, a new dense version); ``time`` is the earliest of the tables' cuts.
``live.json`` (``{"version": 5, "time": ...}``, written by ``tigana admin publish rollback``, removed by
``publish resume``) pins what every server serves; without it they serve the newest version their
validation gate accepts. Every file is
written to a temporary name, fsynced and renamed before a manifest names it (``files.atomic_write``), so a
reader that follows the manifest never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tigana.embeddings.files import FileMismatch, atomic_write, read_checked
from tigana.ps.errors import DataLoss, InvalidArgument

MODEL_FILE = "model.json"
MODEL_FORMAT = "tigana-model"
DENSE_DIR = "dense"
DENSE_FORMAT = "tigana-dense-log"
TABLES_DIR = "tables"
VERSIONS_FILE = "versions.json"
VERSIONS_FORMAT = "tigana-publish-log"
LIVE_FILE = "live.json"
VERSION = 1


def table_log(root: str | Path, table: str) -> Path:
    """The export log folder of ``table`` in the model folder ``root``."""
    return Path(root) / TABLES_DIR / table


def write_spec(root: str | Path, spec: dict[str, Any]) -> None:
    """Write ``model.json`` (atomically). ``spec`` must name its ``model``, ``tables``, ``num_dense`` and
    ``num_sparse``."""
    missing = [k for k in ("model", "tables", "num_dense", "num_sparse") if k not in spec]
    if missing:
        raise InvalidArgument(f"model.json: fields {missing} are missing")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / MODEL_FILE, json.dumps({"format": MODEL_FORMAT, "version": VERSION, **spec}, indent=1))


def read_spec(root: str | Path) -> dict[str, Any] | None:
    """``model.json`` of ``root``, or None while there is none."""
    return _read_json(Path(root) / MODEL_FILE, MODEL_FORMAT)


def read_dense_manifest(root: str | Path) -> dict[str, Any] | None:
    """``dense/manifest.json`` of ``root``, or None while no version is published."""
    return _read_json(Path(root) / DENSE_DIR / "manifest.json", DENSE_FORMAT)


def _read_json(path: Path, fmt: str) -> dict[str, Any] | None:
    """A JSON file of format ``fmt`` (version ``VERSION``), None when absent; ``DataLoss`` when it is not one."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise DataLoss(f"{path}: not JSON ({exc})") from None
    if doc.get("format") != fmt or doc.get("version") != VERSION:
        raise DataLoss(f"{path}: format {doc.get('format')!r} version {doc.get('version')!r}, expected {fmt!r} "
                       f"version {VERSION}")
    return doc


def read_versions(root: str | Path) -> dict[str, Any] | None:
    """``versions.json`` of ``root`` (the publish log), or None while no version is written."""
    return _read_json(Path(root) / VERSIONS_FILE, VERSIONS_FORMAT)


def read_live(root: str | Path) -> int | None:
    """The version a rollback pinned (``live.json``), or None when the newest is served."""
    path = Path(root) / LIVE_FILE
    try:
        return int(json.loads(path.read_text())["version"])
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise DataLoss(f"{path}: not a live version ({exc})") from None


def rollback(root: str | Path, to: int | None = None) -> int:
    """``tigana admin publish rollback [--to VERSION]``: pin every server of ``root`` to ``to`` (default: the
    version before the pinned one, or before the newest): each serves the newest version at or before it that
    its validation gate accepts. Returns the pinned version, which must be in the publish log."""
    log_ = read_versions(root)
    versions = [int(v["version"]) for v in (log_ or {"versions": []})["versions"]]
    if not versions:
        raise InvalidArgument(f"publish rollback: {root} has no published versions")
    if to is None:
        current = read_live(root) or versions[-1]
        older = [v for v in versions if v < current]
        if not older:
            raise InvalidArgument(f"publish rollback: no version before {current} is kept (kept: {versions})")
        to = older[-1]
    if int(to) not in versions:
        raise InvalidArgument(f"publish rollback: field 'to' is {to}, not a kept version (kept: {versions})")
    dense = next(v for v in log_["versions"] if int(v["version"]) == int(to))["dense"]
    if not (Path(root) / DENSE_DIR / dense["path"]).is_file():
        raise InvalidArgument(f"publish rollback: version {to}'s dense weights (step {dense['version']}) are no "
                              "longer kept (tigana train --publish-keep)")
    atomic_write(Path(root) / LIVE_FILE, json.dumps({"version": int(to), "time": time.time()}))
    return int(to)


def resume(root: str | Path) -> None:
    """``tigana admin publish resume``: unpin (servers go back to the newest version their gate accepts)."""
    (Path(root) / LIVE_FILE).unlink(missing_ok=True)


def newest_dense(root: str | Path) -> dict[str, Any] | None:
    """The newest published dense version's entry (``version``, ``path``, ``time``, ``sha256``), or None."""
    m = read_dense_manifest(root)
    return m["versions"][-1] if m is not None and m["versions"] else None


def read_dense(root: str | Path, entry: dict[str, Any], *, verify: bool = True) -> bytes:
    """The bytes of a dense version's file, checked against its sha256 (``DataLoss`` when they differ)."""
    path = Path(root) / DENSE_DIR / entry["path"]
    if not verify:
        return path.read_bytes()
    try:
        return read_checked(path, entry["sha256"])
    except FileMismatch:
        raise DataLoss(f"{path}: sha256 differs from dense/manifest.json's; not loaded") from None


def publish_dense(root: str | Path, version: int, data: bytes, *, keep: int = 20,
                  published: float | None = None) -> dict[str, Any]:
    """Add dense weights ``data`` as ``version`` (the training step) and keep the newest ``keep`` versions.
    The file is written and fsynced before the manifest names it; files the manifest dropped are deleted
    after it was replaced. Returns the new entry. A version not above the newest is refused (a restarted job
    publishes past its old versions)."""
    if keep < 1:
        raise InvalidArgument(f"publish: keep must be >= 1, got {keep}")
    folder = Path(root) / DENSE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    m = read_dense_manifest(root) or {"format": DENSE_FORMAT, "version": VERSION, "versions": []}
    versions = [v for v in m["versions"] if int(v["version"]) != int(version)]  # a resumed job writes it again
    if versions and int(version) < int(versions[-1]["version"]):
        raise InvalidArgument(f"publish: version {version} is below the newest published, "
                              f"{versions[-1]['version']}")
    entry = {"version": int(version), "path": f"dense-{int(version):09d}.pt",
             "time": time.time() if published is None else published,
             "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write(folder / entry["path"], data)
    kept = (versions + [entry])[-keep:]
    atomic_write(folder / "manifest.json", json.dumps({**m, "versions": kept}, indent=1))
    named = {v["path"] for v in kept}
    for old in folder.glob("dense-*.pt"):
        if old.name not in named:
            old.unlink(missing_ok=True)
    return entry


def follow_tables(client: Any, root: str | Path, stop: threading.Event, *, interval_s: float = 2.0,
                  overlap_s: float = 0.5, full_every: int = 100, keep_versions: int = 20,
                  on_entry: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``tigana admin export --follow --model DIR``: wait for ``model.json`` (the trainer's first publish), then
    write the export log of every table it names into ``DIR/tables/TABLE`` (``exportlog.ExportFollower``, one
    entry per table each ``interval_s``) until ``stop`` is set. A failed export is logged and retried at the
    next tick with the same cut (nothing is lost: the next delta starts at the last written cut). After each
    round that changed a table or found a new dense version, a model version joins the publish log
    (``versions.json``, the newest ``keep_versions`` kept; ``on_entry("", version)``). Returns the tables'
    counts (entries and rows written)."""
    from tigana.ps.serving.exportlog import ExportFollower  # exportlog imports the client's export path

    spec = read_spec(root)
    while spec is None and not stop.wait(min(interval_s, 0.2)):
        spec = read_spec(root)
    if spec is None:
        return {"tables": {}}
    followers: dict[str, ExportFollower] = {}
    try:
        for table in spec["tables"]:
            followers[table] = ExportFollower(client, table, table_log(root, table), interval_s=interval_s,
                                              overlap_s=overlap_s, full_every=full_every)
        while not stop.is_set():
            started = time.monotonic()
            for table, follower in followers.items():
                entry = follower.try_step()
                if entry is not None and on_entry is not None:
                    on_entry(table, entry)
            version = publish_version(root, {t: f.manifest for t, f in followers.items()}, keep_versions)
            if version is not None and on_entry is not None:
                on_entry("", version)
            stop.wait(max(0.0, started + interval_s - time.monotonic()))
    finally:
        for follower in followers.values():
            follower.close()
    versions = read_versions(root)
    newest = versions["versions"][-1]["version"] if versions and versions["versions"] else 0
    return {"version": newest, "tables": {t: {"entries": f.entries_written, "rows": f.rows_written,
                                              "seq": (f.manifest or {}).get("seq", 0)} for t, f in followers.items()}}


def publish_version(root: str | Path, manifests: dict[str, dict[str, Any] | None], keep: int = 20
                    ) -> dict[str, Any] | None:
    """Append a model version to the publish log (``versions.json``, the newest ``keep`` kept) of every
    table at its export log's ``manifests[table]`` position and the newest dense version, when all of them
    exist and either changed since the last version; returns the new entry, or None. One writer per folder
    (the follower)."""
    dense = newest_dense(root)
    if dense is None or not manifests or any(m is None for m in manifests.values()):
        return None
    versions = read_versions(root) or {"format": VERSIONS_FORMAT, "version": VERSION, "versions": []}
    tables = {t: {"seq": int(m["seq"]), "log_id": m["log_id"]} for t, m in manifests.items()}
    last = versions["versions"][-1] if versions["versions"] else None
    if last is not None and last["tables"] == tables and last["dense"]["sha256"] == dense["sha256"]:
        return None
    entry = {"version": (int(last["version"]) if last else 0) + 1,
             "time": min(float(m["time"]) for m in manifests.values()), "written": time.time(),
             "step": int(dense["version"]), "dense": dense, "tables": tables}
    versions["versions"] = (versions["versions"] + [entry])[-keep:]
    atomic_write(Path(root) / VERSIONS_FILE, json.dumps(versions, indent=1))
    return entry
