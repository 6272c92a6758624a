"""The membership agent's map refreshes: requests routed at a newer epoch are coalesced on one thread."""

import threading
import time

import pytest

from tigana.ps.membership import Agent
from tigana.ps.membership import agent as membership


class _Map:
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch


class _Reply:
    def __init__(self, epoch: int) -> None:
        self.map = _Map(epoch)

    def HasField(self, name: str) -> bool:  # noqa: N802 - the protobuf method's name
        return name == "map"


class _Stub:
    """A scheduler whose map is at ``epoch``; counts GetMap calls, each slow enough for requests to pile up."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.calls = epoch, 0

    def GetMap(self, request, timeout: float) -> _Reply:  # noqa: N802 - the gRPC method's name
        self.calls += 1
        time.sleep(0.01)
        return _Reply(self.epoch)


class _Service:
    server_id, boot = "s0", "b0"

    def __init__(self) -> None:
        self.epoch = 1

    def install(self, m: _Map) -> bool:
        if m.epoch <= self.epoch:
            return False
        self.epoch = m.epoch
        return True


@pytest.fixture
def agent(monkeypatch):
    monkeypatch.setattr(membership.cluster_wire, "map_from_pb", lambda m: m)
    service = _Service()
    a = Agent(service, "127.0.0.1:1", "127.0.0.1:2", heartbeat_interval_s=0.05)  # never started: no heartbeats
    a._stubs = [_Stub(epoch=7)]
    yield a
    a.close()


def test_a_thousand_wrong_shard_refreshes_start_one_thread_and_install_the_map(agent) -> None:
    """Regression (issue 16): refresh_soon started a thread per WrongShard request, so a burst of requests
    routed at a newer epoch started a thousand threads, each asking the scheduler for the same map."""
    before = threading.active_count()
    peak = before
    for k in range(1000):
        agent.refresh_soon(2 + k % 5)  # epochs 2..6, in any order
        peak = max(peak, threading.active_count())
    assert peak - before <= 1
    deadline = time.monotonic() + 10
    while agent.service.epoch < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert agent.service.epoch == 7  # the map was fetched and installed
    assert agent._stubs[0].calls < 50  # coalesced: not one GetMap per request
    agent.refresh_soon(8)  # the scheduler has 7: the refresher keeps asking (at the interval), on the same thread
    time.sleep(0.2)
    assert threading.active_count() - before <= 1
    agent._stubs[0].epoch = 9
    deadline = time.monotonic() + 10
    while agent.service.epoch < 9 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert agent.service.epoch == 9


def test_close_stops_the_refresher(agent) -> None:
    agent.refresh_soon(3)
    refresher = agent._refresher
    assert refresher is not None
    agent.close()
    assert not refresher.is_alive()
    agent.refresh_soon(50)  # after close: nothing starts
    assert agent._refresher is refresher


class _ClosedStub:
    """What grpc does once the agent's channel is closed: every call raises ValueError."""

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            raise ValueError("Cannot invoke RPC on closed channel!")
        return call


def test_calls_from_handlers_racing_close_return_quietly(agent) -> None:
    """Regression: a Replicate handler asking for a newer map while the server stopped logged "Replicate failed
    with a bug" and a traceback (the agent's channel was closed under the call). Once the agent is closing, a
    refresh or a report is not answered, quietly; before that, a closed channel is a bug and raises."""
    agent._stubs = [_ClosedStub()]
    with pytest.raises(ValueError):
        agent.refresh(50)
    with pytest.raises(ValueError):
        agent.handover_ready([1], 3)

    class _ClosingStub(_ClosedStub):  # ``close`` runs while the call is in flight
        def __getattr__(self, name: str):
            def call(*args, **kwargs):
                agent._stop.set()
                raise ValueError("Cannot invoke RPC on closed channel!")
            return call

    agent._stubs = [_ClosingStub()]
    agent.refresh(50)
    agent._stop.clear()
    assert agent.copy_caught_up("t", [1, 2], 3) is None
    agent._stubs = [_ClosedStub()]
    agent.close()
    agent.refresh(50)  # nothing raised: the server is stopping
    assert agent.copy_caught_up("t", [1, 2], 3) is None
    agent.handover_ready([1], 3)
    assert agent.service.epoch == 1
