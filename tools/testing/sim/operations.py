"""The simulated operator and nemesis: one random planned operation (or fault) at a time, as the admin
commands would ask the scheduler, with the run's own random source (``operate``); or a scripted scenario,
a list of timed operations (``Op``, run by ``perform``).

Example::

    script = (Op(2.0, "create", "scratch0"), Op(4.0, "drop", "scratch0"))
    run_seed(1, Settings(script=script, faults=False))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.ps.errors import PSError
from tigana.ps.routing import IN_SYNC, TableDef

__all__ = ["Op", "operate", "perform"]

PLANNED = ("move", "move_primary", "rebalance", "drain", "undrain", "create_drop", "join")
FAULTS = ("crash", "crash_restart", "pause", "partition", "drops", "scheduler_restart", "clock_jump")
DISK_FAULTS = ("lose_slot",)  # with data dirs: every copy of a slot lost at once, back from its snapshots
DOMAIN_FAULTS = ("domain_crash",)  # with hosts: every server of one host crashes at once


@dataclass(frozen=True)
class Op:
    """One scripted operation at simulated time ``at``.

    ``target`` names a server (``s1``), a table (``scratch0``, for create/drop), or a role resolved when the
    operation runs: ``primary:SLOT`` (the server leading SLOT), ``replica:SLOT`` (its first in-sync
    replica) or ``spare:SLOT`` (the first server up that holds no copy of SLOT). ``slot`` is the slot of a move, ``seconds`` how long a fault lasts (a pause, a partition, the
    down time of a crash_restart, a clock jump's size, the delay of late reports). Kinds: create, drop,
    create_async, move, move_primary, rebalance, drain, undrain, join, crash, restart, crash_restart, pause
    (``target`` a server, or ``scheduler``: its process stopped and going on later, no restart),
    partition (from every other server, not the scheduler), domain_crash (``target`` a host: every server
    there crashes at once, and restarts ``seconds`` later), scheduler_restart, clock_jump (``target``
    ``scheduler`` or a server), late_reports (every caught-up report is delivered again ``seconds`` later, a
    retried RPC whose first answer was lost), snapshot (a full snapshot of ``target`` alone, with data dirs),
    fault (``target`` a fault kind, ``crash`` say: the random nemesis's pick, its victim drawn and its
    survivability checked as in a random run), heal."""

    at: float
    kind: str
    target: str = ""
    slot: int = -1
    seconds: float = 0.0


def _resolve(run: Any, target: str) -> str:
    if ":" not in target:
        return target
    role, slot = target.split(":")
    m = run.scheduler.core.map
    row, states = m.copies[int(slot)], m.states[int(slot)]
    if role == "primary":
        return m.servers[int(row[0])].id if row[0] >= 0 else ""
    if role == "spare":
        return next((e.id for i, e in enumerate(m.servers) if e.up and i not in row), "")
    picks = [int(k) for k in range(1, row.shape[0]) if row[k] >= 0 and states[k] == IN_SYNC]
    return m.servers[row[picks[0]]].id if picks else ""


def _table(name: str, durability: str = "sync") -> TableDef:
    return TableDef(TableConfig(name, dim=2, optimizer=SGD(lr=1.0), initializer=Zeros()), durability)


def perform(run: Any, op: Op) -> None:
    """Run one scripted operation now (refusals are logged, as an operator would see them)."""
    core = run.scheduler.core
    target = _resolve(run, op.target)
    try:
        if op.kind in ("create", "create_async"):
            core.create_table(_table(op.target, "async" if op.kind == "create_async" else "sync"), exist_ok=True)
        elif op.kind == "drop":
            core.drop_table(op.target)
        elif op.kind in ("move", "move_primary"):
            core.move_slot(op.slot, target, primary=op.kind == "move_primary")
        elif op.kind == "rebalance":
            core.rebalance()
        elif op.kind in ("drain", "undrain"):
            core.drain(target, undrain=op.kind == "undrain")
        elif op.kind == "join":
            run._add_server()
            target = f"s{len(run.servers) - 1}"
        elif op.kind in ("crash", "crash_restart", "restart", "pause", "partition", "clock_jump"):
            _fault(run, op.kind, victim=run.servers.get(target) or target, seconds=op.seconds)
            return
        elif op.kind in ("scheduler_restart", "late_reports"):
            _fault(run, op.kind, seconds=op.seconds)
            return
        elif op.kind == "lose_slot":
            _lose_slot(run, op.slot, op.seconds)
            return
        elif op.kind == "snapshot":
            from tigana.tools.testing.sim.disk import snapshot

            snapshot(run, incremental=False, only=target)
        elif op.kind == "domain_crash":
            _domain_crash(run, op.target, op.seconds)
            return
        elif op.kind == "fault":  # the nemesis's own pick: ``target`` names the kind, the victim is drawn
            _fault(run, op.target)
            return
        elif op.kind == "heal":
            run._heal()
            return
        else:
            raise ValueError(f"unknown scripted operation {op.kind!r}")
        run.log(f"{op.kind} {target} {'slot ' + str(op.slot) if op.slot >= 0 else ''}".rstrip())
    except PSError as exc:
        run.log(f"{op.kind} {target} refused: {exc}")


def operate(run: Any) -> None:
    """One operation of ``run`` (a ``simulation._Run``), chosen by its random source."""
    rng = run.world.rng
    kinds = PLANNED + (FAULTS if run.s.faults else ()) + (DISK_FAULTS if run.s.faults and
                                                          run.s.snapshot_every_s > 0 else ()) \
        + (DOMAIN_FAULTS if run.s.faults and run.s.hosts > 1 else ())
    kind = rng.choice(kinds)
    core = run.scheduler.core
    m = core.map
    names = [e.id for e in m.servers if e.up]
    try:
        if kind in ("move", "move_primary") and names:
            slot = rng.randrange(run.s.num_slots)
            to = rng.choice(names)
            core.move_slot(slot, to, primary=kind == "move_primary")
            run.log(f"{kind} slot {slot} to {to}")
        elif kind == "rebalance":
            core.rebalance()
            run.log("rebalance")
        elif kind == "drain" and len(names) > 1 + run.s.replicas:
            victim = rng.choice(names)
            core.drain(victim)
            run.log(f"drain {victim}")
        elif kind == "undrain" and core.draining:
            victim = sorted(core.draining)[0]
            core.drain(victim, undrain=True)
            run.log(f"undrain {victim}")
        elif kind == "create_drop":
            run.scratch += 1
            name = f"scratch{run.scratch % 2}"
            if name in m.tables:
                core.drop_table(name)
                run.log(f"drop {name}")
            else:
                core.create_table(TableDef(TableConfig(name, dim=2, optimizer=SGD(lr=1.0), initializer=Zeros())),
                                  exist_ok=True)
                run.log(f"create {name}")
        elif kind == "join" and len(run.servers) < run.s.servers + 2:
            run._add_server()
            run.log(f"join s{len(run.servers) - 1}")
        elif kind in FAULTS or kind in DOMAIN_FAULTS:
            _fault(run, kind)
    except PSError as exc:  # refused as an operator would see it (no such copy, last server...): fine
        run.log(f"{kind} refused: {exc}")


def _fault(run: Any, kind: str, victim: Any = None, seconds: float = 0.0) -> None:
    """A fault within what the cluster promises to survive: a server is crashed, paused or cut off only while
    every slot has its 1 + replicas in-sync copies and fewer than ``replicas`` servers are impaired (losing
    every copy of a slot loses what was acknowledged since the last snapshot: that is another promise).
    A scripted fault names its ``victim`` and lasts ``seconds``, and nothing checks it is survivable."""
    rng = run.world.rng
    alive = [s for s in run.servers.values() if s.alive]
    scripted = victim is not None or seconds > 0
    impaired = {s.name for s in run.servers.values() if not s.up} | run.cut_off
    # a server restarted since the map was made holds none of the copies the map lists for it (a scheduler that
    # is down has not seen the new boot): impaired too, or a second crash would take a slot's last real copy
    m = run.scheduler.core.map
    impaired |= {e.id for e in m.servers if e.id in run.servers and run.servers[e.id].svc is not None
                 and run.servers[e.id].svc.boot != e.boot}
    degraded = run.scheduler.core.map.summary()["degraded_slots"]
    # a host's loss is survived only while every slot's in-sync copies are on two hosts or more
    apart = kind != "domain_crash" or not run.scheduler.core.domain_degraded()[0].any()
    if not scripted and kind in ("crash", "crash_restart", "pause", "partition", "lose_slot", "domain_crash") and \
            (len(impaired) >= run.s.replicas or degraded or not apart):
        kind = rng.choice(("drops", "scheduler_restart"))
    if kind == "lose_slot":
        _lose_slot(run, rng.randrange(run.s.num_slots), rng.uniform(0.5, 4.0))
        return
    if kind == "domain_crash":
        hosts = sorted({s.domain.host for s in alive})
        if hosts:
            _domain_crash(run, rng.choice(hosts), rng.uniform(0.5, 5.0))
        return

    def lasting(lo: float, hi: float) -> float:
        return seconds if scripted else rng.uniform(lo, hi)

    if isinstance(victim, str) or (victim is None and not alive):
        if kind not in ("clock_jump", "scheduler_restart", "late_reports", "drops") and \
                not (kind == "pause" and victim == "scheduler"):
            run.log(f"{kind} {victim}: no such server")
            return
    elif victim is None and alive:
        victim = rng.choice(alive)
    run.faulty = True
    if kind == "restart":
        victim.start()
        run.log(f"restart {victim.name}")
    elif kind in ("crash", "crash_restart") and (scripted or len(alive) > 1):
        victim.crash()
        run.log(f"crash {victim.name}")
        if kind == "crash_restart":
            run.world.at(lasting(0.5, 5.0), lambda: (victim.start(), run.log(f"restart {victim.name}")))
    elif kind == "pause" and victim == "scheduler":  # its process stopped, then going on: no restart (L6)
        run.scheduler.up = False
        run.log("pause scheduler")
        run.world.at(lasting(0.5, 6.0), lambda: (setattr(run.scheduler, "up", True), run.log("resume scheduler")))
    elif kind == "pause":
        victim.paused = True
        run.log(f"pause {victim.name}")
        run.world.at(lasting(0.5, 6.0), lambda: (setattr(victim, "paused", False),
                                                 run.log(f"resume {victim.name}")))
    elif kind == "clock_jump":
        node = run.scheduler if victim == "scheduler" or (not scripted and rng.random() < 0.3) else victim
        jump = lasting(0.5, 8.0)
        node.skew += jump
        run.log(f"clock of {getattr(node, 'name', 'scheduler')} jumps {jump:.2f}s forward")
    elif kind == "late_reports":
        run.late_reports_s = lasting(1.0, 6.0)
        run.log(f"caught-up reports delivered again {run.late_reports_s:.2f}s later")
    elif kind == "partition":
        others = ["scheduler"] + [s.name for s in run.servers.values() if s is not victim]
        if scripted:  # cut off from the other servers, not from the scheduler
            chosen = others[1:]
        else:
            chosen = rng.sample(others, rng.randint(1, len(others)))
        cut = {frozenset((victim.name, o)) for o in chosen}
        run.net.cut |= cut
        run.cut_off.add(victim.name)
        run.log(f"partition {victim.name} from {sorted(next(iter(c - {victim.name})) for c in cut)}")
        run.world.at(lasting(0.5, 6.0), lambda: (run.net.cut.difference_update(cut),
                                                     run.cut_off.discard(victim.name),
                                                     run.log(f"partition of {victim.name} healed")))
    elif kind == "drops":
        run.net.drop = rng.uniform(0.01, 0.2)
        run.log(f"drop {run.net.drop:.2f} of messages")
        run.world.at(rng.uniform(0.5, 4.0), lambda: setattr(run.net, "drop", 0.0))
    elif kind == "scheduler_restart":
        run.scheduler.up = False
        run.log("scheduler crash")

        def back() -> None:
            run.scheduler.up = True
            run.scheduler.restart()
            run.log("scheduler restarted from its store")

        run.world.at(lasting(0.2, 3.0), back)


def _lose_slot(run: Any, slot: int, seconds: float) -> None:
    """Every server holding an in-sync copy of ``slot`` crashes at once (beyond what replication survives)
    and restarts from its data dir ``seconds`` later: the unclean election runs, and the ledger may miss,
    for the slots lost, what was acknowledged after their newest snapshot (``disk.lose_slots``)."""
    from tigana.tools.testing.sim.disk import lose_slots

    m = run.scheduler.core.map
    holders = {m.servers[int(c)].id for c, st in zip(m.copies[slot], m.states[slot], strict=True)
               if c >= 0 and st == IN_SYNC}
    victims = [run.servers[h] for h in sorted(holders) if h in run.servers and run.servers[h].alive]
    if not victims:
        return
    run.faulty = True
    for victim in victims:
        victim.crash()
    lost = lose_slots(run, {s.name for s in run.servers.values() if not s.alive})
    run.log(f"lose every copy of slot {slot}: crash {','.join(v.name for v in victims)} (slots lost: {lost})")

    def back() -> None:
        for victim in victims:
            if not victim.alive:
                victim.start()
        run.log(f"restart {','.join(v.name for v in victims)} from their data dirs")

    run.world.at(seconds, back)


def _domain_crash(run: Any, host: str, seconds: float) -> None:
    """Every server on ``host`` crashes at once (a machine, or a Kubernetes node, lost) and restarts
    ``seconds`` later. Placement kept a copy of every slot on another host, so nothing acknowledged sync is lost
    (S1 holds throughout)."""
    victims = [s for s in run.servers.values() if s.domain.host == host and s.alive]
    if not victims:
        run.log(f"domain_crash {host}: no server up there")
        return
    run.faulty = True
    for victim in victims:
        victim.crash()
    run.log(f"domain_crash host {host}: crash {','.join(v.name for v in victims)}")

    def back() -> None:
        for victim in victims:
            if not victim.alive:
                victim.start()
        run.log(f"restart {','.join(v.name for v in victims)} (host {host} back)")

    run.world.at(seconds, back)
