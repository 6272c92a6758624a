"""The thread and gRPC adapter of a shard server's membership (the decisions are ``core.Membership``).

The ``Agent`` runs one thread: it asks the core which call to make (register, then a heartbeat every
``heartbeat_interval_s``, sent without waiting for the earlier ones' answers), makes it, installs any newer
map that comes back and hands the outcome to the core. It also carries the service's reports (a copy failed,
a copy caught up, a hand-over ready) and map refreshes. Refreshes asked for by requests (``refresh_soon``) are
coalesced by the core: one refresher thread, started on first use, fetches the map while the highest epoch
wanted is above ours. A report whose answer names a newer epoch hands it to that refresher, never installs on
the reporting thread: a report may run inside ``refresh`` or an install's actions. While the scheduler is down
the server keeps serving on the map it holds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from tigana.proto import scheduler_pb2 as spb
from tigana.proto import scheduler_pb2_grpc as spb_grpc
from tigana.ps.channels import reconnect_options
from tigana.ps.domains import FailureDomain
from tigana.ps.membership.core import REGISTER, Membership, caught_up_answer
from tigana.ps.security import NONE, Security
from tigana.ps.wire import cluster as cluster_wire

log = logging.getLogger("tigana.ps.membership")


class Agent:
    """The link of one ``ShardService`` to its scheduler(s) (``scheduler``: "host:port[,host:port]")."""

    def __init__(self, service, scheduler: str, address: str, *, heartbeat_interval_s: float = 0.5,
                 lease_s: float = 2.0, security: Security = NONE, domain: FailureDomain = FailureDomain(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.clock = clock  # the lease's and the heartbeats' clock (the simulator's world gives its own)
        self.domain = domain  # where this server runs, sent with every Register
        self.addresses = [a.strip() for a in scheduler.split(",") if a.strip()]
        self.address = address
        self.interval = heartbeat_interval_s
        self.core = Membership(heartbeat_interval_s, lease_s, schedulers=len(self.addresses))
        options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
                   *reconnect_options()]
        self._security, self._options = security, options
        self._channels = [security.channel(a, options) for a in self.addresses]
        self._stubs = [spb_grpc.SchedulerStub(c) for c in self._channels]
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._refresh_lock = threading.Lock()
        self._wanted_cond = threading.Condition()  # guards the core's ``wanted``
        self._refresher: threading.Thread | None = None
        self._answers: queue.SimpleQueue = queue.SimpleQueue()  # (future, sent, scheduler index) of heartbeats
        self._thread = threading.Thread(target=self._run, name="tigana-agent", daemon=True)

    @property
    def stub(self) -> spb_grpc.SchedulerStub:
        return self._stubs[self.core.current]

    def _next(self) -> None:
        """The next scheduler; with one address (a Service over a leader and standbys), a new connection."""
        self.core.next_scheduler()
        if len(self.addresses) == 1:  # the old channel is not closed: calls in flight on it finish or fail
            self._channels[0] = self._security.channel(self.addresses[0], self._options)
            self._stubs[0] = spb_grpc.SchedulerStub(self._channels[0])

    def start(self) -> None:
        self._thread.start()

    @property
    def registered(self) -> bool:
        return self.core.registered

    def lease_ok(self) -> bool:
        return self.core.lease_ok(self.clock())

    # --- the loop ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the answers are read: one that lands after it wakes the wait below
            self._wake.wait(self.run_once())

    def run_once(self) -> float:
        """One pass of the agent's loop: take the heartbeats' answers, then register or heartbeat when one is
        due. Returns the seconds until the next pass is due (sooner when an answer comes: ``_answers_in``).
        The daemon's thread calls it in a loop; the simulator from its events."""
        wait = self.interval
        try:
            self._answers_in()
            if self.core.next_call() == REGISTER:
                self._register()
            else:
                wait = self.core.beat_due(self.clock())
                if wait <= 0:
                    self._heartbeat()
                    wait = self.core.beat_due(self.clock())
        except grpc.RpcError as err:  # a register failed
            log.debug("scheduler call failed: %s", err.code().name)
            self._next()
            wait = self.core.call_failed()
        except Exception:  # noqa: BLE001 - keep the server in the cluster whatever happened
            log.exception("membership loop")
        return wait

    def _register(self) -> None:
        s = self.service
        sent = self.clock()
        reply = self.stub.Register(spb.RegisterRequest(server_id=s.server_id, address=self.address, boot=s.boot,
                                                       positions=s.positions(),
                                                       domain=cluster_wire.domain_to_pb(self.domain)), timeout=5.0)
        s.install(cluster_wire.map_from_pb(reply.map))
        self.core.registered_ok(sent)
        log.info("registered with the scheduler at %s as %s (boot %s)", self.addresses[self.core.current],
                 s.server_id, s.boot)

    def _heartbeat(self) -> None:
        """Send a heartbeat without waiting for its answer (``_answers_in`` takes it): heartbeats keep their
        cadence over a slow link, and the lease with them (``core``). The deadline is the lease: a slow link
        (a round trip under the scheduler's timeout) must not fail heartbeats. While the core searches for the
        leader, the heartbeat goes to every scheduler at once."""
        s = self.service
        stats = {**s.cluster_figures(), **s.load_figures()}
        request = spb.HeartbeatRequest(server_id=s.server_id, boot=s.boot, epoch=s.epoch, stats=stats)
        targets, sent = self.core.targets(), self.clock()
        self.core.beat_sent(sent, len(targets))
        for which in targets:
            future = self._stubs[which].Heartbeat.future(request, timeout=max(1.0, self.core.lease_s))

            def answered(f: grpc.Future, which: int = which) -> None:  # on a gRPC thread: to the agent's loop
                self._answers.put((f, sent, which))
                self._wake.set()

            future.add_done_callback(answered)

    def _answers_in(self) -> None:
        """Take the heartbeats' answers in the order they came: install each map, then renew the lease (it
        renews only once the map its answer returned is installed); a failure tries the next scheduler."""
        while True:
            try:
                future, sent, which = self._answers.get_nowait()
            except queue.Empty:
                return
            try:
                reply = future.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as err:
                code = err.code().name if isinstance(err, grpc.RpcError) else "CANCELLED"
                log.debug("heartbeat to %s failed: %s", self.addresses[which], code)
                current = which == self.core.current
                self.core.heartbeat_failed(self.clock(), which)
                if current and len(self.addresses) == 1:  # one address: a new connection
                    self._next()
                continue
            if reply.reregister:
                self.core.heartbeat_answered(sent, True, which)
                continue
            if reply.HasField("map"):
                self.service.install(cluster_wire.map_from_pb(reply.map))
            self.core.heartbeat_answered(sent, False, which)

    # --- calls from the service ---------------------------------------------------------------------------
    def refresh(self, epoch: int = 0, wait_s: float = 0.0) -> None:
        """Fetch and install the scheduler's map if newer than ours (waiting up to ``wait_s`` for one at
        least as new as ``epoch``)."""
        with self._refresh_lock:
            s = self.service
            if (epoch and s.epoch >= epoch) or self._stop.is_set():
                return
            try:
                reply = self.stub.GetMap(spb.GetMapRequest(known_epoch=s.epoch, wait_s=wait_s),
                                         timeout=wait_s + 2.0)
            except grpc.RpcError:
                self._next()
                return
            except ValueError:  # grpc's "closed channel": a call from a handler raced ``close``
                if not self._stop.is_set():
                    raise
                return
            if reply.HasField("map"):
                s.install(cluster_wire.map_from_pb(reply.map))

    def refresh_soon(self, epoch: int) -> None:
        """Non-blocking: have the refresher fetch a map at least as new as ``epoch`` soon. Thread-safe; calls
        coalesce (one refresher thread for the agent's life, asking for the highest epoch wanted)."""
        with self._wanted_cond:
            if self._stop.is_set() or not self.core.want(epoch):
                return
            self._wake_refresher()

    def _wake_refresher(self) -> None:
        """(Under ``_wanted_cond``.) Have the refresher run ``refresh_pass`` until the map is as new as wanted:
        its thread, started on first use (the simulator runs the passes from its events instead)."""
        if self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh_loop, name="tigana-agent-refresh", daemon=True)
            self._refresher.start()
        self._wanted_cond.notify()

    def _refresh_loop(self) -> None:
        """The refresher: while the highest epoch wanted is above ours, fetch the map (every heartbeat
        interval while the scheduler does not have it or cannot be reached)."""
        while True:
            with self._wanted_cond:
                while not self._stop.is_set() and not self.core.wants_more(self.service.epoch):
                    self._wanted_cond.wait()
                if self._stop.is_set():
                    return
            if self.refresh_pass():
                self._stop.wait(self.interval)

    def refresh_pass(self) -> bool:
        """One pass of the refresher: fetch the map the highest epoch wanted asks for. True: ours is still older
        (the scheduler does not have it or cannot be reached): the next pass waits a heartbeat interval."""
        with self._wanted_cond:
            wanted = self.core.wanted
        try:
            self.refresh(wanted)
        except Exception:  # noqa: BLE001 - the refresher outlives a bad reply
            log.exception("map refresh")
        return self.service.epoch < wanted

    def report_copy_failure(self, target: str, slots: np.ndarray, reason: str, epoch: int = 0) -> None:
        """Report that ``target``'s copies of ``slots`` failed, as seen at map ``epoch`` (0: the map installed
        now): the scheduler keeps the copies of slots that changed after it."""
        self._report("ReportCopyFailure", spb.ReportCopyFailureRequest(
            reporter=self.service.server_id, epoch=epoch or self.service.epoch, target=target,
            slots=np.asarray(slots, "<i4").tobytes(), reason=reason[:500]))

    def copy_caught_up(self, target: str, slots: np.ndarray, since_epoch: int) -> bool | None:
        """Report a slot copy (started at map epoch ``since_epoch``) caught up. False: the scheduler refused
        it as stale (the copy was removed or demoted after the slot copy started); None: not answered."""
        reply = self._report("CopyCaughtUp", spb.CopyCaughtUpRequest(
            reporter=self.service.server_id, epoch=self.service.epoch, target=target,
            slots=np.asarray(slots, "<i4").tobytes(), since_epoch=since_epoch))
        if reply is None:
            return None
        return caught_up_answer(reply.accepted, reply.message)

    def handover_ready(self, slots: np.ndarray, epoch: int) -> None:
        """Report that this primary refuses writes to ``slots`` and its in-sync copies hold all it wrote."""
        self._report("HandoverReady", spb.HandoverReadyRequest(
            reporter=self.service.server_id, epoch=epoch, slots=np.asarray(slots, "<i4").tobytes()))

    def report_unreachable(self, address: str) -> None:
        self._report("ReportUnreachable", spb.ReportUnreachableRequest(address=address,
                                                                        reporter=self.service.server_id))

    def _report(self, method: str, request) -> spb.ReportResponse | None:
        if self._stop.is_set():
            return None  # stopping: not answered (the channels are being closed)
        try:
            reply = getattr(self.stub, method)(request, timeout=5.0)
        except grpc.RpcError as err:
            log.warning("%s to the scheduler failed (%s); it is retried", method, err.code().name)
            self._next()
            return None
        except ValueError:  # grpc's "closed channel": a call from a handler raced ``close``
            if not self._stop.is_set():
                raise
            return None
        if reply.epoch > self.service.epoch:
            # the refresher fetches it: a report runs where the caller is (a sender, the hand-over thread, a map's
            # actions, even inside ``refresh``), and an install from here waited on locks its caller may hold
            self.refresh_soon(reply.epoch)
        return reply

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._wanted_cond:
            self._wanted_cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        if self._refresher is not None and self._refresher.is_alive():
            self._refresher.join(timeout=5.0)
        for c in self._channels:
            c.close()
