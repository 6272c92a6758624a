"""A deterministic simulator of a Tigana cluster, after FoundationDB's simulation testing and TigerBeetle's
VOPR: the real scheduler core and shard services, the daemon's membership agent and stream senders, and the
trainers' real client, on one seeded random source, a simulated network (delays, drops, partitions), crashes,
pauses and restarts, planned operations, and the invariants of docs/replication.md checked after every step.

Example::

    from tigana.tools.testing.sim import Settings, run_seed
    outcome = run_seed(7, Settings(faults=True))
    assert outcome.ok, (outcome.violations, outcome.trace[-40:])
"""

from tigana.tools.testing.sim.operations import Op
from tigana.tools.testing.sim.simulation import Outcome, Settings, run_seed

__all__ = ["Op", "Outcome", "Settings", "run_seed"]
