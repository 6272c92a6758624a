"""Failover under a push loop, with real processes and real faults (``kill -9``, SIGSTOP), checked by a ledger.

Every acknowledged push adds exactly 1 to the rows of its ids (``tigana.tools.bench.ledger``); after the fault
the pulled rows must equal the ledger: 0 updates lost, 0 doubled. Recovery times are recorded (printed), not
asserted: speed is measured by ``tigana bench failover``.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from tigana import ps
from tigana.proto import shard_pb2 as pb
from tigana.ps import routing
from tigana.ps.errors import from_rpc_error
from tigana.ps.ops import admin
from tigana.ps.wire import data as wire
from tigana.tools.bench.ledger import PushLoop, audit, create_ledger_table

pytestmark = pytest.mark.timeout(240)


def _leader_of_most(cluster: ps.LocalCluster) -> int:
    m = admin.shard_map(cluster.scheduler)
    counts = {m.servers[i].address: int(m.leads(i).sum()) for i in range(len(m.servers))}
    return max(range(len(cluster.addresses)), key=lambda i: counts.get(cluster.addresses[i], 0))


def test_kill_9_of_a_primary_loses_and_doubles_nothing(make_shard_cluster) -> None:
    cluster = make_shard_cluster(3, replicas=1)
    with ps.connect(scheduler=cluster.scheduler, failover_timeout_s=60) as client:
        create_ledger_table(client)  # sync: the default with replicas
        loop = PushLoop(client, num_ids=20_000, ids_per_push=500).start()
        admin.wait_for(lambda: loop.acked_count() > 50, what="pushes before the fault")
        victim = _leader_of_most(cluster)
        killed_at = time.monotonic()
        cluster.kill(victim)
        admin.wait_for(lambda: loop.first_ack_sent_after(killed_at) is not None, what="a push acknowledged after the kill")
        recovery = loop.first_ack_sent_after(killed_at) - killed_at
        admin.wait_for(lambda: loop.acked_count() > 200, what="pushes after the fault")
        loop.stop()
        result = audit(client, loop)
        print(f"kill -9 of a primary: {result.as_dict()}, recovery {recovery:.3f}s")
        assert (result.lost, result.doubled, result.failed_pushes) == (0, 0, 0), result
        assert result.acked_pushes == loop.sent  # the loop finished: no push was given up on, no restart
        # The copies of the dead server's slots are rebuilt on the survivors; every copy equals its primary.
        admin.wait_for(lambda: admin.settled(cluster.scheduler), what="the lost copies to be rebuilt")
        check = admin.verify(cluster.scheduler)
        assert check["differing"] == [] and check["copies_checked"] == cluster.num_slots, check


def test_kill_9_of_a_replica_keeps_pushes_going_and_rebuilds_the_copy(make_shard_cluster) -> None:
    """Two servers: the survivor leads every slot alone; the killed server, restarted on its data dir, comes
    back as a new process and is rebuilt as a copy by the slot copy; afterwards the checksums are equal."""
    cluster = make_shard_cluster(2, replicas=1)
    with ps.connect(scheduler=cluster.scheduler, failover_timeout_s=60) as client:
        create_ledger_table(client)
        loop = PushLoop(client, num_ids=20_000, ids_per_push=500).start()
        admin.wait_for(lambda: loop.acked_count() > 50, what="pushes before the fault")
        cluster.kill(1)
        n = loop.acked_count()
        admin.wait_for(lambda: loop.acked_count() > n + 100, what="pushes with the copy gone")
        cluster.restart(1)
        admin.wait_for(lambda: admin.settled(cluster.scheduler), what="the copy to be rebuilt")
        n = loop.acked_count()
        admin.wait_for(lambda: loop.acked_count() > n + 50, what="pushes with the rebuilt copy in sync")
        loop.stop()
        result = audit(client, loop)
        assert (result.lost, result.doubled, result.failed_pushes) == (0, 0, 0), result
        status = admin.cluster_status(cluster.scheduler)
        assert all(s["up"] for s in status["servers"])
        assert sorted(s["primaries"] + s["replicas"] for s in status["servers"]) == [4096, 4096]
        check = admin.verify(cluster.scheduler)
        assert check["differing"] == [] and check["copies_checked"] == cluster.num_slots, check


def test_a_paused_primary_accepts_nothing_at_its_old_epoch_and_rejoins_as_a_copy(make_shard_cluster) -> None:
    cluster = make_shard_cluster(2, replicas=1, heartbeat_timeout=1.5)
    with ps.connect(scheduler=cluster.scheduler, failover_timeout_s=60) as client:
        create_ledger_table(client)
        old = admin.shard_map(cluster.scheduler)
        loop = PushLoop(client, num_ids=20_000, ids_per_push=500).start()
        admin.wait_for(lambda: loop.acked_count() > 50, what="pushes before the fault")
        # the victim: the server leading the most slots now (wherever the placement has got to)
        leader = int(np.argmax(np.bincount(old.copies[:, 0][old.copies[:, 0] >= 0], minlength=len(old.servers))))
        victim = cluster.addresses.index(old.servers[leader].address)
        led = np.flatnonzero(old.leads(leader))
        assert led.size > 0
        paused_at = time.monotonic()
        cluster.pause(victim)
        try:
            admin.wait_for(lambda: loop.first_ack_sent_after(paused_at + 0.1) is not None, timeout_s=30,
                  what="pushes acknowledged by the promoted copy while the old primary is paused")
            time.sleep(1.0)
        finally:
            cluster.resume(victim)
        # Fencing: stamped with the epoch it led at, a push to the woken old primary is refused, not applied.
        ids = _ids_in_slots(led[:3])
        data, scales = wire.encode_block(-np.ones((ids.size, 4), np.float32), pb.CODEC_FP32)
        raw = wire.encode_push_request("ledger", ids, pb.CODEC_FP32, 4, data, scales, "fencing-probe", 1, 0,
                                       old.epoch)
        channel = grpc.insecure_channel(cluster.addresses[victim])
        try:
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary("/tigana.v1.Shard/Push")(raw, timeout=30)
        finally:
            channel.close()
        error = from_rpc_error(refused.value)
        assert isinstance(error, (ps.WrongShard, ps.Unavailable)), error
        admin.wait_for(lambda: admin.settled(cluster.scheduler), what="the old primary to rejoin as an in-sync copy")
        status = admin.cluster_status(cluster.scheduler)
        back = next(s for s in status["servers"] if s["address"] == cluster.addresses[victim])
        # back as a new member: its copies rebuilt in sync (and, by the auto-rebalance, its share of primaries)
        assert back["up"] and back["primaries"] + back["replicas"] == cluster.num_slots
        loop.stop()
        result = audit(client, loop)
        print(f"SIGSTOP of a primary: {result.as_dict()}")
        assert (result.lost, result.doubled, result.failed_pushes) == (0, 0, 0), result
        probe = client.pull("ledger", ids, insert=False)
        assert (np.rint(probe[:, 0]).astype(np.int64) == loop.acked[ids]).all()  # the probe applied nowhere
        check = admin.verify(cluster.scheduler)
        assert check["differing"] == [], check


def _ids_in_slots(slots: np.ndarray, per_slot: int = 2) -> np.ndarray:
    """Ledger ids (below 20,000) whose routing slot is in ``slots``."""
    ids = np.arange(20_000, dtype=np.int64)
    hit = ids[np.isin(routing.slot_of(ids), slots)]
    return hit[: per_slot * len(slots)]


def test_parts_in_flight_to_a_paused_primary_are_routed_again_by_the_failover_map(make_shard_cluster) -> None:
    """A SIGSTOPped primary holds the parts sent to it until their deadline (here 120 s, and keepalive no
    sooner): the failover map that names new primaries gives them up and routes them again at once, under
    their (client id, seq). Counted by cause (``parts_rerouted_by_map``); acknowledgements resume long before
    any deadline could have passed, and the ledger finds nothing lost or doubled."""
    cluster = make_shard_cluster(3, replicas=1)
    with ps.connect(scheduler=cluster.scheduler, failover_timeout_s=180, timeout_s=120,
                    keepalive_time_s=120) as client:
        create_ledger_table(client)
        loop = PushLoop(client, num_ids=20_000, ids_per_push=500).start()
        admin.wait_for(lambda: loop.acked_count() > 50, what="pushes before the fault")
        victim = _leader_of_most(cluster)
        epoch = client.epoch
        assert client.stats()["parts_rerouted_by_map"] == 0
        paused_at = time.monotonic()
        cluster.pause(victim)
        try:
            admin.wait_for(lambda: loop.first_ack_sent_after(paused_at) is not None, timeout_s=90,
                           what="a push acknowledged while the old primary is paused")
            recovery = loop.first_ack_sent_after(paused_at) - paused_at
            stats = client.stats()
            n = loop.acked_count()
            admin.wait_for(lambda: loop.acked_count() > n + 50, what="pushes by the new primaries")
        finally:
            cluster.resume(victim)
        loop.stop()
        result = audit(client, loop)
        print(f"SIGSTOP of a primary, parts in flight routed again: {result.as_dict()}, recovery {recovery:.3f}s, "
              f"parts_rerouted_by_map {stats['parts_rerouted_by_map']}")
        assert stats["epoch"] > epoch
        # The parts held by the paused server were given up for the failover map, not for a deadline (120 s),
        # keepalive (>= 120 s) or the loop's failover budget: it acknowledged again well before any of those.
        assert stats["parts_rerouted_by_map"] > 0, stats
        assert recovery < 30.0, recovery
        assert (result.lost, result.doubled, result.failed_pushes) == (0, 0, 0), result
        assert result.acked_pushes == loop.sent
