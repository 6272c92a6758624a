"""``admin.verify`` on a real cluster (a scheduler and 3 daemons on loopback, 1 replica) whose map changes
between verify's read of the scheduler's map and its reads of the servers: servers under a newer map than the
one verify holds are read again, with the map, never reported as differing."""

from __future__ import annotations

import numpy as np
import pytest

from tigana import ps
from tigana.ps.ops import admin

pytestmark = pytest.mark.timeout(180)

IDS = np.arange(5000, dtype=np.int64)


def _held(scheduler: str, server_id: str) -> int:
    s = next(s for s in admin.status(scheduler).servers if s.info.id == server_id)
    return s.primaries + s.replicas + s.catching_up


def test_servers_under_a_newer_map_than_verifys_are_read_again(make_shard_cluster, monkeypatch) -> None:
    """The drain lands between verify's map read and its server reads (here: verify's first map read is the
    map before the drain). The drained server then holds nothing of the slots that map gives it, and the
    slots it led have their primary elsewhere: ``copy_lsn None`` / ``primary_lsn None`` in a ``differing``
    report, though every copy is equal. Read again with the scheduler's map, every copy compares equal."""
    cluster = make_shard_cluster(3, replicas=1)
    with ps.connect(scheduler=cluster.scheduler) as client:
        client.create_table("emb", 8)
        grads = np.random.default_rng(0).normal(size=(IDS.size, 8)).astype(np.float32)
        client.push("emb", IDS, grads).result()
    admin.wait_for(lambda: admin.settled(cluster.scheduler), what="the cluster to settle")
    before = admin.shard_map(cluster.scheduler)
    victim = cluster.server_id(2)
    assert before.holds(before.index_of(victim)).any()
    admin.drain(cluster.scheduler, victim)
    admin.wait_for(lambda: admin.settled(cluster.scheduler) and _held(cluster.scheduler, victim) == 0,
                   what="the drain")

    reads: list[int] = []
    scheduler_map = admin.shard_map

    def stale_first(*args, **kwargs):
        reads.append(1)
        return before if len(reads) == 1 else scheduler_map(*args, **kwargs)

    monkeypatch.setattr(admin, "shard_map", stale_first)
    check = admin.verify(cluster.scheduler)
    assert check["differing"] == [] and check["behind"] == [], check
    assert check["copies_checked"] == cluster.num_slots * cluster.replicas, check
    assert len(reads) >= 2 and check["epoch"] > before.epoch
