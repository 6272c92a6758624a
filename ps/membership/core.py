"""A shard server's membership as a sans-IO core: what to call next, the lease, and what answers mean.

``Membership`` has no thread, socket or clock: the adapter (``agent.Agent`` in the daemon, the simulator's
agent in ``tigana.tools.sim``) asks it which call to make (``next_call``), makes it, and hands the outcome back
with the time the call was sent. The decisions kept here:

- register first (with the log positions of what the server loaded, for an unclean election); heartbeat
  every ``interval_s`` after; register again when the scheduler says so (it lost us, or we restarted);
- the primary lease (async tables): ``lease_ok(now)`` is true while the last successful call is younger than
  ``lease_s``, counted from when that call was *sent*: the scheduler heard from us no earlier, so its timeout
  (> lease_s) runs out after our lease does however slow the reply. A server whose heartbeats fail stops
  acknowledging async pushes before the scheduler can declare it dead, which bounds what a deposed primary
  can acknowledge. A heartbeat renews the lease only after the map it returned is installed;
- after a failed call, back off, but a registered server never waits longer than its interval: silence longer
  than that would let a slow scheduler link look like a dead server;
- map refreshes asked for by requests (one per ``WrongShard`` routed at a newer epoch) coalesce: only an epoch
  above the highest one wanted asks for a fetch (``want``);
- a caught-up report answered "stale" means the copy was removed or demoted after the slot copy started.
"""

from __future__ import annotations

REGISTER, HEARTBEAT = "register", "heartbeat"


class Membership:
    """The state of one server's membership: registered or not, its lease, its backoff, the epoch wanted."""

    def __init__(self, interval_s: float = 0.5, lease_s: float = 2.0) -> None:
        self.interval_s, self.lease_s = interval_s, lease_s
        self.registered = False
        self.last_ok = float("-inf")  # when the last successful call was sent
        self.backoff_s = 0.1
        self.wanted = 0  # the highest map epoch a request asked for

    def next_call(self) -> str:
        """The call to make now: ``REGISTER`` or ``HEARTBEAT``."""
        return HEARTBEAT if self.registered else REGISTER

    def registered_ok(self, sent: float) -> None:
        """Register answered (its map installed)."""
        self.registered = True
        self.last_ok = sent
        self.backoff_s = 0.1

    def heartbeat_answered(self, sent: float, reregister: bool) -> bool:
        """A heartbeat answered (its map, if any, installed). True: register again at once."""
        self.backoff_s = 0.1
        if reregister:
            self.registered = False
            return True
        self.last_ok = sent
        return False

    def call_failed(self) -> float:
        """A register or heartbeat failed (the adapter tries the next scheduler): how long to wait first."""
        wait = self.backoff_s
        self.backoff_s = min(self.interval_s if self.registered else 2.0, self.backoff_s * 2)
        return wait

    def lease_ok(self, now: float) -> bool:
        return now - self.last_ok < self.lease_s

    def want(self, epoch: int) -> bool:
        """A request saw map ``epoch``: True when it is above every epoch wanted so far (fetch it)."""
        if epoch <= self.wanted:
            return False
        self.wanted = epoch
        return True

    def wants_more(self, have_epoch: int) -> bool:
        """Whether a map newer than ``have_epoch`` is still wanted."""
        return self.wanted > have_epoch


def caught_up_answer(accepted: bool, message: str) -> bool:
    """What a CopyCaughtUp answer means to the primary: False only when the scheduler refused the report as
    stale (the copy starts again); a refusal for any other reason is retried by the primary's upkeep."""
    return accepted or not message.startswith("stale")
