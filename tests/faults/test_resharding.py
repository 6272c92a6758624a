"""Live resharding under a push loop, with real processes: drain, rebalance onto a new server, and a
``kill -9`` of a move's source or target in the middle. Every run is checked by the ledger (0 updates lost,
0 doubled) and by ``verify`` (every copy equals its primary, slot by slot)."""

from __future__ import annotations

import re
import time
import urllib.request

import numpy as np
import pytest

from tigana import ps
from tigana.ps.ops import admin
from tigana.tools.bench.ledger import PushLoop, audit, create_ledger_table
from tigana.tools.testing.nemesis.monitor import scrape

pytestmark = pytest.mark.timeout(300)


def _held(scheduler: str, server_id: str) -> int:
    reply = admin.status(scheduler)
    s = next(s for s in reply.servers if s.info.id == server_id)
    return s.primaries + s.replicas + s.catching_up


def _ledger_run(cluster, action, *, ids: int = 20_000, before: int = 40, after: int = 40):
    """Run ``action(loop)`` while a ledger push loop runs; audit, verify; return the audit."""
    with ps.connect(scheduler=cluster.scheduler, failover_timeout_s=90) as client:
        create_ledger_table(client)
        # rows to move: every id exists before the moves start
        client.push("ledger", np.arange(ids), np.zeros((ids, 4), np.float32)).result()
        loop = PushLoop(client, num_ids=ids, ids_per_push=500).start()
        n = loop.acked_count()
        admin.wait_for(lambda: loop.acked_count() > n + before, what="pushes before the moves")
        action(loop)
        admin.wait_for(lambda: admin.settled(cluster.scheduler), what="the moves to finish")
        n = loop.acked_count()
        admin.wait_for(lambda: loop.acked_count() > n + after, what="pushes after the moves")
        loop.stop()
        result = audit(client, loop)
    assert (result.lost, result.doubled, result.failed_pushes) == (0, 0, 0), (result, loop.errors[:2])
    check = admin.verify(cluster.scheduler)
    assert check["differing"] == [] and check["copies_checked"] == cluster.num_slots * cluster.replicas, check
    return result


def test_drain_a_server_under_a_push_loop(make_shard_cluster) -> None:
    cluster = make_shard_cluster(3, replicas=1)
    victim = cluster.server_id(2)

    def drain(loop) -> None:
        admin.drain(cluster.scheduler, victim)
        admin.wait_for(lambda: _held(cluster.scheduler, victim) == 0, what="the drained server to hold nothing")

    _ledger_run(cluster, drain)
    assert _held(cluster.scheduler, victim) == 0 and victim in admin.status(cluster.scheduler).draining


def test_a_new_server_gets_slots_by_rebalance_under_load(make_shard_cluster) -> None:
    cluster = make_shard_cluster(2, replicas=1)

    def grow(loop) -> None:
        i = cluster.add_server()
        plan = admin.rebalance(cluster.scheduler, plan_only=True, load=admin.slot_load(cluster.scheduler))
        assert plan.moves and plan.after.max < plan.before.max  # the plan is shown before anything moves
        applied = admin.rebalance(cluster.scheduler, load=admin.slot_load(cluster.scheduler))
        assert applied.after.max <= 1.1 * applied.after.mean, applied  # measured load (rows, rate) evened out
        admin.wait_for(lambda: _held(cluster.scheduler, cluster.server_id(i)) > 0, what="the new server to get slots")

    _ledger_run(cluster, grow)
    status = admin.cluster_status(cluster.scheduler)
    counts = sorted(s["primaries"] + s["replicas"] for s in status["servers"])
    assert len(counts) == 3 and counts[0] > 0.25 * counts[-1], counts


def test_kill_9_of_the_source_mid_move_then_retry(make_shard_cluster) -> None:
    """Drain a server and kill it while its slots are being copied away: the survivors fail over and the
    copies complete from the new primaries; retried after a restart, the drain completes."""
    cluster = make_shard_cluster(3, replicas=1)
    victim = cluster.server_id(0)

    def drain_and_kill(loop) -> None:
        admin.drain(cluster.scheduler, victim)
        cluster.kill(0)  # mid-move: the copies it was sending are cut off
        cluster.restart(0)
        admin.drain(cluster.scheduler, victim)  # the retry (the target was kept: it is idempotent)
        admin.wait_for(lambda: _held(cluster.scheduler, victim) == 0, what="the retried drain")

    _ledger_run(cluster, drain_and_kill)


def test_kill_9_of_the_target_mid_move_then_retry(make_shard_cluster) -> None:
    """Rebalance onto a new server and kill it while it is being filled: its half-built copies are dropped
    (never promoted); restarted and rebalanced again, it ends holding slots."""
    cluster = make_shard_cluster(2, replicas=1)

    def fill_and_kill(loop) -> None:
        i = cluster.add_server()
        admin.rebalance(cluster.scheduler)
        cluster.kill(i)  # mid-move: it held only catching-up copies
        admin.wait_for(lambda: not admin.cluster_status(cluster.scheduler)["servers"][i]["up"], what="the target's death")
        cluster.restart(i)
        admin.rebalance(cluster.scheduler)  # the retry
        admin.wait_for(lambda: _held(cluster.scheduler, cluster.server_id(i)) > 0, what="the target to get slots again")

    _ledger_run(cluster, fill_and_kill)


def test_planned_hand_overs_and_moves_lose_no_async_update_and_demote_nothing(make_shard_cluster) -> None:
    """No failure, no demotion: primaries handed over (to a server that already holds a copy, and to one that
    does not), a rebalance and a drain, under sync and async push loops. A hand-over used to switch the
    primary while the old one's items were in flight: the new primary refused them, every copy of the old
    primary's slots was demoted, and the acknowledged async updates it had not yet streamed were lost."""
    cluster = make_shard_cluster(3, replicas=1, metrics=True)
    with ps.connect(scheduler=cluster.scheduler, failover_timeout_s=90) as client:
        create_ledger_table(client, "ledger_sync", durability="sync")
        create_ledger_table(client, "ledger_async", durability="async")
        loops = [PushLoop(client, table=t, num_ids=10_000, ids_per_push=250, seed=k).start()
                 for k, t in enumerate(("ledger_sync", "ledger_async"))]
        admin.wait_for(lambda: min(lp.acked_count() for lp in loops) > 20, what="pushes before the moves")
        m = admin.shard_map(cluster.scheduler)
        for slot in (1, 700, 1500):
            holder = int(m.copies[slot, 1])  # an in-sync replica: the cheapest hand-over, no data moves
            admin.move_slot(cluster.scheduler, slot, m.servers[holder].id, primary=True)
        other = next(i for i in range(3) if not m.holds(i)[2000])
        admin.move_slot(cluster.scheduler, 2000, m.servers[other].id, primary=True)  # a copy first, then the role
        admin.wait_for(lambda: admin.settled(cluster.scheduler), what="the hand-overs")
        for slot in (1, 700, 1500):
            assert admin.shard_map(cluster.scheduler).copies[slot, 0] == m.copies[slot, 1]
        admin.drain(cluster.scheduler, cluster.server_id(2))
        admin.wait_for(lambda: _held(cluster.scheduler, cluster.server_id(2)) == 0, what="the drain")
        admin.drain(cluster.scheduler, cluster.server_id(2), undrain=True)
        admin.rebalance(cluster.scheduler)
        admin.wait_for(lambda: admin.settled(cluster.scheduler), what="the rebalance")
        n = [lp.acked_count() for lp in loops]
        admin.wait_for(lambda: all(lp.acked_count() > k + 20 for lp, k in zip(loops, n, strict=True)),
                       what="pushes after the moves")
        for loop in loops:
            loop.stop()
        for loop in loops:
            result = audit(client, loop, table=loop.table)
            assert (result.lost, result.doubled, result.failed_pushes) == (0, 0, 0), (loop.table, result)
    demoted, declared_dead = scrape(cluster.scheduler_metrics_ports[0])
    assert sum(demoted.values()) == 0 and declared_dead == 0
    check = admin.verify(cluster.scheduler)
    assert check["differing"] == [], check


def _paced_seconds(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        m = re.search(r"^tigana_slot_copy_paced_seconds ([0-9.e+-]+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def test_a_rebalance_keeps_to_the_copy_rate(make_shard_cluster) -> None:
    """``tigana server --copy-rate``: a planned move's copies send at most the rate (plus a quarter second's
    burst) from each server, and the rows arrive whole. 40,000 rows of dim 16 (at least 90 bytes each on the
    wire), a third of them moved at 256 KiB/s from each of 2 servers: at least ~2.2 s of copying, most
    of it paced."""
    rate = 256 << 10
    cluster = make_shard_cluster(2, replicas=1, metrics=True, server_args=["--copy-rate", "256KiB"],
                                 scheduler_args=["--no-auto-rebalance"])  # the rebalance below moves the slots
    with ps.connect(scheduler=cluster.scheduler) as client:
        client.create_table("paced", dim=16, optimizer=ps.SGD(lr=0.1), initializer=ps.Zeros())
        client.push("paced", np.arange(40_000), np.ones((40_000, 16), np.float32)).result()
        new = cluster.add_server()
        load = admin.slot_load(cluster.scheduler)
        start = time.monotonic()
        plan = admin.rebalance(cluster.scheduler, load=load)
        admin.wait_for(lambda: admin.settled(cluster.scheduler), what="the rebalance")
        elapsed = time.monotonic() - start
        rows = np.frombuffer(load.rows, "<i8")
        moved = sum(int(rows[m.slot]) * len(m.add) for m in plan.moves)
        assert moved > 10_000 and _held(cluster.scheduler, cluster.server_id(new)) > 0
        # each of the 2 sources sends its share at the rate at most, after a burst of a quarter second
        assert elapsed >= moved * 90 / (2 * rate) - 2 * 0.25, (elapsed, moved)
        paced = sum(_paced_seconds(p) for p in cluster.metrics_ports[:2])
        assert paced > 0.5, paced
        np.testing.assert_allclose(client.pull("paced", np.arange(40_000), insert=False), -0.1, rtol=1e-6)
    check = admin.verify(cluster.scheduler)
    assert check["differing"] == [], check
