"""Writing a checkpoint: one cluster cut (``cutround`` over ``PrepareCut``/``CommitCut``), its parts read from
every primary and written as chunk files (``parts``), then the manifest, all in a temp folder renamed into place.

``incremental``: the rows changed since a base checkpoint (and the ids removed since then), per table; a table
new since the base, a server whose tombstones do not reach back to it (a slot copied to it since, a restart), or
one that leads a slot another primary wrote since the base (``SINCE_MARGIN_S``), gives a full part instead, so
every chain restores exactly. ``quantize``: the weights' codec; the optimizer
state stays exact unless ``quantize_state``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from tigana.proto import shard_pb2 as pb
from tigana.ps import routing
from tigana.ps.client.checkpoint.cutround import Commit, CutRound, Failed, Read, Release
from tigana.ps.client.checkpoint.export import _publish, _table_dir
from tigana.ps.client.checkpoint.parts import PartWriter
from tigana.ps.client.checkpoint.port import CheckpointPort
from tigana.ps.client.checkpoint.quantize import CODECS
from tigana.ps.client.checkpoint.restore import FORMAT, MANIFEST, VERSION, read_manifest
from tigana.ps.client.routes import Server
from tigana.ps.errors import DataLoss, InvalidArgument, PSError, Unavailable, from_rpc_error
from tigana.ps.wire import cluster as cluster_wire

HOLD_MS = 2000  # the longest a server holds writes waiting for the commit
# Which rows changed since the base is decided by log positions, not by comparing clocks across servers. A
# server's part is incremental only if every slot it leads kept its log position since the base (no write) or was
# led by it alone since the base (the map's slot_epochs: its copies unchanged since the base's epoch); the rows
# of such slots changed since the base were all stamped by this server's own clock, at or after its own reading
# at the base's commit, so it reads the rows updated at or after that reading, less this margin (a clock stepped
# back by less than it; row times are rounded up, never down). A server with no reading in the base (it led
# nothing then), or a slot another primary wrote since, gives a full part (``tigana.ps.shard.cuts``).
SINCE_MARGIN_S = 0.1


def write_checkpoint(port: CheckpointPort, directory: str | os.PathLike, tables: list[str] | None = None, *,
                     incremental: bool = False, base: str | os.PathLike | None = None, quantize: str = "none",
                     quantize_state: bool = False) -> dict[str, Any]:
    """Checkpoint ``tables`` (default: all) of the cluster behind ``port`` (a client's ``checkpoint_port()``) into ``directory`` (absent or
    empty) at one cut of the whole cluster. ``incremental``: only rows changed since ``base`` (default: the
    newest checkpoint beside ``directory``; none there: a full one). Returns the manifest."""
    root = Path(directory)
    if root.exists() and any(root.iterdir()):
        raise InvalidArgument(f"checkpoint: {str(root)!r} exists and is not empty")
    if quantize not in CODECS:
        raise InvalidArgument(f"checkpoint: field 'quantize' must be one of {list(CODECS)}, got {quantize!r}")
    base_path = _find_base(root, base) if incremental or base is not None else None
    base_manifest = read_manifest(base_path) if base_path is not None else None
    port.flush()
    names = sorted(tables or port.list_tables())
    base_cut = _BaseCut.of(base_manifest, names, port.config.num_slots) if base_manifest is not None else None
    tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}")
    deadline = time.monotonic() + port.config.failover_timeout_s
    while True:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            manifest = _one_cut(port, tmp, names, base_cut, quantize, quantize_state)
            break
        except PSError as error:
            shutil.rmtree(tmp, ignore_errors=True)
            # a map change under the cut, a server that refused or failed over: cut again by the newest map
            if time.monotonic() > deadline or not (isinstance(error, Unavailable) or port.retryable(error)):
                raise
            port.follow_map()
            time.sleep(0.1)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    try:
        manifest["kind"] = "incremental" if base_manifest is not None else "full"
        if base_path is not None:
            manifest["base"] = {"path": os.path.relpath(base_path, root),
                                "manifest_sha256": hashlib.sha256((base_path / MANIFEST).read_bytes()).hexdigest()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _publish(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _find_base(root: Path, base: str | os.PathLike | None) -> Path | None:
    """The base of an incremental: ``base``, or the newest checkpoint in ``root``'s parent folder (None)."""
    if base is not None:
        return Path(base)
    newest: tuple[float, Path] | None = None
    parent = root.parent
    for path in parent.iterdir() if parent.is_dir() else []:
        if path == root or path.name.startswith(".") or not (path / MANIFEST).is_file():
            continue
        try:
            created = float(json.loads((path / MANIFEST).read_text()).get("created", 0.0))
        except (OSError, ValueError):
            continue
        if newest is None or created > newest[0]:
            newest = (created, path)
    return newest[1] if newest else None


class _BaseCut:
    """What an incremental cut's servers need of its base: each server's clock reading at the base's commit
    (by address), the base's map epoch, and per table every slot's log position in the base."""

    def __init__(self, times: dict[str, float], epoch: int, positions: dict[str, bytes]) -> None:
        self.times, self.epoch, self.positions = times, epoch, positions

    @classmethod
    def of(cls, manifest: dict[str, Any], names: list[str], num_slots: int) -> _BaseCut:
        positions = {}
        for name in names:
            table = manifest["tables"].get(name)
            if table is None:
                continue  # new since the base: a full part
            at = np.full((num_slots, 2), np.iinfo(np.uint64).max, np.uint64)  # a slot no part names: never kept
            for part in table["parts"]:
                if part["positions"]:  # slots in increasing order, as format_slots wrote them
                    slots = np.flatnonzero(routing.parse_slots(part["slots"], num_slots))
                    at[slots] = np.asarray(part["positions"], np.uint64).reshape(-1, 2)
            positions[name] = at.astype("<u8").tobytes()
        return cls({a: float(t) for a, t in manifest["cut"]["servers"].items()}, int(manifest["epoch"]), positions)

    def request(self, address: str) -> dict[str, Any]:
        """The CommitCutRequest fields of ``address``'s commit: no reading of its own in the base, no since."""
        if address not in self.times:
            return {}
        since = self.times[address] - SINCE_MARGIN_S
        return {"since": dict.fromkeys(self.positions, since), "base_epoch": self.epoch,
                "base_positions": self.positions}


def _one_cut(port: CheckpointPort, tmp: Path, names: list[str], base: _BaseCut | None, quantize: str,
             quantize_state: bool) -> dict[str, Any]:
    """One round: prepare, commit, read every part; released on every server whatever happens."""
    route = port.route()
    if (route.primary_of_slot < 0).any():
        raise Unavailable(f"checkpoint: {int((route.primary_of_slot < 0).sum())} slot(s) have no primary now")
    servers = {s.address: s for i, s in enumerate(route.servers)
               if s is not None and (route.primary_of_slot == i).any()}
    cut = uuid.uuid4().hex
    round_ = CutRound(list(servers), port.config.num_slots)
    timeout = port.config.admin_timeout_s
    commits: dict[str, pb.CommitCutResponse] = {}
    commits_sent: dict[str, pb.CommitCutRequest] = {}
    infos = {n: port.describe_table(n) for n in names}
    with futures.ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="tigana-cut") as pool:
        def each(call, make):
            jobs = {a: pool.submit(call, servers[a], make(a)) for a in servers}
            out = {}
            for address, job in jobs.items():
                try:
                    out[address] = job.result()
                except grpc.RpcError as err:
                    out[address] = from_rpc_error(err, address)
            return out

        actions: list = []
        errors: list[Exception] = []
        try:
            prepare = pb.PrepareCutRequest(cut=cut, tables=names, hold_ms=HOLD_MS)
            for address, reply in each(lambda s, r: s.stub.PrepareCut(r, timeout=HOLD_MS / 1000), lambda a: prepare
                                       ).items():
                if isinstance(reply, Exception):
                    errors.append(reply)
                    actions += round_.refused(address, str(reply))
                else:
                    actions += round_.prepared(address)
            if any(isinstance(a, Commit) for a in actions):
                commits_sent = {a: pb.CommitCutRequest(cut=cut, **(base.request(a) if base is not None else {}))
                                for a in servers}
                for address, reply in each(lambda s, r: s.stub.CommitCut(r, timeout=timeout),
                                           commits_sent.__getitem__).items():
                    if isinstance(reply, Exception):
                        errors.append(reply)
                        actions += round_.refused(address, str(reply))
                    else:
                        commits[address] = reply
                        actions += round_.committed(address, reply.epoch,
                                                    cluster_wire.array(reply.slots, "<i4", field="slots"))
            failed = [a for a in actions if isinstance(a, Failed)]
            if failed:
                for error in errors:  # a refusal no new round can mend (a credential, a bad table) as it is
                    if not (isinstance(error, Unavailable) or port.retryable(error)):
                        raise error
                raise Unavailable(f"checkpoint: the cut was not taken: {failed[0].reason}")
            if not any(isinstance(a, Read) for a in actions):
                raise Unavailable("checkpoint: the cut was not taken")
            parts = each(lambda s, r: _read_parts(port, s, r, tmp, infos, quantize, quantize_state),
                         lambda a: cut)
        finally:
            released = [a for a in actions + round_.done() if isinstance(a, Release)]
            for address in sorted({x for a in released for x in a.servers}):
                with contextlib.suppress(grpc.RpcError):  # else its keep timer drops it
                    servers[address].stub.ReleaseCut(pb.ReleaseCutRequest(cut=cut), timeout=timeout)
    for reply in parts.values():
        if isinstance(reply, Exception):
            raise reply
    since = {a: dict(r.since) for a, r in commits_sent.items()}
    return _manifest(port, infos, since, commits, parts, quantize, quantize_state)


def _read_parts(port: CheckpointPort, server: Server, cut: str, tmp: Path, infos: dict[str, Any], quantize: str,
                quantize_state: bool) -> dict[str, dict[str, Any]]:
    """Every table's part of the cut on ``server``, written under ``tmp``."""
    out = {}
    for name, info in infos.items():
        width = int(info.stats["state_width"])
        part = f"{_table_dir(name)}/{_part_name(server.address)}"
        writer = PartWriter(tmp, part, table=name, codec=quantize, state_codec=quantize if quantize_state else "none")
        deleted = None
        request = pb.ExportRowsRequest(table=name, cut=cut, chunk_rows=65536)
        for chunk in server.stub.ExportRows(request, timeout=port.config.admin_timeout_s):
            if chunk.HasField("rows"):
                writer.add(cluster_wire.rows_from_pb(chunk.rows, dim=info.config.dim, state_width=width, table=name))
            if chunk.deleted_complete:
                deleted = cluster_wire.array(chunk.deleted_ids, "<i8", field="deleted_ids")
        out[name] = writer.finish(deleted)
    return out


def _part_name(address: str) -> str:
    return "part-" + hashlib.sha256(address.encode()).hexdigest()[:12]


def _manifest(port: CheckpointPort, infos: dict[str, Any], since: dict[str, dict[str, float]],
              commits: dict[str, pb.CommitCutResponse],
              parts: dict[str, dict[str, dict[str, Any]]], quantize: str, quantize_state: bool) -> dict[str, Any]:
    times = {a: c.server_time for a, c in commits.items()}
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "created": time.time(), "epoch": next(iter(commits.values())).epoch,
        "num_slots": port.config.num_slots, "kind": "full", "base": None, "quantize": quantize,
        "quantize_state": bool(quantize_state), "cut": {"time": min(times.values()), "servers": times,
                                                        "hold_ms": HOLD_MS},
        "tables": {}}
    total = 0
    for name, info in infos.items():
        spec = port.table_spec(name)
        entries, step = [], 0
        for address, commit in sorted(commits.items()):
            table = next(t for t in commit.tables if t.table == name)
            slots = cluster_wire.array(commit.slots, "<i4", field="slots").tolist()
            positions = zip(cluster_wire.array(table.positions_epochs, "<u8", field="positions").tolist(),
                            cluster_wire.array(table.positions_indexes, "<u8", field="positions").tolist(),
                            strict=True)
            entry = dict(parts[address][name], server=address, full=bool(table.full),
                         since=0.0 if table.full else since[address].get(name, 0.0),
                         slots=routing.format_slots(slots), positions=[list(p) for p in positions])
            entries.append(entry)
            step = max(step, int(table.step))
        rows = sum(e["rows"] for e in entries)
        nbytes = sum(e["bytes"] for e in entries)
        total += nbytes
        manifest["tables"][name] = {
            "spec": json_format.MessageToDict(spec, preserving_proto_field_name=True), "rows": rows, "step": step,
            "dim": int(info.config.dim), "state_width": int(info.stats["state_width"]),
            "since": min((e["since"] for e in entries if not e["full"]), default=0.0),
            "deleted": sum(e["deleted"] for e in entries), "bytes": nbytes,
            "parts": entries}
    manifest["bytes"] = total
    if any(not np.isfinite(v) for v in times.values()):
        raise DataLoss("checkpoint: a server's clock is not finite")
    return manifest
