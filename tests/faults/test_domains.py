"""Failure domains on real daemons: four ``tigana server --domain host=...`` processes on loopback, two per
"host", and ``tigana scheduler --replicas 1``. The first host's servers register first (the cluster starts on
one host: every slot's copies share it), the second host's after; then every slot's two copies move onto
different hosts, so a ``kill -9`` of both servers of one host (the host lost) under a sync ledger loses and
doubles nothing."""

from __future__ import annotations

import json
import subprocess

from grpc_health.v1 import health_pb2

from tigana import ps
from tigana.ps import domains
from tigana.ps.health import check_health
from tigana.ps.ops import admin
from tigana.ps.scheduler import DOMAINS_HEALTH_NAME
from tigana.tools.bench.ledger import PushLoop, audit, create_ledger_table
from tigana.tools.testing.nemesis.daemons import Daemons, tigana_command

HOSTS = ("rack-a-node", "rack-a-node", "rack-b-node", "rack-b-node")


def _spread_out(scheduler: str) -> bool:
    """Every slot has its two in-sync copies, on two hosts, every server holds its share, and nothing is
    moving. (Without the share: in the moment between the 4th server's registration and the auto-rebalance that
    gives it slots, the 3 servers' placement already reads spread out, and the move that follows widened the map
    under the test's assertions.)"""
    s = admin.cluster_status(scheduler, timeout_s=5.0)
    return (s is not None and len(s["servers"]) == 4 and all(v["primaries"] + v["replicas"] for v in s["servers"])
            and not s["degraded_slots"] and not s["unavailable_slots"]
            and not s["domain_degraded_slots"] and s["domain_level"] == "host"
            and admin.status(scheduler).moving_slots == 0)


def _domains_health(scheduler: str) -> int:
    return check_health(scheduler, DOMAINS_HEALTH_NAME, timeout_s=5.0).status


def test_copies_on_two_hosts_and_losing_a_host_loses_nothing_sync(tmp_path) -> None:
    with Daemons(tmp_path, heartbeat_timeout_s=2.0) as d:
        d.start_scheduler(replicas=1)
        for host in HOSTS[:2]:
            d.start_server("--domain", f"zone=z1,host={host}")
        d.wait_ready()
        admin.wait_for(lambda: len(admin.shard_map(d.scheduler_address).servers) == 2, what="the first host")
        for host in HOSTS[2:]:
            d.start_server("--domain", f"zone=z1,host={host}")
        d.wait_ready()
        with ps.connect(scheduler=d.scheduler_address, failover_timeout_s=60) as client:
            create_ledger_table(client, "ledger_sync", durability="sync")
            loop = PushLoop(client, table="ledger_sync", num_ids=4000, ids_per_push=200, in_flight=2).start()
            admin.wait_for(lambda: _spread_out(d.scheduler_address), timeout_s=60,
                           what="every slot's copies on two hosts")
            m = admin.shard_map(d.scheduler_address)
            assert sorted(str(s.domain) for s in m.servers) == sorted(f"zone=z1,host={h}" for h in HOSTS)
            hosts = domains.group_ids([s.domain for s in m.servers], "host")
            assert (m.copies >= 0).all() and m.width == 2
            assert (hosts[m.copies[:, 0]] != hosts[m.copies[:, 1]]).all()
            assert _domains_health(d.scheduler_address) == health_pb2.HealthCheckResponse.SERVING
            n = loop.acked_count()
            admin.wait_for(lambda: loop.acked_count() > n + 10, what="pushes to the spread-out cluster")
            lost_host = {s.address for s in m.servers if s.domain.host == HOSTS[0]}
            victims = [srv for srv in d.servers if srv.address in lost_host]
            assert len(victims) == 2
            for victim in victims:  # the host goes: both of its servers at once
                victim.kill9()
            n = loop.acked_count()
            admin.wait_for(lambda: loop.acked_count() > n + 20, timeout_s=60, what="pushes after the host loss")
            loop.stop()
            result = audit(client, loop, table="ledger_sync")
            assert result.acked_pushes > 0
            assert result.lost == 0 and result.doubled == 0, result.as_dict()
            after = admin.cluster_status(d.scheduler_address)
            assert not any(s["up"] for s in after["servers"] if s["address"] in lost_host)
            assert after["domain_level"] == "server"  # one host left: no level keeps two copies apart
            # re-replicated on the one host left: every slot's in-sync copies share it, and status says so
            admin.wait_for(lambda: admin.cluster_status(d.scheduler_address)["domain_degraded_slots"] == 4096,
                           timeout_s=60, what="the copies rebuilt on the host left")
            admin.wait_for(lambda: _domains_health(d.scheduler_address) == health_pb2.HealthCheckResponse.NOT_SERVING,
                           timeout_s=10, what="tigana.v1.Scheduler.domains NOT_SERVING")
            text = subprocess.run([*tigana_command(), "admin", "--scheduler", d.scheduler_address, "status"],
                                  capture_output=True, text=True, timeout=60)
            assert text.returncode == 0, text.stderr
            assert "domain-degraded 4096" in text.stdout and "DOMAIN-DEGRADED: 4096 slot(s)" in text.stdout
            assert f"zone=z1,host={HOSTS[2]}" in text.stdout, text.stdout
            js = subprocess.run([*tigana_command(), "admin", "--scheduler", d.scheduler_address, "--json", "status"],
                                capture_output=True, text=True, timeout=60)
            report = json.loads(js.stdout.splitlines()[-1])
            assert report["domain_degraded_slots"] == 4096 and report["domain_level"] == "server"
            assert sorted(s["domain"] for s in report["servers"]) == sorted(f"zone=z1,host={h}" for h in HOSTS)
