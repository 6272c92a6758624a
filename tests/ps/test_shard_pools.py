"""Sync pushes waiting for their copies cannot starve the replication and the maps into a server: ``Replicate``
and ``InstallMap`` run on the service's control pool, apart from the gRPC server's pool that unary pushes and
``ImportRows`` hold while they wait (``ps/shard/service.py``, ``add_to_server``).

A real shard daemon on loopback with a pool of two threads (``max_workers=2``, no streams); its map, installed
through ``InstallMap``, puts the copies of its sync table on a server where nothing listens (a paused copy):
every sync push waits ``ack_timeout_s`` for it, on a pool thread. No scheduler listens at its scheduler address:
the maps are what one would have sent."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import grpc
import numpy as np

from tigana.embeddings import SGD, TableConfig, Zeros
from tigana.proto import shard_pb2 as pb
from tigana.proto import shard_pb2_grpc
from tigana.ps.routing import IN_SYNC, ServerEntry, ShardMap, TableDef
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import start_server
from tigana.ps.wire import cluster as cluster_wire
from tigana.ps.wire import data as wire

SLOTS = 64


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections are refused


def test_replicate_and_install_map_are_served_while_waiting_sync_pushes_hold_every_pool_thread(tmp_path) -> None:
    handle = start_server(ServerConfig(port=0, num_slots=SLOTS, scheduler=f"127.0.0.1:{_closed_port()}",
                                       max_workers=2, max_streams=0, ack_timeout_s=5.0, replication_timeout_s=60.0,
                                       drain_grace_s=0.5, snapshot_on_shutdown=False))
    channel = grpc.insecure_channel(handle.address)
    pushes: list[grpc.Future] = []
    try:
        svc = handle.service
        deadline = time.monotonic() + 30
        while svc.state != "serving":  # loaded; it never registers (no scheduler listens): the test installs maps
            assert time.monotonic() < deadline, f"the server is {svc.state}"
            time.sleep(0.02)
        stub = shard_pb2_grpc.ShardStub(channel)
        spec = TableDef(TableConfig("t", dim=4, optimizer=SGD(lr=1.0), initializer=Zeros()), durability="sync",
                        created_epoch=1)
        servers = (ServerEntry(svc.server_id, handle.address, svc.boot),
                   ServerEntry("paused", f"127.0.0.1:{_closed_port()}", "b"))
        copies = np.stack([np.zeros(SLOTS, np.int32), np.ones(SLOTS, np.int32)], axis=1)
        m = ShardMap(5, SLOTS, 1, servers, copies, np.full(copies.shape, IN_SYNC, np.uint8),
                     np.zeros(SLOTS, np.uint64), {"t": spec})
        assert stub.InstallMap(pb.InstallMapRequest(map=cluster_wire.map_to_pb(m)), timeout=10).epoch == 5
        table = svc.tables.get("t").table
        for seq in (1, 2):  # one per pool thread, each waiting 5 s for the paused copy
            ids = np.arange(seq * 100, seq * 100 + 10, dtype=np.int64)
            request = pb.PushRequest(table="t", ids=wire.encode_ids(ids), client_id="c", seq=seq, epoch=5,
                                     grads=wire.encode_rows(np.ones((ids.size, 4), np.float32)))
            pushes.append(stub.Push.future(request, timeout=30))
        deadline = time.monotonic() + 10
        while not (table.contains(np.array([100, 200])).all()):  # both applied: both now wait on a pool thread
            assert time.monotonic() < deadline, "the pushes were never applied"
            time.sleep(0.01)
        assert not any(f.done() for f in pushes)

        started = time.monotonic()
        newer = m.evolve(tables={**m.tables})
        assert stub.InstallMap(pb.InstallMapRequest(map=cluster_wire.map_to_pb(newer)), timeout=2.0).epoch == 6
        replicate = channel.unary_unary("/tigana.v1.Shard/Replicate", request_serializer=lambda raw: raw,
                                        response_deserializer=pb.ReplicateResponse.FromString)
        raw = cluster_wire.encode_replicate_request("paused", "b", 1, 6, 1, [], 0)
        reply = replicate(raw, timeout=2.0)
        assert reply.reject == pb.REJECT_NONE and reply.epoch == 6
        assert time.monotonic() - started < 2.0
        assert not any(f.done() for f in pushes), "the pushes stopped waiting: the pool was not exhausted"
        names = {t.name for t in threading.enumerate()}
        assert any(n.startswith("tigana-control") for n in names)
    finally:
        for f in pushes:
            with contextlib.suppress(grpc.RpcError):  # UNAVAILABLE: the paused copy never acknowledged it
                f.result(timeout=30)
        channel.close()
        handle.close(grace=0.5)
