"""The shard map (``tigana.ps.routing.ShardMap``), slot grouping and slot lists, and the map's wire form."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana.embeddings import Adagrad, TableConfig
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import InvalidArgument
from tigana.ps.routing import (
    CATCHING_UP,
    IN_SYNC,
    NO_SERVER,
    ServerEntry,
    ShardMap,
    TableDef,
    format_slots,
    group_keys,
    mix64,
    parse_slots,
    slot_of,
)
from tigana.ps.wire import cluster as cluster_wire

SERVERS = tuple(ServerEntry(f"s{i}", f"127.0.0.1:{7000 + i}", f"boot{i}") for i in range(4))


def base_map(num_slots: int = 8) -> ShardMap:
    """Epoch 2: 4 servers; slot s led by s % 4 with a replica on (s + 1) % 4, all in sync."""
    m = ShardMap.empty(num_slots, replicas=1, cluster_id="c1").evolve(servers=SERVERS)
    slots = np.arange(num_slots)
    copies = np.stack([slots % 4, (slots + 1) % 4], axis=1).astype(np.int32)
    return m.evolve(copies=copies, states=np.zeros(copies.shape, np.uint8))


# --- evolve -------------------------------------------------------------------------------------------------
def test_empty_map():
    m = ShardMap.empty(16, replicas=2, cluster_id="x")
    assert m.epoch == 0 and m.servers == () and m.width == 1 and m.replicas == 2 and m.cluster_id == "x"
    assert (m.copies == NO_SERVER).all() and (m.slot_epochs == 0).all()


def test_evolve_bumps_epoch_and_marks_changed_slots_only():
    m = base_map()
    assert m.epoch == 2 and (m.slot_epochs == 2).all()  # the first placement touched every slot
    servers_only = m.evolve(servers=m.replace_server(3, up=False))
    assert servers_only.epoch == 3 and not servers_only.servers[3].up
    np.testing.assert_array_equal(servers_only.slot_epochs, m.slot_epochs)

    copies = np.array(m.copies)
    copies[5, 1] = 0  # slot 5: replica 2 -> 0
    m2 = servers_only.evolve(copies=copies)
    assert m2.epoch == 4
    assert m2.slot_epochs[5] == 4
    assert (np.delete(m2.slot_epochs, 5) == 2).all()

    states = np.array(m2.states)
    states[6, 1] = CATCHING_UP  # slot 6: a state change counts too
    m3 = m2.evolve(states=states)
    assert m3.slot_epochs[6] == 5 and m3.slot_epochs[5] == 4
    assert (np.delete(m3.slot_epochs, [5, 6]) == 2).all()

    # the same placement written with holes elsewhere is no change after compaction
    padded = np.concatenate([np.array(m3.copies)[:, :1], np.full((8, 1), NO_SERVER, np.int32),
                             np.array(m3.copies)[:, 1:]], axis=1)
    padded_states = np.concatenate([np.array(m3.states)[:, :1], np.zeros((8, 1), np.uint8),
                                    np.array(m3.states)[:, 1:]], axis=1)
    m4 = m3.evolve(copies=padded, states=padded_states)
    assert m4.epoch == 6
    np.testing.assert_array_equal(m4.copies, m3.copies)
    np.testing.assert_array_equal(m4.slot_epochs, m3.slot_epochs)
    # other fields carry over; replicas and tables can be replaced
    assert m4.cluster_id == "c1" and m4.servers == m3.servers and m4.replicas == 1
    t = TableDef(TableConfig("t", 4))
    m5 = m4.evolve(replicas=2, tables={"t": t})
    assert m5.replicas == 2 and m5.tables == {"t": t}
    np.testing.assert_array_equal(m5.slot_epochs, m4.slot_epochs)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_slots=st.integers(1, 64), width=st.integers(1, 4))
def test_evolve_slot_epochs_property(seed, num_slots, width):
    """slot_epochs[s] becomes the new epoch exactly when slot s's compacted (copies, states) changed."""
    rng = np.random.default_rng(seed)
    m = ShardMap.empty(num_slots).evolve(servers=SERVERS)

    def random_placement():
        c = np.full((num_slots, width), NO_SERVER, np.int32)
        s = np.zeros((num_slots, width), np.uint8)
        for slot in range(num_slots):
            k = int(rng.integers(0, min(width, 4) + 1))
            cols = np.sort(rng.permutation(width)[:k])
            c[slot, cols] = rng.permutation(4)[:k]
            s[slot, cols] = rng.integers(0, 2, k)
        return c, s

    def canon(mm: ShardMap, slot: int) -> tuple:
        row, srow = mm.copies[slot], mm.states[slot]
        return (int(row[0]), tuple((int(x), int(y)) for x, y in zip(row[1:], srow[1:], strict=True) if x >= 0))

    for _ in range(3):
        c, s = random_placement()
        keep = rng.random(num_slots) < 0.5  # half the slots unchanged
        c[keep] = NO_SERVER
        s[keep] = 0
        old_c, old_s = np.array(m.copies), np.array(m.states)
        w = max(width, old_c.shape[1])
        c = np.pad(c, ((0, 0), (0, w - c.shape[1])), constant_values=NO_SERVER)
        s = np.pad(s, ((0, 0), (0, w - s.shape[1])))
        c[keep, :old_c.shape[1]], s[keep, :old_s.shape[1]] = old_c[keep], old_s[keep]
        new = m.evolve(copies=c, states=s)
        assert new.epoch == m.epoch + 1
        for slot in range(num_slots):
            changed = canon(new, slot) != canon(m, slot)
            assert new.slot_epochs[slot] == (new.epoch if changed else m.slot_epochs[slot]), slot
            if keep[slot]:
                assert not changed
        # compacted: primary in column 0, present replicas first, no empty column
        cols = np.asarray(new.copies)
        present = cols[:, 1:] >= 0
        assert (np.diff(present.astype(int), axis=1) <= 0).all()
        assert new.width == 1 or present[:, -1].any()
        assert ((cols[:, 0] < 0) | (new.states[:, 0] == IN_SYNC)).all()
        assert (new.states[cols < 0] == 0).all()
        m = new


def test_arrays_are_read_only_and_owned():
    copies = np.array([[0, 1], [1, NO_SERVER]], np.int32)
    m = ShardMap(1, 2, 1, SERVERS[:2], copies, np.zeros((2, 2), np.uint8), np.zeros(2, np.uint64))
    for a in (m.copies, m.states, m.slot_epochs):
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0] = 1
    copies[0, 0] = 1  # the caller's array is not shared
    assert m.copies[0, 0] == 0
    with pytest.raises(ValueError):  # frozen dataclass fields, read-only arrays: also via evolve results
        m.evolve().copies[0, 0] = 3


def test_compact_keeps_primary_in_column_zero_and_trims():
    m = ShardMap.empty(3).evolve(servers=SERVERS)
    copies = np.array([[NO_SERVER, NO_SERVER, 2, NO_SERVER],   # no primary, one catching-up copy
                       [0, NO_SERVER, NO_SERVER, 1],
                       [3, NO_SERVER, NO_SERVER, NO_SERVER]], np.int32)
    states = np.array([[1, 0, CATCHING_UP, 0], [1, 0, 0, CATCHING_UP], [0, 0, 0, 0]], np.uint8)
    m = m.evolve(copies=copies, states=states)
    np.testing.assert_array_equal(m.copies, [[NO_SERVER, 2], [0, 1], [3, NO_SERVER]])
    # a primary is in sync by definition; empty places hold 0
    np.testing.assert_array_equal(m.states, [[0, CATCHING_UP], [IN_SYNC, CATCHING_UP], [IN_SYNC, 0]])
    np.testing.assert_array_equal(m.primary_of_slot(), [NO_SERVER, 0, 3])
    only_primaries = m.evolve(copies=np.array([[1, NO_SERVER], [0, NO_SERVER], [2, NO_SERVER]], np.int32),
                              states=np.zeros((3, 2), np.uint8))
    assert only_primaries.width == 1


def test_width_one_primaries_are_in_sync():
    """Regression: with one column (no replica anywhere) a primary is in sync too, whatever state was passed."""
    m = ShardMap.empty(2).evolve(servers=SERVERS)
    m = m.evolve(copies=np.array([[0], [NO_SERVER]], np.int32), states=np.array([[CATCHING_UP], [1]], np.uint8))
    np.testing.assert_array_equal(m.states, [[IN_SYNC], [0]])
    np.testing.assert_array_equal(m.in_sync_count(), [1, 0])


def test_queries():
    m = ShardMap.empty(4).evolve(servers=SERVERS)
    m = m.evolve(copies=np.array([[0, 1, 2], [1, 0, NO_SERVER], [NO_SERVER, 2, NO_SERVER], [2, 0, 1]], np.int32),
                 states=np.array([[0, 0, 1], [0, 1, 0], [0, 1, 0], [0, 0, 0]], np.uint8))
    np.testing.assert_array_equal(m.in_sync_count(), [2, 1, 0, 3])
    np.testing.assert_array_equal(m.holds(0), [True, True, False, True])
    np.testing.assert_array_equal(m.holds(3), [False] * 4)
    np.testing.assert_array_equal(m.leads(2), [False, False, False, True])
    np.testing.assert_array_equal(m.copy_state(0), [IN_SYNC, CATCHING_UP, -1, IN_SYNC])
    np.testing.assert_array_equal(m.copy_state(2), [CATCHING_UP, -1, CATCHING_UP, IN_SYNC])
    np.testing.assert_array_equal(m.copy_state(3), [-1] * 4)
    assert m.copy_state(0).dtype == np.int8
    assert m.index_of("s2") == 2 and m.index_of("nope") == -1
    assert m.address(1) == "127.0.0.1:7001"
    np.testing.assert_array_equal(m.slots_of(m.holds(1)), [0, 1, 3])
    s = m.summary()
    assert s["servers_up"] == 4 and s["unavailable_slots"] == 1 and s["catching_up"] == 3
    assert s["degraded_slots"] == 1  # replicas=0: only slot 2 (no in-sync copy) is below 1 + 0


def test_post_init_rejects_bad_shapes():
    ok = dict(epoch=1, num_slots=2, replicas=0, servers=SERVERS[:1], copies=np.zeros((2, 1), np.int32),
              states=np.zeros((2, 1), np.uint8), slot_epochs=np.zeros(2, np.uint64))
    ShardMap(**ok)
    for change in (dict(copies=np.zeros((3, 1), np.int32)), dict(states=np.zeros((2, 2), np.uint8)),
                   dict(slot_epochs=np.zeros(3, np.uint64)), dict(copies=np.ones((2, 1), np.int32)),
                   dict(copies=np.full((2, 1), -2, np.int32)), dict(copies=np.zeros((2, 0), np.int32))):
        with pytest.raises(ValueError):
            ShardMap(**{**ok, **change})


# --- group_keys ---------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(num_owners=st.integers(1, 8), data=st.data())
def test_group_keys_matches_reference(num_owners, data):
    owners = np.array(data.draw(st.lists(st.integers(-1, num_owners - 1), min_size=0, max_size=200)), np.int32)
    key_of_slot, primary_starts = group_keys(owners, num_owners)
    rank = lambda s: (owners[s] if owners[s] >= 0 else num_owners, s)  # noqa: E731
    order = sorted(range(owners.shape[0]), key=rank)
    expected = np.empty(owners.shape[0], np.int64)
    expected[order] = np.arange(owners.shape[0])
    np.testing.assert_array_equal(key_of_slot, expected)
    assert primary_starts.shape == (num_owners + 2,)
    for o in range(num_owners + 1):  # owner num_owners: the slots without a primary, last
        members = [s for s in range(owners.shape[0]) if (owners[s] if owners[s] >= 0 else num_owners) == o]
        lo, hi = int(primary_starts[o]), int(primary_starts[o + 1])
        assert sorted(key_of_slot[members].tolist()) == list(range(lo, hi))
        assert [int(key_of_slot[s]) for s in members] == list(range(lo, hi))  # by slot within an owner
    assert primary_starts[0] == 0 and primary_starts[-1] == owners.shape[0]


def test_group_keys_example():
    keys, starts = group_keys(np.array([1, -1, 0, 1, 0], np.int32), 2)
    np.testing.assert_array_equal(keys, [2, 4, 0, 3, 1])
    np.testing.assert_array_equal(starts, [0, 2, 4, 5])


# --- slot lists ---------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(num_slots=st.integers(1, 300), data=st.data())
def test_format_parse_round_trip(num_slots, data):
    slots = data.draw(st.sets(st.integers(0, num_slots - 1), min_size=1))
    text = format_slots(slots)
    mask = parse_slots(text, num_slots)
    assert set(np.flatnonzero(mask).tolist()) == slots
    assert format_slots(np.flatnonzero(mask)) == text  # canonical
    assert text.count(",") < len(slots)


def test_format_parse_examples():
    assert format_slots([7, 0, 2, 1, 1]) == "0-2,7"
    assert format_slots([]) == ""  # note: "" parses as every slot, so the empty set does not round-trip
    assert parse_slots("", 4).all() and parse_slots("all", 4).all()
    np.testing.assert_array_equal(parse_slots(" 1-2 , 0 ", 4), [True, True, True, False])
    for bad in ("3-1", "0-4", "-1", "x"):
        with pytest.raises(ValueError):
            parse_slots(bad, 4)


# --- wire ---------------------------------------------------------------------------------------------------
def wire_map() -> ShardMap:
    m = base_map(16)
    copies = np.array(m.copies)
    copies[3] = [NO_SERVER, 2]
    states = np.array(m.states)
    states[3, 1] = states[4, 1] = CATCHING_UP
    tables = {"emb": TableDef(TableConfig("emb", 8, optimizer=Adagrad(lr=0.1), seed=7), "sync", 2),
              "side": TableDef(TableConfig("side", 3, dtype="float16"), "async", 1)}
    return m.evolve(copies=copies, states=states, tables=tables,
                    servers=m.replace_server(2, up=False, address="10.0.0.2:9"))


def test_wire_round_trip():
    m = wire_map()
    msg = cluster_wire.map_to_pb(m)
    back = cluster_wire.map_from_pb(pb.ShardMap.FromString(msg.SerializeToString()))
    assert (back.epoch, back.num_slots, back.replicas, back.cluster_id) == (m.epoch, m.num_slots, m.replicas, "c1")
    assert back.servers == m.servers
    assert back.tables == m.tables
    for name in ("copies", "states", "slot_epochs"):
        a, b = getattr(m, name), getattr(back, name)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
        assert not b.flags.writeable


@pytest.mark.parametrize("field,name", [("copies", "ShardMap.copies"), ("states", "ShardMap.states"),
                                        ("slot_epochs", "ShardMap.slot_epochs")])
@pytest.mark.parametrize("cut", [1, 4, 8])
def test_map_from_pb_rejects_wrong_lengths(field, name, cut):
    msg = cluster_wire.map_to_pb(wire_map())
    data = getattr(msg, field)
    setattr(msg, field, data[:-cut])
    with pytest.raises(InvalidArgument, match=name):
        cluster_wire.map_from_pb(msg)
    setattr(msg, field, data + b"\0" * cut)
    with pytest.raises(InvalidArgument, match=name):
        cluster_wire.map_from_pb(msg)


def test_map_from_pb_rejects_bad_maps():
    msg = cluster_wire.map_to_pb(wire_map())
    bad = pb.ShardMap()
    bad.CopyFrom(msg)
    bad.width = 0
    with pytest.raises(InvalidArgument, match="width"):
        cluster_wire.map_from_pb(bad)
    bad.CopyFrom(msg)
    copies = np.frombuffer(msg.copies, "<i4").copy()
    copies[0] = len(msg.servers)  # a server index out of range
    bad.copies = copies.tobytes()
    with pytest.raises(InvalidArgument, match="out of range"):
        cluster_wire.map_from_pb(bad)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=200),
       num_slots=st.one_of(st.sampled_from([1, 2, 4096, 1 << 16]), st.integers(1, 100_000)))
def test_slot_of_is_mix64_modulo_the_slot_count(ids, num_slots):
    """The compiled ``slot_of`` against its definition (numpy's mix64, then modulo), for int64 and uint64 ids,
    power-of-two counts (masked) and others (divided), and any shape."""
    a = np.array(ids, np.int64)
    want = (mix64(a) % np.uint64(num_slots)).astype(np.int64)
    np.testing.assert_array_equal(slot_of(a, num_slots), want)
    np.testing.assert_array_equal(slot_of(a.view(np.uint64), num_slots), want)
    if a.size % 2 == 0:
        np.testing.assert_array_equal(slot_of(a.reshape(2, -1), num_slots), want.reshape(2, -1))
    np.testing.assert_array_equal(slot_of(a[::2], num_slots), want[::2])  # not contiguous


def test_the_engine_lists_and_counts_rows_by_the_routing_slot() -> None:
    """``EmbeddingTable.stored_ids_in_slots`` / ``rows_per_slot`` (one pass over the index: a replica emptying the
    slots a copy starts over, ``SlotInfo``) use the slot ``slot_of`` routes by, resident and spilled rows alike."""
    import tempfile

    from tigana import embeddings as emb

    ids = np.random.default_rng(5).integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64)
    wanted = np.zeros(4096, bool)
    wanted[::3] = True
    with tempfile.TemporaryDirectory() as spill:
        for kw in ({}, {"memory_budget": 200 * 64, "spill_dir": spill}):  # the second spills most rows
            table = emb.EmbeddingTable(emb.TableConfig("t", dim=4, **kw))
            try:
                table.pull(ids)
                assert table.stats()["rows_spilled"] > 0 if kw else True
                slots = slot_of(ids)
                assert sorted(table.stored_ids_in_slots(4096, wanted).tolist()) == sorted(ids[wanted[slots]].tolist())
                np.testing.assert_array_equal(table.rows_per_slot(4096), np.bincount(slots, minlength=4096))
            finally:
                table.close()
