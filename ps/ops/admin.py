"""Operating a live cluster: what ``tigana admin`` and the tests ask a scheduler and its servers.

``cluster_status`` summarizes the scheduler's view (servers, epoch, degraded and unavailable slots);
``verify`` compares the per-slot checksums of every copy of every slot with its primary's and names the
slots that differ. Both talk to real processes over gRPC.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import numpy as np

from tigana.proto import scheduler_pb2 as spb
from tigana.proto import scheduler_pb2_grpc as spb_grpc
from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps.errors import DeadlineExceeded, TableNotFound, Unavailable, from_rpc_error
from tigana.ps.routing import IN_SYNC, ShardMap
from tigana.ps.security import NONE, Security
from tigana.ps.wire import cluster as cluster_wire

_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


_STANDBY = "is a standby"  # in the UNAVAILABLE a standby scheduler answers (``NotLeader``)


def _scheduler_call(address: str, method: str, request: Any, timeout_s: float, security: Security = NONE) -> Any:
    """One call to the scheduler at ``address`` ("host:port[,host:port]": a leader and its standbys; a standby
    or a dead one answers UNAVAILABLE, and the next is tried until one answers or ``timeout_s`` passes)."""
    addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
    deadline = time.monotonic() + timeout_s
    k = 0
    while True:
        one = addresses[k % len(addresses)]
        channel = security.channel(one, _OPTIONS)
        try:
            left = deadline - time.monotonic()
            return getattr(spb_grpc.SchedulerStub(channel), method)(
                request, timeout=max(0.5, left / 2 if len(addresses) > 1 else left))
        except grpc.RpcError as err:
            error = from_rpc_error(err, one)
            # One address answered by a standby: a Service in front of a leader and its standbys, where a new
            # connection (the channel is made again) may reach the leader; a dead one fails at once.
            behind_service = len(addresses) == 1 and _STANDBY in str(error)
            if not isinstance(error, (Unavailable, DeadlineExceeded)) or (len(addresses) == 1 and not behind_service) \
                    or time.monotonic() >= deadline:
                raise error from None
        finally:
            channel.close()
        k += 1
        if k % len(addresses) == 0:
            time.sleep(0.1)


def status(address: str, timeout_s: float = 10.0, security: Security = NONE) -> spb.StatusResponse:
    """The scheduler's ``Status`` reply (raises ``Unavailable`` when it does not answer)."""
    return _scheduler_call(address, "Status", spb.StatusRequest(), timeout_s, security)


def cluster_status(address: str | None, timeout_s: float = 10.0, security: Security = NONE
                   ) -> dict[str, Any] | None:
    """{epoch, servers: [{id, address, up, domain, primaries, replicas, catching_up, last_heartbeat_s, stats}],
    degraded_slots, unavailable_slots, domain_degraded_slots, domain_level, tables}; None when the scheduler does
    not answer. ``domain_degraded_slots``: slots whose in-sync copies share a failure domain at ``domain_level``
    (zone, rack or host; ``server`` where no level has enough domains, judged by host)."""
    if address is None:
        return None
    try:
        reply = status(address, timeout_s, security)
    except Unavailable:
        return None
    m = cluster_wire.map_from_pb(reply.map)
    return {
        "epoch": m.epoch, "cluster_id": m.cluster_id, "replicas": m.replicas, "num_slots": m.num_slots,
        "degraded_slots": int(reply.degraded_slots), "unavailable_slots": int(reply.unavailable_slots),
        "unprotected_slots": m.summary()["unprotected_slots"],
        "domain_degraded_slots": int(reply.domain_degraded_slots), "domain_level": reply.domain_level,
        "tables": sorted(m.tables),
        "servers": [{"id": s.info.id, "address": s.info.address, "up": s.info.state == pb.SERVER_UP,
                     "domain": str(cluster_wire.domain_from_pb(s.info.domain)),
                     "primaries": s.primaries, "replicas": s.replicas, "catching_up": s.catching_up,
                     "last_heartbeat_s": round(s.last_heartbeat_s, 3), "stats": dict(s.stats)}
                    for s in reply.servers],
    }


def shard_map(address: str, timeout_s: float = 10.0, security: Security = NONE) -> ShardMap:
    """The scheduler's current map; ``Unavailable`` saying so when it has none yet (no shard server has
    registered since the cluster was created)."""
    reply = _scheduler_call(address, "GetMap", spb.GetMapRequest(known_epoch=0), timeout_s, security)
    if not reply.HasField("map"):
        raise Unavailable(f"scheduler {address}: no shard server has registered with the scheduler yet (it has no "
                          "shard map)")
    return cluster_wire.map_from_pb(reply.map)


def slot_info(server_address: str, table: str = "", *, checksums: bool = True, security: Security = NONE,
              timeout_s: float = 60.0) -> dict[str, dict[str, np.ndarray]]:
    """Per table: {slots, rows, checksums, lsn_epochs, lsn_indexes, pull_rates, push_rates, bytes} of the
    copies one server holds (numpy arrays aligned on slots)."""
    return _slot_info(server_address, table, checksums=checksums, security=security, timeout_s=timeout_s)[1]


def _slot_info(server_address: str, table: str, *, checksums: bool, security: Security, timeout_s: float
               ) -> tuple[int, dict[str, dict[str, np.ndarray]]]:
    """(the epoch of the map the server answered under, ``slot_info``'s tables)."""
    channel = security.channel(server_address, _OPTIONS)
    try:
        reply = shard_pb2_grpc.ShardStub(channel).SlotInfo(pb.SlotInfoRequest(table=table, checksums=checksums),
                                                          timeout=timeout_s)
    except grpc.RpcError as err:
        raise from_rpc_error(err, server_address) from None
    finally:
        channel.close()
    out = {}
    for t in reply.tables:
        a = cluster_wire.array
        out[t.table] = {"slots": a(t.slots, "<i4", field="slots"), "rows": a(t.rows, "<i8", field="rows"),
                        "checksums": a(t.checksums, "<u8", field="checksums"),
                        "lsn_epochs": a(t.lsn_epochs, "<u8", field="lsn_epochs"),
                        "lsn_indexes": a(t.lsn_indexes, "<u8", field="lsn_indexes"),
                        "pull_rates": a(t.pull_rates, "<f8", field="pull_rates"),
                        "push_rates": a(t.push_rates, "<f8", field="push_rates"),
                        "bytes": a(t.bytes, "<i8", field="bytes")}
    return int(reply.epoch), out


def verify(scheduler: str, table: str = "", timeout_s: float = 120.0, security: Security = NONE,
           settle_s: float = 30.0) -> dict[str, Any]:
    """Compare every in-sync copy's per-slot checksum with its primary's, at the same log position.

    Each server reads a slot's checksum and its log position (epoch, index) at one moment, and says which map
    it answers under. A copy at the primary's position must have the primary's checksum (else it ``differs``).
    What cannot be compared yet is read again, with the scheduler's map, for up to ``settle_s`` seconds: a copy
    at another position (asynchronous replication, or a write in flight), and a side with no position for the
    slot (a server that has not installed the map yet, or one that installed a newer map the slot left; a
    restarted process answers for a map that names its predecessor, holding nothing, until the scheduler hears
    it). Copies still so then are reported ``behind``, not compared; a server still under the map's own epoch
    that holds nothing of a slot the map gives it then ``differs``. Returns {epoch, copies_checked, differing:
    [{table, slot, primary, copy, ...}], behind: [...], unreachable}."""
    deadline = time.monotonic() + settle_s
    while True:
        final = time.monotonic() > deadline
        m = shard_map(scheduler, security=security)
        infos: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        epochs: dict[int, int] = {}
        unreachable = []
        for i, s in enumerate(m.servers):
            if not s.up or not m.holds(i).any():
                continue
            try:
                try:
                    epochs[i], infos[i] = _slot_info(s.address, table, checksums=True, timeout_s=timeout_s,
                                                     security=security)
                except TableNotFound:  # not created there yet, or no longer: only the map it is under is asked
                    epochs[i], infos[i] = _slot_info(s.address, "", checksums=False, timeout_s=timeout_s,
                                                     security=security)[0], {}
            except Unavailable:
                unreachable.append(s.id)
        checked, differing, behind = _compare_copies(m, infos, [table] if table else sorted(m.tables), epochs,
                                                     final=final)
        if not behind or final:
            return {"epoch": m.epoch, "copies_checked": checked, "differing": differing, "behind": behind,
                    "unreachable": unreachable}
        time.sleep(0.5)


def _compare_copies(m: ShardMap, infos: dict[int, dict[str, dict[str, np.ndarray]]], tables: list[str],
                    epochs: dict[int, int] | None = None, *, final: bool = True
                    ) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    """(copies compared, copies that differ, copies not comparable: ``behind``) of the servers in ``infos``
    (server index → ``slot_info``), which answered under the maps of ``epochs`` (server index → epoch; m's
    own where absent). A side with no position for a slot is behind when its server answered under another
    map than ``m``, or when this is not the ``final`` read; else the copy differs."""
    differing: list[dict[str, Any]] = []
    behind: list[dict[str, Any]] = []
    checked = 0
    epochs = epochs or {}
    for name in tables:
        sums: dict[int, dict[int, tuple[int, int, int, int]]] = {}
        for i, per_table in infos.items():
            t = per_table.get(name)
            sums[i] = {} if t is None else dict(zip(
                t["slots"].tolist(), zip(t["checksums"].tolist(), t["lsn_epochs"].tolist(),
                                         t["lsn_indexes"].tolist(), t["rows"].tolist(), strict=True), strict=True))
        for slot in range(m.num_slots):
            primary = int(m.copies[slot, 0])
            if primary < 0 or primary not in sums:  # no primary, or one that did not answer (``unreachable``)
                continue
            mine = sums[primary].get(slot)
            for j in range(1, m.width):
                c = int(m.copies[slot, j])
                if c < 0 or m.states[slot, j] != IN_SYNC or c not in sums:
                    continue
                theirs = sums[c].get(slot)
                where = {"table": name, "slot": slot, "primary": m.servers[primary].id, "copy": m.servers[c].id,
                         "primary_lsn": list(mine[1:3]) if mine else None,
                         "copy_lsn": list(theirs[1:3]) if theirs else None}
                lacking = [k for k, got in ((primary, mine), (c, theirs)) if got is None]
                elsewhere = any(epochs.get(k, m.epoch) != m.epoch for k in lacking)
                if (lacking and (elsewhere or not final)) or (not lacking and mine[1:3] != theirs[1:3]):
                    behind.append({**where, "primary_map_epoch": epochs.get(primary, m.epoch),
                                   "copy_map_epoch": epochs.get(c, m.epoch)})
                    continue
                checked += 1
                if lacking or mine[0] != theirs[0]:  # what differs, for whoever looks into it
                    differing.append({**where, "primary_rows": mine[3] if mine else None,
                                      "copy_rows": theirs[3] if theirs else None})
    return checked, differing, behind


# --- placement operations ------------------------------------------------------------------------------------
def drain(address: str, server: str, *, undrain: bool = False, timeout_s: float = 30.0,
          security: Security = NONE) -> spb.PlanResponse:
    """Ask the scheduler to move every copy off ``server`` (id or address); the moves then run on their own."""
    return _scheduler_call(address, "Drain", spb.DrainRequest(server=server, undrain=undrain), timeout_s, security)


def move_slot(address: str, slot: int, to: str, *, from_: str = "", primary: bool = False,
              timeout_s: float = 30.0, security: Security = NONE) -> spb.PlanResponse:
    """Ask the scheduler to move ``slot``'s copy on ``from_`` (default: its primary) to server ``to``."""
    request = spb.MoveSlotRequest(slot=slot, to=to, primary=primary)
    setattr(request, "from", from_)
    return _scheduler_call(address, "MoveSlot", request, timeout_s, security)


def slot_load(address: str, timeout_s: float = 60.0, security: Security = NONE) -> spb.SlotLoad:
    """The measured per-slot load, read from every slot's primary: rows, bytes, pull + push rows/s."""
    m = shard_map(address, timeout_s, security)
    rows = np.zeros(m.num_slots, np.int64)
    nbytes = np.zeros(m.num_slots, np.int64)
    rates = np.zeros(m.num_slots, np.float64)
    for i, s in enumerate(m.servers):
        if not s.up or not m.leads(i).any():
            continue
        for t in slot_info(s.address, checksums=False, timeout_s=timeout_s, security=security).values():
            led = m.copies[t["slots"], 0] == i
            slots = t["slots"][led]
            rows[slots] += t["rows"][led]
            nbytes[slots] += t["bytes"][led]
            rates[slots] += t["pull_rates"][led] + t["push_rates"][led]
    return spb.SlotLoad(rows=rows.astype("<i8").tobytes(), bytes=nbytes.astype("<i8").tobytes(),
                        rates=rates.astype("<f8").tobytes())


def rebalance(address: str, *, plan_only: bool = False, load: spb.SlotLoad | None = None, row_weight: float = 1.0,
              rate_weight: float = 0.0, link_bytes_per_s: float = 100e6, timeout_s: float = 60.0,
              security: Security = NONE) -> spb.PlanResponse:
    """Plan (and unless ``plan_only`` apply) a placement that evens out the measured load."""
    request = spb.RebalanceRequest(plan_only=plan_only, cost=spb.CostModel(
        row_weight=row_weight, rate_weight=rate_weight, link_bytes_per_s=link_bytes_per_s))
    if load is not None:
        request.load.CopyFrom(load)
    return _scheduler_call(address, "Rebalance", request, timeout_s, security)


def settled(address: str, security: Security = NONE) -> bool:
    """Every slot has a primary, every wanted copy is in sync, and nothing is moving."""
    reply = status(address, security=security)
    return (not reply.unavailable_slots and not reply.degraded_slots and not reply.moving_slots
            and not sum(s.catching_up for s in reply.servers))


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition", interval_s: float = 0.1) -> None:
    """Poll ``predicate()`` until it is true; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
