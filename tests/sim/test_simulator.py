"""The deterministic simulator (``tigana.tools.sim``): a fixed set of seeds, with and without faults, every
invariant of docs/replication.md checked after every step; a seed replays exactly."""

from __future__ import annotations

import pytest

from tigana.tools.sim import Settings, run_seed


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_seeds_with_faults_keep_every_invariant(seed: int) -> None:
    out = run_seed(seed, Settings(busy_s=6.0, faults=True, ops_per_s=1.0))
    assert out.ok, (out.violations, "\n".join(out.trace[-80:]))
    assert out.acked > 0 and out.convergence_s is not None


@pytest.mark.parametrize("seed", [10, 11])
def test_planned_operations_alone_fail_no_push(seed: int) -> None:
    out = run_seed(seed, Settings(busy_s=6.0, faults=False, ops_per_s=1.0))
    assert out.ok, (out.violations, "\n".join(out.trace[-80:]))
    assert out.failed_pushes == 0 and out.acked > 0
    assert not [line for line in out.trace if "out of the in-sync set" in line]  # no failure, no demotion


def test_a_seed_replays_exactly() -> None:
    a = run_seed(5, Settings(busy_s=3.0))
    b = run_seed(5, Settings(busy_s=3.0))
    assert a.ops == b.ops and a.steps == b.steps and a.acked == b.acked
