"""A map's replication actions run after ``install`` released its locks (``ps/shard/ownership.py``,
``Replicator.on_map``/``run``), and a report whose answer names a newer map hands it to the agent's refresher
(``ps/membership/agent.py``): no scheduler call, and no install its answer brings, waits under a table, registry
or install lock.

A real scheduler in process and a real ``ShardService`` with a real ``Agent`` (its loop not started: the test
makes its calls). The one thing planted, in test code, is the action: the replication core asks for a failure
report with the map it is given, as it does when a slot copy started again emptied copies the map has in sync.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.ps.membership.agent import Agent
from tigana.ps.replication.actions import ReportFailure
from tigana.ps.routing import TableDef
from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.ps.shard import ShardService
from tigana.ps.shard.config import ServerConfig

SLOTS = 64


def _spec(name: str) -> TableDef:
    return TableDef(TableConfig(name, dim=4, optimizer=SGD(lr=1.0), initializer=Zeros()), durability="sync")


def test_an_install_whose_failure_report_answers_a_newer_map_completes_with_no_lock_held(tmp_path) -> None:
    """The self-deadlock of issue 44: ``install`` held its install lock and every table lock while the
    replicator ran a ``ReportFailure`` action; the agent's report, answered with a newer epoch, called
    ``refresh``, which installed and waited on the install lock (and, inside a refresh, on the agent's refresh
    lock): the server hung holding every table lock. Here the install comes from ``Agent.refresh`` (the map
    the scheduler holds), its planted report is answered with a newer epoch (the scheduler moved on
    meanwhile), and the install completes; the report ran with no lock held; the newer map is installed by the
    refresher."""
    sched = start_scheduler(SchedulerConfig(data_dir=str(tmp_path / "sched"), replicas=0, num_slots=SLOTS,
                                            heartbeat_timeout_s=60.0))
    service = agent = None
    hung = False
    try:
        service = ShardService(ServerConfig(num_slots=SLOTS, scheduler=sched.address, ack_timeout_s=0.5))
        service.state = "serving"
        agent = Agent(service, sched.address, "127.0.0.1:2")
        service.agent = agent
        sched.core.register(service.server_id, "127.0.0.1:2", service.boot)
        sched.core.create_table(_spec("t"), exist_ok=False)
        first = sched.core.map.epoch

        core = service.replicator.core
        real_on_map = core.on_map
        planted: list[int] = []

        def on_map(m, *args, **kwargs):
            actions = real_on_map(m, *args, **kwargs)
            if not planted:  # once: the scheduler moves on (a table created) before the report reaches it
                planted.append(m.epoch)
                sched.core.create_table(_spec("u"), exist_ok=False)
                actions.append(ReportFailure("elsewhere", np.array([1], np.int32), "planted by the test"))
            return actions

        core.on_map = on_map
        held: list[tuple[str, bool, bool, bool]] = []
        real_report = agent._report

        def report(method, request):
            held.append((method, service.ownership.install_lock.locked(), service.tables.lock._is_owned(),
                         any(h.lock.locked() for h in (h for _, h in service.tables.items()))))
            return real_report(method, request)

        agent._report = report
        worker = threading.Thread(target=agent.refresh, name="test-refresh", daemon=True)
        worker.start()
        worker.join(15)
        hung = worker.is_alive()
        assert not hung, "install hung: its failure report waited for an install of the newer map"
        assert planted == [first] and service.epoch >= first
        assert held == [("ReportCopyFailure", False, False, False)], held
        newer = sched.core.map.epoch
        assert newer > first
        deadline = time.monotonic() + 10
        while service.epoch < newer:  # the refresher fetches the map the report's answer named
            assert time.monotonic() < deadline, f"at epoch {service.epoch}, the report named {newer}"
            time.sleep(0.02)
        assert set(service.table_names()) == {"t", "u"}
    finally:
        if not hung:  # a hung install holds every table lock: closing would hang the suite too
            if agent is not None:
                agent.close()
            if service is not None:
                service.close_tables()
        sched.close()
