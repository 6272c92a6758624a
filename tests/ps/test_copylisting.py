"""The listing the slot copies of one map install share (``ps/shard/copylisting.py``): made once while its users
hold it, freed when the last one leaves, made again for a user that comes later."""

from __future__ import annotations

import threading

from tigana.ps.shard.copylisting import SharedListings


def test_copies_that_start_together_share_one_listing_and_the_last_frees_it() -> None:
    listings = SharedListings()
    made = []
    gate = threading.Event()
    inside = threading.Barrier(4)
    seen = []

    def make() -> list[int]:
        gate.wait(5)  # the first user is still making it while the others arrive
        made.append(1)
        return [1, 2, 3]

    def copy() -> None:
        with listings.shared(("t", 7), make) as value:
            seen.append(value)
            inside.wait(5)  # every user holds it at once

    threads = [threading.Thread(target=copy) for _ in range(4)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert len(made) == 1 and all(v is seen[0] for v in seen) and len(seen) == 4
    assert len(listings) == 0  # freed with its last user
    # a copy of the same install that comes after the others left makes a new (later, as good) listing
    with listings.shared(("t", 7), make) as value:
        assert value == [1, 2, 3] and len(made) == 2
    # another install or table never shares
    with listings.shared(("t", 8), make), listings.shared(("u", 7), make):
        assert len(made) == 4 and len(listings) == 2


def test_a_failed_listing_is_made_again_by_the_next_user() -> None:
    listings = SharedListings()
    calls = []

    def make() -> list[int]:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk")
        return [5]

    try:
        with listings.shared("k", make):
            raise AssertionError("unreachable")
    except OSError:
        pass
    with listings.shared("k", make) as value:
        assert value == [5] and len(calls) == 2
    assert len(listings) == 0
