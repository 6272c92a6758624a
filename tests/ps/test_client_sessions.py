"""Exactly-once for a client the server's window forgot (issue 16): a late retry is refused, never applied
twice; a new push from the forgotten client goes on under a new session (Kafka's UNKNOWN_PRODUCER_ID)."""

import grpc
import numpy as np
import pytest

from tigana import ps
from tigana.proto import shard_pb2 as pb
from tigana.ps.errors import UnknownClient, from_rpc_error
from tigana.ps.session import client_stamp, new_client_id
from tigana.ps.wire import data as wire


def _raw_push(table: str, ids: np.ndarray, client_id: str, seq: int) -> bytes:
    data, scales = wire.encode_block(np.ones((ids.size, 4), np.float32), pb.CODEC_FP32)
    return wire.encode_push_request(table, ids, pb.CODEC_FP32, 4, data, scales, client_id, seq, 0)


def test_a_forgotten_clients_retry_is_refused_and_its_next_push_starts_a_new_session(shard_server) -> None:
    ids = np.array([1, 2, 3], np.int64)
    with ps.connect([shard_server.address]) as client:
        client.create_table("s", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        server = client._servers[0]
        first_id = client.client_id
        raw = _raw_push("s", ids, first_id, 10**6)
        assert server.push(raw, timeout=60).applied_rows == 3
        window = shard_server.service.tables.get("s").dedup
        window.max_clients = 1
        other = new_client_id()
        assert server.push(_raw_push("s", np.array([9], np.int64), other, 1), timeout=60).applied_rows == 1
        assert window.horizon == client_stamp(first_id)  # the client was dropped from the window
        with pytest.raises(grpc.RpcError) as caught:  # its late retry: refused, not applied a second time
            server.push(raw, timeout=60)
        refused = from_rpc_error(caught.value)
        assert isinstance(refused, UnknownClient) and refused.horizon == window.horizon
        np.testing.assert_array_equal(client.pull("s", ids), -np.ones((3, 4), np.float32))
        # a new push (never sent before, so nothing of it can have been applied): refused as unknown, then
        # sent again by the client under a new session stamped above the horizon; applied once
        client.push("s", ids, np.ones((3, 4), np.float32))
        client.flush()
        assert client.client_id != first_id and client_stamp(client.client_id) > window.horizon
        np.testing.assert_array_equal(client.pull("s", ids), -2 * np.ones((3, 4), np.float32))
        assert client.stats()["push_errors"] == 0



def test_a_part_that_may_have_been_applied_is_not_resent_under_a_new_session() -> None:
    """UnknownClient after an attempt whose outcome is unknown (a deadline, an Unavailable after the apply):
    the push may have been applied under the old session, so the part fails instead of going again."""
    from tigana.ps.client.inflight import _NOTHING_APPLIED, Attempt, PushOp
    from tigana.ps.errors import DeadlineExceeded, Unavailable, WrongShard

    # the answers that prove nothing was applied keep a retried part eligible; the others do not
    assert isinstance(UnknownClient("x"), _NOTHING_APPLIED) and isinstance(WrongShard("x"), _NOTHING_APPLIED)
    assert not isinstance(DeadlineExceeded("x"), _NOTHING_APPLIED) and not isinstance(Unavailable("x"),
                                                                                        _NOTHING_APPLIED)
    op = PushOp.__new__(PushOp)  # only the attempt is read before the decision
    op.attempt = Attempt(2, float("inf"), None, refused=False)
    assert not op._new_session(UnknownClient("horizon=5"), 0, 1, lambda *_: None)
    assert Attempt(1, float("inf")).refused  # a first attempt was never sent: nothing of it can be applied
