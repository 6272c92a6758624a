"""A shard server's membership in a cluster: registration, heartbeats, the primary lease and the other calls
to the scheduler.

- ``core``: ``Membership``, the sans-IO core (which call next, the lease, backoff, coalesced refreshes);
- ``agent``: ``Agent``, its thread and gRPC adapter in the daemon.
"""

from tigana.ps.membership.agent import Agent
from tigana.ps.membership.core import HEARTBEAT, REGISTER, Membership, caught_up_answer

__all__ = ["HEARTBEAT", "REGISTER", "Agent", "Membership", "caught_up_answer"]
