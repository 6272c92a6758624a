"""The checkers check again only what a step changed (``memo.Passed``): a skip must never hide a violation. Under
``Passed.verify`` every subject is checked and a violation found on one the memo would have skipped raises."""

from __future__ import annotations

import numpy as np
import pytest

from tigana.ps.shard.dedup import DedupWindow
from tigana.tools.testing.sim import Settings, run_seed
from tigana.tools.testing.sim.memo import Passed


def test_a_subject_is_skipped_only_with_the_same_objects_and_equal_values() -> None:
    passed, table, other = Passed(), np.zeros(3), np.zeros(3)
    assert not passed.again("s0", (table,), (1, b"x"))
    passed.passed("s0", (table,), (1, b"x"))
    assert passed.again("s0", (table,), (1, b"x"))
    assert not passed.again("s0", (other,), (1, b"x"))  # an equal array is another object: checked again
    assert not passed.again("s0", (table,), (2, b"x"))
    assert not passed.again("s1", (table,), (1, b"x"))
    passed.failed("s0", "a violation")
    assert not passed.again("s0", (table,), (1, b"x"))


def test_under_verify_a_skip_that_would_hide_a_violation_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Passed, "verify", True)
    passed, table = Passed(), np.zeros(3)
    passed.passed("s0", (table,), (1,))
    assert not passed.again("s0", (table,), (1,))  # checked all the same
    with pytest.raises(AssertionError, match="skipped 's0' as unchanged"):
        passed.failed("s0", "S6: applied twice")
    assert not passed.again("s1", (table,), (1,))
    passed.failed("s1", "S1: lost")  # never passed: nothing would have skipped it


def test_no_skip_hides_a_planted_duplicate(monkeypatch: pytest.MonkeyPatch) -> None:
    """S6 planted (a duplicate push applied again), every subject checked: the violation is found, and never on
    a copy the memo would have skipped."""
    monkeypatch.setattr(Passed, "verify", True)
    monkeypatch.setattr(DedupWindow, "applied", lambda self, client_id, seq, slots: np.zeros(len(slots), bool))
    settings = dict(busy_s=5.0, faults=True, ops_per_s=1.5, converge_s=20.0)
    found = [run_seed(seed, Settings(**settings)).violations[:1] for seed in range(3)]
    assert any(v and v[0].startswith("S6:") for v in found), found


def test_every_skip_is_of_a_subject_whose_reads_did_not_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every subject checked, each skip the memo would have made is compared with what the checker reads, read
    afresh (``Passed.verify``): a memo key missing an input (the server's stamp, the ledger's books) fails here."""
    monkeypatch.setattr(Passed, "verify", True)
    for seed in range(2):
        out = run_seed(seed, Settings(busy_s=8.0, converge_s=20.0))
        assert out.ok, out.violations
