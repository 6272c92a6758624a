"""One seeded run: a cluster, a workload of pushes and admin operations, faults, and the invariants checked
after every step (docs/replication.md names them).

A run has three phases: ``busy`` (pushes, planned operations, and faults when enabled), ``heal`` (faults
lifted, crashed servers restarted, pushes finishing) and the liveness check: within ``converge_s`` simulated
seconds every slot must reach 1 + replicas in-sync copies and every push must be settled. Checked after every
step: every safety property (``checkers.Checkers``, the ledger exactly: ``exactness.Exactness``), no pull
reading above the pushes sent, and no copy demoted before any fault; at convergence and at the deadline the
liveness ones and what only a settled cluster shows (``convergence``). With hosts (``Settings.hosts``), servers
sit in failure domains, a fault can crash every server of one host at once (``domain_crash``), and at
convergence no slot's in-sync copies may share a host while enough hosts are up. With data dirs
(``snapshot_every_s``), S1
is relaxed exactly as docs/replication.md says: a slot that lost every in-sync copy at once may miss what was
acknowledged after its newest snapshot (``disk.lose_slots``). Operations are random (``operations.operate``)
or scripted (``Settings.script``, a tuple of ``operations.Op``). The ``Outcome`` carries the first violation,
the trace to replay it and ``minimal_trace()``, the lines about the violation only.
"""

from __future__ import annotations

import logging
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.ps.domains import FailureDomain
from tigana.ps.errors import PSError
from tigana.ps.routing import TableDef, slot_of
from tigana.ps.scheduler import SchedulerConfig
from tigana.tools.testing.sim.checkers import Checkers
from tigana.tools.testing.sim.convergence import check_settled, converged, why_not
from tigana.tools.testing.sim.detector import probe_answer
from tigana.tools.testing.sim.disk import snapshot
from tigana.tools.testing.sim.ledger import DIM, Ledger
from tigana.tools.testing.sim.nodes import SchedulerNode, SimServer
from tigana.tools.testing.sim.realclient import RealSimClient
from tigana.tools.testing.sim.world import Net, World

__all__ = ["Outcome", "Settings", "run_seed"]

STEP_S = 0.01
LEDGERS = {"ledger_sync": "sync", "ledger_async": "async"}  # the order of ``exactness.LEDGERS``


@dataclass(frozen=True)
class Settings:
    servers: int = 3
    replicas: int = 1
    num_slots: int = 16
    ids: int = 256
    clients: int = 2
    busy_s: float = 20.0
    converge_s: float = 60.0
    faults: bool = True
    ops_per_s: float = 0.6
    script: tuple = ()  # scripted operations (``operations.Op``): when given, no random operation runs
    auto_rebalance: bool = True
    pulls: bool = True  # clients also pull (inserting, and read-only) beside their pushes
    snapshot_every_s: float = 0.0  # > 0: servers have a data dir, snapshots this often (every 4th full)
    tables_at_s: float = 0.0  # the ledger tables are created then (a trainer that starts after the servers)
    hosts: int = 0  # > 0: server k runs on host h{k % hosts} (its failure domain); 0: every server its own
    queue_bytes: int = 0  # > 0: each replication stream's bound (``replication_queue_bytes``; 0: the default)


@dataclass
class Outcome:
    seed: int
    steps: int = 0
    violations: list[str] = field(default_factory=list)
    convergence_s: float | None = None
    acked: int = 0
    failed_pushes: int = 0
    ops: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    demotions: int = 0  # copies out of the in-sync set on a primary's report (the scheduler's counter)
    demotions_without_fault: int = 0  # ... of them before the first fault
    pulls: int = 0
    copies_per_server: dict[str, int] = field(default_factory=dict)  # in the final map, up servers only
    simulated_s: float = 0.0  # the world's time at the end of the run

    @property
    def ok(self) -> bool:
        return not self.violations

    def minimal_trace(self, limit: int = 200) -> list[str]:
        """The trace cut to what the first violation is about: every operation and fault, and the lines that
        name its servers or tables (the cluster's own lines about them included), then the violation."""
        return shrink(self.trace, self.violations[0] if self.violations else "", limit)


def shrink(trace: list[str], violation: str, limit: int = 200) -> list[str]:
    names = set(re.findall(r"\b(s\d+|scheduler|ledger_\w+|scratch\d)\b", violation))
    slots = set(re.findall(r"slot (\d+)", violation))
    words = [re.compile(rf"\b{re.escape(n)}\b") for n in names]
    words += [re.compile(rf"slots? [^:;)]*\b{n}\b") for n in slots]
    kept = [line for line in trace if " op " in line[:12] or "VIOLATION" in line or
            any(w.search(line) for w in words)]
    return kept[-limit:]


class _Run:
    def __init__(self, seed: int, settings: Settings, folder: Path) -> None:
        self.s = settings
        self.folder = folder
        self.world = World(seed)
        self.servers: dict[str, SimServer] = {}
        self.net = Net(self.world, self._up)
        self.checkers = Checkers(self)
        config = SchedulerConfig(replicas=settings.replicas, num_slots=settings.num_slots, heartbeat_timeout_s=3.0,
                                 auto_rebalance=settings.auto_rebalance)
        self.scheduler = SchedulerNode(self.world, self.net, config, self._announce,
                                       saved=self.checkers.on_map, probe=lambda a: probe_answer(self, a))
        self.ledger = Ledger(settings.ids)
        for name in LEDGERS:
            self.ledger.table(name)
        self.clients = [RealSimClient(self.world, self.net, f"c{k}", k + 1, self.scheduler, self.servers,
                                      self.ledger, settings.num_slots) for k in range(settings.clients)]
        self.out = Outcome(seed)
        self.ids = np.arange(settings.ids, dtype=np.int64)
        self.slots = slot_of(self.ids, settings.num_slots)
        self.faulty = False
        self.cut_off: set[str] = set()  # servers a partition cuts off now
        self.scratch = 0
        self._demoted_seen = 0
        self._fault_seen = False
        self._demotions_due: list[tuple[float, str]] = []
        self.late_reports_s = 0.0  # a fault: caught-up reports delivered again this much later
        self.script = sorted(settings.script, key=lambda op: op.at)
        for _ in range(settings.servers):
            self._add_server()

    # --- plumbing ---
    def _up(self, name: str) -> bool:
        if name == "scheduler":
            return self.scheduler.up
        server = self.servers.get(name)
        return server.up if server is not None else name.startswith("c")  # clients never crash here

    def _announce(self, m) -> None:
        for server in list(self.servers.values()):
            self.net.call("scheduler", server.name, lambda s=server: s.install(m), lambda r, e: None)

    def _add_server(self) -> None:
        k = len(self.servers)
        name = f"s{k}"
        domain = FailureDomain(host=f"h{k % self.s.hosts}") if self.s.hosts > 0 else FailureDomain()
        self.servers[name] = SimServer(self.world, self.net, name, self.scheduler, self.servers, self.s.num_slots,
                                       late_reports_s=lambda: self.late_reports_s,
                                       data_dir=self.folder / name if self.s.snapshot_every_s > 0 else None,
                                       domain=domain, queue_bytes=self.s.queue_bytes)

    def log(self, text: str) -> None:
        self.world.log(f"op {text}")
        self.out.ops.append(f"{self.world.now:.2f} {text}")

    # --- the run ---
    def run(self) -> Outcome:
        w, s = self.world, self.s
        next_beat = next_op = next_push = 0.0
        next_snapshot, snapshots = s.snapshot_every_s, 0
        tables_made = False
        end_busy = s.busy_s
        heal_by = end_busy + s.converge_s
        converged_at = None
        while self.script and self.script[0].at <= 0.0:  # in effect from the first moment (late reports)
            self._perform(self.script.pop(0))
        while w.now < heal_by:
            w.run_until(w.now + STEP_S)
            self.out.steps += 1
            if w.now >= next_beat:
                next_beat = w.now + 0.5
                for server in list(self.servers.values()):
                    server.maintain()
                if self.scheduler.up:
                    self.scheduler.tick()
            for server in list(self.servers.values()):
                server.step()
            if s.snapshot_every_s > 0 and w.now >= next_snapshot:
                next_snapshot, snapshots = w.now + s.snapshot_every_s, snapshots + 1
                snapshot(self, incremental=snapshots % 4 != 0)
            if not tables_made and self.scheduler.core.map.servers and w.now >= s.tables_at_s:
                self._create_ledgers()
                tables_made = True
            busy = w.now < end_busy
            if tables_made and busy and w.now >= next_push:
                next_push = w.now + 0.02
                scratch = [t for t in self.scheduler.core.map.tables if t.startswith("scratch")]
                for c in self.clients:
                    if c.in_flight < 4:
                        # mostly the ledgers; some pushes to a scratch table, which a drop may cut short
                        table = w.rng.choice(list(LEDGERS) + scratch[:1])
                        self.ledger.table(table)
                        c.push(table, np.array(w.rng.sample(range(s.ids), 16), np.int64))
                    if s.pulls and w.rng.random() < 0.25:  # inserting pulls create rows pushes never touched
                        c.pull(w.rng.choice(list(LEDGERS)), np.array(w.rng.sample(range(s.ids + 64), 8), np.int64),
                               read_only=w.rng.random() < 0.5)
            while self.script and self.script[0].at <= w.now:
                self._perform(self.script.pop(0))
            if tables_made and busy and not s.script and w.now >= next_op:
                next_op = w.now + w.rng.expovariate(s.ops_per_s)
                self._operation()
            if not busy and self.faulty:
                self._heal()
            self._check()
            if self.out.violations:
                break
            if not busy and converged_at is None and converged(self):
                converged_at = w.now
                self.out.violations += check_settled(self, heal_by)
                self._check(final=True)
                break
        self.out.violations += [text for _, text in self._demotions_due]
        if converged_at is None and not self.out.violations:
            self.out.violations.append(why_not(self))
        self.out.convergence_s = None if converged_at is None else converged_at - end_busy
        self.out.acked = sum(c.acked for c in self.clients)
        self.out.failed_pushes = sum(c.failed for c in self.clients)
        self.out.pulls = sum(c.pulls for c in self.clients)
        self.out.demotions = self.scheduler.demotions()
        m = self.scheduler.core.map
        self.out.copies_per_server = {e.id: int((m.copies == i).sum()) for i, e in enumerate(m.servers) if e.up}
        self.out.trace = w.trace
        self.out.simulated_s = w.now
        return self.out

    def _create_ledgers(self) -> None:
        core = self.scheduler.core
        for name, durability in LEDGERS.items():
            spec = TableDef(TableConfig(name, dim=DIM, optimizer=SGD(lr=1.0), initializer=Zeros()), durability)
            core.create_table(spec, exist_ok=True)
        self.log("ledger tables created")

    # --- operations and faults ---
    def _operation(self) -> None:
        from tigana.tools.testing.sim.operations import operate

        operate(self)

    def _perform(self, op) -> None:
        from tigana.tools.testing.sim.operations import perform

        perform(self, op)

    def _heal(self) -> None:
        self.net.cut.clear()
        self.cut_off.clear()
        self.net.drop = 0.0
        self.late_reports_s = 0.0
        for server in self.servers.values():
            if server.paused:
                server.paused = False
            if not server.alive:
                server.start()
        if not self.scheduler.up:
            self.scheduler.up = True
            self.scheduler.restart()
        self.faulty = False
        self.log("healed: partitions lifted, every node up")

    # --- invariants ---
    def _check(self, final: bool = False) -> None:
        for c in self.clients:
            if c.doubled:
                self.out.violations.append(c.doubled[0])
        self.out.violations += self.checkers.after_step()
        demoted = self.scheduler.demotions()
        self._fault_seen |= self.faulty  # what a fault set off may end after the heal: counted as faulty
        if not self._fault_seen and demoted > self._demoted_seen:
            self.out.demotions_without_fault += demoted - self._demoted_seen
            # reported a second later: the loss the demotion comes with, when there is one, names the cause
            self._demotions_due.append((self.world.now + 1.0, f"no-demotion: {demoted - self._demoted_seen} cop(ies) "
                                        "demoted with no fault (docs/replication.md, no failure, no demotion)"))
        while self._demotions_due and (self._demotions_due[0][0] <= self.world.now or self.out.violations
                                       or final):
            self.out.violations.append(self._demotions_due.pop(0)[1])
        self._demoted_seen = demoted
        if self.out.violations:
            self.world.log(f"VIOLATION {self.out.violations[0]}")


class _ToTrace(logging.Handler):
    """The cluster's own log lines, stamped with simulated time, into the run's trace (not the console); the
    run's scratch folder (a new temporary path each run) is written ``$DIR``, so a seed's trace replays to
    the byte."""

    def __init__(self, world: World, folder: Path) -> None:
        super().__init__(logging.INFO)
        self.world, self.folder = world, str(folder)

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().replace(self.folder, "$DIR")
        self.world.log(f"{record.name.rsplit('.', 1)[-1]}: {text[:300]}")


def run_seed(seed: int, settings: Settings | None = None) -> Outcome:
    """Run one seed; the same seed and settings replay exactly (``Outcome.trace``: what happened, with the
    cluster's log lines, up to the first violation)."""
    root = logging.getLogger("tigana")
    saved = (root.level, root.propagate, list(root.handlers))
    with tempfile.TemporaryDirectory(prefix="tigana-sim-") as tmp:
        run = _Run(seed, settings or Settings(), Path(tmp))
        root.handlers, root.propagate = [_ToTrace(run.world, Path(tmp))], False
        root.setLevel(logging.INFO)
        try:
            return run.run()
        except PSError as exc:  # an error no caller expects is a finding too
            run.out.violations.append(f"error: {type(exc).__name__}: {exc}")
            run.out.trace = run.world.trace
            return run.out
        finally:
            root.setLevel(saved[0])
            root.propagate, root.handlers = saved[1], saved[2]
            for server in run.servers.values():
                server.close()
