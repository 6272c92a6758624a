"""The client's optional ports (``ClientPorts.describe_table``, ``on_push``): a caller that runs the client on
its own I/O (the simulator) learns each push's exactly-once key, also when a part goes again under a new
session, and answers table descriptions, through public seams only; against a real shard server."""

from __future__ import annotations

import numpy as np

from tigana import ps
from tigana.embeddings import TableConfig
from tigana.ps.client import Client
from tigana.ps.client.ports import ClientPorts, PushKeyed
from tigana.ps.client.tables import TableInfo
from tigana.ps.session import client_stamp


def test_on_push_tells_each_key_a_push_takes_also_under_a_new_session(shard_server) -> None:
    keys: list[PushKeyed] = []
    with ps.connect([shard_server.address]) as admin:
        admin.create_table("s", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
    with Client([shard_server.address], ports=ClientPorts(on_push=keys.append)) as client:
        ids = np.array([7, 3, 3, 5], np.int64)
        client.push("s", ids, np.ones((4, 4), np.float32)).result()
        first = client.client_id
        assert [(k.table, k.client_id, k.seq, k.of) for k in keys] == [("s", first, 1, None)]
        np.testing.assert_array_equal(np.sort(keys[0].ids), [3, 5, 7])  # the distinct ids sent under it
        # The server's window forgets this client: the next push is refused as unknown and sent again under a
        # new session and seq, which the port is told, with the key the push started with.
        window = shard_server.service.tables.get("s").dedup
        window.max_clients = 1
        with ps.connect([shard_server.address]) as other:
            other.push("s", np.array([9], np.int64), np.ones((1, 4), np.float32)).result()
        assert window.horizon >= client_stamp(first)
        client.push("s", np.array([1, 2], np.int64), np.ones((2, 4), np.float32)).result()
        assert client.client_id != first
        assert [(k.client_id, k.seq, k.of) for k in keys[1:]] == [(first, 2, None),
                                                                   (client.client_id, 3, (first, 2))]
        np.testing.assert_array_equal(np.sort(keys[2].ids), [1, 2])
        np.testing.assert_array_equal(client.pull("s", np.array([1, 2, 3])), -np.array([[1.0], [1.0], [2.0]]) * np.ones(4))


def test_describe_table_port_answers_the_clients_table_questions(shard_server) -> None:
    asked: list[str] = []

    def describe(name: str) -> TableInfo:
        asked.append(name)
        return TableInfo(TableConfig(name, dim=4), {})

    with ps.connect([shard_server.address]) as admin:
        admin.create_table("d", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
    with Client([shard_server.address], ports=ClientPorts(describe_table=describe)) as client:
        client.push("d", np.array([1], np.int64), np.ones((1, 4), np.float32)).result()  # its width: asked once
        client.push("d", np.array([2], np.int64), np.ones((1, 4), np.float32)).result()
        assert asked == ["d"]
        assert client.describe_table("d").config.dim == 4 and asked == ["d", "d"]
        np.testing.assert_array_equal(client.pull("d", np.array([1, 2])), -np.ones((2, 4), np.float32))
