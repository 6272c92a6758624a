"""The wire module: hand-encoded Pull/Push messages match protobuf, codecs round-trip within their precision,
malformed bytes raise InvalidArgument naming table and field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tigana.embeddings import config as cfg
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import InvalidArgument
from tigana.ps.wire import data as wire

CODECS = [pb.CODEC_FP32, pb.CODEC_FP16, pb.CODEC_BF16, pb.CODEC_INT8]


def _tolerance(codec: int, rows: np.ndarray) -> np.ndarray:
    """Per-element bound on |decoded - original| for a codec."""
    mag = np.abs(rows)
    if codec == pb.CODEC_FP32:
        return np.zeros_like(rows)
    if codec == pb.CODEC_FP16:
        return mag * 2.0**-11 + 2.0**-24  # half an ulp relative, plus the subnormal step
    if codec == pb.CODEC_BF16:
        return mag * 2.0**-8 + 1e-38
    row_max = mag.max(axis=1, keepdims=True) if rows.size else mag
    return np.broadcast_to(row_max / 127.0 * 0.5 * 1.0001 + 1e-30, rows.shape)


finite_rows = st.integers(0, 40).flatmap(lambda n: st.integers(1, 24).flatmap(lambda d: hnp.arrays(
    np.float32, (n, d), elements=st.floats(-1e4, 1e4, allow_nan=False, width=32))))


@settings(max_examples=60, deadline=None)
@given(rows=finite_rows, codec=st.sampled_from(CODECS), seq=st.integers(0, 2**64 - 1),
       part=st.integers(0, 2**32 - 1), table=st.text(min_size=1, max_size=20))
def test_push_request_matches_protobuf_and_round_trips(rows, codec, seq, part, table):
    n, dim = rows.shape
    ids = np.arange(n, dtype=np.int64) * 7919 - 3
    data, scales = wire.encode_block(rows, codec)
    raw = wire.encode_push_request(table, ids, codec, dim, data, scales, "client-x", seq, part)
    msg = pb.PushRequest.FromString(raw)
    assert (msg.table, msg.client_id, msg.seq, msg.part) == (table, "client-x", seq, part)
    np.testing.assert_array_equal(wire.decode_ids(msg.ids, table=table), ids)
    # The same block through the protobuf path (what the server decodes) and through the raw path agree.
    via_pb = wire.decode_rows(msg.grads, n, dim, table=table, field="grads")
    via_raw = wire.decode_block(msg.grads, n, dim, table=table, field="grads")
    np.testing.assert_array_equal(via_pb, via_raw)
    assert np.all(np.abs(via_pb - rows) <= _tolerance(codec, rows))


@settings(max_examples=60, deadline=None)
@given(rows=finite_rows, codec=st.sampled_from(CODECS))
def test_pull_response_decodes_as_protobuf(rows, codec):
    n, dim = rows.shape
    raw = pb.PullResponse(rows=wire.encode_rows(rows, codec)).SerializeToString()
    got = wire.decode_pull_response(raw)
    assert got.nbytes == len(raw)
    out = wire.decode_block(got, n, dim, table="t")
    np.testing.assert_array_equal(out, wire.decode_rows(pb.PullResponse.FromString(raw).rows, n, dim, table="t"))
    assert np.all(np.abs(out - rows) <= _tolerance(codec, rows))


@settings(max_examples=40, deadline=None)
@given(ids=hnp.arrays(np.int64, st.integers(0, 50)), codec=st.sampled_from(CODECS), table=st.text(min_size=1))
def test_pull_request_matches_protobuf(ids, codec, table):
    msg = pb.PullRequest.FromString(wire.encode_pull_request(table, ids, codec))
    assert msg.table == table and msg.codec == codec
    np.testing.assert_array_equal(wire.decode_ids(msg.ids, table=table), ids)


def test_encode_block_agrees_with_encode_rows():
    rows = np.random.default_rng(0).normal(size=(33, 7)).astype(np.float32)
    for codec in CODECS:
        data, scales = wire.encode_block(rows, codec)
        ref = wire.encode_rows(rows, codec)
        assert data.tobytes() == ref.data
        assert (scales.tobytes() if scales is not None else b"") == ref.scales


def test_fp16_saturates_instead_of_overflowing():
    rows = np.array([[1e6, -1e6, 3.0]], np.float32)
    data, _ = wire.encode_block(rows, pb.CODEC_FP16)
    out = np.frombuffer(data, "<f2").astype(np.float32)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out, [65504.0, -65504.0, 3.0])


def test_int8_zero_rows_and_bf16_nan():
    rows = np.zeros((3, 4), np.float32)
    data, scales = wire.encode_block(rows, pb.CODEC_INT8)
    block = pb.Rows(codec=pb.CODEC_INT8, dim=4, data=data.tobytes(), scales=scales.tobytes())
    np.testing.assert_array_equal(wire.decode_block(block, 3, 4, table="t"), rows)
    bits, _ = wire.encode_block(np.array([[np.nan, 1.0]], np.float32), pb.CODEC_BF16)
    back = wire.decode_block(pb.Rows(codec=pb.CODEC_BF16, dim=2, data=bits.tobytes()), 1, 2, table="t")
    assert np.isnan(back[0, 0]) and back[0, 1] == 1.0


def test_unknown_fields_are_skipped():
    rows = np.ones((2, 3), np.float32)
    msg = pb.PullResponse(rows=wire.encode_rows(rows, pb.CODEC_FP32))
    # field 9 (varint 5), field 10 (fixed64), field 11 (fixed32), field 12 (bytes) — as a newer server might send
    extra = bytes([9 << 3 | 0, 5]) + bytes([10 << 3 | 1]) + b"\0" * 8 + bytes([11 << 3 | 5]) + b"\0" * 4 + \
        bytes([12 << 3 | 2, 3]) + b"abc"
    got = wire.decode_pull_response(extra + msg.SerializeToString() + extra)
    np.testing.assert_array_equal(wire.decode_block(got, 2, 3, table="t"), rows)


@pytest.mark.parametrize("raw", [b"\x0a", b"\x0a\x05ab", b"\x0a\x80", b"\x0f\x00", b"\x08" + b"\xff" * 11])
def test_malformed_reply_raises_invalid_argument(raw):
    with pytest.raises(InvalidArgument, match="malformed"):
        wire.decode_pull_response(raw)


def test_length_mismatches_name_table_and_field():
    rows = np.ones((4, 3), np.float32)
    got = wire.decode_pull_response(pb.PullResponse(rows=wire.encode_rows(rows)).SerializeToString())
    with pytest.raises(InvalidArgument, match=r"table 'clicks'.*field 'rows'.*bytes"):
        wire.decode_block(got, 5, 3, table="clicks")
    with pytest.raises(InvalidArgument, match=r"table 'clicks'.*field 'rows'.*dim 3, table dim is 4"):
        wire.decode_block(got, 3, 4, table="clicks")
    block = pb.Rows(codec=pb.CODEC_INT8, dim=3, data=b"\0" * 12, scales=b"\0" * 3)
    with pytest.raises(InvalidArgument, match=r"table 'clicks'.*'grads'.scales"):
        wire.decode_block(block, 4, 3, table="clicks", field="grads")
    with pytest.raises(InvalidArgument, match=r"table 'clicks'.*field 'ids'.*multiple of 8"):
        wire.decode_ids(b"\0" * 12, table="clicks")
    with pytest.raises(InvalidArgument, match="unknown codec"):
        wire.decode_block(pb.Rows(codec=7, dim=3), 0, 3, table="clicks")


def test_codec_names():
    assert wire.codec_of("none") == wire.codec_of("fp32") == pb.CODEC_FP32
    assert wire.codec_of("int8") == pb.CODEC_INT8
    with pytest.raises(InvalidArgument, match="compression"):
        wire.codec_of("zstd")


def test_fp16_kernel_matches_numpy_on_every_exponent():
    from tigana.ps import _kernels

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
    specials = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e9, -1e9, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                         2.0**-14, 6.1e-5, np.inf, -np.inf, np.nan], np.float32)
    x = np.concatenate([bits.view(np.float32), specials])
    out = np.empty(x.size, np.uint16)
    _kernels.f32_to_f16_bits(x, out)
    finite = np.isfinite(x)
    want = np.clip(x[finite], -65504, 65504).astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(out[finite], want)
    np.testing.assert_array_equal(out[np.isinf(x)], x[np.isinf(x)].astype(np.float16).view(np.uint16))
    assert np.all(np.isnan(out[np.isnan(x)].view(np.float16)))
    np.testing.assert_array_equal(_kernels.f16_to_f32(out[finite]), want.view(np.float16).astype(np.float32))


def _first_seen_unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference: unique ids in first-seen order and the inverse (ids == uniq[inverse])."""
    u, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return u[order], rank[inverse.reshape(-1)]


def _first_seen_sum(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference: unique ids in first-seen order and their gradients summed in order of occurrence."""
    uniq, inverse = _first_seen_unique(ids)
    sums = np.zeros((uniq.size, grads.shape[1]), np.float32)
    np.add.at(sums, inverse, grads)
    return uniq, sums


@settings(max_examples=30, deadline=None)
@given(rows=finite_rows, codec=st.sampled_from(CODECS))
def test_raw_pull_response_parses_as_protobuf(rows, codec):
    msg = pb.PullResponse.FromString(wire.encode_pull_response(rows, codec))
    ref = wire.encode_rows(rows, codec)
    assert msg.rows == ref


def _group_by_owner(ids: np.ndarray, primary_of_slot: np.ndarray, servers: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference: positions of ids grouped by owner per ``routing`` (order, starts), order kept in a group."""
    from tigana.ps import routing

    parts = routing.split_by_owner(primary_of_slot[routing.slot_of(ids, len(primary_of_slot))], servers)
    return np.concatenate(parts), np.concatenate([[0], np.cumsum([len(p) for p in parts])])


@settings(max_examples=40, deadline=None)
@given(ids=hnp.arrays(np.int64, st.integers(0, 300), elements=st.integers(-5, 5) | st.integers(-2**63, 2**63 - 1)),
       servers=st.integers(1, 4), dim=st.integers(1, 5), num_slots=st.sampled_from([4, 7, 4096]))
def test_grouped_dedup_kernels_match_dedup_then_group(ids, servers, dim, num_slots):
    """The client's one-pass kernels equal the numpy reference dedup -> group by owner, bit for bit."""
    from tigana.ps import _kernels, routing

    primary_of_slot = routing.static_assignment(servers, num_slots)
    ref_uniq, _ = _first_seen_unique(ids)
    order, ref_starts = _group_by_owner(ref_uniq, primary_of_slot, servers)
    uniq, starts, src = _kernels.dedup_grouped(ids, primary_of_slot, servers)
    np.testing.assert_array_equal(uniq, ref_uniq[order])
    np.testing.assert_array_equal(starts, ref_starts)
    np.testing.assert_array_equal(uniq[src], ids)
    grads = (np.arange(ids.size * dim, dtype=np.float32).reshape(ids.size, dim) % 7) - 3.25
    ref_u, ref_sums = _first_seen_sum(ids, grads)
    u2, sums, starts2, finite = _kernels.dedup_sum_grouped(ids, grads, primary_of_slot, servers)
    np.testing.assert_array_equal(u2, ref_u[order])
    np.testing.assert_array_equal(sums, ref_sums[order])
    np.testing.assert_array_equal(starts2, ref_starts)
    assert finite
    if ids.size:
        for bad in (np.nan, np.inf, -np.inf, 2.0**64, -(2.0**64), 3e38):
            g = grads.copy()
            g[ids.size // 2, dim - 1] = bad
            assert not _kernels.dedup_sum_grouped(ids, g, primary_of_slot, servers)[3]
        g = grads.copy()
        g[ids.size // 2, dim - 1] = np.nextafter(np.float32(2.0**64), np.float32(0))  # just below: in range
        assert _kernels.dedup_sum_grouped(ids, g, primary_of_slot, servers)[3]


def test_first_foreign_matches_routing():
    from tigana.ps import _kernels, routing

    ids = np.arange(-500, 500, 7, dtype=np.int64) * 1_000_003
    owned = routing.static_assignment(3) == 1
    foreign = ~owned[routing.slot_of(ids)]
    count, first = _kernels.first_foreign(ids, owned)
    assert count == int(foreign.sum()) and first == int(np.argmax(foreign))
    assert _kernels.first_foreign(ids, np.ones(4096, bool)) == (0, -1)


def _same_push(got, msg: pb.PushRequest) -> None:
    assert (got.table, got.client_id, got.seq, got.part) == (msg.table, msg.client_id, msg.seq, msg.part)
    assert bytes(got.ids) == msg.ids
    g = got.grads
    assert (g.codec, g.dim, bytes(g.data), bytes(g.scales)) == (msg.grads.codec, msg.grads.dim, msg.grads.data,
                                                                msg.grads.scales)


@settings(max_examples=60, deadline=None)
@given(rows=finite_rows, codec=st.sampled_from(CODECS), seq=st.integers(0, 2**64 - 1),
       part=st.integers(0, 2**32 - 1), table=st.text(max_size=20), client=st.text(max_size=8),
       extra=st.binary(max_size=4))
def test_push_request_parser_reads_what_protobuf_reads(rows, codec, seq, part, table, client, extra):
    """The server's Push deserializer gives the fields protobuf gives, as views, for canonical messages (also
    with an unknown field appended) and for protobuf-built ones."""
    n, dim = rows.shape
    ids = np.arange(n, dtype=np.int64) * 31 - 9
    data, scales = wire.encode_block(rows, codec)
    raw = wire.encode_push_request(table, ids, codec, dim, data, scales, client, seq, part)
    unknown = b"\x9a\x01" + bytes([len(extra)]) + extra  # field 19, length-delimited
    for blob in (raw, raw + unknown, pb.PushRequest.FromString(raw).SerializeToString()):
        got = wire.decode_push_request(blob)
        assert isinstance(got, wire.RawPush)
        _same_push(got, pb.PushRequest.FromString(blob))


def test_push_request_parser_leaves_the_odd_cases_to_protobuf():
    grads = pb.Rows(codec=pb.CODEC_FP32, dim=2, data=np.ones(2, np.float32).tobytes())
    msg = pb.PushRequest(table="t", ids=wire.encode_ids(np.array([4])), grads=grads, client_id="c", seq=3, part=1)
    raw = msg.SerializeToString()
    # a second grads sub-message is merged by protobuf: the parser hands the message to it
    merged = raw + pb.PushRequest(grads=pb.Rows(dim=2)).SerializeToString()
    got = wire.decode_push_request(merged)
    _same_push(got, pb.PushRequest.FromString(merged))
    # a known field with another wire type is an unknown field to protobuf
    odd = raw + b"\x10\x05"  # field 2 (ids) as a varint
    _same_push(wire.decode_push_request(odd), pb.PushRequest.FromString(odd))
    # what protobuf rejects is rejected (invalid UTF-8 in a string field, truncation)
    for bad in (b"\x0a\x02\xff\xfe", raw[:-1], b"\x12\x80"):
        with pytest.raises(Exception) as want:
            pb.PushRequest.FromString(bad)
        with pytest.raises(type(want.value)):
            wire.decode_push_request(bad)


@pytest.mark.parametrize("dim", [1, 3, 8])
def test_gather_kernels_equal_take(dim):
    """The pull's reassembly kernels (one block, two blocks; int64 and int32 word views) equal np.take."""
    from tigana.ps import _kernels

    rng = np.random.default_rng(dim)
    rows = rng.normal(size=(50, dim)).astype(np.float32)
    src = rng.integers(0, 50, 200)
    want = np.take(rows, src, axis=0)
    words = _kernels.row_words
    out = np.empty_like(want)
    _kernels.gather_rows(words(rows), src, words(out))
    np.testing.assert_array_equal(out, want)
    out2 = np.empty_like(want)
    raw = wire.encode_pull_response(rows[20:])  # a view into a received message (unaligned words)
    tail = wire.decode_block(wire.decode_pull_response(raw), 30, dim, table="t")
    _kernels.gather_rows2(words(rows[:20]), words(tail), src, words(out2))
    np.testing.assert_array_equal(out2, want)


@pytest.mark.parametrize("admission, eviction", [
    (cfg.Admission(), cfg.Eviction()),
    (cfg.Admission(min_count=3, probability=0.0, max_tracked=1000), cfg.Eviction(ttl_steps=5, policy="lfu")),
    (cfg.Admission(probability=0.25), cfg.Eviction(ttl_seconds=2.5, max_rows=10)),
])
def test_table_spec_round_trips_every_served_field(admission, eviction):
    """Every field a server honours survives the wire, a probability of 0 (admit nothing) included."""
    config = cfg.TableConfig("spec", dim=7, optimizer=cfg.FTRL(alpha=0.2, l1=0.01), initializer=cfg.Uniform(),
                             seed=11, dtype="float16", admission=admission, eviction=eviction, memory_budget=1 << 20)
    raw = wire.spec_to_pb(config).SerializeToString()
    assert wire.spec_from_pb(pb.TableSpec.FromString(raw)) == config


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16383, 16384, 2**21, 2**32 + 5, 2**64 - 1])
def test_varints_from_the_table_and_past_it_are_protobufs(n: int) -> None:
    # the one- and two-byte varints come from a table made once; the rest are built: both as protobuf writes
    assert wire.varint_field(5, n) == pb.PushRequest(seq=n).SerializeToString()  # 0: no field, as protobuf
    assert wire._varint(n) == (pb.PushRequest(seq=n).SerializeToString()[1:] if n else b"\x00")


def test_the_varint_table_holds_what_the_encoder_builds() -> None:
    assert len(wire._SMALL) == 1 << 14
    assert all(wire._SMALL[n] == wire._varint_slow(n) for n in range(1 << 14))
