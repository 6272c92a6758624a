"""A client's copy of the shard map, kept fresh: a long poll on the scheduler, plus refreshes on demand.

``MapFollower`` fetches the map at connect, then long-polls ``GetMap`` (answered as soon as the epoch moves
past the one it holds), and fetches at once when the data path asks (a ``WrongShard`` names a newer epoch,
a server is unreachable). It also tells the scheduler about unreachable servers, so a dead one is found by a
probe in well under the heartbeat timeout. Thread-safety: callbacks run on its own threads.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import grpc

from tigana.proto import scheduler_pb2 as spb
from tigana.proto import scheduler_pb2_grpc as spb_grpc
from tigana.ps.errors import DeadlineExceeded, Unavailable, from_rpc_error
from tigana.ps.routing import ShardMap
from tigana.ps.wire import cluster as cluster_wire

log = logging.getLogger("tigana.ps.mapfollower")


class MapFollower:
    """Follows the map of the scheduler(s) at ``addresses`` ("host:port[,host:port]"); ``on_map`` gets every
    newer map. ``stub`` is the scheduler stub for other calls (tables)."""

    def __init__(self, addresses: str, on_map: Callable[[ShardMap], None], options: list,
                 poll_s: float = 10.0, channel: Callable[[str, list], grpc.Channel] | None = None) -> None:
        self.addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if not self.addresses:
            raise Unavailable("scheduler: no address given")
        self.on_map = on_map
        self.poll_s = poll_s
        make = channel or (lambda a, o: grpc.insecure_channel(a, options=o))
        self._make, self._options = make, options
        self._channels = [make(a, options) for a in self.addresses]
        self._stubs = [spb_grpc.SchedulerStub(c) for c in self._channels]
        self._which = 0
        self.epoch = 0
        self._lock = threading.Lock()
        self._fetching = False
        self._reported: dict[str, float] = {}
        self._stop = threading.Event()
        self.refreshes = 0
        self._thread: threading.Thread | None = None

    @property
    def stub(self) -> spb_grpc.SchedulerStub:
        return self._stubs[self._which % len(self._stubs)]

    @property
    def address(self) -> str:
        return self.addresses[self._which % len(self.addresses)]

    def _failover(self) -> None:
        """Move on to the next scheduler. With one address (a Kubernetes Service in front of a leader and its
        standbys) dial it again instead: the open connection would keep reaching the same, refusing pod."""
        self._which += 1
        if len(self.addresses) == 1:  # the old channel is not closed: calls in flight on it finish or fail
            self._channels[0] = self._make(self.addresses[0], self._options)
            self._stubs[0] = spb_grpc.SchedulerStub(self._channels[0])

    def fetch(self, timeout_s: float) -> ShardMap:
        """The scheduler's map (blocking up to ``timeout_s``). A scheduler that has no map yet (no shard server
        has registered: a cold server compiles its kernels for seconds) is long-polled until its first map;
        ``Unavailable`` when none comes in time (saying so) or no scheduler answers (naming them)."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            try:
                # known_epoch=0: a map (epoch >= 1: a server has registered) is answered at once; the empty
                # one (epoch 0) is held by the scheduler until the first registration or wait_s
                reply = self.stub.GetMap(spb.GetMapRequest(known_epoch=0, wait_s=max(0.0, min(left - 0.5, 30.0))),
                                         timeout=max(0.5, left))
                if reply.HasField("map"):
                    m = cluster_wire.map_from_pb(reply.map)
                    self._deliver(m)
                    return m
                last = None  # the scheduler answered: it has no map yet
            except grpc.RpcError as err:
                last = from_rpc_error(err, self.address)
                if not isinstance(last, (Unavailable, DeadlineExceeded)):
                    raise last from None  # refused (credentials, ...): another try would be refused too
                self._failover()
            if time.monotonic() >= deadline:
                if last is None:
                    raise Unavailable(f"scheduler {self.address}: no shard server has registered with the scheduler "
                                      f"yet (waited {timeout_s:g}s for its first shard map)")
                raise Unavailable(f"scheduler {','.join(self.addresses)}: {last}") from None
            time.sleep(0.1)  # a scheduler not up yet, or shutting down, answers at once: no spin on it

    def start(self) -> None:
        self._thread = threading.Thread(target=self._poll, name="tigana-map-follower", daemon=True)
        self._thread.start()

    def _deliver(self, m: ShardMap) -> None:
        with self._lock:
            if m.epoch <= self.epoch:
                return
            log.debug("map epoch %d (had %d)", m.epoch, self.epoch)
            self.epoch = m.epoch
            self.refreshes += 1
            self.on_map(m)

    def _poll(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                reply = self.stub.GetMap(spb.GetMapRequest(known_epoch=self.epoch, wait_s=self.poll_s),
                                         timeout=self.poll_s + 5.0)
                if reply.HasField("map"):
                    self._deliver(cluster_wire.map_from_pb(reply.map))
                backoff = 0.1
            except grpc.RpcError:
                if self._stop.is_set():
                    return
                self._failover()
                self._stop.wait(backoff)
                backoff = min(2.0, backoff * 2)
            except ValueError:  # channel closed
                return
            except Exception:  # noqa: BLE001 - keep following whatever happened
                log.exception("map follower")
                self._stop.wait(1.0)

    def refresh(self, min_epoch: int = 0) -> None:
        """Fetch the map now unless one at least as new as ``min_epoch`` is here (non-blocking; one fetch at
        a time)."""
        with self._lock:
            if (min_epoch and self.epoch >= min_epoch) or self._fetching or self._stop.is_set():
                return
            self._fetching = True

        def run() -> None:
            try:
                reply = self.stub.GetMap(spb.GetMapRequest(known_epoch=self.epoch, wait_s=0.0), timeout=5.0)
                if reply.HasField("map"):
                    self._deliver(cluster_wire.map_from_pb(reply.map))
            except (grpc.RpcError, ValueError):
                self._failover()
            finally:
                with self._lock:
                    self._fetching = False

        threading.Thread(target=run, name="tigana-map-refresh", daemon=True).start()

    def report_unreachable(self, address: str) -> None:
        """Tell the scheduler (at most once a second per address) that ``address`` did not answer."""
        now = time.monotonic()
        with self._lock:
            if now - self._reported.get(address, -1e9) < 1.0 or self._stop.is_set():
                return
            self._reported[address] = now
        with contextlib.suppress(grpc.RpcError, ValueError):
            self.stub.ReportUnreachable.future(spb.ReportUnreachableRequest(address=address, reporter="client"),
                                               timeout=2.0)

    def close(self) -> None:
        self._stop.set()
        for c in self._channels:
            c.close()
