"""The checkpoint's pieces alone, against reference models: the row codecs, a part's files, and the sans-IO
CutRound coordinator (the cluster paths are in test_checkpoint.py and test_checkpoint_cut.py)."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tigana.embeddings import RowBatch
from tigana.ps.client.checkpoint.cutround import Commit, CutRound, Failed, Read, Release
from tigana.ps.client.checkpoint.parts import PartWriter, iter_part, part_deleted, verify_part
from tigana.ps.client.checkpoint.quantize import decode, encode
from tigana.ps.errors import DataLoss, InvalidArgument

_finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
_rows = hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=9), elements=_finite32)


@settings(max_examples=200, deadline=None)
@given(_rows)
@example(np.array([[0.0, 1e-45]], np.float32))  # a scale below float32's smallest subnormal
def test_int8_keeps_every_value_within_half_a_step_of_its_row(values: np.ndarray) -> None:
    arrays = encode(values, "int8", table="t", field="weights")
    back = decode(arrays, "weights")
    assert back.shape == values.shape and back.dtype == np.float32 and np.isfinite(back).all()
    if values.size:
        # plus float32's half-ulp of each value (at least a subnormal's): the rounding of decode's final cast
        bound = (arrays["weights_scale"].astype(np.float64)[:, None] / 2
                 + np.abs(values).astype(np.float64) * 2.0**-23 + 2.0**-149)
        assert (np.abs(back.astype(np.float64) - values.astype(np.float64)) <= bound).all()
        # a constant row comes back exactly
        const = (values == values[:, :1]).all(axis=1)
        assert (back[const] == values[const]).all()


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=9),
                  elements=st.floats(-65504, 65504, width=32)))
def test_fp16_is_the_cast(values: np.ndarray) -> None:
    back = decode(encode(values, "fp16", table="t", field="state"), "state")
    assert np.array_equal(back, values.astype(np.float16).astype(np.float32))


@settings(max_examples=50, deadline=None)
@given(_rows, st.sampled_from(["none", "fp16", "int8"]))
def test_none_is_exact_and_every_codec_names_what_it_refuses(values: np.ndarray, codec: str) -> None:
    assert np.array_equal(decode(encode(values, "none", table="t", field="w"), "w"), values)
    if values.size:
        bad = values.copy()
        bad.flat[0] = np.nan
        if codec != "none":
            with pytest.raises(InvalidArgument, match="table 't': field 'w'.*not finite"):
                encode(bad, codec, table="t", field="w")
    with pytest.raises(InvalidArgument, match="'quantize'"):
        encode(values, "int4", table="t", field="w")


def test_fp16_refuses_values_beyond_its_range() -> None:
    with pytest.raises(InvalidArgument, match="table 'big': field 'weights'.*fp16"):
        encode(np.array([[1e6, 0.0]], np.float32), "fp16", table="big", field="weights")


def _batch(draw: st.DrawFn, n: int, dim: int, width: int) -> RowBatch:
    ids = np.array(draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=n, max_size=n, unique=True)), np.int64)
    counts = draw(hnp.arrays(np.int64, n, elements=st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 2**62))))
    steps = draw(hnp.arrays(np.int64, n, elements=st.integers(0, 2**40)))
    ticks = draw(hnp.arrays(np.int64, n, elements=st.integers(0, 2**33)))
    base = draw(st.sampled_from([0.0, 1.7e9]))
    # the engine's times are whole 1/128 s ticks; an odd one (not a tick) must round-trip too
    times = base + ticks / 128.0
    if n and draw(st.booleans()):
        times[0] = base + 0.001
    weights = draw(hnp.arrays(np.float32, (n, dim), elements=_finite32))
    state = draw(hnp.arrays(np.float32, (n, width), elements=_finite32))
    return RowBatch(ids, weights, state, counts, steps, times)


@st.composite
def _parts(draw: st.DrawFn) -> tuple[list[RowBatch], int, int]:
    dim, width = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    return [_batch(draw, draw(st.integers(0, 6)), dim, width) for _ in range(draw(st.integers(0, 4)))], dim, width


@settings(max_examples=60, deadline=None)
@given(_parts(), st.lists(st.integers(-2**63, 2**63 - 1), max_size=5, unique=True))
def test_a_part_reads_back_exactly_what_was_written(tmp_path_factory: pytest.TempPathFactory,
                                                    part: tuple[list[RowBatch], int, int],
                                                    deleted: list[int]) -> None:
    batches, dim, width = part
    root = tmp_path_factory.mktemp("part")
    writer = PartWriter(root, "t/p0", table="t")
    for b in batches:
        writer.add(b)
    entry = writer.finish(np.array(sorted(deleted), np.int64))
    verify_part(root, entry)
    read = list(iter_part(root, entry, dim=dim, state_width=width))
    want = [b for b in batches if len(b)]
    got = RowBatch.concat(read) if read else RowBatch.empty(dim, width)
    ref = RowBatch.concat(want) if want else RowBatch.empty(dim, width)
    assert entry["rows"] == len(ref)
    for field in ("ids", "weights", "state", "update_count", "last_step", "last_time"):
        assert np.array_equal(getattr(got, field), getattr(ref, field)), field
    assert part_deleted(root, entry).tolist() == sorted(deleted)


def test_a_damaged_part_file_is_named(tmp_path) -> None:
    writer = PartWriter(tmp_path, "t/p0", table="t")
    writer.add(RowBatch(np.arange(3), np.ones((3, 2), np.float32), np.zeros((3, 0), np.float32),
                        np.ones(3, np.int64), np.ones(3, np.int64), np.full(3, 5.0)))
    entry = writer.finish()
    path = tmp_path / "t/p0" / entry["chunks"][0]["file"]
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataLoss, match="chunk-00000.npz does not match its checksum"):
        verify_part(tmp_path, entry)


# --- CutRound against its contract: commit only once every server is prepared; read only a whole cut (one epoch,
# --- the led slots a partition); any failure releases every server touched, exactly once.

@st.composite
def _round_events(draw: st.DrawFn) -> tuple[list[str], int, list[tuple]]:
    servers = [f"s{i}" for i in range(draw(st.integers(1, 4)))]
    num_slots = draw(st.integers(1, 12))
    owner = draw(st.lists(st.sampled_from(servers), min_size=num_slots, max_size=num_slots))
    events: list[tuple] = []
    for s in draw(st.permutations(servers)):
        events.append(("refused", s) if draw(st.integers(0, 9)) == 0 else ("prepared", s))
    for s in draw(st.permutations(servers)):
        epoch = 7 if draw(st.integers(0, 9)) else 8
        slots = [i for i, o in enumerate(owner) if o == s]
        if draw(st.integers(0, 9)) == 0:
            slots = slots + [draw(st.integers(0, num_slots - 1))]  # a slot led twice
        if slots and draw(st.integers(0, 9)) == 0:
            slots = slots[1:]  # a slot led by nobody
        events.append(("committed", s, epoch, slots))
    return servers, num_slots, events


@settings(max_examples=300, deadline=None)
@given(_round_events())
def test_cut_round_reads_only_a_whole_cut_and_releases_all_it_touched(case) -> None:
    servers, num_slots, events = case
    rnd = CutRound(servers, num_slots)
    actions: list = []
    prepared: set[str] = set()
    touched: set[str] = set()
    commits: dict[str, tuple[int, list[int]]] = {}
    for ev in events:
        if ev[0] == "prepared":
            prepared.add(ev[1])
            touched.add(ev[1])
            got = rnd.prepared(ev[1])
        elif ev[0] == "refused":
            touched.add(ev[1])
            got = rnd.refused(ev[1], "no")
        else:
            # the driver sends CommitCut only after the Commit action
            if not any(isinstance(a, Commit) for a in actions):
                continue
            commits[ev[1]] = (ev[2], ev[3])
            got = rnd.committed(ev[1], ev[2], np.array(ev[3], np.int64))
        for a in got:
            if isinstance(a, Commit):
                assert prepared == set(servers) and a.servers == tuple(servers)
        actions += got
    kinds = [type(a) for a in actions]
    assert kinds.count(Commit) <= 1 and kinds.count(Failed) <= 1 and kinds.count(Read) <= 1
    whole = (len(commits) == len(servers) and len({e for e, _ in commits.values()}) == 1
             and sorted(s for _, sl in commits.values() for s in sl) == list(range(num_slots)))
    if any(ev[0] == "refused" for ev in events):
        assert Read not in kinds and Commit not in kinds
    assert (Read in kinds) == whole
    if Failed in kinds:
        i = kinds.index(Failed)
        assert isinstance(actions[i - 1], Release)  # released before the round is given up
        released = [x for a in actions if isinstance(a, Release) for x in a.servers]
        assert sorted(released) == sorted(touched | set(commits))  # each server touched, once
        assert rnd.phase == "failed"
    elif Read in kinds:
        assert rnd.phase == "read"
        assert rnd.done() == [Release(tuple(sorted(servers)))]


def test_cut_round_needs_a_server() -> None:
    with pytest.raises(ValueError):
        CutRound([], 4)
