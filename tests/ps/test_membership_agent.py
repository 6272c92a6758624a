"""The membership agent over a real link: a scheduler and a server in process, the server reaching the
scheduler only through a proxy that delays every byte (``SlowProxy``, the slow-link fault's)."""

from __future__ import annotations

import time

import numpy as np

from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import start_server
from tigana.tools.testing.faults.network import SlowProxy


def test_a_slow_scheduler_link_under_the_lease_keeps_the_lease(tmp_path) -> None:
    """A round trip of 1.2 s to the scheduler (interval 0.5 s, lease 2 s, scheduler timeout 3 s): every
    heartbeat is answered well within the lease, so the lease must never lapse. Heartbeats sent one after
    another's answer (as they were) came 1.7 s apart, so the lease, counted from each one's send, lapsed for
    0.9 s of every 1.7 s and the server refused its async pushes half the time with no fault at all."""
    sched = start_scheduler(SchedulerConfig(data_dir=str(tmp_path / "sched"), replicas=0, heartbeat_timeout_s=3.0))
    proxy = SlowProxy(("127.0.0.1", sched.port))
    server = None
    try:
        server = start_server(ServerConfig(port=0, data_dir=str(tmp_path / "s0"), scheduler=proxy.address,
                                           heartbeat_interval_s=0.5, lease_s=2.0, drain_grace_s=1.0))
        assert server.wait_ready(30)
        agent = server.service.agent
        deadline = time.monotonic() + 20
        while not agent.lease_ok():
            assert time.monotonic() < deadline, "never registered"
            time.sleep(0.05)
        proxy.delay_s = 0.6  # one way: a round trip of 1.2 s
        time.sleep(2.5)  # the calls sent before the delay are answered; the delayed ones are in flight
        samples = []
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            samples.append(agent.lease_ok())
            time.sleep(0.02)
        lapsed = 1.0 - float(np.mean(samples))
        assert lapsed == 0.0, f"the lease lapsed {lapsed:.0%} of the time over a 1.2 s round trip"
        assert sched.core.map.servers[0].up  # and the scheduler never declared the server dead
    finally:
        if server is not None:
            server.close(grace=1.0)
        proxy.close()
        sched.close()
