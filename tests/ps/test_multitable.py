"""Multi-table frames (``ExchangeRequest.pulls``/``pushes``): one frame per server carrying every table's part
of a step. On the wire; against real in-process shard servers over their ``Exchange`` stream (bad input in
the middle of a frame applies nothing of it, a retried frame applies once, a part refused for a slot the
server does not lead leaves the other parts applied once); and through ``Client.pull_many``/``push_many``,
bit for bit what one call per table gives."""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest

from tigana import ps
from tigana.proto import shard_pb2 as pb
from tigana.ps import routing
from tigana.ps.errors import InvalidArgument, NotEnoughReplicas, TableNotFound
from tigana.ps.rpc import Malformed
from tigana.ps.wire import data as wire
from tigana.ps.wire import frames
from tigana.ps.wire.frames import EXCHANGE

DIM = 4


def _push_parts(table: str, ids: np.ndarray, grads: np.ndarray, client_id: str, seq: int, epoch: int = 0,
                dim: int | None = None) -> list:
    data, scales = wire.encode_block(np.ascontiguousarray(grads, np.float32), pb.CODEC_FP32)
    return wire.push_request_parts(table, np.asarray(ids, np.int64), pb.CODEC_FP32,
                                   grads.shape[1] if dim is None else dim, data, scales, client_id, seq, 0, epoch)


def test_multi_table_frames_round_trip() -> None:
    ids = [np.array([3, 1, 7], np.int64), np.array([9], np.int64)]
    raw = frames.request_many(5, 300, frames.PULL, [wire.pull_request_parts("a", ids[0], pb.CODEC_FP16, 4),
                                                    wire.pull_request_parts("b", ids[1], pb.CODEC_FP32, 4, True)])
    parsed = pb.ExchangeRequest.FromString(raw)  # the hand codec writes the proto's wire
    assert (parsed.id, parsed.timeout_ms, [p.table for p in parsed.pulls]) == (5, 300, ["a", "b"])
    frame = frames.read_request(raw)
    assert (frame.id, frame.kind, frame.timeout_ms) == (5, frames.PULLS, 300)
    assert frame.request == list(parsed.pulls)
    assert frame.request[1] == pb.PullRequest(table="b", ids=ids[1].tobytes(), epoch=4, read_only=True)

    grads = [np.arange(6, dtype=np.float32).reshape(3, 2), np.ones((1, 2), np.float32)]
    raw = frames.request_many(6, 0, frames.PUSH, [_push_parts("a", ids[0], grads[0], "me", 11, 2),
                                                  _push_parts("b", ids[1], grads[1], "me", 12, 2)])
    assert [(p.table, p.seq) for p in pb.ExchangeRequest.FromString(raw).pushes] == [("a", 11), ("b", 12)]
    frame = frames.read_request(raw)
    assert (frame.id, frame.kind) == (6, frames.PUSHES)
    assert [(p.table, p.client_id, p.seq, p.epoch) for p in frame.request] == [("a", "me", 11, 2), ("b", "me", 12, 2)]
    for push, g in zip(frame.request, grads, strict=True):
        np.testing.assert_array_equal(wire.decode_rows(push.grads, g.shape[0], 2, table=push.table), g)

    # the answer: each part's reply or error, in order; read back as a list of answers under the frame's id
    rows = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    answer = frames.read_answer(frames.many_answer(5, [
        frames.pull_answer(0, rows, pb.CODEC_FP32),
        frames.error_answer(0, NotEnoughReplicas("table 'b': slot 4 short", epoch=8), 8),
        frames.push_answer(0, pb.PushResponse(applied_rows=2, epoch=3))]))
    assert answer.id == 5 and answer.error is None and len(answer.reply) == 3
    pulled, refused, pushed = answer.reply
    np.testing.assert_array_equal(wire.decode_block(pulled.reply, 3, 4, table="a"), rows)
    assert isinstance(refused.error, NotEnoughReplicas) and refused.error.epoch == 8 and "slot 4" in str(refused.error)
    assert pushed.reply == pb.PushResponse(applied_rows=2, epoch=3)
    assert len(pb.ExchangeResponse.FromString(frames.many_answer(5, [frames.push_answer(0, pb.PushResponse())] * 2)
                                              ).parts) == 2
    # in a bundle, beside a single-table frame
    got = frames.read_request(frames.bundle([raw, frames.request(7, 0, frames.PULL, wire.pull_request_parts("c", ids[1]))]))
    assert [(f.id, f.kind) for f in got] == [(6, frames.PUSHES), (7, frames.PULL)]

    # a frame mixing pulls and pushes, or a part that does not parse, is refused whole under its id
    mixed = raw + b"".join(wire.len_field_parts(frames.PULLS, wire.pull_request_parts("a", ids[0])))
    assert isinstance(frames.read_request(mixed).request, Malformed)
    bad = frames.request_many(8, 0, frames.PULL, [wire.pull_request_parts("a", ids[0]), [b"\xff\xff\xff"]])
    frame = frames.read_request(bad)
    assert frame.id == 8 and isinstance(frame.request, Malformed) and "part 1" in frame.request.why


def _exchange(address: str, raws: list[bytes]) -> dict[int, frames.Answer]:
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(EXCHANGE, request_serializer=wire.identity, response_deserializer=wire.identity)
        return {a.id: a for raw in call(iter(raws), timeout=20) for a in frames.read_answers(raw)}


@pytest.fixture
def server_and_tables(shard_server):
    names = [f"mt{i}" for i in range(4)]
    with ps.connect([shard_server.address], timeout_s=20) as client:
        for i, name in enumerate(names):
            client.create_table(name, dim=DIM, optimizer=ps.SGD(lr=1.0), initializer=ps.Normal(std=0.1), seed=5 + i)
        yield shard_server, client, names


def test_bad_input_in_the_middle_of_a_frame_applies_nothing_of_it(server_and_tables) -> None:
    server, client, names = server_and_tables
    ids = np.arange(40, dtype=np.int64)
    before = [client.pull(n, ids) for n in names]
    sizes = [len(server.service.tables.find(n).table) for n in names]
    g = np.ones((ids.size, DIM), np.float32)
    nan = g.copy()
    nan[7, 2] = np.nan

    def pushes(middle: list) -> list:
        return [_push_parts(names[0], ids, g, "bad", 1), _push_parts(names[1], ids, g, "bad", 2), middle,
                _push_parts(names[3], ids, g, "bad", 4)]

    cases = [  # (the third part, the error, what its message names)
        (_push_parts("nope", ids, g, "bad", 3), TableNotFound, "'nope'"),
        (_push_parts(names[2], ids, g[:, :3], "bad", 3), InvalidArgument, rf"'{names[2]}'.*'grads'.*dim 3"),
        (_push_parts(names[2], ids, g[:-1], "bad", 3, dim=DIM), InvalidArgument, rf"'{names[2]}'.*'grads'.*39 rows"),
        (_push_parts(names[2], ids, nan, "bad", 3), InvalidArgument, rf"'{names[2]}'.*'grads'.*NaN"),
        ([b"\xff\xff"], InvalidArgument, "pushes.*part 2"),
    ]
    raws = [frames.request_many(k + 1, 0, frames.PUSH, pushes(middle)) for k, (middle, _, _) in enumerate(cases)]
    # and a pull frame naming an unknown table inserts nothing of its other tables' new ids
    fresh = np.arange(10_000, 10_050, dtype=np.int64)
    raws.append(frames.request_many(99, 0, frames.PULL, [wire.pull_request_parts(names[0], fresh),
                                                         wire.pull_request_parts("nope", fresh),
                                                         wire.pull_request_parts(names[1], fresh)]))
    answers = _exchange(server.address, raws)
    for k, (_, exc, pattern) in enumerate(cases):
        a = answers[k + 1]
        assert a.reply is None and isinstance(a.error, exc), (k, a.error)
        assert a.error.answered

        assert re.search(pattern, str(a.error)), (k, str(a.error))
    assert isinstance(answers[99].error, TableNotFound) and "'nope'" in str(answers[99].error)
    # nothing of any frame applied or inserted, and the server serves on
    assert [len(server.service.tables.find(n).table) for n in names] == sizes
    for n, b in zip(names, before, strict=True):
        np.testing.assert_array_equal(client.pull(n, ids), b)
    # the same keys are still unused: the good frame applies every part
    good = _exchange(server.address, [frames.request_many(100, 0, frames.PUSH,
                                                          pushes(_push_parts(names[2], ids, g, "bad", 3)))])
    assert [p.reply.applied_rows for p in good[100].reply] == [ids.size] * 4
    for n, b in zip(names, before, strict=True):
        np.testing.assert_array_equal(client.pull(n, ids), b - 1.0)


def test_a_retried_frame_applies_once_and_a_partly_duplicate_one_only_its_new_parts(server_and_tables) -> None:
    server, client, names = server_and_tables
    ids = np.arange(60, dtype=np.int64)
    before = [client.pull(n, ids) for n in names]
    g = np.full((ids.size, DIM), 0.5, np.float32)
    # names[0]'s part arrives first on its own (a single-table frame); then a frame with all four parts under
    # the same keys, twice (a retry after a lost answer)
    first = _exchange(server.address, [frames.request(1, 0, frames.PUSH, _push_parts(names[0], ids, g, "c", 10))])
    assert first[1].reply.applied_rows == ids.size
    frame = frames.request_many(2, 0, frames.PUSH, [_push_parts(n, ids, g, "c", 10 + k) for k, n in enumerate(names)])
    once = _exchange(server.address, [frame])[2].reply
    assert [(p.reply.applied_rows, p.reply.duplicate) for p in once] == [(0, True)] + [(ids.size, False)] * 3
    again = _exchange(server.address, [frame])[2].reply
    assert [(p.reply.applied_rows, p.reply.duplicate) for p in again] == [(0, True)] * 4
    for n, b in zip(names, before, strict=True):  # SGD, lr 1: every table moved by exactly one push
        np.testing.assert_array_equal(client.pull(n, ids), b - np.float32(0.5))


def test_a_part_for_slots_the_server_does_not_lead_is_refused_alone(shard_servers) -> None:
    """Fencing per part: the part naming slots this server does not lead answers ``WrongShard`` (nothing of its
    table applied), the frame's other parts are applied; the client's re-route of that part to its primary,
    and a retry of the whole frame, apply nothing twice."""
    names = ["fa", "fb", "fc"]
    with ps.connect([h.address for h in shard_servers]) as client:
        for name in names:
            client.create_table(name, dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        ids = np.arange(300, dtype=np.int64)
        owned = shard_servers[0].service.owned_slots()
        mine = ids[owned[routing.slot_of(ids, owned.shape[0])]]
        foreign = ids[~owned[routing.slot_of(ids, owned.shape[0])]]
        g = np.ones((mine.size, 2), np.float32)
        parts = [_push_parts("fa", mine, g, "f", 1), _push_parts("fb", foreign, np.ones((foreign.size, 2), np.float32),
                                                                  "f", 2), _push_parts("fc", mine, g, "f", 3)]
        frame = frames.request_many(4, 0, frames.PUSH, parts)
        answer = _exchange(shard_servers[0].address, [frame])[4].reply
        assert isinstance(answer[1].error, ps.WrongShard) and "does not lead" in str(answer[1].error)
        assert [(a.reply.applied_rows, a.reply.duplicate) for a in (answer[0], answer[2])] == [(mine.size, False)] * 2
        # the refused part, routed to the primary of its slots, lands; the whole frame again changes nothing
        routed = _exchange(shard_servers[1].address, [frames.request(5, 0, frames.PUSH, parts[1])])[5].reply
        assert (routed.applied_rows, routed.duplicate) == (foreign.size, False)
        again = _exchange(shard_servers[0].address, [frame])[4].reply
        assert [(a.reply.applied_rows, a.reply.duplicate) for a in (again[0], again[2])] == [(0, True)] * 2
        assert isinstance(again[1].error, ps.WrongShard)
        np.testing.assert_array_equal(client.pull("fa", mine), -np.ones((mine.size, 2), np.float32))
        np.testing.assert_array_equal(client.pull("fb", foreign), -np.ones((foreign.size, 2), np.float32))
        np.testing.assert_array_equal(client.pull("fa", foreign), np.zeros((foreign.size, 2), np.float32))
        np.testing.assert_array_equal(client.pull("fb", mine), np.zeros((mine.size, 2), np.float32))
        np.testing.assert_array_equal(client.pull("fc", mine), -np.ones((mine.size, 2), np.float32))


def test_pull_many_and_push_many_equal_one_call_per_table_bit_for_bit(shard_servers) -> None:
    """Two sets of identical tables, one driven by ``pull_many``/``push_many`` (one multi-table frame per server
    and step), the other by one ``pull``/``push`` per table: the same rows, bit for bit, at every step."""
    rng = np.random.default_rng(7)
    dims = [4, 8, 4, 16, 8]
    with ps.connect([h.address for h in shard_servers], timeout_s=20) as client:
        for prefix in ("m", "s"):
            for i, dim in enumerate(dims):
                client.create_table(f"{prefix}{i}", dim=dim, optimizer=ps.Adam(lr=0.01), initializer=ps.Normal(std=0.1),
                                    seed=21 + i, staleness=0)
        many = [f"m{i}" for i in range(len(dims))]
        single = [f"s{i}" for i in range(len(dims))]
        merged = sum(s.exchange.merged for s in client._servers)
        for _ in range(3):
            ids = [(rng.zipf(1.2, 300) % 2000 * 104729 - 3).astype(np.int64) for _ in dims]
            got = [f.result() for f in client.pull_many(many, ids)]
            want = [client.pull(n, i) for n, i in zip(single, ids, strict=True)]
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b)
            grads = [rng.normal(size=(i.size, d)).astype(np.float32) for i, d in zip(ids, dims, strict=True)]
            applied = [f.result() for f in client.push_many(many, ids, grads)]
            assert applied == [f.result() for f in (client.push(n, i, g) for n, i, g in zip(single, ids, grads,
                                                                                              strict=True))]
        client.flush()
        probe = [np.unique(rng.integers(-10**6, 10**6, 400)) for _ in dims]
        for m, s, p in zip(many, single, probe, strict=True):
            np.testing.assert_array_equal(client.pull(m, p, insert=False), client.pull(s, p, insert=False))
        # 3 steps x (pull + push) x 2 servers frames, each of 5 tables' parts
        assert sum(s.exchange.merged for s in client._servers) - merged == 3 * 2 * 2 * len(dims)
