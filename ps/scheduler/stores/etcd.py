"""The scheduler's state in etcd, and the leader election that fences every write to it.

``tigana scheduler --store etcd://HOST:PORT[,HOST:PORT][/PREFIX]`` runs two or three schedulers on one store.
Keys under PREFIX (default ``/tigana``):

- ``PREFIX/leader``: the leader's address and a token unique to its term, attached to its etcd lease. It is
  created only when absent, so at most one scheduler holds it; it disappears when the lease is not kept alive
  (the leader died, paused or lost etcd) and a standby then takes it.
- ``PREFIX/state``: the ``SchedulerState`` (map, target placement, drains), as ``FileMapStore`` keeps it.

Invariant (fencing). A state is saved only by one etcd transaction that finds (1) ``leader`` holding this
scheduler's term token and (2) ``state`` at the revision this scheduler last read or wrote. (1) fails for a
leader whose lease ran out, even if it does not know yet (a SIGSTOP, a partition); (2) is a compare-and-swap
on the map: the epoch only grows from the map this leader loaded, never from a map it did not see. A save
that fails raises ``Deposed`` and the scheduler stops acting as leader. Maps are announced to servers and
clients only after they are saved, so a deposed leader announces nothing, and servers fence stale epochs
themselves (``replication``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from urllib.parse import urlsplit

import grpc

from tigana.ps.channels import reconnect_options
from tigana.ps.errors import InvalidArgument, Unavailable
from tigana.ps.scheduler.stores.file import SchedulerState, decode_state, encode_state

__all__ = ["Deposed", "EtcdMapStore", "parse_store_url"]


_CHANNEL_OPTIONS = reconnect_options()


class Deposed(Unavailable):
    """This scheduler is not (or no longer) the leader: its write was refused by the store."""


def parse_store_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://h1:2379,h2:2379/prefix`` -> ([(h1, 2379), (h2, 2379)], "/prefix")."""
    parts = urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc:
        raise InvalidArgument(f"--store: expected etcd://HOST:PORT[,HOST:PORT][/PREFIX], got {url!r}")
    endpoints = []
    for item in parts.netloc.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"--store: endpoint {item!r} is not HOST:PORT (in {url!r})")
        endpoints.append((host.strip("[]"), int(port)))
    prefix = parts.path.rstrip("/") or "/tigana"
    return endpoints, prefix


class EtcdMapStore:
    """A ``MapStore`` in etcd with leader election (see the module docstring). ``campaign`` and
    ``keep_alive`` run on the scheduler's election thread; ``load``/``save`` under the scheduler's lock."""

    def __init__(self, url: str, *, timeout_s: float = 3.0) -> None:
        try:
            import pyetcd
        except ImportError as exc:  # the optional extra
            raise InvalidArgument("--store etcd://...: the etcd client is not installed "
                                  "(pip install 'tigana[etcd]')") from exc
        self.url = url
        endpoints, self.prefix = parse_store_url(url)
        self._pyetcd = pyetcd
        self._client = pyetcd.MultiEndpointEtcd3Client(
            # an endpoint that failed is retried after 0.5 s (the library's default is 5 minutes)
            endpoints=[pyetcd.Endpoint(h, p, secure=False, time_retry=0.5, opts=_CHANNEL_OPTIONS)
                       for h, p in endpoints], timeout=timeout_s,
            failover=len(endpoints) > 1)
        self.leader_key = f"{self.prefix}/leader"
        self.state_key = f"{self.prefix}/state"
        self._lock = threading.Lock()
        self._lease = None
        self._token: str | None = None
        self._rev = 0  # mod revision of ``state`` as this leader last read or wrote it
        self.deposed = threading.Event()

    def describe(self) -> str:
        return f"{self.url} ({self.state_key})"

    # --- election ------------------------------------------------------------------------------------------
    def leader(self) -> str | None:
        """The address of the current leader (None when there is none)."""
        value, _ = self._call(self._client.get, self.leader_key)
        return value.decode().split(" ", 1)[0] if value else None

    def campaign(self, address: str, ttl_s: int) -> bool:
        """One attempt to become the leader (True: this scheduler now leads, until its lease runs out)."""
        if self._call(self._client.get, self.leader_key)[0] is not None:
            return False
        lease = self._call(self._client.lease, ttl_s)
        token = f"{address} {uuid.uuid4().hex}"
        tx = self._client.transactions
        ok, _ = self._call(self._client.transaction, compare=[tx.create(self.leader_key) == 0],
                           success=[tx.put(self.leader_key, token, lease=lease.id)], failure=[])
        if not ok:
            self._quiet(lambda: self._client.revoke_lease(lease.id))
            return False
        with self._lock:
            self._lease, self._token, self._rev = lease, token, 0
            self.deposed.clear()
        return True

    def keep_alive(self) -> bool:
        """Renew the leader's lease; False when it is gone (expired or revoked) or etcd did not answer."""
        lease = self._lease
        if lease is None:
            return False
        try:
            replies = list(self._client.refresh_lease(lease.id))
        except Exception:  # noqa: BLE001 - any failure to renew counts as not renewed
            return False
        return bool(replies) and replies[-1].TTL > 0

    def resign(self) -> None:
        """Give up leadership (revoking the lease deletes ``leader`` at once, so a standby need not wait)."""
        with self._lock:
            lease, self._lease, self._token = self._lease, None, None
            self.deposed.set()
        if lease is not None:
            self._quiet(lambda: self._client.revoke_lease(lease.id))

    # --- MapStore ------------------------------------------------------------------------------------------
    def load(self) -> SchedulerState | None:
        value, meta = self._call(self._client.get, self.state_key)
        with self._lock:
            self._rev = meta.mod_revision if meta is not None else 0
        return None if value is None else decode_state(value, self.describe())

    def save(self, state: SchedulerState) -> None:
        """Write ``state`` if this scheduler still leads and nobody else wrote since (one transaction)."""
        with self._lock:
            token, rev = self._token, self._rev
        if token is None:
            raise Deposed(f"scheduler store {self.url}: this scheduler is not the leader")
        tx = self._client.transactions
        ok, replies = self._call(self._client.transaction,
                                 compare=[tx.value(self.leader_key) == token, tx.mod(self.state_key) == rev],
                                 success=[tx.put(self.state_key, encode_state(state))], failure=[])
        if not ok:
            self.deposed.set()
            raise Deposed(f"scheduler store {self.url}: map at epoch {state.map.epoch} refused, this scheduler "
                          "is no longer the leader (its lease ran out or another wrote the map)")
        with self._lock:
            self._rev = replies[0].response_put.header.revision

    def close(self) -> None:
        self._quiet(self._client.close)

    # --- helpers -------------------------------------------------------------------------------------------
    def _call(self, fn, *args, **kwargs):
        """One etcd call; an etcd that does not answer is ``Unavailable`` (the caller retries or steps down)."""
        try:
            return fn(*args, **kwargs)
        except (self._pyetcd.Etcd3Exception, grpc.RpcError, ValueError) as exc:  # ValueError: "failed node"
            raise Unavailable(f"scheduler store {self.url}: {type(exc).__name__}: {exc}") from None

    @staticmethod
    def _quiet(fn) -> None:
        with contextlib.suppress(Exception):  # best effort: the lease expires on its own anyway
            fn()


def wait_for_etcd(url: str, timeout_s: float = 30.0) -> None:
    """Block until the etcd at ``url`` answers (``Unavailable`` after ``timeout_s``)."""
    store = EtcdMapStore(url, timeout_s=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                store.leader()
                return
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        store.close()
