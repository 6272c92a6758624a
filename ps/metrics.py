"""Prometheus metrics of one shard server, in a registry of its own (never the process-global one), so several
servers in one process (tests, benchmarks) keep separate counts.

Counters and histograms are updated per RPC (a handful of label lookups, not per row); rows and bytes per table
are read from the tables when scraped. Thread-safe (prometheus-client metrics are).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _TableCollector:
    """Rows and bytes per table, read at scrape time from ``source() -> {table: {"rows": .., "bytes": ..}}``."""

    def __init__(self, source: Callable[[], dict[str, dict[str, float]]]) -> None:
        self._source = source

    def describe(self) -> Iterable[Any]:  # registering must not read tables that do not exist yet
        yield GaugeMetricFamily("tigana_table_rows", "Rows held per table (resident and spilled)", labels=["table"])
        yield GaugeMetricFamily("tigana_table_bytes", "Bytes held per table", labels=["table"])

    def collect(self) -> Iterable[Any]:
        rows = GaugeMetricFamily("tigana_table_rows", "Rows held per table (resident and spilled)", labels=["table"])
        nbytes = GaugeMetricFamily("tigana_table_bytes", "Bytes held per table", labels=["table"])
        for name, values in sorted(self._source().items()):
            rows.add_metric([name], float(values.get("rows", 0.0)))
            nbytes.add_metric([name], float(values.get("bytes", 0.0)))
        yield rows
        yield nbytes


class _ClusterCollector:
    """The server's place in the cluster, read at scrape time from ``source() -> {name: value}``: map epoch,
    slots led and held, copies catching up, and the replication lag of its outgoing streams (items, bytes,
    seconds: the loss bound of async tables)."""

    _HELP = {
        "epoch": "Shard map epoch this server holds",
        "slots_led": "Routing slots this server is the primary of",
        "slots_held": "Routing slots this server holds a copy of (primary or replica)",
        "slots_catching_up": "Copies on this server still being built by a slot copy",
        "replication_lag_items": "Items enqueued but not yet applied by the slowest copy",
        "replication_lag_bytes": "Bytes enqueued but not yet applied by the slowest copy",
        "replication_lag_s": "Seconds since the slowest lagging copy last applied an item",
        "replication_streams": "Outgoing replication streams",
        "replication_streams_broken": "Outgoing replication streams failing to deliver",
        "slot_copies_in_progress": "Slot copies this server is sending",
    }

    def __init__(self, source: Callable[[], dict[str, float]]) -> None:
        self._source = source

    def describe(self) -> Iterable[Any]:
        for name, text in self._HELP.items():
            yield GaugeMetricFamily(f"tigana_{name}", text)

    def collect(self) -> Iterable[Any]:
        values = self._source()
        for name, text in self._HELP.items():
            if name in values:
                yield GaugeMetricFamily(f"tigana_{name}", text, value=float(values[name]))


class ServerMetrics:
    """The metrics of one server; ``http_port`` is set once ``serve_http`` runs."""

    def __init__(self, table_source: Callable[[], dict[str, dict[str, float]]] | None = None,
                 cluster_source: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tigana_requests", "RPCs answered, by method and status code",
                                ["method", "code"], registry=r)
        self.rejected = Counter("tigana_rejected_requests", "RPCs answered with an error status, by method and code",
                                ["method", "code"], registry=r)
        self.latency = Histogram("tigana_request_seconds", "RPC latency in the server, by method", ["method"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.auth_rejected = Counter("tigana_auth_rejected", "Calls refused by the credential check, by method and "
                                     "reason (missing, invalid, expired, role)", ["method", "reason"], registry=r)
        self.rows_pulled = Counter("tigana_rows_pulled", "Rows returned by Pull, by table", ["table"], registry=r)
        self.rows_pushed = Counter("tigana_rows_pushed", "Gradient rows applied by Push, by table", ["table"],
                                   registry=r)
        self.duplicate_pushes = Counter("tigana_duplicate_pushes", "Replayed pushes answered as duplicates",
                                        ["table"], registry=r)
        self.bytes_in = Counter("tigana_request_bytes", "Id and row payload bytes received, by method", ["method"],
                                registry=r)
        self.bytes_out = Counter("tigana_response_bytes", "Row payload bytes sent, by method", ["method"],
                                 registry=r)
        if table_source is not None:
            r.register(_TableCollector(table_source))
        if cluster_source is not None:
            r.register(_ClusterCollector(cluster_source))
        self.http_port: int | None = None
        self._httpd: Any = None

    def count_auth_rejection(self, method: str, reason: str) -> None:
        """A call refused by the credential check (reason: missing, invalid, role); never the token itself."""
        self.auth_rejected.labels(method.rsplit("/", 1)[-1], reason).inc()

    def observe(self, method: str, code: str, seconds: float) -> None:
        """Count one answered RPC."""
        self.requests.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)
        if code != "OK":
            self.rejected.labels(method, code).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``port`` (0 or -1: a free port) in a daemon thread; returns the bound port."""
        from prometheus_client import start_http_server

        httpd, _thread = start_http_server(max(port, 0), addr=host, registry=self.registry)
        self._httpd = httpd
        self.http_port = int(httpd.server_port)
        return self.http_port

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
