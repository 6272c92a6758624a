"""The real membership agent in the simulated world: ``tigana.ps.membership.Agent`` over the world's network.

``RealSimAgent`` is the daemon's ``Agent`` with only its I/O replaced, the way ``nodes.py`` replaces the
servers': its scheduler channels are ``SchedulerChannel``s, whose calls travel over the ``Net`` to the real
``SchedulerService`` handlers of the scheduler node's current core (the gRPC wrapper's body, without its
context); its loop (``Agent.run_once``) and its refresher (``Agent.refresh_pass``) run from the world's
events instead of threads, on the server's clock. So what the daemon's agent does is what runs here:
registration, heartbeats sent without waiting for the earlier ones' answers, the lease, and the refresh of
the map when a report's answer names a newer epoch (handed to the refresher, never installed on the
reporting caller: ``Agent._report``).

Blocking calls (register, a map fetch, reports) are answered at once (``Net.now_call``: the simulation's
simplification for calls a server makes from inside another step); heartbeats travel with the network's
delays and losses. A lost call fails with UNAVAILABLE, a refused one with the status the daemon's scheduler
would answer (``errors.to_status``); a bug in a handler is raised, a test failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from tigana.proto import scheduler_pb2 as spb
from tigana.ps.errors import PSError, to_status
from tigana.ps.membership.agent import Agent
from tigana.ps.scheduler.service import SchedulerService
from tigana.tools.testing.sim.world import Lost

__all__ = ["RealSimAgent", "SchedulerChannel"]

SCHEDULER = "scheduler"


class CallFailed(grpc.RpcError):
    """A scheduler call that failed, as the agent's gRPC stub raises it (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Future:
    """A heartbeat's answer to come (the part of ``grpc.Future`` the agent uses)."""

    def __init__(self) -> None:
        self._done: list[Callable[[_Future], None]] = []
        self._result: Any = None
        self._error: BaseException | None = None
        self.settled = False

    def settle(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error, self.settled = result, error, True
        for fn in self._done:
            fn(self)

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[[_Future], None]) -> None:
        if self.settled:
            fn(self)
        else:
            self._done.append(fn)


class _Method:
    """One scheduler method of a ``SchedulerChannel``: called (answered at once) or ``future`` (over the net)."""

    def __init__(self, channel: SchedulerChannel, name: str) -> None:
        self.channel, self.name = channel, name

    def _handler(self, request: Any) -> Callable[[], Any]:
        node = self.channel.scheduler
        if self.name == "GetMap" and request.wait_s > 0:  # no long poll on one thread: asked and answered now
            request = spb.GetMapRequest(known_epoch=request.known_epoch, wait_s=0.0)
        method = getattr(SchedulerService, self.name).__wrapped__  # the handler, without the gRPC guard

        def handle() -> Any:
            try:
                return method(SchedulerService(lambda: node.core), request, None)
            except PSError as exc:
                code, message = to_status(exc)
                raise CallFailed(code, message) from None
        return handle

    def __call__(self, request: Any, timeout: float | None = None, **_: Any) -> Any:
        ch = self.channel
        try:
            reply = ch.net.now_call(ch.src, SCHEDULER, self._handler(request))
        except Lost as exc:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        late = ch.late_s()
        if self.name == "CopyCaughtUp" and late > 0:
            self._again(request, late)
        return reply

    def _again(self, request: Any, late: float) -> None:
        """The fault ``late_reports``: a retried report whose first answer was lost arrives again, unchanged,
        ``late`` seconds later."""
        ch = self.channel
        world = ch.net.world

        def again() -> None:
            try:
                reply = ch.net.now_call(ch.src, SCHEDULER, self._handler(request))
            except (Lost, CallFailed):
                return
            slots = np.frombuffer(request.slots, "<i4").tolist()
            world.log(f"late caught-up report {request.reporter} -> {request.target} (slot copy of epoch "
                      f"{request.since_epoch}, slots {slots[:8]}): {(reply.accepted, reply.message)}")
        world.at(late, again)

    def future(self, request: Any, timeout: float | None = None, **_: Any) -> _Future:
        ch = self.channel
        fut = _Future()

        def reply(result: Any, error: BaseException | None) -> None:
            if isinstance(error, Lost):
                error = CallFailed(grpc.StatusCode.UNAVAILABLE, str(error))
            elif error is not None and not isinstance(error, CallFailed):
                raise error  # a bug in the scheduler: a test failure
            fut.settle(result, error)
            ch.answered()

        ch.net.call(ch.src, SCHEDULER, self._handler(request), reply, timeout_s=timeout or 1.0)
        return fut


class SchedulerChannel:
    """What ``spb_grpc.SchedulerStub`` is built on: every method over the world's ``Net`` to ``scheduler``
    (a ``SchedulerNode``: its current core answers). ``answered()`` runs after a heartbeat's answer lands."""

    def __init__(self, net: Any, src: str, scheduler: Any, answered: Callable[[], None],
                 late_s: Callable[[], float] = lambda: 0.0) -> None:
        self.net, self.src, self.scheduler, self.answered = net, src, scheduler, answered
        self.late_s = late_s  # > 0: caught-up reports are delivered again this much later (a fault)

    def unary_unary(self, path: str, *args: Any, **kwargs: Any) -> _Method:
        return _Method(self, path.rsplit("/", 1)[-1])

    def close(self) -> None:
        return None


class _Security:
    def __init__(self, make: Callable[[], SchedulerChannel]) -> None:
        self.make = make

    def channel(self, address: str, options: list) -> SchedulerChannel:
        return self.make()


class RealSimAgent(Agent):
    """The daemon's ``Agent`` of ``server`` (a ``SimServer``), its loop and refresher run by the world."""

    def __init__(self, server: Any) -> None:
        self.server = server
        security = _Security(lambda: SchedulerChannel(server.net, server.name, server.scheduler, self._woken,
                                                       server.late_reports_s))
        super().__init__(server.svc, SCHEDULER, server.name, heartbeat_interval_s=0.5,
                         lease_s=server.config.lease_s, security=security, domain=server.domain,
                         clock=server.clock)
        self._refreshing = False
        server.world.at(0.0, self._loop)

    def _current(self) -> bool:
        """Whether this agent's process is the server's live one (a crash made a new one, or none)."""
        return self.server.agent is self and self.server.alive

    def _loop(self) -> None:
        """The agent's thread: a pass, then the next when it is due; a paused process does nothing."""
        s = self.server
        if not self._current():
            return
        wait = self.run_once() if s.up else self.interval
        s.world.at(max(wait, 0.001), self._loop)

    def _woken(self) -> None:
        """A heartbeat's answer landed: the loop takes it now (the daemon's ``_wake``)."""
        if self._current() and self.server.up:
            self._answers_in()

    def _wake_refresher(self) -> None:
        if not self._refreshing:  # one refresher, as the daemon's thread: passes until the map is as new
            self._refreshing = True
            self.server.world.at(0.01, self._refresh)

    def _refresh(self) -> None:
        s = self.server
        if not self._current():
            self._refreshing = False
            return
        if s.up and not self.core.wants_more(s.svc.epoch):
            self._refreshing = False
            return
        if not s.up or self.refresh_pass():
            s.world.at(self.interval, self._refresh)
        else:
            self._refreshing = False
