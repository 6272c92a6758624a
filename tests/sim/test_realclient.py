"""The simulator drives the real client (``tigana.tools.testing.sim.realclient``): the
trainer's own routing, parts in flight, retries and sessions over the world's network and clock keep every
invariant, replay exactly, and a client that breaks exactly-once is caught."""

from __future__ import annotations

from typing import Any

import pytest

from tigana.ps.client import inflight
from tigana.tools.testing.sim import Settings, realclient, run_seed
from tigana.tools.testing.sim.realclient import RealSimClient

REAL = Settings(busy_s=4.0, faults=True, ops_per_s=1.0)


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch) -> list[RealSimClient]:
    """Every ``RealSimClient`` a run makes (to read its real client's counters afterwards)."""
    made: list[RealSimClient] = []
    init = RealSimClient.__init__

    def keep(self: RealSimClient, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(realclient.RealSimClient, "__init__", keep)
    return made


@pytest.mark.parametrize("seed", [0, 2])
def test_the_real_client_under_faults_keeps_every_invariant(seed: int, clients: list[RealSimClient]) -> None:
    out = run_seed(seed, REAL)
    assert out.ok, (out.violations, "\n".join(out.minimal_trace(120)))
    assert out.acked > 0 and out.pulls > 0 and out.convergence_s is not None
    stats = [c.client.stats() for c in clients if c.client is not None]
    assert len(stats) == REAL.clients
    # the client's own failure handling ran: parts retried, maps followed
    assert sum(s["retries"] for s in stats) > 0, stats
    assert all(s["map_refreshes"] > 1 for s in stats), stats


def test_the_real_client_with_planned_operations_alone_fails_no_push() -> None:
    out = run_seed(10, Settings(busy_s=4.0, faults=False, ops_per_s=1.0))
    assert out.ok, (out.violations, "\n".join(out.minimal_trace(120)))
    assert out.failed_pushes == 0 and out.acked > 0
    assert out.demotions == 0


def test_a_seed_with_the_real_client_replays_exactly() -> None:
    settings = Settings(busy_s=3.0)
    a, b = run_seed(5, settings), run_seed(5, settings)
    assert a.acked > 0
    assert a.ops == b.ops and a.steps == b.steps and a.acked == b.acked and a.pulls == b.pulls
    assert a.trace == b.trace


def test_a_retry_under_a_new_seq_is_caught_as_a_double_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    # The mutation (test code only): a failed part goes again under a new seq, so the servers cannot tell it
    # from a new push, and an attempt whose answer was lost is applied twice.
    again = inflight.PushOp._again

    def new_seq(self: inflight.PushOp, lo: int, hi: int, client_id: str | None = None) -> Any:
        return again(self, lo, hi, self.client_id)
    monkeypatch.setattr(inflight.PushOp, "_again", new_seq)
    found = [v for seed in (0, 2) for v in run_seed(seed, REAL).violations]
    assert found and all(v.startswith("S6") for v in found), found
