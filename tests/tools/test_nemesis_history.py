"""The nemesis's history checker (``tigana.tools.testing.nemesis.history``): against a per-read, per-id reference
model on random histories, on histories a linearizable counter produced (no violation), and on each kind of
violation planted into one (caught)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.tools.testing.nemesis.history import Increment, Read, check_counters

NUM_IDS = 12


def reference(watched, increments, reads):
    """The three checks written out per read and per id, straight from their definitions."""
    stale = phantom = backwards = same = 0
    bad = 0
    for r in reads:
        for w, i in enumerate(watched):
            lower = sum(1 for inc in increments if inc.done is not None and inc.done < r.start and i in inc.ids)
            upper = sum(1 for inc in increments if inc.sent < r.end and i in inc.ids)
            floor = max((o.values[w] for o in reads if o.end < r.start), default=0)
            prev = [o for o in reads if o.reader == r.reader and o.start < r.start]
            s, p, b = r.values[w] < lower, r.values[w] > upper, r.values[w] < floor
            stale, phantom, backwards, bad = stale + s, phantom + p, backwards + b, bad + (s or p or b)
            if prev:
                last = max(prev, key=lambda o: o.start)
                same += r.values[w] < last.values[w]
    return {"stale_reads": stale, "phantom_reads": phantom, "backwards_reads": backwards,
            "backwards_reads_same_reader": same, "linearizability_violations": bad}


def linearizable_history(rng: np.random.Generator, n_ops: int, readers: int = 2):
    """A history of a real counter: each increment takes effect at one instant inside its interval, each read
    returns the counts at one instant inside its own; reads of one reader follow each other."""
    increments, effects = [], []
    for _ in range(n_ops):
        sent = float(rng.uniform(0, 10))
        at = sent + float(rng.uniform(0, 1))
        done = at + float(rng.uniform(0, 1))
        failed = rng.random() < 0.1
        applied = not failed or rng.random() < 0.5
        ids = rng.choice(NUM_IDS, int(rng.integers(1, 5)), replace=False).astype(np.int64)
        increments.append(Increment(ids, sent, None if failed else done))
        if applied:
            effects.append((at, ids))
    reads = []
    for reader in range(readers):
        t = 0.0
        while t < 11:
            start = t + float(rng.uniform(0, 0.5))
            at = start + float(rng.uniform(0, 0.3))
            end = at + float(rng.uniform(0, 0.3))
            counts = np.zeros(NUM_IDS, np.int64)
            for e_at, ids in effects:
                if e_at <= at:
                    counts[ids] += 1
            reads.append(Read(reader, start, end, counts))
            t = end
    return increments, reads


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 25))
def test_the_checker_agrees_with_the_reference_on_random_histories(seed, n_ops):
    rng = np.random.default_rng(seed)
    increments, reads = linearizable_history(rng, n_ops)
    for r in reads:  # scramble some values so that every kind of violation shows up
        noise = rng.integers(-2, 3, NUM_IDS) * (rng.random(NUM_IDS) < 0.2)
        r.values = np.maximum(r.values + noise, 0)
    watched = np.arange(NUM_IDS, dtype=np.int64)
    got = check_counters(watched, increments, reads, NUM_IDS)
    want = reference(watched, increments, reads)
    assert {k: got[k] for k in want} == want


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 40))
def test_a_linearizable_counter_has_no_violation(seed, n_ops):
    increments, reads = linearizable_history(np.random.default_rng(seed), n_ops)
    got = check_counters(np.arange(NUM_IDS, dtype=np.int64), increments, reads, NUM_IDS)
    assert got["linearizability_violations"] == 0 and got["backwards_reads_same_reader"] == 0, got["examples"]
    assert got["checked"] == len(reads) * NUM_IDS


def _one_id_history():
    """id 3: pushed at [1, 2] (acknowledged) and at [5, 6] (failed, never applied)."""
    increments = [Increment(np.array([3]), 1.0, 2.0), Increment(np.array([3, 4]), 5.0, None)]
    return increments, np.array([3, 4], np.int64)


def test_a_read_that_misses_an_acknowledged_push_is_stale():
    increments, watched = _one_id_history()
    reads = [Read(0, 3.0, 3.5, np.array([0, 0]))]
    got = check_counters(watched, increments, reads, 10)
    assert got["stale_reads"] == 1 and got["linearizability_violations"] == 1 and got["max_read_deficit"] == 1
    assert got["examples"][0] == {"id": 3, "kind": "stale", "value": 0, "bound": 1, "at_s": 2.0, "reader": 0}
    # overlapping the push, either value is fine
    assert check_counters(watched, increments, [Read(0, 1.5, 1.7, np.array([0, 0]))], 10)[
        "linearizability_violations"] == 0


def test_a_read_of_a_push_never_sent_is_a_phantom():
    increments, watched = _one_id_history()
    assert check_counters(watched, increments, [Read(0, 3.0, 3.5, np.array([2, 0]))], 10)["phantom_reads"] == 1
    # the failed push was sent by 5.5: reading it applied is allowed (once)
    ok = check_counters(watched, increments, [Read(0, 5.2, 5.5, np.array([2, 1]))], 10)
    assert ok["linearizability_violations"] == 0
    assert check_counters(watched, increments, [Read(0, 5.2, 5.5, np.array([3, 1]))], 10)["phantom_reads"] == 1


def test_a_value_that_runs_backwards_is_caught_across_and_within_readers():
    increments, watched = _one_id_history()
    # reader 1 saw the failed push applied; a later read by reader 0 does not: it ran backwards
    reads = [Read(1, 5.5, 5.8, np.array([2, 1])), Read(0, 6.0, 6.2, np.array([1, 0]))]
    got = check_counters(watched, increments, reads, 10)
    assert got["backwards_reads"] == 2 and got["backwards_reads_same_reader"] == 0 and got["stale_reads"] == 0
    reads[1].reader = 1
    assert check_counters(watched, increments, reads, 10)["backwards_reads_same_reader"] == 2
    # overlapping reads may be ordered either way
    reads = [Read(1, 5.5, 6.1, np.array([2, 1])), Read(0, 6.0, 6.2, np.array([1, 0]))]
    assert check_counters(watched, increments, reads, 10)["linearizability_violations"] == 0


def test_an_empty_history_checks_nothing():
    got = check_counters(np.arange(4), [], [], 4)
    assert got["reads"] == 0 and got["linearizability_violations"] == 0
