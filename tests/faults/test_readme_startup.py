"""The README's start-up, as a new user runs it: ``tigana scheduler --replicas 1``, then three ``tigana server
--scheduler ...`` processes, and a client that connects, creates its tables and pushes at once, with no wait
the README does not ask for: not even for the processes to serve (the client connects while the servers
still start, before any has registered with the scheduler, and waits for the first map itself).

It used to end with every slot on the first server, 4,096 copies on the second that never caught up (empty
slots had nothing to acknowledge), nothing on the third, and a ``kill -9`` of the first server losing every
acknowledged update. Now the cluster must replicate and balance itself over all three servers with no admin
command, and the same ``kill -9`` must lose and double nothing.
"""

from __future__ import annotations

import time

import pytest

from tigana import ps
from tigana.ps.ops import admin
from tigana.tools.bench.ledger import PushLoop, audit, create_ledger_table
from tigana.tools.testing.nemesis.daemons import Daemons

pytestmark = pytest.mark.slow


def _settled(scheduler: str) -> dict | None:
    s = admin.cluster_status(scheduler, timeout_s=5.0)
    if s is None or s["degraded_slots"] or s["unavailable_slots"] or len(s["servers"]) < 3:
        return None
    if not all(srv["primaries"] and srv["replicas"] for srv in s["servers"]):
        return None
    return s


def test_readme_startup_replicates_and_balances_and_a_kill_9_loses_nothing(tmp_path) -> None:
    with Daemons(tmp_path, heartbeat_timeout_s=3.0) as d:
        d.start_scheduler(replicas=1)
        first = d.start_server()
        d.start_server()
        d.start_server()
        # At once, as the README's ``ps.connect("host:port")``: no ready file, no retry loop here.
        with ps.connect(d.scheduler_address) as client:
            assert client.scheduler == d.scheduler_address
            create_ledger_table(client, "ledger_sync", durability="sync")
            create_ledger_table(client, "ledger_async", durability="async")
            loops = {name: PushLoop(client, table=name, num_ids=5000, ids_per_push=250, in_flight=2,
                                    seed=k).start()
                     for k, name in enumerate(("ledger_sync", "ledger_async"))}
            # The first pushes are acknowledged while the cluster still forms, not only once it settled.
            admin.wait_for(lambda: all(loop.acked_count() > 0 for loop in loops.values()), timeout_s=60,
                           what="the first acknowledged pushes")
            assert all(not loop.errors for loop in loops.values()), {n: lp.errors[:3] for n, lp in loops.items()}
            # Fully replicated and balanced over every server, with no admin command, within seconds.
            deadline = time.monotonic() + 60
            status = None
            while status is None:
                assert time.monotonic() < deadline, admin.cluster_status(d.scheduler_address)
                time.sleep(0.5)
                status = _settled(d.scheduler_address)
            prim = [srv["primaries"] for srv in status["servers"]]
            assert max(prim) - min(prim) <= 1, prim
            time.sleep(1.0)  # pushes to the protected cluster
            # Async: acknowledged at once, replicated after; the loss bound is the lag at the kill. Stop its
            # loop and let its lag drain, so that its audit is exact too.
            loops["ledger_async"].stop()
            lag_deadline = time.monotonic() + 30
            while True:
                stats = client.server_stats("ledger_async")
                if all(t["ledger_async"].get("replication_lag_items", 0) == 0 for t in stats.values()):
                    break
                assert time.monotonic() < lag_deadline, stats
                time.sleep(0.2)
            first.kill9()  # the sync loop goes on through the failover
            time.sleep(2.0)
            loops["ledger_sync"].stop()
            for name, loop in loops.items():
                result = audit(client, loop, table=name)
                assert result.acked_pushes > 0, name
                assert result.lost == 0 and result.doubled == 0, (name, result.as_dict())
                assert result.failed_pushes == 0, (name, result.as_dict(), loop.errors[:3])
            client.flush()


def test_sigterm_under_load_drains_cleanly_with_no_thread_traceback(tmp_path) -> None:
    """SIGTERM of a server while pushes, replication streams and a slot copy are in flight: it exits 0 and its
    log has no traceback (replication threads used to die with one when the channels closed under them)."""
    with Daemons(tmp_path, heartbeat_timeout_s=3.0) as d:
        d.start_scheduler(replicas=1)
        d.start_server()
        d.start_server()
        d.wait_ready()
        with ps.connect(scheduler=d.scheduler_address, failover_timeout_s=60) as client:
            create_ledger_table(client, "ledger_sync", durability="sync")
            loop = PushLoop(client, table="ledger_sync", num_ids=20_000, ids_per_push=500).start()
            admin.wait_for(lambda: loop.acked_count() > 20, what="pushes before the SIGTERM")
            third = d.start_server()  # joins: slot copies start toward it
            third.wait_ready()
            time.sleep(0.5)
            victim = d.servers[1]
            victim.terminate()
            assert victim.proc is not None and victim.proc.wait(60) == 0
            n = loop.acked_count()
            admin.wait_for(lambda: loop.acked_count() > n + 20, timeout_s=90, what="pushes after the SIGTERM")
            loop.stop()
            result = audit(client, loop, table="ledger_sync")
            assert result.lost == 0 and result.doubled == 0, result.as_dict()
        text = victim.log_path.read_text()
        assert "Traceback" not in text, text[text.index("Traceback") - 200:][:3000]
