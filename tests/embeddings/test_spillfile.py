"""SpillFile (the spill tier's records on disk) against a dict reference: writes into freed slots before the file
grows, reads by slot with CRC and key checks, a full disk or the byte cap refusing a write with nothing
changed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lmdbstore import DIM, SW, as_dict, ids_strategy, make_rows

from tigana.embeddings import CorruptStore, StorageFull
from tigana.embeddings import spillfile as spillfile_module
from tigana.embeddings.spillfile import SpillFile

ops = st.lists(st.tuples(st.sampled_from(["write", "free", "read"]),
                         st.lists(ids_strategy, min_size=0, max_size=12), st.integers(0, 3)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_spill_file_matches_a_dict_reference(tmp_path_factory, script) -> None:
    path = tmp_path_factory.mktemp("spill")
    ref: dict[int, tuple] = {}   # id -> row
    slot_of: dict[int, int] = {}  # id -> slot
    peak = 0
    store = SpillFile(path, table="t", dim=DIM, state_width=SW)
    try:
        for op, id_list, version in script:
            ids = np.array(sorted(set(id_list)), np.int64)
            if op == "write":
                ids = ids[~np.isin(ids, list(slot_of))]  # the tier spills ids it does not hold
                slots = store.write(make_rows(ids, version))
                assert slots.shape == ids.shape and len(set(slots.tolist()) | set(slot_of.values())) == \
                    len(slot_of) + ids.size  # a slot holds one row
                slot_of.update(zip(ids.tolist(), slots.tolist(), strict=True))
                ref.update(as_dict(make_rows(ids, version)))
            elif op == "free":
                held = [i for i in ids.tolist() if i in slot_of]
                store.free(np.array([slot_of.pop(i) for i in held], np.int64))
                for i in held:
                    del ref[i]
            held = np.array(sorted(slot_of), np.int64)
            got = store.read(np.array([slot_of[i] for i in held.tolist()], np.int64), held)
            assert as_dict(got) == {i: ref[i] for i in held.tolist()}
            assert len(store) == len(ref)
            peak = max(peak, len(ref))  # freed slots are written first: no slot past the most rows held at once
            assert all(slot < peak for slot in slot_of.values())
    finally:
        store.close()


def test_freed_slots_are_written_before_the_file_grows(tmp_path: Path) -> None:
    store = SpillFile(tmp_path, table="t", dim=DIM, state_width=SW)
    try:
        first = store.write(make_rows(np.arange(1000), 0))
        size = store.stats()["file_bytes"]
        for round_ in range(20):  # churn: a tier that spills and unspills as much
            store.free(first[:500])
            first[:500] = store.write(make_rows(np.arange(5000 + round_ * 500, 5500 + round_ * 500), round_))
        assert store.stats()["file_bytes"] == size and store.stats()["free_slots"] == 0 and len(store) == 1000
        assert int(first.max()) < 1000
    finally:
        store.close()


def test_a_damaged_or_misplaced_record_raises_naming_the_file_and_id(tmp_path: Path) -> None:
    store = SpillFile(tmp_path, table="clicks", dim=DIM, state_width=SW)
    try:
        ids = np.arange(10, 20, dtype=np.int64)
        slots = store.write(make_rows(ids, 1))
        with open(store.file, "r+b") as f:  # flip a byte of the weights of id 13
            f.seek(int(slots[3]) * store.record_bytes + 40)
            b = f.read(1)
            f.seek(int(slots[3]) * store.record_bytes + 40)
            f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(CorruptStore) as err:
            store.read(slots, ids)
        assert str(store.file) in str(err.value) and "id 13" in str(err.value)
        corrupt: list[int] = []
        good = store.read(slots, ids, corrupt=corrupt)
        assert corrupt == [13] and good.ids.tolist() == [i for i in ids.tolist() if i != 13]
        with pytest.raises(CorruptStore):  # a slot read for another id than the one it holds
            store.read(slots[:1], np.array([99], np.int64))
        with pytest.raises(CorruptStore):
            store.read(np.array([len(ids) + 5]), np.array([1], np.int64))
    finally:
        store.close()


def test_the_byte_cap_refuses_a_write_and_changes_nothing(tmp_path: Path) -> None:
    store = SpillFile(tmp_path, table="clicks", dim=DIM, state_width=SW, max_bytes=1 << 20)
    try:
        per = store.record_bytes
        fits = (1 << 20) // per
        slots = store.write(make_rows(np.arange(fits - 10), 0))
        with pytest.raises(StorageFull, match="clicks"):
            store.write(make_rows(np.arange(10**6, 10**6 + 20), 0))
        assert len(store) == fits - 10
        assert as_dict(store.read(slots, np.arange(fits - 10))) == as_dict(make_rows(np.arange(fits - 10), 0))
        store.free(slots[:20])
        store.write(make_rows(np.arange(10**6, 10**6 + 20), 0))  # room again in the freed slots
        assert len(store) == fits - 10
    finally:
        store.close()


def test_a_full_disk_refuses_a_write_and_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SpillFile(tmp_path, table="clicks", dim=DIM, state_width=SW)
    try:
        slots = store.write(make_rows(np.arange(100), 0))
        size = os.path.getsize(store.file)
        capacity = int(store.stats()["file_bytes"]) // store.record_bytes

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(spillfile_module.os, "posix_fallocate", full)
        with pytest.raises(StorageFull, match="disk full"):
            store.write(make_rows(np.arange(1000, 1000 + capacity), 1))
        assert len(store) == 100 and os.path.getsize(store.file) == size
        assert as_dict(store.read(slots, np.arange(100))) == as_dict(make_rows(np.arange(100), 0))
        monkeypatch.undo()
        more = store.write(make_rows(np.arange(1000, 1000 + capacity), 1))
        assert len(store) == 100 + capacity and int(more.max()) >= capacity
    finally:
        store.close()


def test_past_the_slots_an_index_value_holds_a_write_is_refused(tmp_path: Path) -> None:
    store = SpillFile(tmp_path, table="clicks", dim=DIM, state_width=SW)
    try:
        store.write(make_rows(np.arange(10), 0))
        store._high = spillfile_module.MAX_RECORDS - 5  # as if the file held that many (a sparse test)
        with pytest.raises(StorageFull, match="at most"):
            store.write(make_rows(np.arange(100, 110), 0))
        assert store.stats()["file_bytes"] < 1 << 30  # refused before growing
    finally:
        store.close()


def test_a_large_gather_split_over_the_reader_threads_reads_what_one_gather_reads(tmp_path: Path) -> None:
    store = SpillFile(tmp_path, table="clicks", dim=DIM, state_width=SW)
    try:
        ids = np.arange(3 * spillfile_module._SPLIT_AT, dtype=np.int64) * 7919 - 10**9
        slots = store.write(make_rows(ids, 2))
        order = np.random.default_rng(1).permutation(ids.shape[0])
        got = store.read(slots[order], ids[order])
        assert spillfile_module._READERS  # the split path ran
        assert as_dict(got) == as_dict(make_rows(ids, 2)) and np.array_equal(got.ids, ids[order])
        small = store.read(slots[order[:10]], ids[order[:10]])
        assert np.array_equal(small.weights, got.weights[:10])
    finally:
        store.close()
