"""The simulated operator and nemesis: one random planned operation (or fault) at a time, as the admin
commands would ask the scheduler, with the run's own random source."""

from __future__ import annotations

from typing import Any

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.ps.errors import PSError
from tigana.ps.routing import TableDef

__all__ = ["operate"]

PLANNED = ("move", "move_primary", "rebalance", "drain", "undrain", "create_drop", "join")
FAULTS = ("crash", "crash_restart", "pause", "partition", "drops", "scheduler_restart")


def operate(run: Any) -> None:
    """One operation of ``run`` (a ``simulation._Run``), chosen by its random source."""
    rng = run.world.rng
    kinds = PLANNED + (FAULTS if run.s.faults else ())
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
        elif kind in FAULTS:
            _fault(run, kind)
    except PSError as exc:  # refused as an operator would see it (no such copy, last server...): fine
        run.log(f"{kind} refused: {exc}")


def _fault(run: Any, kind: str) -> None:
    """A fault within what the cluster promises to survive: a server is crashed, paused or cut off only while
    every slot has its 1 + replicas in-sync copies and fewer than ``replicas`` servers are impaired (losing
    every copy of a slot loses what was acknowledged since the last snapshot: that is another promise)."""
    rng = run.world.rng
    alive = [s for s in run.servers.values() if s.alive]
    impaired = {s.name for s in run.servers.values() if not s.up} | run.cut_off
    degraded = run.scheduler.core.map.summary()["degraded_slots"]
    if kind in ("crash", "crash_restart", "pause", "partition") and (len(impaired) >= run.s.replicas or degraded):
        kind = rng.choice(("drops", "scheduler_restart"))
    run.faulty = True
    if kind in ("crash", "crash_restart") and len(alive) > 1:
        victim = rng.choice(alive)
        victim.crash()
        run.log(f"crash {victim.name}")
        if kind == "crash_restart":
            run.world.at(rng.uniform(0.5, 5.0), lambda: (victim.start(), run.log(f"restart {victim.name}")))
    elif kind == "pause" and alive:
        victim = rng.choice(alive)
        victim.paused = True
        run.log(f"pause {victim.name}")
        run.world.at(rng.uniform(0.5, 6.0), lambda: (setattr(victim, "paused", False),
                                                     run.log(f"resume {victim.name}")))
    elif kind == "partition" and alive:
        victim = rng.choice(alive)
        others = ["scheduler"] + [s.name for s in run.servers.values() if s is not victim]
        cut = {frozenset((victim.name, o)) for o in rng.sample(others, rng.randint(1, len(others)))}
        run.net.cut |= cut
        run.cut_off.add(victim.name)
        run.log(f"partition {victim.name} from {sorted(next(iter(c - {victim.name})) for c in cut)}")
        run.world.at(rng.uniform(0.5, 6.0), lambda: (run.net.cut.difference_update(cut),
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

        run.world.at(rng.uniform(0.2, 3.0), back)
