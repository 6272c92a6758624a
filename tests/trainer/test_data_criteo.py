"""The Criteo reader: real rows checked against a plain-Python parse, synthetic round trips, rank parts, errors."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tigana.trainer.data import (
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_NAMES,
    CriteoChunk,
    CriteoFormatError,
    CriteoReader,
    SyntheticCriteo,
    criteo_salts,
    feature_salt,
    format_dac,
    hash_values,
    missing_id,
    mix64,
    parse_criteo,
    transform_dense,
)

SHARED_DATA = Path(os.environ.get("TIGANA_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
CRITEO_DIR = SHARED_DATA / "criteo-dac-head2k"
DAC = CRITEO_DIR / "train_head1999.txt"
CSV = CRITEO_DIR / "train.tiny.csv"
needs_criteo = pytest.mark.skipif(not (DAC.is_file() and CSV.is_file()), reason="Criteo sample rows not present")


def _naive_parse(path: Path) -> tuple[np.ndarray, list[list[int | None]], list[list[int | None]]]:
    """A line-by-line reference: labels, ints (None = missing), hex values (None = missing)."""
    labels, ints, cats = [], [], []
    lines = path.read_text().splitlines()
    if lines[0].startswith("Id,"):
        lines = [line.split(",", 1)[1].replace(",", "\t") for line in lines[1:]]
    for line in lines:
        fields = line.split("\t")
        fields += [""] * (1 + NUM_DENSE + NUM_SPARSE - len(fields))
        labels.append(int(fields[0]))
        ints.append([int(x) if x else None for x in fields[1:1 + NUM_DENSE]])
        cats.append([int(x, 16) if x else None for x in fields[1 + NUM_DENSE:]])
    return np.array(labels), ints, cats


def _all_rows(reader: CriteoReader) -> CriteoChunk:
    chunks = list(reader.chunks())
    return CriteoChunk(*(np.concatenate([getattr(c, f) for c in chunks])
                         for f in ("labels", "ints", "int_missing", "raw", "cat_missing")))


def _cat(batches: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense, ids (n, F), labels) of a list of single-hot batches."""
    dense = torch.cat([b.dense for b in batches])
    ids = torch.cat([b.sparse.values.view(len(b.sparse.keys), -1).T for b in batches])
    labels = torch.cat([b.labels for b in batches])
    return dense, ids, labels


# ------------------------------------------------------------------------------------------- real rows
@needs_criteo
def test_real_rows_match_a_plain_python_parse() -> None:
    labels, ints, cats = _naive_parse(DAC)
    rows = _all_rows(CriteoReader(DAC, 512, block_bytes=4096))  # many blocks: lines cross block edges
    assert len(rows) == len(labels) == 1999
    np.testing.assert_array_equal(rows.labels, labels)
    expect_missing = np.array([[v is None for v in r] for r in ints])
    np.testing.assert_array_equal(rows.int_missing, expect_missing)
    np.testing.assert_array_equal(rows.ints, np.array([[v or 0 for v in r] for r in ints]))
    np.testing.assert_array_equal(rows.cat_missing, np.array([[v is None for v in r] for r in cats]))
    present = ~rows.cat_missing
    np.testing.assert_array_equal(rows.raw[present], np.array([[v or 0 for v in r] for r in cats], np.uint64)[present])
    # The features of the Criteo sample: a 21% click rate, negative I2 values, I12 the most often missing.
    assert 0.15 < rows.labels.mean() < 0.25
    assert rows.ints[:, 1].min() < 0
    assert int(np.argmax(rows.int_missing.mean(0))) == 11


@needs_criteo
def test_real_rows_batches_dense_labels_and_ids() -> None:
    labels, ints, cats = _naive_parse(DAC)
    batches = list(CriteoReader(DAC, 600))
    assert [len(b) for b in batches] == [600, 600, 600, 199]
    dense, ids, got_labels = _cat(batches)
    assert dense.dtype == torch.float32 and dense.shape == (1999, NUM_DENSE)
    expect = [[math.log(max(v or 0, -2) + 3) for v in r] for r in ints]
    np.testing.assert_allclose(dense.numpy(), np.array(expect), rtol=1e-6)
    assert torch.equal(got_labels, torch.from_numpy(labels.astype(np.float32)))
    salts = criteo_salts()
    for f in (0, 2, 11, 25):
        expect_ids = [missing_id(salts[f]) if r[f] is None else
                      int(hash_values(np.array([r[f]], np.uint64), salts[f])[0]) for r in cats]
        assert ids[:, f].tolist() == expect_ids
    assert bool((ids >= 0).all())
    b = batches[0]
    assert b.sparse.keys == SPARSE_NAMES and b.sparse.values.dtype == torch.int64
    assert torch.equal(b.sparse.lengths, torch.ones(600 * NUM_SPARSE, dtype=torch.int64))


@needs_criteo
def test_kaggle_csv_reads_the_same_rows_as_the_dac_text() -> None:
    a = _cat(list(CriteoReader(DAC, 700)))
    b = _cat(list(CriteoReader(CSV, 700, block_bytes=2048)))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@needs_criteo
def test_ids_are_salted_per_feature_and_stable() -> None:
    rows = _all_rows(CriteoReader(DAC, 100))
    ids = hash_values(rows.raw, criteo_salts())
    # The same raw value in two features maps to two different ids.
    shared = set(rows.raw[~rows.cat_missing[:, 0], 0].tolist()) & set(rows.raw[~rows.cat_missing[:, 5], 5].tolist())
    values0 = {int(r): int(i) for r, i in zip(rows.raw[:, 0], ids[:, 0], strict=True)}
    values5 = {int(r): int(i) for r, i in zip(rows.raw[:, 5], ids[:, 5], strict=True)}
    for raw in shared:
        assert values0[raw] != values5[raw]
    # Missing ids differ between features and never equal a present value's id.
    missing = [missing_id(s) for s in criteo_salts()]
    assert len(set(missing)) == NUM_SPARSE
    for f in range(NUM_SPARSE):
        assert missing[f] not in set(ids[~rows.cat_missing[:, f], f].tolist())
    # A different salt seed changes every id.
    assert not np.any(hash_values(rows.raw, criteo_salts(1)) == ids)


def test_salts_and_ids_are_pinned() -> None:
    """A regression pin of the id format: ids stored in parameter-server tables (snapshots, checkpoints) stay
    valid only while these never change. The values come from BLAKE2b and splitmix64, not from any process
    state (Python's randomized hash() is not involved)."""
    salt = feature_salt("C7")
    assert int(salt) == 10285715003883387880
    assert int(hash_values(np.array([0x68FD1E64], np.uint64), salt)[0]) == 469155536257464423
    assert feature_salt("C7", seed=1) != salt


def _splitmix_finalizer(x: int) -> int:
    mask = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50))
def test_mix64_matches_the_scalar_splitmix64_finalizer(xs: list[int]) -> None:
    got = mix64(np.array(xs, dtype=np.uint64))
    assert got.tolist() == [_splitmix_finalizer(x) for x in xs]


# ------------------------------------------------------------------------------------ synthetic files
@pytest.fixture(scope="module")
def synthetic_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[SyntheticCriteo, Path, int]:
    gen = SyntheticCriteo(seed=3, block_rows=1000)
    path = tmp_path_factory.mktemp("criteo") / "synthetic.txt"
    gen.write_tsv(path, 3000)
    return gen, path, 3000


def test_synthetic_tsv_round_trips_through_the_reader(synthetic_file: tuple[SyntheticCriteo, Path, int]) -> None:
    gen, path, n = synthetic_file
    read = _cat(list(CriteoReader(path, 777, block_bytes=10_000)))
    made = _cat(list(gen.batches(777, n)))
    for x, y in zip(read, made, strict=True):
        assert torch.equal(x, y)
    assert (read[0] == 0).any()  # log(x + 3) of I2 = -2 happens


def _fingerprints(ids: torch.Tensor) -> list[int]:
    """One int per row (a weighted sum of its ids, wrapping), sorted: equal multisets of rows, equal lists."""
    weights = torch.randint(1, 2**31, (ids.shape[1],), generator=torch.Generator().manual_seed(0))
    return sorted((ids * weights).sum(1).tolist())


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world_size=st.integers(1, 6), block=st.integers(1024, 60_000), partition=st.sampled_from(["bytes", "rows"]))
def test_rank_parts_cover_every_row_once(synthetic_file: tuple[SyntheticCriteo, Path, int], world_size: int,
                                         block: int, partition: str) -> None:
    gen, path, n = synthetic_file
    seen = []
    for rank in range(world_size):
        reader = CriteoReader(path, 333, rank=rank, world_size=world_size, partition=partition, block_bytes=block)
        seen.append(_cat(list(reader))[1])
    assert _fingerprints(torch.cat(seen)) == _fingerprints(gen.batch(0, n).sparse.values.view(NUM_SPARSE, -1).T)


def test_rows_partition_interleaves_lines(synthetic_file: tuple[SyntheticCriteo, Path, int]) -> None:
    _, path, n = synthetic_file
    everything = _cat(list(CriteoReader(path, n)))[1]
    part = _cat(list(CriteoReader(path, 100, rank=1, world_size=3, partition="rows")))[1]
    assert torch.equal(part, everything[1::3])


def test_max_rows_drop_last_and_transforms(synthetic_file: tuple[SyntheticCriteo, Path, int]) -> None:
    _, path, _ = synthetic_file
    assert [len(b) for b in CriteoReader(path, 300, max_rows=1000)] == [300, 300, 300, 100]
    assert [len(b) for b in CriteoReader(path, 300, max_rows=1000, drop_last=True)] == [300, 300, 300]
    raw = next(iter(CriteoReader(path, 50, dense_transform="none"))).dense
    log1p = next(iter(CriteoReader(path, 50, dense_transform="log1p"))).dense
    torch.testing.assert_close(log1p, torch.log1p(raw.clamp(min=0)))


# ------------------------------------------------------------------------------- format corner cases
def _line(label: str = "1", ints: list[str] | None = None, cats: list[str] | None = None) -> str:
    ints = ints if ints is not None else ["1"] * NUM_DENSE
    cats = cats if cats is not None else ["0a1b2c3d"] * NUM_SPARSE
    return "\t".join([label, *ints, *cats])


def test_stripped_trailing_fields_crlf_and_blank_lines() -> None:
    full = _line(cats=["ff"] * 20 + [""] * 6)
    stripped = full.rstrip("\t")
    block = (full + "\r\n" + stripped + "\r\n\r\n" + stripped).encode()
    rows = parse_criteo(block)
    assert len(rows) == 3
    assert rows.cat_missing[:, 20:].all() and not rows.cat_missing[:, :20].any()
    assert (rows.raw[:, :20] == 0xFF).all()


def test_empty_and_negative_integers() -> None:
    ints = ["", "-2", "0", "17", "", "123456789012", "-1", "", "3", "", "", "", "9"]
    rows = parse_criteo(_line(ints=ints).encode())
    assert rows.ints[0].tolist() == [int(x) if x else 0 for x in ints]
    assert rows.int_missing[0].tolist() == [x == "" for x in ints]
    np.testing.assert_allclose(transform_dense(rows.ints)[0], [math.log(max(int(x or 0), -2) + 3) for x in ints],
                               rtol=1e-6)


@pytest.mark.parametrize(("line", "field"), [
    (_line(label="2"), "label"),
    (_line(label=""), "label"),
    (_line(ints=["1"] * 4 + ["1x"] + ["1"] * 8), "I5"),
    (_line(ints=["-"] + ["1"] * 12), "I1"),
    (_line(ints=["1"] * 12 + ["1" * 30]), "I13"),
    (_line(cats=["0a1b2c3d"] * 2 + ["xyz"] + ["0a1b2c3d"] * 23), "C3"),
    (_line(cats=["0a1b2c3d"] * 25 + ["1" * 17]), "C26"),
])
def test_bad_fields_are_named(line: str, field: str) -> None:
    good = _line()
    with pytest.raises(CriteoFormatError, match=rf"field {field} of the line at byte {len(good) + 1}\b"):
        parse_criteo(f"{good}\n{line}\n".encode())


def test_too_many_fields_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(_line() + "\n" + _line() + "\textra\n")
    with pytest.raises(CriteoFormatError, match="has 41 fields, expected 40"):
        list(CriteoReader(path, 10))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        CriteoReader(DAC, 10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        CriteoReader(DAC, 0)
    with pytest.raises(ValueError, match="dense transform"):
        CriteoReader(DAC, 10, dense_transform="sqrt")  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.lists(st.one_of(st.none(), st.integers(-3, 10**12)),
                                                       min_size=NUM_DENSE, max_size=NUM_DENSE),
                          st.lists(st.one_of(st.none(), st.integers(0, 2**32 - 1)), min_size=NUM_SPARSE,
                                   max_size=NUM_SPARSE)), min_size=1, max_size=20))
def test_format_and_parse_are_inverse(rows: list) -> None:
    labels = np.array([r[0] for r in rows], np.int64)
    int_missing = np.array([[v is None for v in r[1]] for r in rows])
    ints = np.array([[v or 0 for v in r[1]] for r in rows], np.int64)
    cat_missing = np.array([[v is None for v in r[2]] for r in rows])
    raw = np.array([[v or 0 for v in r[2]] for r in rows], np.uint64)
    raw[cat_missing] = np.uint64(2**64 - 1)
    made = CriteoChunk(labels, ints, int_missing, raw, cat_missing)
    back = parse_criteo(format_dac(made))
    for name in ("labels", "ints", "int_missing", "raw", "cat_missing"):
        np.testing.assert_array_equal(getattr(back, name), getattr(made, name))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_last_line_without_newline_and_empty_files(tmp_path: Path, world_size: int) -> None:
    path = tmp_path / "three.txt"
    lines = [_line(label=str(k % 2), ints=[str(k)] * NUM_DENSE) for k in range(3)]
    path.write_text("\n".join(lines))  # no final newline
    got = []
    for rank in range(world_size):
        for batch in CriteoReader(path, 2, rank=rank, world_size=world_size, block_bytes=1024):
            got += batch.labels.tolist()
    assert sorted(got) == [0.0, 0.0, 1.0]
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert list(CriteoReader(empty, 4, rank=0, world_size=world_size)) == []
