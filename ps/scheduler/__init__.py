"""tigana.ps.scheduler — the scheduler: owns the shard map of a cluster, detects failed servers and recovers
their slots.

``SchedulerCore`` is the state machine (sans-IO: events in, ``Ready`` out); ``SchedulerDriver`` runs it on
threads, a store and a clock; ``SchedulerService`` is its gRPC face; ``start_scheduler`` the one function the
CLI, tests and benchmarks start it with.

Every change is a new map (epoch + 1) saved in the ``MapStore`` before anyone sees it; servers get it pushed
(``InstallMap``) and with their heartbeats, clients long-poll ``GetMap``. What changes a map:

- a server registers: a new one is added (and, once ``expect_servers`` are up, the first placement made);
  a known one with a new boot (it restarted and lost its memory since its last snapshot) has its copies
  demoted to catching up, so it never leads with stale rows while a valid copy exists elsewhere;
- a server is declared dead (no heartbeat for ``heartbeat_timeout_s``, or a probe finds its port closed):
  its copies leave the map; for every slot it led the first in-sync copy is promoted (only an in-sync copy
  has every acknowledged update); then missing copies are added as catching-up copies on the least loaded
  servers, which their primaries build with the slot copy;
- a primary reports a copy failed (it could not stream to it): the copy is demoted to catching up, out of
  the in-sync set, before the primary acknowledges anything without it (invariant I1 of ``replication``);
- a primary reports a copy caught up: it joins the in-sync set;
- tables are created or dropped;
- the placement moves toward a target (``placement.step_toward``), one safe step per map.

A slot left with no in-sync copy at all (every copy lost its memory, e.g. all servers restarted) gets a
primary again by an unclean election among the servers that registered with rows of it, by their log
positions (newest wins): what their snapshots held, so at most the updates since the last snapshot
interval are lost. Thread-safety: the driver runs one event at a time, under one lock.

One room per concept:

- ``config``: ``SchedulerConfig`` and ``load_scheduler_config``;
- ``placement``: where copies go and the safe steps toward a target (pure functions, no I/O);
- ``core``: ``SchedulerCore`` (state, commits, servers, copy reports, tables, reads), assembled from
  ``liveness`` (failure detection, probes, elections) and ``moves`` (placement and its steps, hand-overs) with ``spread`` (failure domains in placement),
  over the fields declared in ``_fields``; ``actions``: what it asks its driver to do (persist, announce,
  probe);
- ``driver``: ``SchedulerDriver``, the core on threads, a ``MapStore`` and a clock;
- ``service``: the gRPC ``SchedulerService``;
- ``announcer`` and ``daemon``: ``SchedulerHandle``, ``start_scheduler``, the tick and election threads, health;
- the stores (``stores``): ``stores.file`` (the ``MapStore`` interface, ``FileMapStore``) and ``stores.etcd`` (etcd, with the
  leader election that fences every write; imported only when a config names it).
"""

from tigana.ps.errors import PSError
from tigana.ps.scheduler.config import SchedulerConfig, load_scheduler_config
from tigana.ps.scheduler.core import SchedulerCore
from tigana.ps.scheduler.daemon import (
    DOMAINS_HEALTH_NAME,
    REPLICATION_HEALTH_NAME,
    NotLeader,
    SchedulerHandle,
    probe_closed,
    start_scheduler,
)
from tigana.ps.scheduler.driver import SchedulerDriver
from tigana.ps.scheduler.moves import _placement_changes as _placement_changes  # used by tests
from tigana.ps.scheduler.service import SERVICE_NAME, SchedulerService
from tigana.ps.scheduler.stores.file import FileMapStore, MapStore, SchedulerState

__all__ = ["DOMAINS_HEALTH_NAME", "REPLICATION_HEALTH_NAME", "SERVICE_NAME", "FileMapStore", "MapStore", "NotLeader", "PSError",
           "SchedulerConfig", "SchedulerCore", "SchedulerDriver", "SchedulerHandle", "SchedulerService", "SchedulerState",
           "load_scheduler_config", "probe_closed", "start_scheduler"]
