"""Multi-table frames across map changes, with real processes: ``push_many`` of several tables (one frame per
server holding every table's part) while the scheduler hands primaries over. A part refused for a slot its
server no longer leads is routed again on its own, under its own (client id, seq); the frame's other parts
stand. Every acknowledged push adds exactly 1 to each of its rows: nothing lost, nothing doubled."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tigana import ps
from tigana.ps.ops import admin

pytestmark = pytest.mark.timeout(240)

TABLES = ["mr0", "mr1", "mr2"]


def test_push_many_across_hand_overs_lands_every_part_once(make_shard_cluster) -> None:
    cluster = make_shard_cluster(2, replicas=1)
    ids = np.arange(3000, dtype=np.int64)  # every push: each id of each table + 1 (SGD lr 1, gradient -1)
    with ps.connect(scheduler=cluster.scheduler, failover_timeout_s=90) as client:
        for name in TABLES:
            client.create_table(name, dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(), durability="sync")
        grads = [-np.ones((ids.size, 2), np.float32)] * len(TABLES)
        acked, errors = [0], []
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                try:
                    for f in client.push_many(TABLES, [ids] * len(TABLES), grads, unique=True):
                        f.result(timeout=90)
                    acked[0] += 1
                except Exception as exc:  # noqa: BLE001 - counted; the test fails on it
                    errors.append(exc)
                    return

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        admin.wait_for(lambda: acked[0] > 5, what="pushes before the hand-overs")
        m = admin.shard_map(cluster.scheduler)
        for slot in range(0, m.num_slots, m.num_slots // 64):  # 64 primaries handed to their in-sync replica
            admin.move_slot(cluster.scheduler, slot, m.servers[int(m.copies[slot, 1])].id, primary=True)
        admin.wait_for(lambda: admin.settled(cluster.scheduler), what="the hand-overs")
        n = acked[0]
        admin.wait_for(lambda: acked[0] > n + 5 or bool(errors), what="pushes after the hand-overs")
        stop.set()
        thread.join(timeout=120)
        assert not errors, errors[:1]
        stats = client.stats()
        assert client.epoch > m.epoch
        assert sum(s.exchange.merged for s in client._servers if s.exchange is not None) > 0
        for name in TABLES:  # every acknowledged push applied once, on every row of every table
            np.testing.assert_array_equal(client.pull(name, ids, insert=False), np.full((ids.size, 2), acked[0],
                                                                                         np.float32))
        print(f"push_many across hand-overs: {acked[0]} pushes, retries {stats['retries']}, "
              f"parts re-routed by a map {stats['parts_rerouted_by_map']}")
