"""What the faults share: the report line, cluster start-up, percentiles, process memory, the scheduler's
count of servers it declared dead, and a raw push stamped with a chosen map epoch (the fencing probe)."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tigana import ps
from tigana.proto import shard_pb2 as pb
from tigana.ps import routing
from tigana.ps.allocator import ALLOCATOR_ENV
from tigana.ps.ops import admin
from tigana.ps.wire import data as wire
from tigana.tools.bench.ledger import TABLE_DIM, PushLoop, create_ledger_table
from tigana.tools.bench.report import emit

BAD_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


@dataclass
class Report:
    """One fault's outcome: the judged figure against its target, the named figures, pass or fail."""

    unit: str
    value: float
    peer: str
    peer_value: float | None
    ok: bool
    figures: dict[str, Any] = field(default_factory=dict)

    def emit(self, name: str, what: str) -> dict:
        return emit(f"faults.{name}", self.unit, self.value, self.peer, self.peer_value, **self.figures,
                    fault=what, ok=self.ok)


def root_problem() -> str | None:
    """Why the faults that need root (network namespaces, tmpfs mounts) cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tmpfs mounts)"
    for tool in ("ip", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command"
    return None


def cluster(shards: int = 2, **kwargs: Any) -> ps.LocalCluster:
    """A scheduler and ``shards`` daemons with 1 replica of every slot (sync), the daemons' allocator tuning."""
    kwargs.setdefault("replicas", 1)
    kwargs.setdefault("env", {**ALLOCATOR_ENV, **os.environ})
    return ps.LocalCluster(shards, **kwargs)


def pct(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 3) if whole else 100.0


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"recovery_s_p50": None, "recovery_s_p95": None}
    return {"recovery_s_p50": round(float(np.percentile(xs, 50)), 4),
            "recovery_s_p95": round(float(np.percentile(xs, 95)), 4)}


def rss_mib(pid: int) -> float:
    """Resident memory of a process (MiB), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def deaths(c: ps.LocalCluster) -> int:
    """Servers the scheduler(s) declared dead so far (a leader's log says so once per declaration)."""
    paths = [c.scheduler_log(k) for k in range(max(1, len(c.scheduler_procs)))]
    return sum(p.read_text(errors="replace").count(" declared dead: ") for p in paths if p.exists())


def leader_of_most(c: ps.LocalCluster) -> tuple[int, np.ndarray]:
    """(index of the live shard leading the most slots, the slots it leads)."""
    m = admin.shard_map(c.scheduler)
    best, slots = 0, np.empty(0, np.int64)
    for i, address in enumerate(c.addresses):
        j = next((k for k, s in enumerate(m.servers) if s.address == address or s.id == c.server_id(i)), -1)
        if j >= 0 and m.servers[j].up and c.alive()[i]:
            led = np.flatnonzero(m.leads(j))
            if led.size > slots.size:
                best, slots = i, led
    return best, slots


def ids_in_slots(slots: np.ndarray, num_ids: int, per_slot: int = 2, num_slots: int = routing.DEFAULT_NUM_SLOTS
                 ) -> np.ndarray:
    """Ledger ids below ``num_ids`` whose routing slot is in ``slots``, at most ``per_slot`` a slot."""
    ids = np.arange(num_ids, dtype=np.int64)
    hit = ids[np.isin(routing.slot_of(ids, num_slots), slots)]
    return hit[: per_slot * len(slots)]


def raw_push(address: str, table: str, ids: np.ndarray, epoch: int, timeout_s: float = 10.0,
             security: Any = None) -> grpc.StatusCode:
    """One ledger push (every row +1) sent straight to ``address`` stamped with map ``epoch``, bypassing the
    client's routing; its status code (OK: the server applied and acknowledged it)."""
    data, scales = wire.encode_block(-np.ones((ids.size, TABLE_DIM), np.float32), pb.CODEC_FP32)
    raw = wire.encode_push_request(table, ids, pb.CODEC_FP32, TABLE_DIM, data, scales,
                                   f"probe-{uuid.uuid4().hex[:8]}", 1, 0, epoch)
    channel = security.channel(address) if security is not None else grpc.insecure_channel(address)
    try:
        channel.unary_unary("/tigana.v1.Shard/Push")(raw, timeout=timeout_s)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()
    finally:
        channel.close()


def wait_settled(c: ps.LocalCluster, timeout_s: float = 120.0) -> None:
    admin.wait_for(lambda: admin.settled(c.scheduler), timeout_s, "every copy in sync")


@contextlib.contextmanager
def ledger_loop(client: ps.Client, table: str = "ledger", durability: str | None = None, **loop_kwargs: Any
                ) -> Iterator[PushLoop]:
    """A ledger table and its push loop (``PushLoop`` arguments), stopped on the way out; audit it after."""
    create_ledger_table(client, table, durability=durability)
    loop = PushLoop(client, table=table, **loop_kwargs).start()
    try:
        yield loop
    finally:
        loop.stop()


@contextlib.contextmanager
def ledger_cluster(shards: int = 2, *, failover_timeout_s: float = 120, loop: dict[str, Any] | None = None,
                   **cluster_kwargs: Any) -> Iterator[tuple[ps.LocalCluster, ps.Client, PushLoop]]:
    """``cluster(shards, **cluster_kwargs)``, a client routed by its scheduler and a ledger push loop
    (``loop``: ``PushLoop`` arguments, 500 ids a push by default), all stopped on the way out."""
    with cluster(shards, **cluster_kwargs) as c, \
            ps.connect(scheduler=c.scheduler, failover_timeout_s=failover_timeout_s) as client, \
            ledger_loop(client, **{"ids_per_push": 500, **(loop or {})}) as push_loop:
        yield c, client, push_loop


def ready_for_fault(c: ps.LocalCluster, loop: PushLoop, pushes: int = 20) -> None:
    """Every copy in sync and ``pushes`` more pushes acknowledged: the moment for the next fault."""
    wait_settled(c)
    n = loop.acked_count()
    admin.wait_for(lambda: loop.acked_count() > n + pushes, 60, "pushes before the fault")


def since(t: float) -> float:
    return time.monotonic() - t
