"""``Client.pull_many`` / ``push_many``: every table of a step grouped in one pass and sent as one message per
server, against real in-process shard servers (reference: ``tigana.embeddings.EmbeddingTable``) and, for the
grouping kernels, against the one-table kernels."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tigana import ps
from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.ps import _kernels, routing


def _segments(draw_sizes: list[int], ids: np.ndarray) -> np.ndarray:
    bounds = np.zeros(len(draw_sizes) + 1, np.int64)
    np.cumsum(draw_sizes, out=bounds[1:])
    return np.minimum(bounds, ids.shape[0])


@settings(max_examples=40, deadline=None)
@given(ids=hnp.arrays(np.int64, st.integers(0, 300), elements=st.integers(-5, 5) | st.integers(-2**63, 2**63 - 1)),
       sizes=st.lists(st.integers(0, 120), min_size=1, max_size=5), servers=st.integers(1, 4),
       num_slots=st.sampled_from([4, 7, 4096]))
def test_many_table_kernels_equal_one_table_kernels(ids, sizes, servers, num_slots):
    """Each segment grouped by the many-table kernels is what the one-table kernel gives it, bit for bit; and
    the ``unique`` pass (no hashing) groups deduplicated ids exactly as the hashing pass does."""
    keys = routing.static_assignment(servers, num_slots)
    bounds = _segments(sizes, ids)
    bounds[-1] = ids.shape[0]
    grads = ((np.arange(ids.size * 3, dtype=np.float32).reshape(ids.size, 3) % 7) - 3.25)
    uniq, ub, starts, src = _kernels.dedup_grouped_many(ids, bounds, keys, servers, False)
    u2, sums, ub2, starts2, in_range = _kernels.dedup_sum_grouped_many(ids, grads, bounds, keys, servers, False)
    np.testing.assert_array_equal(ub, ub2)
    for t in range(len(bounds) - 1):
        seg = ids[bounds[t]:bounds[t + 1]]
        r_uniq, r_starts, r_src = _kernels.dedup_grouped(seg, keys, servers)
        np.testing.assert_array_equal(uniq[ub[t]:ub[t + 1]], r_uniq)
        np.testing.assert_array_equal(starts[t], r_starts)
        np.testing.assert_array_equal(src[bounds[t]:bounds[t + 1]], r_src)
        s_uniq, s_sums, s_starts, s_ok = _kernels.dedup_sum_grouped(seg, grads[bounds[t]:bounds[t + 1]], keys, servers)
        np.testing.assert_array_equal(u2[ub[t]:ub[t + 1]], s_uniq)
        np.testing.assert_array_equal(sums[ub[t]:ub[t + 1]], s_sums)
        np.testing.assert_array_equal(starts2[t], s_starts)
        assert in_range[t] == s_ok
        # the same distinct ids, handed down as unique: the same grouping without the hash pass
        d_uniq, d_ub, d_starts, d_src = _kernels.dedup_grouped_many(r_uniq[::-1].copy(), np.array([0, r_uniq.size]),
                                                                   keys, servers, True)
        h_uniq, h_starts, h_src = _kernels.dedup_grouped(r_uniq[::-1].copy(), keys, servers)
        np.testing.assert_array_equal(d_uniq, h_uniq)
        np.testing.assert_array_equal(d_starts[0], h_starts)
        np.testing.assert_array_equal(d_src, h_src)


def test_pull_many_and_push_many_match_the_engine_and_one_table_calls(three_shards):
    rng = np.random.default_rng(3)
    dims = [4, 8, 4, 8, 4, 16]  # two row widths: the push groups them per width
    names = [f"many{i}" for i in range(len(dims))]
    with ps.connect([h.address for h in three_shards], timeout_s=20) as client:
        refs = []
        for i, (name, dim) in enumerate(zip(names, dims, strict=True)):
            client.create_table(name, dim=dim, optimizer=ps.Adagrad(lr=0.05), initializer=ps.Normal(std=0.1),
                                seed=11 + i, staleness=0)
            refs.append(EmbeddingTable(TableConfig(name, dim, optimizer=ps.Adagrad(lr=0.05),
                                                   initializer=ps.Normal(std=0.1), seed=11 + i)))
        for step in range(4):
            ids = [(rng.zipf(1.3, 400) % 3000 * 7919 - 11).astype(np.int64) for _ in names]
            ids[2] = ids[2][:0] if step == 1 else ids[2]  # an empty entry is answered, not sent
            rows = [f.result() for f in client.pull_many(names, ids)]
            for name, i, r, ref in zip(names, ids, rows, refs, strict=True):
                np.testing.assert_allclose(r, ref.pull(i), rtol=1e-6, atol=1e-6)
                np.testing.assert_array_equal(r, client.pull(name, i))
            uniq = [np.unique(i) for i in ids]
            for got, u, name in zip(client.pull_many(names, uniq, unique=True), uniq, names, strict=True):
                np.testing.assert_array_equal(got.result(), client.pull(name, u))
            grads = [rng.normal(size=(i.size, d)).astype(np.float32) for i, d in zip(ids, dims, strict=True)]
            applied = [f.result() for f in client.push_many(names, ids, grads)]
            assert applied == [np.unique(i).size for i in ids]
            for i, g, ref in zip(ids, grads, refs, strict=True):
                ref.push(i, g)
        probe = [np.unique(rng.zipf(1.3, 500) % 3000 * 7919 - 11).astype(np.int64) for _ in names]
        for got, p, ref in zip(client.pull_many(names, probe, insert=False), probe, refs, strict=True):
            np.testing.assert_allclose(got.result(), ref.pull(p, insert=False), rtol=1e-5, atol=1e-6)


def test_every_table_of_a_call_is_one_message_per_server(three_shards):
    names = [f"msg{i}" for i in range(6)]
    with ps.connect([h.address for h in three_shards], timeout_s=20) as client:
        for name in names:
            client.create_table(name, dim=4, staleness=None)
        ids = [np.arange(1000, dtype=np.int64) + 7 * k for k in range(len(names))]
        client.pull_many(names, ids)[0].result()  # streams open
        client.flush()

        def sent() -> list[tuple[int, int]]:  # (frames, parts inside multi-table frames) per server
            return [(s.exchange._next_id, s.exchange.merged) for s in client._servers]

        before = sent()
        for f in client.pull_many(names, ids, unique=True):
            f.result()
        # each server got its part of all six tables as one frame of six parts
        assert [(f - f0, m - m0) for (f0, m0), (f, m) in zip(before, sent(), strict=True)] == [(1, len(names))] * 3
        before = sent()
        client.push_many(names, ids, [np.ones((i.size, 4), np.float32) for i in ids], unique=True)
        client.flush()
        assert [(f - f0, m - m0) for (f0, m0), (f, m) in zip(before, sent(), strict=True)] == [(1, len(names))] * 3


def test_push_many_refuses_a_bad_entry_and_changes_nothing(client_and_tables):
    client, names = client_and_tables
    ids = [np.arange(50, dtype=np.int64) for _ in names]
    before = [client.pull(n, i) for n, i in zip(names, ids, strict=True)]
    good = [np.ones((50, 4), np.float32) for _ in names]
    nan = [g.copy() for g in good]
    nan[2][17, 1] = np.nan
    cases = [
        (lambda: client.push_many(names, ids, nan), ps.InvalidArgument, rf"table '{names[2]}'.*'grads'.*NaN"),
        (lambda: client.push_many(names, ids, good[:-1]), ps.InvalidArgument, "push_many"),
        (lambda: client.push_many(names[:2] + ["nope"], ids[:3], good[:3]), ps.TableNotFound, "nope"),
        (lambda: client.push_many(names, ids[:2] + [ids[2].astype(np.float32)] + ids[3:], good), ps.InvalidArgument,
         rf"table '{names[2]}'.*'ids'.*integer"),
        (lambda: client.push_many(names, ids, good[:1] + [np.ones((50, 5), np.float32)] + good[2:]),
         ps.InvalidArgument, rf"'{names[1]}'.*'grads'.*shape"),
        (lambda: client.pull_many(names, ids[:-1]), ps.InvalidArgument, "pull_many"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()
    client.flush()
    for n, i, b in zip(names, ids, before, strict=True):
        np.testing.assert_array_equal(client.pull(n, i), b)


@pytest.fixture
def client_and_tables(shard_servers):
    with ps.connect([h.address for h in shard_servers], timeout_s=20) as client:
        names = [f"bad_many{i}" for i in range(4)]
        for name in names:
            client.create_table(name, dim=4, optimizer=ps.SGD(lr=1.0), seed=3)
        yield client, names


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_push_many_under_one_permit_never_stalls(shard_servers, transport):
    """With one push permit per server, a call over many tables (one message per server) and calls back to
    back all complete, and every push lands once."""
    names = [f"permit{i}" for i in range(8)]
    refs = {}
    rng = np.random.default_rng(9)
    with ps.connect([h.address for h in shard_servers], max_pushes_in_flight=1, transport=transport,
                    timeout_s=20) as client:
        for name in names:
            client.create_table(name, dim=4, optimizer=ps.SGD(lr=0.5), initializer=ps.Zeros(), staleness=None)
            refs[name] = EmbeddingTable(TableConfig(name, 4, optimizer=ps.SGD(lr=0.5), initializer=ps.Zeros()))
        futs = []
        for _ in range(12):
            ids = [rng.integers(0, 500, 200).astype(np.int64) for _ in names]
            grads = [rng.normal(size=(200, 4)).astype(np.float32) for _ in names]
            futs += client.push_many(names, ids, grads)
            for name, i, g in zip(names, ids, grads, strict=True):
                refs[name].push(i, g)
        client.flush()
        assert all(f.done() and f.exception() is None for f in futs)
        probe = np.arange(500, dtype=np.int64)
        for name in names:
            np.testing.assert_allclose(client.pull(name, probe), refs[name].pull(probe), rtol=1e-5, atol=1e-6)
