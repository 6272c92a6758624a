"""The tigana.ps client against real in-process shard servers on loopback ports (no mocked transport).

Reference model: ``tigana.embeddings.EmbeddingTable`` in this process with the same config and seed.
"""

from __future__ import annotations

import socket
import threading
from concurrent import futures as cf

import numpy as np
import pytest
import torch

from tigana import ps
from tigana.embeddings import EmbeddingTable, TableConfig
from tigana.proto import shard_pb2 as pb
from tigana.ps import routing
from tigana.ps.wire import data as wire
from tigana.ps.wire import frames

OPTIMIZERS = [ps.SGD(lr=0.1), ps.Adagrad(lr=0.05), ps.RowWiseAdagrad(lr=0.05), ps.Adam(lr=0.01),
              ps.FTRL(alpha=0.1, l1=0.001)]


@pytest.fixture
def client(shard_servers):
    c = ps.connect([h.address for h in shard_servers], timeout_s=20)
    try:
        yield c
    finally:
        c.close()


def _zipf_ids(rng: np.random.Generator, n: int, high: int = 5000) -> np.ndarray:
    ids = rng.zipf(1.2, n) % high
    return (ids * 1_000_003 - 77).astype(np.int64)  # spread, with negatives and duplicates


def test_pull_after_push_matches_engine_for_every_optimizer(three_shards):
    rng = np.random.default_rng(1)
    dim = 8
    with ps.connect([h.address for h in three_shards], timeout_s=20) as client:
        refs = {}
        for i, opt in enumerate(OPTIMIZERS):
            name = f"t_{opt.kind}"
            held = client.create_table(name, dim=dim, optimizer=opt, initializer=ps.Normal(std=0.1), seed=7 + i)
            assert held.optimizer == opt and held.dim == dim
            refs[name] = EmbeddingTable(TableConfig(name, dim, optimizer=opt, initializer=ps.Normal(std=0.1),
                                                    seed=7 + i))
        for _step in range(3):
            ids = _zipf_ids(rng, 3000)
            grads = rng.normal(size=(ids.size, dim)).astype(np.float32)
            for name, ref in refs.items():
                np.testing.assert_allclose(client.pull(name, ids), ref.pull(ids), rtol=1e-5, atol=1e-6,
                                           err_msg=name)  # duplicates summed in another order
                client.push(name, ids, grads)
                ref.push(ids, grads)
        client.flush()
        probe = np.concatenate([_zipf_ids(rng, 2000), np.array([123456789, -5], np.int64)])
        for name, ref in refs.items():
            np.testing.assert_allclose(client.pull(name, probe), ref.pull(probe), rtol=1e-5, atol=1e-6,
                                       err_msg=name)
        # every shard holds only its own slots
        owners = routing.static_assignment(3)
        for h in three_shards:
            rows = client.describe_table("t_sgd").shards[h.address]["rows"]
            assert rows > 0
        assert sum(client.describe_table("t_sgd").shards[h.address]["rows"] for h in three_shards) == \
            len(refs["t_sgd"])
        assert owners.shape == (routing.DEFAULT_NUM_SLOTS,)


def test_duplicates_order_shapes_and_torch(client):
    client.create_table("dup", dim=4, initializer=ps.Uniform(low=-1, high=1), seed=3)
    ids = np.array([5, -1, 5, 2**62, 0, -1, 5, np.iinfo(np.int64).min], np.int64)
    rows = client.pull("dup", ids)
    assert rows.shape == (8, 4) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows[0], rows[2])
    np.testing.assert_array_equal(rows[0], rows[6])
    np.testing.assert_array_equal(rows[1], rows[5])
    singles = np.stack([client.pull("dup", ids[i:i + 1])[0] for i in range(len(ids))])
    np.testing.assert_array_equal(rows, singles)
    # torch ids, 2-D ids (ids.shape + (dim,)), uint64 ids as the same bits
    np.testing.assert_array_equal(client.pull("dup", torch.from_numpy(ids)), rows)
    np.testing.assert_array_equal(client.pull("dup", ids.reshape(2, 4)), rows.reshape(2, 4, 4))
    np.testing.assert_array_equal(client.pull("dup", ids.view(np.uint64)), rows)
    assert client.pull("dup", np.empty(0, np.int64)).shape == (0, 4)
    # a push with duplicates sums them: SGD(lr=0.01) default
    before = client.pull("dup", np.array([5], np.int64))
    grads = torch.ones(len(ids), 4)
    assert client.push("dup", torch.from_numpy(ids), grads).result() == 5  # unique rows applied
    after = client.pull("dup", np.array([5], np.int64))
    np.testing.assert_allclose(after, before - 0.01 * 3, rtol=1e-6)


def test_write_rows_replaces_whole_rows_and_restarts_their_optimizer_state(client):
    client.create_table("written", dim=3, optimizer=ps.Adagrad(lr=0.1), initializer=ps.Uniform(low=-1, high=1))
    ids = np.array([4, -7, 2**62], np.int64)
    client.push("written", ids, np.ones((3, 3), np.float32)).result()  # accumulators grow
    rows = np.arange(9, dtype=np.float32).reshape(3, 3)
    assert client.write_rows("written", ids, rows) == 3
    np.testing.assert_array_equal(client.pull("written", ids, insert=False), rows)
    # the state restarted: the next step is a fresh row's first Adagrad step (lr * g / sqrt(g^2 + eps) ~ lr)
    client.push("written", ids, np.ones((3, 3), np.float32)).result()
    np.testing.assert_allclose(client.pull("written", ids), rows - 0.1, atol=1e-4)
    with pytest.raises(ps.InvalidArgument, match="table 'written': the ids to write repeat"):
        client.write_rows("written", np.array([1, 1]), np.zeros((2, 3), np.float32))
    with pytest.raises(ps.InvalidArgument, match="table 'written': rows of shape"):
        client.write_rows("written", ids, np.zeros((3, 4), np.float32))


def test_chunking_a_batch_above_4mib(make_shard_server):
    # Servers that refuse messages above 4 MiB: only chunked batches get through.
    handles = []
    for i in range(2):
        start, stop = routing.slot_range(i, 2)
        handles.append(make_shard_server(slots=f"{start}-{stop - 1}", max_message_bytes=4 << 20))
    dim, n = 64, 50_000  # 12.8 MB of fp32 rows, ~6.4 MB per shard
    ids = np.arange(n, dtype=np.int64) * 3
    grads = np.full((n, dim), 0.5, np.float32)
    ref = EmbeddingTable(TableConfig("big", dim, optimizer=ps.Adagrad(lr=0.1), seed=11))
    with ps.connect([h.address for h in handles], timeout_s=30) as client:
        client.create_table("big", dim=dim, optimizer=ps.Adagrad(lr=0.1), seed=11)
        rows = client.pull("big", ids)
        np.testing.assert_array_equal(rows, ref.pull(ids))
        assert client.push("big", ids, grads).result() == n
        ref.push(ids, grads)
        np.testing.assert_allclose(client.pull("big", ids), ref.pull(ids), rtol=1e-6, atol=1e-7)
        sent = client.stats()["bytes_sent"]["big"]["push"]
        assert sent > n * dim * 4  # the whole batch went, in messages under the servers' limit
        # one message above the limit would be refused, which is what chunking avoids
        with ps.connect([h.address for h in handles], chunk_bytes=16 << 20, max_message_bytes=64 << 20,
                        timeout_s=30) as unchunked, pytest.raises(ps.ResourceExhausted):
            unchunked.pull("big", ids)


def test_staleness_zero_reads_own_writes(client):
    client.create_table("ryw", dim=3, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(), staleness=0)
    ids = np.arange(200, dtype=np.int64)
    for k in range(1, 11):
        client.push("ryw", ids, np.ones((200, 3), np.float32))  # not waited for
        rows = client.pull("ryw", ids)
        np.testing.assert_array_equal(rows, np.full((200, 3), -float(k), np.float32))
    st = client.stats()["staleness"]["ryw"]
    assert st["bound"] == 0 and st["max"] == 0 and st["last"] == 0


def test_staleness_bound_and_fully_async(client):
    client.create_table("stale", dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(), staleness=2)
    ids = np.arange(64, dtype=np.int64)
    for i in range(1, 21):
        client.push("stale", ids, np.ones((64, 2), np.float32))
        rows = client.pull("stale", ids)
        # every row has all but at most the last 2 of this client's i pushes (each one subtracts 1)
        assert rows.min() >= -i and rows.max() <= -(i - 2), (i, rows.min(), rows.max())
    st = client.stats()["staleness"]["stale"]
    assert st["bound"] == 2 and st["max"] <= 2
    client.set_staleness("stale", None)
    fut = client.pull_async("stale", ids)
    assert isinstance(fut, cf.Future)
    assert fut.result(timeout=20).shape == (64, 2)
    client.flush()
    np.testing.assert_array_equal(client.pull("stale", ids), np.full((64, 2), -20.0, np.float32))
    stats = client.stats()
    assert stats["pushes"] == 20 and stats["pushes_in_flight"] == 0 and stats["pulls"] >= 22


class _OnTheWire:
    """Wraps a channel's Push callable: counts the push messages outstanding on the wire and keeps the peak."""

    def __init__(self, inner) -> None:
        self.inner, self.now, self.peak, self.sent = inner, 0, 0, 0
        self.lock = threading.Lock()

    def _done(self, _future) -> None:
        with self.lock:
            self.now -= 1

    def future(self, request, timeout=None):
        with self.lock:
            self.now += 1
            self.sent += 1
            self.peak = max(self.peak, self.now)
        fut = self.inner.future(request, timeout=timeout)
        fut.add_done_callback(self._done)  # runs before the client's own callback frees the slot
        return fut


class _FramesOnTheWire:
    """Wraps a server's Exchange stream: counts the push frames outstanding and keeps the peak."""

    def __init__(self, exchange) -> None:
        self.inner_send, self.now, self.peak, self.sent = exchange.send, 0, 0, 0
        self.lock = threading.Lock()

    def send(self, kind, parts, timeout_s, done):
        if kind != frames.PUSH:
            return self.inner_send(kind, parts, timeout_s, done)
        with self.lock:
            self.now += 1
            self.sent += 1
            self.peak = max(self.peak, self.now)

        def counted(reply, error):
            with self.lock:
                self.now -= 1
            done(reply, error)
        return self.inner_send(kind, parts, timeout_s, counted)


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_bounded_pushes_in_flight(shard_servers, transport):
    ref = EmbeddingTable(TableConfig("bp", 8, optimizer=ps.Adam(lr=0.01), seed=2))
    rng = np.random.default_rng(5)
    with ps.connect([h.address for h in shard_servers], max_pushes_in_flight=1, chunk_bytes=8192,
                    transport=transport) as client:
        client.create_table("bp", dim=8, optimizer=ps.Adam(lr=0.01), seed=2, staleness=None)
        wires = []
        for server in client._servers:  # count the real messages on each server's channel
            if transport == "unary":
                server.push = _OnTheWire(server.push)
                wires.append(server.push)
            else:
                wire = _FramesOnTheWire(server.exchange)
                server.exchange.send = wire.send
                wires.append(wire)
        futs = []
        for _ in range(10):
            ids = _zipf_ids(rng, 1500)
            grads = rng.normal(size=(ids.size, 8)).astype(np.float32)
            futs.append(client.push("bp", ids, grads))
            ref.pull(ids)
            ref.push(ids, grads)
        client.flush()
        assert all(f.done() and f.exception() is None for f in futs)
        # every push was several chunks per server, yet no server ever had more than one message outstanding
        assert all(w.sent > 10 and w.peak == 1 for w in wires), [(w.sent, w.peak) for w in wires]
        probe = np.unique(_zipf_ids(rng, 3000))
        np.testing.assert_allclose(client.pull("bp", probe), ref.pull(probe), rtol=1e-5, atol=1e-6)


def test_replayed_push_is_applied_once(shard_server, shard_stub):
    with ps.connect([shard_server.address]) as client:
        client.create_table("once", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        ids = np.array([1, 2, 3], np.int64)
        data, scales = wire.encode_block(np.ones((3, 4), np.float32), pb.CODEC_FP32)
        raw = wire.encode_push_request("once", ids, pb.CODEC_FP32, 4, data, scales, client.client_id, 10**6, 0)
        request = pb.PushRequest.FromString(raw)
        stub = shard_stub(shard_server.address)
        first, second = stub.Push(request), stub.Push(request)
        assert (first.applied_rows, first.duplicate) == (3, False)
        assert (second.applied_rows, second.duplicate) == (0, True)
        np.testing.assert_array_equal(client.pull("once", ids), -np.ones((3, 4), np.float32))
        # the client's own path: the same bytes through its channel are a duplicate too
        server = client._servers[0]
        assert server.push(raw, timeout=10).duplicate
        # exactly-once is per routing slot, not per message: the same seq cut into other parts (as after a map
        # change) is still a duplicate for the slots it applied to, and applies for slots it did not
        raw2 = wire.encode_push_request("once", ids, pb.CODEC_FP32, 4, data, scales, client.client_id, 10**6, 1)
        assert server.push(raw2, timeout=10).duplicate
        other = np.array([1, 2, 3, 4], np.int64)  # id 4 lies in a slot this seq never touched
        assert len(set(routing.slot_of(other).tolist())) == 4
        data4, scales4 = wire.encode_block(np.ones((4, 4), np.float32), pb.CODEC_FP32)
        raw3 = wire.encode_push_request("once", other, pb.CODEC_FP32, 4, data4, scales4, client.client_id, 10**6, 2)
        reply = server.push(raw3, timeout=10)
        assert (reply.applied_rows, reply.duplicate) == (1, False)
        np.testing.assert_array_equal(client.pull("once", other), -np.ones((4, 4), np.float32))


@pytest.mark.parametrize("codec,tol", [("fp16", 2e-3), ("bf16", 1.6e-2), ("int8", 1.6e-2)])
def test_compression_codecs_round_trip(client, codec, tol):
    name = f"c_{codec}"
    rng = np.random.default_rng(9)
    client.create_table(name, dim=16, optimizer=ps.SGD(lr=0.5), initializer=ps.Normal(std=0.5), seed=4,
                        compression=codec)
    ref = EmbeddingTable(TableConfig(name, 16, optimizer=ps.SGD(lr=0.5), initializer=ps.Normal(std=0.5), seed=4))
    ids = np.arange(0, 4000, 3, dtype=np.int64)
    exact = ref.pull(ids)
    got = client.pull(name, ids)
    scale = np.abs(exact).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - exact) <= tol * scale + 1e-7)
    grads = rng.normal(size=(ids.size, 16)).astype(np.float32)
    client.push(name, ids, grads).result()
    ref.push(ids, grads)
    after = ref.pull(ids)
    got = client.pull(name, ids)
    gscale = 0.5 * np.abs(grads).max(axis=1, keepdims=True) + np.abs(after).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - after) <= tol * gscale + 1e-6)
    # bytes counted per direction; compressed replies are smaller than fp32 ones
    stats = client.stats()
    received = stats["bytes_received"][name]["pull"]
    client.set_compression(name, "none")
    client.pull(name, ids)
    fp32_bytes = client.stats()["bytes_received"][name]["pull"] - received
    assert received / 2 < fp32_bytes * (0.55 if codec != "int8" else 0.35)
    assert stats["bytes_sent"][name]["push"] > 0 and stats["bytes_received"][name]["push"] > 0


def test_bad_inputs_name_table_and_field_and_change_nothing(client):
    client.create_table("bad", dim=4, optimizer=ps.SGD(lr=1.0), seed=1)
    ids = np.arange(10, dtype=np.int64)
    before = client.pull("bad", ids)
    checksums = {a: s["bad"]["checksum"] for a, s in client.server_stats("bad").items()}
    nan_grads = np.zeros((10, 4), np.float32)
    nan_grads[7, 2] = np.nan
    huge = np.zeros((10, 4), np.float32)
    huge[3, 1] = 2e19  # finite, but its square overflows float32: Adagrad/Adam/FTRL state would become Inf
    repeated = np.full((10, 4), 1e19, np.float32)  # each finite and small enough, summed over one id: 3e19
    cases = [
        (lambda: client.push("bad", ids, nan_grads), ps.InvalidArgument, r"table 'bad'.*'grads'.*NaN"),
        (lambda: client.push("bad", ids, np.full((10, 4), np.inf, np.float32)), ps.InvalidArgument, "NaN or Inf"),
        (lambda: client.push("bad", ids, huge), ps.InvalidArgument, r"table 'bad'.*'grads'.*2\*\*64.*nothing"),
        (lambda: client.push("bad", np.array([1, 1, 1, 2, 3, 4, 5, 6, 7, 8]), repeated), ps.InvalidArgument,
         r"'grads'.*summed over repeated ids"),
        (lambda: client.push("bad", ids, np.zeros((9, 4), np.float32)), ps.InvalidArgument, r"'bad'.*'grads'.*shape"),
        (lambda: client.push("bad", ids, np.zeros((10, 5), np.float32)), ps.InvalidArgument, r"'bad'.*'grads'"),
        (lambda: client.push("bad", ids, np.zeros((10, 4), np.int32)), ps.InvalidArgument, r"'grads'.*float"),
        (lambda: client.pull("bad", ids.astype(np.float32)), ps.InvalidArgument, r"table 'bad'.*'ids'.*integer"),
        (lambda: client.pull("nope", ids), ps.TableNotFound, "nope"),
        (lambda: client.push("nope", ids, nan_grads), ps.TableNotFound, "nope"),
        (lambda: client.create_table("bad", dim=8), ps.TableExists, "bad"),
        (lambda: client.create_table("x", dim=0), ps.InvalidArgument, r"table 'x'.*'dim'"),
        (lambda: client.create_table("x", dim=4, optimizer="adam"), ps.InvalidArgument, r"'x'.*'optimizer'"),
        (lambda: client.create_table("x", dim=4, staleness=-1), ps.InvalidArgument, r"'x'.*'staleness'"),
        (lambda: client.create_table("x", dim=4, compression="zstd"), ps.InvalidArgument, r"'x'.*'compression"),
        (lambda: client.create_table("x", dim=4, dtype="int4"), ps.InvalidArgument, r"'x'.*'dtype'"),
        (lambda: client.create_table("", dim=4), ps.InvalidArgument, "'name'"),
        (lambda: client.create_table("x", dim=4, memory_budget="lots"), ps.InvalidArgument, r"'x'.*'memory_budget'"),
        (lambda: client.create_table("x", dim=4, optimizer=ps.SGD(lr=float("nan"))), ps.InvalidArgument,
         r"'x'.*'optimizer.lr'"),
        (lambda: client.create_table("x", dim=4, initializer=ps.Normal(std=-1.0)), ps.InvalidArgument,
         r"'x'.*'initializer.std'"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()
    client.flush()
    np.testing.assert_array_equal(client.pull("bad", ids), before)
    assert {a: s["bad"]["checksum"] for a, s in client.server_stats("bad").items()} == checksums
    assert "x" not in client.list_tables()
    held = client.create_table("budgeted", dim=4, memory_budget="1MiB")  # a size string, as the CLI takes
    assert held.memory_budget == 1 << 20
    assert client.drop_table("budgeted")


def test_server_side_rejection_reaches_the_push_future(shard_server, shard_stub):
    with ps.connect([shard_server.address]) as client:
        client.create_table("dimcheck", dim=4)
        # another client recreates the table with another dim behind this client's back
        shard_stub(shard_server.address).DropTable(pb.DropTableRequest(table="dimcheck"))
        with ps.connect([shard_server.address]) as other:
            other.create_table("dimcheck", dim=6)
        fut = client.push("dimcheck", np.arange(3, dtype=np.int64), np.ones((3, 4), np.float32))
        with pytest.raises(ps.InvalidArgument, match="dimcheck"):
            fut.result(timeout=20)
        with pytest.raises(ps.InvalidArgument, match="dimcheck"):
            client.flush()
        client.flush()  # the error was reported once


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_raises_unavailable_naming_address():
    address = f"127.0.0.1:{_free_port()}"
    client = ps.connect([address], max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, timeout_s=5)
    try:
        with pytest.raises(ps.Unavailable, match=address.replace(".", r"\.") + r".*after 3 attempts"):
            client.create_table("t", dim=4)
        with pytest.raises(ps.Unavailable, match=address.replace(".", r"\.")):
            client.list_tables()
        with pytest.raises(ps.Unavailable, match=address.replace(".", r"\.")):
            client.wait_ready(timeout_s=0.2)
        assert client.stats()["retries"] >= 4
    finally:
        client.close()


def test_pull_async_prefetch_and_admin_calls(client, shard_servers):
    client.create_table("adm", dim=4, seed=5)
    assert client.create_table("adm", dim=4, seed=5).dim == 4  # exist_ok: identical spec is fine
    batches = [np.arange(i * 100, i * 100 + 300, dtype=np.int64) for i in range(4)]
    nxt = client.pull_async("adm", batches[0])
    for i in range(4):
        rows = nxt.result(timeout=20)
        if i + 1 < 4:
            nxt = client.pull_async("adm", batches[i + 1])  # prefetch while "computing"
        client.push("adm", batches[i], np.ones_like(rows))
    client.flush()
    assert "adm" in client.list_tables()
    info = client.describe_table("adm")
    assert info.config.dim == 4 and info.rows == 600 and set(info.shards) == {h.address for h in shard_servers}
    stats = client.server_stats("adm")
    assert set(stats) == {h.address for h in shard_servers}
    assert sum(s["adm"]["rows"] for s in stats.values()) == 600
    assert client.drop_table("adm") is True
    assert "adm" not in client.list_tables()
    with pytest.raises(ps.TableNotFound):
        client.pull("adm", batches[0])


def test_config_validation():
    with pytest.raises(ps.InvalidArgument, match="chunk_bytes"):
        ps.ClientConfig(chunk_bytes=10)
    with pytest.raises(ps.InvalidArgument, match="max_message_bytes"):
        ps.ClientConfig(chunk_bytes=64 << 20)
    with pytest.raises(ps.InvalidArgument, match="unknown config"):
        ps.connect(["127.0.0.1:1"], chunk=3)
    with pytest.raises(ps.InvalidArgument, match="addresses"):
        ps.connect([])
    c = ps.connect("127.0.0.1:1,127.0.0.1:2")
    assert c.addresses == ["127.0.0.1:1", "127.0.0.1:2"]
    c.close()


def test_local_cluster_of_daemons(shard_cluster):
    with ps.connect(shard_cluster.addresses, timeout_s=30) as client:
        client.create_table("lc", dim=16, optimizer=ps.Adagrad(lr=0.05), initializer=ps.Normal(std=0.01),
                            compression={"pull": "fp16", "push": "bf16"})
        ref = EmbeddingTable(TableConfig("lc", 16, optimizer=ps.Adagrad(lr=0.05), initializer=ps.Normal(std=0.01)))
        rng = np.random.default_rng(0)
        ids = _zipf_ids(rng, 5000)
        grads = rng.normal(size=(ids.size, 16)).astype(np.float32)
        ref.pull(ids)
        client.push("lc", ids, grads)
        ref.push(ids, grads)
        client.set_compression("lc", "none")
        np.testing.assert_allclose(client.pull("lc", ids), ref.pull(ids), atol=0.05 * 0.02)
        snaps = client.snapshot()
        assert set(snaps) == set(shard_cluster.addresses) and all(snaps.values())


def test_retries_reach_a_server_that_comes_up_late(make_shard_server):
    port = _free_port()
    client = ps.connect([f"127.0.0.1:{port}"], max_attempts=40, initial_backoff_s=0.05, max_backoff_s=0.2,
                        reconnect_backoff_s=0.05, timeout_s=10)
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            created = pool.submit(client.create_table, "late", dim=4)  # idempotent (exist_ok): retried
            handle = None
            try:
                while client.stats()["retries"] < 2 and not created.done():
                    cf.wait([created], timeout=0.02)
                handle = make_shard_server(port=port)
                assert created.result(timeout=30).dim == 4
            finally:
                if handle is None:
                    created.cancel()
        assert client.stats()["retries"] >= 2
        assert client.pull("late", np.arange(5)).shape == (5, 4)
    finally:
        client.close()


def test_snapshot_then_restore_rolls_back(client):
    client.create_table("snap", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
    ids = np.arange(100, dtype=np.int64)
    client.push("snap", ids, np.ones((100, 4), np.float32))  # snapshot() flushes first
    paths = client.snapshot()
    assert all(paths.values())
    client.push("snap", ids, np.ones((100, 4), np.float32)).result()
    np.testing.assert_array_equal(client.pull("snap", ids), np.full((100, 4), -2.0, np.float32))
    restored = client.restore()
    assert sum(restored.values()) == 100
    np.testing.assert_array_equal(client.pull("snap", ids), np.full((100, 4), -1.0, np.float32))


def test_restore_the_paths_a_snapshot_returned(client):
    for name in ("ra", "rb"):
        client.create_table(name, dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
    ids = np.arange(50, dtype=np.int64)
    for name in ("ra", "rb"):
        client.push(name, ids, np.ones((50, 2), np.float32))
    snap = client.snapshot()
    assert all(len(paths) == 2 for paths in snap.values())  # one per table on every shard
    for name in ("ra", "rb"):
        client.push(name, ids, np.ones((50, 2), np.float32))
    client.flush()
    assert sum(client.restore(snap).values()) == 100
    for name in ("ra", "rb"):
        np.testing.assert_array_equal(client.pull(name, ids), np.full((50, 2), -1.0, np.float32))
    with pytest.raises(ps.InvalidArgument, match="'path' names shard"):
        client.restore({"10.0.0.1:1": ["x"]})


@pytest.mark.parametrize("magnitude", [2.0**63, np.nextafter(np.float32(2.0**64), np.float32(0)), 2.0**64, 3e38])
def test_the_client_refuses_a_summed_gradient_exactly_from_grad_limit(magnitude: float) -> None:
    from tigana.ps import _kernels

    grads = np.zeros((3, 2), np.float32)
    grads[1, 0] = -np.float32(magnitude)
    ids = np.array([5, 6, 7], np.int64)
    *_, in_range = _kernels.dedup_sum_grouped(ids, grads, np.zeros(routing.DEFAULT_NUM_SLOTS, np.int64), 1)
    assert bool(in_range) == (abs(float(np.float32(magnitude))) < _kernels.GRAD_LIMIT)
