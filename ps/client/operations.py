"""Whole-cluster operations of ``Client``: shard snapshots and restores, the servers' counters, this client's
own counters (``stats``), and the one helper they share, the same RPC on every server (``_call_all``).

Thread-safety: every method may be called from any thread; ``snapshot`` and ``restore`` block up to
``ClientConfig.admin_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent import futures as cf
from typing import Any

from tigana.proto import shard_pb2 as pb
from tigana.ps.channels import Call
from tigana.ps.client._fields import ClientFields
from tigana.ps.client.inflight import new_future
from tigana.ps.client.routes import Server
from tigana.ps.errors import InvalidArgument, PSError


class Operations(ClientFields):
    """Snapshots, restores and counters (see the module docstring)."""

    def snapshot(self, incremental: bool = False) -> dict[str, list[str]]:
        """Flush, then have every shard write a (full or incremental) snapshot; paths per address."""
        self.flush()
        replies = self._call_all("Snapshot", lambda _: pb.SnapshotRequest(incremental=incremental),
                                 retry=False, timeout_s=self.config.admin_timeout_s)
        return {s.address: list(r.paths) for s, r in zip(self._servers, replies, strict=True)}

    def restore(self, path: str | Mapping[str, Sequence[str]] = "") -> dict[str, int]:
        """Every shard restores ``path`` (empty: its newest snapshot); rows restored per address.

        ``path`` may also be what ``snapshot`` returned ({address: [table snapshot paths]}): each shard then
        restores exactly its own listed snapshots (one Restore per path), e.g. to resume a checkpoint."""
        if self._maps is not None:
            raise InvalidArgument("restore: a cluster with a scheduler keeps its copies by replication; restore "
                                  "a cluster checkpoint through `tigana admin restore`")
        if not isinstance(path, str):
            return self._restore_each(path)
        replies = self._call_all("Restore", lambda _: pb.RestoreRequest(path=path), retry=False,
                                 timeout_s=self.config.admin_timeout_s)
        return {s.address: int(r.rows) for s, r in zip(self._servers, replies, strict=True)}

    def _restore_each(self, paths: Mapping[str, Sequence[str]]) -> dict[str, int]:
        by_address = {str(a): [str(p) for p in ps] for a, ps in paths.items()}
        unknown = sorted(set(by_address) - set(self.addresses))
        if unknown:
            raise InvalidArgument(f"restore: field 'path' names shard(s) {unknown} this client does not have")
        rows = {s.address: 0 for s in self._servers}
        for s in self._servers:
            for p in by_address.get(s.address, []):
                fut = new_future()
                Call(s.stub.Restore, pb.RestoreRequest(path=p), s.address, self.config.admin_timeout_s, None,
                     settle_into(fut), self._note_retry).start()
                rows[s.address] += int(fut.result().rows)
        return rows

    def server_stats(self, table: str = "") -> dict[str, dict[str, dict[str, float]]]:
        """Per address, per table, the server's counters (rows, bytes, requests, replication lag...)."""
        replies = self._call_all("Stats", lambda _: pb.StatsRequest(table=table), retry=True)
        return {s.address: {t.table: dict(t.values) for t in r.tables} for s, r in zip(self._servers, replies, strict=True)}

    def stats(self) -> dict[str, Any]:
        """This client's counters: pulls, pushes, rows, retries, errors, pushes in flight, the map epoch and
        refreshes, and per table the bytes sent/received by direction and the staleness observed
        (unacknowledged own pushes when a pull was sent: last and max) with the bound, the table's step
        (pushes issued) and how many pulls waited."""
        with self._stats_lock:
            out: dict[str, Any] = dict(self._counters)
        out["client_id"] = self.client_id
        out["epoch"] = self.epoch
        out["map_refreshes"] = self._maps.refreshes if self._maps is not None else 0
        with self._tables_lock:
            tables = list(self._tables.values())
        out["bytes_sent"], out["bytes_received"], out["staleness"] = {}, {}, {}
        in_flight = 0
        for st in tables:
            with st.lock:
                out["bytes_sent"][st.name] = dict(st.bytes["sent"])
                out["bytes_received"][st.name] = dict(st.bytes["received"])
                out["staleness"][st.name] = {"bound": st.staleness, "step": st.step, "last": st.stale_last,
                                             "max": st.stale_max, "waits": st.stale_waits}
                in_flight += len(st.pending)
        out["pushes_in_flight"] = in_flight
        return out

    def _call_all(self, method: str, request_for: Callable[[Server], Any], *, retry: bool,
                  timeout_s: float | None = None) -> list[Any]:
        """The same RPC on every server in parallel; replies in server order; the first error raised."""
        futs = []
        for s in self._servers:
            fut = new_future()
            futs.append(fut)
            Call(getattr(s.stub, method), request_for(s), s.address, timeout_s or self.config.timeout_s,
                 self._retry if retry else None, settle_into(fut), self._note_retry).start()
        cf.wait(futs)
        for f in futs:
            if f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futs]


def settle_into(fut: cf.Future) -> Callable[[Any, PSError | None], None]:
    def done(response: Any, error: PSError | None) -> None:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(response)
    return done
