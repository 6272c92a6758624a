"""Reading and restoring checkpoints: the manifest and its chain of bases, checked whole before anything
changes, then every table recreated and its rows written through the cluster's current primaries
(``ImportRows``, replicated like pushes) and compared slot by slot afterwards.

A chain restores newest first: a row is taken from the newest layer that holds it, an id a newer layer removed
(its tombstones) or holds is skipped in older ones, and a full part's slots are complete: older layers' rows of
those slots are skipped. So every row is written once, and the chain must reach a full part for every slot.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from tigana.embeddings import RowBatch, row_digests
from tigana.embeddings import snapshot as snap
from tigana.embeddings.changes import find_sorted, sorted_unique
from tigana.proto import shard_pb2 as pb
from tigana.ps import routing
from tigana.ps.client.checkpoint.parts import iter_part, part_deleted, verify_part
from tigana.ps.client.checkpoint.port import CheckpointPort
from tigana.ps.errors import DataLoss, InvalidArgument, from_rpc_error
from tigana.ps.wire import cluster as cluster_wire

FORMAT = "tigana-checkpoint"
VERSION = 2  # 1: parts were storage-engine snapshots (still read)
MANIFEST = "manifest.json"
IMPORT_WINDOW = 4  # row batches a restore has in flight (each an ImportRows call per primary)


def read_manifest(directory: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """A checkpoint's manifest after checking its format and (``verify``) every file of its parts."""
    root = Path(directory)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise DataLoss(f"checkpoint {str(root)!r}: no readable {MANIFEST}: {exc}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") not in (1, VERSION):
        raise DataLoss(f"checkpoint {str(root)!r}: unsupported format {manifest.get('format')!r} "
                       f"version {manifest.get('version')!r}")
    if manifest["version"] == 1:
        manifest.setdefault("cut", {"time": manifest["created"]})
    if not verify:
        return manifest
    for name, t in manifest["tables"].items():
        for part in t["parts"]:
            if manifest["version"] == 1:
                m = snap.read_manifest(root / part["path"])
                if m["manifest_sha256"] != part["manifest_sha256"] or m["table"] != name:
                    raise DataLoss(f"checkpoint {str(root)!r}: part {part['path']} does not match the manifest")
            else:
                verify_part(root, part)
    return manifest


def read_chain(directory: str | os.PathLike) -> list[tuple[Path, dict[str, Any]]]:
    """The checkpoint and its bases, newest first, every one checked (and each base against the sha256 its
    successor recorded)."""
    root = Path(directory)
    chain = [(root, read_manifest(root))]
    while chain[-1][1].get("base"):
        here, manifest = chain[-1]
        base = (here / manifest["base"]["path"]).resolve()
        try:
            digest = hashlib.sha256((base / MANIFEST).read_bytes()).hexdigest()
        except OSError as exc:
            raise DataLoss(f"checkpoint {str(here)!r}: its base {str(base)!r} is unreadable: {exc}") from None
        if digest != manifest["base"]["manifest_sha256"]:
            raise DataLoss(f"checkpoint {str(here)!r}: its base {str(base)!r} is not the one it was taken on")
        if len(chain) > 10_000:
            raise DataLoss(f"checkpoint {str(root)!r}: its chain of bases does not end")
        chain.append((base, read_manifest(base)))
    return chain


def restore_checkpoint(port: CheckpointPort, directory: str | os.PathLike, tables: list[str] | None = None
                       ) -> dict[str, int]:
    """Recreate the checkpoint's tables (dropping tables of those names) and write their rows through the
    cluster's current primaries. Returns rows restored per table."""
    chain = read_chain(directory)
    newest = chain[0][1]
    if int(newest["num_slots"]) != port.config.num_slots:
        raise InvalidArgument(f"restore: the checkpoint has {newest['num_slots']} slots, the cluster "
                              f"{port.config.num_slots}")
    for name in tables or []:
        if name not in newest["tables"]:
            raise InvalidArgument(f"restore: table {name!r} is not in checkpoint {str(directory)!r}")
    out = {}
    for name, t in newest["tables"].items():
        if tables is not None and name not in tables:
            continue
        spec = json_format.ParseDict(t["spec"], pb.TableSpec())
        port.drop_table(name)
        port.create_from_spec(spec)
        num_slots = port.config.num_slots
        sums = np.zeros(num_slots, np.uint64)
        counts = np.zeros(num_slots, np.int64)
        written = 0
        # IMPORT_WINDOW batches in flight: reading and digesting the next chunks overlaps the servers' imports
        with futures.ThreadPoolExecutor(IMPORT_WINDOW, thread_name_prefix="tigana-restore") as pool:
            pending: collections.deque[futures.Future] = collections.deque()
            for batch in _chain_rows(chain, name, num_slots, dim=int(t.get("dim", 0))):
                pending.append(pool.submit(import_rows, port, name, batch, int(t["step"])))
                slots = routing.slot_of(batch.ids, num_slots)
                with np.errstate(over="ignore"):
                    np.add.at(sums, slots, row_digests(batch))
                counts += np.bincount(slots, minlength=num_slots)
                if len(pending) >= IMPORT_WINDOW:
                    written += pending.popleft().result()
            while pending:
                written += pending.popleft().result()
        _verify_restored(port, name, sums, counts)
        out[name] = written
    return out


def checkpoint_rows(directory: str | os.PathLike, table: str) -> Iterator[RowBatch]:
    """Every row of ``table`` as the checkpoint at ``directory`` (with its chain) holds it, decoded to float32,
    in chunks of no set order: what a restore writes, read without a cluster (e.g. for serving or evaluation)."""
    chain = read_chain(directory)
    t = chain[0][1]["tables"].get(table)
    if t is None:
        raise InvalidArgument(f"checkpoint {str(directory)!r}: no table {table!r}")
    yield from _chain_rows(chain, table, int(chain[0][1]["num_slots"]), dim=int(t.get("dim", 0)))


def _chain_rows(chain: list[tuple[Path, dict[str, Any]]], name: str, num_slots: int, *, dim: int
                ) -> Iterator[RowBatch]:
    """Every row of table ``name`` as of the newest checkpoint of ``chain``, once (see the module docstring)."""
    covered = np.zeros(num_slots, bool)  # slots a newer full part holds whole
    seen = np.empty(0, np.int64)  # ids a newer incremental part holds or removed (sorted)
    for root, manifest in chain:
        t = manifest["tables"].get(name)
        if t is None:
            break
        newly = np.zeros(num_slots, bool)
        layer: list[np.ndarray] = []
        for part in t["parts"]:
            full = manifest["version"] == 1 or part.get("full", True)
            rows = (snap.iter_snapshot_rows(root / part["path"]) if manifest["version"] == 1 else
                    iter_part(root, part, dim=dim, state_width=int(t["state_width"])))
            for batch in rows:
                keep = ~covered[routing.slot_of(batch.ids, num_slots)]
                if seen.size:
                    keep &= find_sorted(seen, batch.ids) < 0
                if not full:
                    layer.append(batch.ids)
                if not keep.all():
                    batch = batch.take(keep)
                if len(batch):
                    yield batch
            if full:
                newly |= routing.parse_slots(part["slots"], num_slots)
            elif manifest["version"] != 1:
                layer.append(part_deleted(root, part))
        covered |= newly
        if layer:
            seen = sorted_unique(np.concatenate([seen, *layer]))
        if covered.all():
            return
    raise DataLoss(f"restore: table {name!r}: the checkpoint's chain holds no full copy of "
                   f"{int((~covered).sum())} slot(s) (its oldest base is incremental, or lacks the table)")


def _verify_restored(port: CheckpointPort, name: str, sums: np.ndarray, counts: np.ndarray) -> None:
    """Compare every slot's rows at its primary now with the checkpoint's (order-independent digests and
    counts): a row a concurrent map change discarded, or one written twice, is found here, not in training.
    ``DataLoss`` naming the slots that differ. Assumes nothing else writes the table during the restore."""
    deadline = time.monotonic() + port.config.failover_timeout_s
    while True:
        route = port.route()
        seen = np.zeros(sums.shape[0], bool)
        bad: list[int] = []
        moved = False
        for i, server in enumerate(route.servers):
            led = route.primary_of_slot == i
            if server is None or not led.any():
                continue
            try:
                reply = server.stub.SlotInfo(pb.SlotInfoRequest(table=name, checksums=True),
                                             timeout=port.config.admin_timeout_s)
            except grpc.RpcError as err:
                error = from_rpc_error(err, server.address)
                if time.monotonic() > deadline or not port.retryable(error):
                    raise error from None
                moved = True
                break
            for info in reply.tables:
                slots = cluster_wire.array(info.slots, "<i4", field="slots").astype(np.int64)
                keep = led[slots]
                slots = slots[keep]
                got = cluster_wire.array(info.checksums, "<u8", field="checksums")[keep]
                rows = cluster_wire.array(info.rows, "<i8", field="rows")[keep]
                seen[slots] = True
                bad += slots[(got != sums[slots]) | (rows != counts[slots])].tolist()
        if not moved and seen[counts > 0].all():
            break
        if time.monotonic() > deadline:
            raise DataLoss(f"restore: table {name!r}: the slots' primaries could not be checked")
        port.follow_map()
        time.sleep(0.1)
    if bad:
        raise DataLoss(f"restore: table {name!r}: {len(bad)} slot(s) differ from the checkpoint after the restore "
                       f"(slots {routing.format_slots(bad[:50])}); run the restore again")


def import_rows(port: CheckpointPort, name: str, batch: RowBatch, step: int) -> int:
    """Write complete rows (weights, optimizer state, counters) through their primaries (``ImportRows``, chunked
    under the message limit, replicated like pushes), retrying on a map move; returns how many."""
    deadline = time.monotonic() + port.config.failover_timeout_s
    pending = batch
    while True:
        route = port.route()
        primary = route.primary_of_slot[routing.slot_of(pending.ids, route.num_slots)]
        failed = []
        row_bytes = 8 + 4 * (pending.weights.shape[1] + pending.state.shape[1]) + 24
        per = max(1, port.config.chunk_bytes // row_bytes)
        for o in np.unique(primary):
            idx = np.flatnonzero(primary == o)
            if o < 0:
                failed.append(idx)
                continue
            server = route.servers[int(o)]
            for lo in range(0, idx.size, per):
                part = pending.take(idx[lo:lo + per])
                request = pb.ImportRowsRequest(table=name, rows=cluster_wire.rows_to_pb(part), epoch=route.epoch,
                                               step=step)
                try:
                    server.stub.ImportRows(request, timeout=port.config.timeout_s)
                except grpc.RpcError as err:
                    error = from_rpc_error(err, server.address)
                    if time.monotonic() > deadline or not port.retryable(error):
                        raise error from None
                    failed.append(idx[lo:lo + per])
        if not failed:
            return len(batch)
        pending = pending.take(np.concatenate(failed))
        port.follow_map()
        time.sleep(0.1)
