"""DedupWindow against a simple reference: every key recorded within the window is seen; new keys are not."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.ps.dedup import DedupWindow


def test_replayed_key_is_seen_and_empty_client_opts_out() -> None:
    w = DedupWindow(size=4)
    assert not w.seen("a", 1, 0)
    w.record("a", 1, 0, 10)
    assert w.seen("a", 1, 0)
    assert not w.seen("a", 1, 1)      # another part of the same push
    assert not w.seen("b", 1, 0)      # another client
    w.record("", 5, 0)
    assert not w.seen("", 5, 0)
    assert len(w) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 3)), min_size=1, max_size=200),
       st.integers(1, 16))
def test_recent_keys_seen_new_keys_not(steps, size) -> None:
    """Clients push increasing seqs with a few parts each; the last ``size`` keys of a client are always seen,
    keys never recorded above the floor are never seen."""
    w = DedupWindow(size=size)
    history: dict[str, list[tuple[int, int]]] = {}
    next_seq: dict[str, int] = {}
    for client, parts in steps:
        seq = next_seq.get(client, 0)
        next_seq[client] = seq + 1
        for part in range(parts + 1):
            assert not w.seen(client, seq, part)
            w.record(client, seq, part)
            history.setdefault(client, []).append((seq, part))
    for client, keys in history.items():
        for seq, part in keys[-size:]:
            assert w.seen(client, seq, part)
        assert not w.seen(client, next_seq[client], 0)


def test_state_round_trip() -> None:
    w = DedupWindow(size=3)
    for seq in range(5):
        w.record("x", seq, 0, seq)
    back = DedupWindow.from_state(w.to_state())
    for seq in range(5):
        assert back.seen("x", seq, 0) == w.seen("x", seq, 0)
    assert not back.seen("x", 5, 0)
    assert len(back) == len(w) == 3


def test_client_count_is_bounded() -> None:
    w = DedupWindow(size=2, max_clients=3)
    for c in range(10):
        w.record(f"c{c}", 0, 0)
    assert len(w) == 3
    assert w.seen("c9", 0, 0) and not w.seen("c0", 0, 0)
