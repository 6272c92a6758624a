"""A highly available scheduler: two schedulers on a real etcd, one leading, under a ledger push loop.

- ``kill -9`` of the leader: the standby takes over within the lease TTL with the map intact;
- SIGSTOP of the (new) leader past its lease: the other takes over; the paused one, resumed, finds its lease
  gone and its writes refused (fencing), so it changes nothing (it would otherwise declare every server dead:
  it heard no heartbeat while stopped) and stands by;
- ``kill -9`` of a shard server after all that still fails over under the leader: 0 acknowledged updates
  lost, none doubled, the copies identical;
- the store itself: a deposed leader's write is refused, a standby's too.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from tigana import ps
from tigana.ps.ops import admin
from tigana.ps.routing import ShardMap
from tigana.ps.scheduler.stores.etcd import Deposed, EtcdMapStore, parse_store_url
from tigana.ps.scheduler.stores.file import SchedulerState
from tigana.tools.bench.ledger import PushLoop, audit, create_ledger_table

pytestmark = pytest.mark.timeout(240)
TTL = 2


def _up(c: ps.LocalCluster) -> list[bool]:
    """Whether the leading scheduler has each shard (by index) up."""
    up = {s["id"]: s["up"] for s in admin.cluster_status(c.scheduler, timeout_s=5.0)["servers"]}
    return [up[c.server_id(i)] for i in range(c.shards)]


def test_leader_kill_9_a_paused_leader_then_a_shard_kill_9_lose_nothing(make_shard_cluster, etcd) -> None:
    c = make_shard_cluster(2, replicas=1, schedulers=2, store=etcd.url, scheduler_args=["--leader-ttl", str(TTL)],
                           heartbeat_timeout=3.0)
    with ps.connect(scheduler=c.scheduler, failover_timeout_s=60) as client:
        create_ledger_table(client)
        loop = PushLoop(client, ids_per_push=500).start()

        def pushes_go_on(what: str) -> None:
            n = loop.acked_count()
            admin.wait_for(lambda: loop.acked_count() > n + 30, 60, f"pushes {what}")

        try:
            pushes_go_on("before the fault")
            # 1. kill -9 of the leader: the standby leads within the lease TTL, with the map intact
            before = admin.shard_map(c.scheduler)
            old = c.kill_scheduler()
            killed_at = time.monotonic()
            new = c.leading_scheduler(timeout=30)
            took_over = time.monotonic() - killed_at
            assert new != old
            assert took_over < TTL + 2.0, f"the standby took {took_over:.2f}s to lead (lease TTL {TTL}s)"
            after = admin.shard_map(c.scheduler)
            assert after.cluster_id == before.cluster_id and after.epoch >= before.epoch
            np.testing.assert_array_equal(after.copies, before.copies)  # the map survived the leader
            pushes_go_on("under the new leader")
            c.restart_scheduler(old)  # back, as a standby

            # 2. SIGSTOP of the leader past its lease and the heartbeat timeout: the other leads; the paused
            # one, resumed, runs its failure detection on stale heartbeats, but its writes are refused
            paused = c.leading_scheduler()
            c.kill_scheduler(signal.SIGSTOP, which=paused)
            try:
                leader = c.leading_scheduler(timeout=30)
                led_at = time.monotonic()
                assert leader != paused
                # the servers find the new leader within a few heartbeat intervals: once a heartbeat to the
                # paused one ran out, they send to every scheduler (they used to go back to the paused one
                # after each standby refusal, for another whole deadline)
                admin.wait_for(lambda: all(0 <= s["last_heartbeat_s"] < 1.0 for s in admin.cluster_status(
                    c.scheduler, timeout_s=5.0)["servers"]), 10, "the servers to heartbeat the new leader")
                heard_after = time.monotonic() - led_at
                assert heard_after < 2.0, f"the new leader heard every server only {heard_after:.2f}s after it led"
                time.sleep(max(0.0, 3.5 - heard_after))
            finally:
                c.scheduler_procs[paused].send_signal(signal.SIGCONT)
            time.sleep(1.5)
            # nobody declared dead, not even for a moment: the new leader probes the servers whose heartbeats
            # are still timing out on the paused one (a declaration here once wiped every row, S10)
            assert _up(c) == [True, True]
            for k in range(2):
                assert "declared dead" not in c.scheduler_log(k).read_text(), c.scheduler_log(k).read_text()
            assert c.leading_scheduler() == leader
            assert "stepping down as leader" in c.scheduler_log(paused).read_text()
            pushes_go_on("after the resume")

            # 3. kill -9 of a shard server: the new leader fails it over
            c.kill(0)
            admin.wait_for(lambda: _up(c) == [False, True], 30, "the new leader to see the death")
            pushes_go_on("after the shard failover")
            c.restart(0)
            c.wait_placed(120)
        finally:
            loop.stop()
        result = audit(client, loop)
    assert result.lost == 0 and result.doubled == 0, result
    assert result.acked_pushes > 150
    assert admin.verify(c.scheduler)["differing"] == []


def test_the_store_fences_a_deposed_leader(etcd) -> None:
    url = etcd.url + "/fence-test"
    assert parse_store_url(url)[1] == "/fence-test"
    a, b = EtcdMapStore(url), EtcdMapStore(url)
    try:
        m = ShardMap.empty(8, 1, "c1")
        state = SchedulerState(m, m.copies.copy())
        assert a.campaign("a:1", TTL) and not b.campaign("b:1", TTL)
        assert a.load() is None
        a.save(state)
        assert a.leader() == "a:1"
        with pytest.raises(Deposed, match="not the leader"):
            b.save(state)  # a standby writes nothing
        deadline = time.monotonic() + 10
        while not b.campaign("b:1", TTL):  # a stops renewing: its lease runs out
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert b.load().map.epoch == 0
        with pytest.raises(Deposed, match="no longer the leader"):
            a.save(SchedulerState(m.evolve(), m.copies.copy()))  # deposed: refused, even though it thinks it leads
        assert a.deposed.is_set()
        b.save(SchedulerState(m.evolve(), m.copies.copy()))
        assert b.load().map.epoch == 1
    finally:
        a.close()
        b.close()
