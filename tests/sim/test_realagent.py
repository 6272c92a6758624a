"""The simulator running the daemon's membership agent (``Settings.real_agent``: ``tigana.tools.sim.realagent``):
registration, heartbeats, the lease and the map refresh a report's answer asks for are ``Agent``'s own code,
over the world's network and clock; every invariant holds and a seed replays exactly. With the real client and
the stream lanes paced as the daemon's senders pace them (``Settings.real_sender``)."""

from __future__ import annotations

from typing import Any

import pytest

from tigana.ps.membership.agent import Agent
from tigana.tools.sim import Settings, run_seed

REAL = Settings(busy_s=4.0, faults=True, ops_per_s=1.0, real_client=True, real_agent=True, real_sender=True)


@pytest.mark.parametrize("seed", [0, 3])
def test_the_real_agent_client_and_sender_under_faults_keep_every_invariant(seed: int,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    newer: list[str] = []  # reports whose answer named a map newer than the reporter's
    report = Agent._report

    def spy(self: Agent, method: str, request: Any) -> Any:
        reply = report(self, method, request)
        if reply is not None and reply.epoch > self.service.epoch:
            newer.append(method)
        return reply
    monkeypatch.setattr(Agent, "_report", spy)
    out = run_seed(seed, REAL)
    assert out.ok, (out.violations, "\n".join(out.minimal_trace(120)))
    assert out.acked > 0 and out.convergence_s is not None
    assert any("registered with the scheduler" in line for line in out.trace)  # the agent's own log line
    # the path that hid the install deadlock ran: a report's answer handed a newer epoch to the refresher
    assert newer, "no report was answered with a newer epoch"


def test_a_seed_with_the_real_agent_replays_exactly() -> None:
    settings = Settings(busy_s=3.0, real_agent=True, real_sender=True)
    a, b = run_seed(5, settings), run_seed(5, settings)
    assert a.acked > 0
    assert a.ops == b.ops and a.steps == b.steps and a.acked == b.acked
    assert a.trace == b.trace
