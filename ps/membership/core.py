"""A shard server's membership as a sans-IO core: what to call next, the lease, and what answers mean.

``Membership`` has no thread, socket or clock: the adapter (``agent.Agent`` in the daemon, the simulator's
agent in ``tigana.tools.testing.sim``) asks it which call to make (``next_call``), makes it, and hands the outcome back
with the time the call was sent. The decisions kept here:

- register first (with the log positions of what the server loaded, for an unclean election); heartbeat
  every ``interval_s`` after, whether or not the earlier heartbeats were answered (``beat_due``: at most
  ``max_in_flight`` at once); register again when the scheduler says so (it lost us, or we restarted). A
  heartbeat sent only once the last one was answered came a round trip plus the interval apart: over a link
  with a 1.2 s round trip the lease (below) lapsed for 0.9 s of every 1.7 s, with no fault at all;
- the primary lease (async tables): ``lease_ok(now)`` is true while the last successful call is younger than
  ``lease_s``, counted from when that call was *sent*: the scheduler heard from us no earlier, so its timeout
  (> lease_s) runs out after our lease does however slow the reply. Answers may come back out of order: the
  lease counts from the latest send answered. A server whose heartbeats fail stops
  acknowledging async pushes before the scheduler can declare it dead, which bounds what a deposed primary
  can acknowledge. A heartbeat renews the lease only after the map it returned is installed;
- after a failed call, back off, but a registered server never waits longer than its interval: silence longer
  than that would let a slow scheduler link look like a dead server;
- with several schedulers (a leader and standbys), heartbeats go to the one that answered last; once a
  heartbeat to it fails, every heartbeat goes to all of them (``targets``) until one answers, and that one is
  used from then on. A standby refuses at once, a paused or partitioned old leader never answers, and the new
  leader answers from its first moment. Going round them one at a time, each standby refusal sent the server
  back to the paused leader for another whole deadline: servers found a new leader seconds after it took over,
  their leases lapsed meanwhile, and a new leader that heard nobody declared them dead;
- map refreshes asked for by requests (one per ``WrongShard`` routed at a newer epoch) coalesce: only an epoch
  above the highest one wanted asks for a fetch (``want``);
- a caught-up report answered "stale" means the copy was removed or demoted after the slot copy started.
"""

from __future__ import annotations

REGISTER, HEARTBEAT = "register", "heartbeat"


class Membership:
    """The state of one server's membership: registered or not, its lease, its backoff, the epoch wanted."""

    def __init__(self, interval_s: float = 0.5, lease_s: float = 2.0, schedulers: int = 1) -> None:
        self.interval_s, self.lease_s = interval_s, lease_s
        self.schedulers = max(1, schedulers)
        self.current = 0  # the scheduler calls go to (an index into the adapter's addresses)
        self.searching = False  # the current one failed: heartbeats go to every scheduler until one answers
        self.registered = False
        self.last_ok = float("-inf")  # when the last successful call was sent
        self.backoff_s = 0.1
        self.wanted = 0  # the highest map epoch a request asked for
        self.in_flight = 0  # heartbeats sent and not yet answered (or failed)
        self.max_in_flight = int(lease_s / interval_s) + 2 if interval_s > 0 else 1
        self.next_beat = float("-inf")  # when the next heartbeat is due

    def next_call(self) -> str:
        """The call to make now: ``REGISTER`` or ``HEARTBEAT``."""
        return HEARTBEAT if self.registered else REGISTER

    def registered_ok(self, sent: float) -> None:
        """Register answered (its map installed)."""
        self.registered = True
        self.last_ok = max(self.last_ok, sent)
        self.backoff_s = 0.1
        self.next_beat = sent + self.interval_s

    def targets(self) -> list[int]:
        """The schedulers the next heartbeat goes to: the current one, or every one while searching."""
        return list(range(self.schedulers)) if self.searching else [self.current]

    def next_scheduler(self) -> None:
        """A register or report to the current scheduler failed: the next one."""
        self.current = (self.current + 1) % self.schedulers

    def beat_due(self, now: float) -> float:
        """Seconds until the next heartbeat may be sent (0: send it now). The cadence does not wait for
        answers; only ``max_in_flight`` unanswered heartbeats per target hold it (an answer or failure frees
        one)."""
        if self.in_flight >= self.max_in_flight * len(self.targets()):
            return self.interval_s
        return max(0.0, self.next_beat - now)

    def beat_sent(self, now: float, calls: int = 1) -> None:
        """A heartbeat went out as ``calls`` calls (one per target)."""
        self.in_flight += calls
        self.next_beat = now + self.interval_s

    def heartbeat_answered(self, sent: float, reregister: bool, which: int | None = None) -> bool:
        """A heartbeat answered (its map, if any, installed) by scheduler ``which``: the one to use from now
        on. True: register again at once."""
        self.in_flight = max(0, self.in_flight - 1)
        self.backoff_s = 0.1
        if which is not None:
            self.current, self.searching = which, False
        if reregister:
            self.registered = False
            return True
        self.last_ok = max(self.last_ok, sent)
        return False

    def heartbeat_failed(self, now: float, which: int | None = None) -> float:
        """A heartbeat to scheduler ``which`` failed: the next one waits the backoff (never longer than the
        interval for a registered server); returns that wait. A failure of the current scheduler, one of
        several, starts a search (``targets``); a failure of another says nothing new."""
        self.in_flight = max(0, self.in_flight - 1)
        if self.schedulers > 1 and (which is None or which == self.current):
            self.searching = True
        wait = self.call_failed()
        self.next_beat = max(self.next_beat, now + wait)
        return wait

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
