"""Prometheus metrics of a shard server, a scheduler, ``tigana serve`` and a client, each in a registry of its own
(never the process-global one), so several in one process (tests, benchmarks) keep separate counts.

Counters and histograms are updated per RPC (a handful of label lookups, not per row); rows and bytes per table
are read from the tables when scraped. Thread-safe (prometheus-client metrics are).

Conventions, the same on every endpoint:
- a duration is in seconds and its name ends in ``_seconds`` (Prometheus's base unit), gauges included;
- every registry carries the process collectors (``process_resident_memory_bytes``, ``process_cpu_seconds_total``,
  open fds, start time; ``python_info``; ``python_gc_*``), so each daemon's RSS and CPU are scraped with its own
  metrics: a registry of our own does not get them from prometheus-client's default one;
- no ``*_created`` series: importing this module turns them off for the process (``disable_created_metrics``),
  since they double the series count of every counter and histogram and no dashboard reads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # in code, not by environment: every process that makes metrics imports this module

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def add_process_collectors(registry: CollectorRegistry) -> CollectorRegistry:
    """Register the process, platform and GC collectors in ``registry`` (once: a second call changes nothing)."""
    for make in (ProcessCollector, PlatformCollector, GCCollector):
        with contextlib.suppress(ValueError):  # "Duplicated timeseries": registered already
            make(registry=registry)
    return registry


def new_registry() -> CollectorRegistry:
    """A registry of its own for one endpoint, with the process collectors."""
    return add_process_collectors(CollectorRegistry(auto_describe=True))


class _TableCollector:
    """Rows, bytes, admissions and evictions per table, read at scrape time from ``source() -> {table: {"rows",
    "bytes", "rows_spilled", "admissions", "rejected_admissions", "evictions", "spills"}}`` (the engine's
    ``stats()``; a key a table lacks is left out)."""

    _GAUGES = (("rows", "tigana_table_rows", "Rows held per table (resident and spilled)"),
               ("bytes", "tigana_table_bytes", "Bytes of memory held per table (rows, index, admission state)"),
               ("rows_spilled", "tigana_table_rows_spilled", "Rows per table moved to the spill tier on disk"))
    _COUNTERS = (("admissions", "tigana_table_admissions", "Rows admitted into the table (inserted)"),
                 ("rejected_admissions", "tigana_table_rejected_admissions",
                  "Row insertions refused by the admission policy (not seen often enough yet)"),
                 ("evictions", "tigana_table_evictions", "Rows evicted by TTL or the row cap"),
                 ("spills", "tigana_table_spills", "Rows moved from memory to the spill tier"))

    def __init__(self, source: Callable[[], dict[str, dict[str, float]]]) -> None:
        self._source = source

    def _families(self) -> list[Any]:
        return [GaugeMetricFamily(name, text, labels=["table"]) for _, name, text in self._GAUGES] + \
            [CounterMetricFamily(name, text, labels=["table"]) for _, name, text in self._COUNTERS]

    def describe(self) -> Iterable[Any]:  # registering must not read tables that do not exist yet
        yield from self._families()

    def collect(self) -> Iterable[Any]:
        families = self._families()
        keys = [k for k, _, _ in self._GAUGES] + [k for k, _, _ in self._COUNTERS]
        for name, values in sorted(self._source().items()):
            for key, family in zip(keys, families, strict=True):
                if key in values or key in ("rows", "bytes"):
                    family.add_metric([name], float(values.get(key, 0.0)))
        yield from families


class _ClusterCollector:
    """The server's place in the cluster, read at scrape time from ``source() -> {name: value}``: map epoch,
    slots led and held, copies catching up, and the replication lag of its outgoing streams (items, bytes,
    seconds: the loss bound of async tables). A source key is the metric's name after the prefix, unless
    ``_NAMES`` maps it to another (the source's ``replication_lag_s`` is ``tigana_replication_lag_seconds``)."""

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
        "slot_copy_queued_bytes": "Bytes of copied rows queued on the copy lanes, not yet applied by their targets",
        "slot_copy_paced_s": "Seconds slot copies of planned moves waited for the server's copy rate (--copy-rate)",
    }
    _NAMES: dict[str, str] = {"replication_lag_s": "replication_lag_seconds",
                              "slot_copy_paced_s": "slot_copy_paced_seconds"}
    _PREFIX = "tigana_"

    def __init__(self, source: Callable[[], dict[str, float]]) -> None:
        self._source = source

    def _name(self, key: str) -> str:
        return f"{self._PREFIX}{self._NAMES.get(key, key)}"

    def describe(self) -> Iterable[Any]:
        for key, text in self._HELP.items():
            yield GaugeMetricFamily(self._name(key), text)

    def collect(self) -> Iterable[Any]:
        values = self._source()
        for key, text in self._HELP.items():
            if key in values:
                yield GaugeMetricFamily(self._name(key), text, value=float(values[key]))


class MetricsEndpoint:
    """A registry served over HTTP: ``serve_http`` starts ``/metrics`` in a daemon thread, ``close`` stops it."""

    registry: CollectorRegistry
    http_port: int | None = None
    _httpd: Any = None

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``port`` (0 or -1: a free port) in a daemon thread; returns the bound port."""
        from prometheus_client import start_http_server

        add_process_collectors(self.registry)  # also for a registry made elsewhere (a trainer rank's)
        httpd, _thread = start_http_server(max(port, 0), addr=host, registry=self.registry)
        self._httpd = httpd
        self.http_port = int(httpd.server_port)
        return self.http_port

    def close(self) -> None:
        """Stop the HTTP endpoint (idempotent)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


class ServerMetrics(MetricsEndpoint):
    """The metrics of one server; ``http_port`` is set once ``serve_http`` runs."""

    def __init__(self, table_source: Callable[[], dict[str, dict[str, float]]] | None = None,
                 cluster_source: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = new_registry()
        r = self.registry
        self.requests = Counter("tigana_requests", "RPCs answered, by method and status code",
                                ["method", "code"], registry=r)
        self.rejected = Counter("tigana_rejected_requests", "RPCs answered with an error status, by method and code",
                                ["method", "code"], registry=r)
        self.latency = Histogram("tigana_request_seconds", "RPC latency in the server, by method", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self._children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}  # observe's labelled children
        self._labelled: dict[tuple[int, tuple[str, ...]], Any] = {}  # labelled's
        self.auth_rejected = Counter("tigana_auth_rejected", "Calls refused by the credential check, by method and "
                                     "reason (missing, invalid, expired, role)", ["method", "reason"], registry=r)
        self.rows_pulled = Counter("tigana_rows_pulled", "Rows returned by Pull, by table", ["table"], registry=r)
        self.rows_pushed = Counter("tigana_rows_pushed", "Gradient rows applied by Push, by table", ["table"],
                                   registry=r)
        self.duplicate_pushes = Counter("tigana_duplicate_pushes", "Replayed pushes answered as duplicates",
                                        ["table"], registry=r)
        self.under_replicated_pushes = Counter(
            "tigana_under_replicated_pushes", "Sync pushes acknowledged while a slot of theirs had fewer in-sync "
            "copies than the cluster keeps (a loss of this server may lose them), by table", ["table"], registry=r)
        self.bytes_in = Counter("tigana_request_bytes", "Id and row payload bytes received, by method", ["method"],
                                registry=r)
        self.bytes_out = Counter("tigana_response_bytes", "Row payload bytes sent, by method", ["method"],
                                 registry=r)
        # Rows only (no ids): raw / wire is the compression ratio of the fp16, bf16 and int8 codecs.
        self.row_bytes_raw = Counter("tigana_row_bytes_raw", "Row bytes of Pull replies and Push requests as "
                                     "float32, before wire compression, by method", ["method"], registry=r)
        self.row_bytes_wire = Counter("tigana_row_bytes_wire", "Row bytes of Pull replies and Push requests as "
                                      "sent (after fp16/bf16/int8 compression), by method", ["method"], registry=r)
        if table_source is not None:
            r.register(_TableCollector(table_source))
        if cluster_source is not None:
            r.register(_ClusterCollector(cluster_source))

    def count_auth_rejection(self, method: str, reason: str) -> None:
        """A call refused by the credential check (reason: missing, invalid, role); never the token itself."""
        self.auth_rejected.labels(method.rsplit("/", 1)[-1], reason).inc()

    def labelled(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, kept: the data path counts a few of them for every frame."""
        key = (id(metric), values)
        child = self._labelled.get(key)
        if child is None:
            child = self._labelled[key] = metric.labels(*values)
        return child

    def observe(self, method: str, code: str, seconds: float) -> None:
        """Count one answered RPC (or stream frame). The labelled children are kept per (method, code): a
        ``labels()`` lookup costs more than the count itself, and every data-path frame comes here."""
        key = (method, code)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self.requests.labels(method, code), self.latency.labels(method),
                                               self.rejected.labels(method, code) if code != "OK" else None)
        children[0].inc()
        children[1].observe(seconds)
        if children[2] is not None:
            children[2].inc()


class ClientCollector:
    """A client's counters, read at scrape time from ``source()`` (``Client.stats()``): pulls, pushes, rows,
    retries and errors, wire bytes per table and direction, and the staleness it observed per table (its own
    pushes not yet acknowledged when a pull was sent: rows the pull's answer may lack, in steps)."""

    _COUNTERS = (("pulls", "Pulls completed by this client"), ("pushes", "Pushes acknowledged to this client"),
                 ("rows_pulled", "Ids pulled by this client (duplicates counted)"),
                 ("rows_pushed", "Distinct rows pushed by this client"),
                 ("retries", "Messages this client sent again (re-routed or retried)"),
                 ("pull_errors", "Pulls that failed"), ("push_errors", "Pushes that failed"))

    def __init__(self, source: Callable[[], dict[str, Any]]) -> None:
        self._source = source

    def _families(self) -> list[Any]:
        out: list[Any] = [CounterMetricFamily(f"tigana_client_{k}", text) for k, text in self._COUNTERS]
        out += [
            CounterMetricFamily("tigana_client_wire_bytes", "Bytes of pull and push messages on the wire, by table, "
                                "operation and direction (after compression)", labels=["table", "op", "direction"]),
            GaugeMetricFamily("tigana_client_staleness_steps", "Observed staleness: this client's pushes not yet "
                              "acknowledged when its last pull of the table was sent", labels=["table"]),
            GaugeMetricFamily("tigana_client_staleness_max_steps", "The largest observed staleness so far",
                              labels=["table"]),
            GaugeMetricFamily("tigana_client_staleness_bound_steps", "The table's staleness bound in this client "
                              "(absent: fully asynchronous)", labels=["table"]),
            CounterMetricFamily("tigana_client_staleness_waits", "Pulls held back until older pushes were "
                                "acknowledged (the staleness bound at work)", labels=["table"]),
            GaugeMetricFamily("tigana_client_pushes_in_flight", "Pushes sent and not yet acknowledged"),
            GaugeMetricFamily("tigana_client_map_epoch", "Shard map epoch this client routes by"),
        ]
        return out

    def describe(self) -> Iterable[Any]:
        yield from self._families()

    def collect(self) -> Iterable[Any]:
        stats = self._source()
        families = self._families()
        by_name = {f.name: f for f in families}
        for key, _ in self._COUNTERS:
            by_name[f"tigana_client_{key}"].add_metric([], float(stats.get(key, 0)))
        wire = by_name["tigana_client_wire_bytes"]
        for direction in ("sent", "received"):
            for table, ops in sorted(stats.get(f"bytes_{direction}", {}).items()):
                for op, n in sorted(ops.items()):
                    wire.add_metric([table, op, direction], float(n))
        for table, st in sorted(stats.get("staleness", {}).items()):
            by_name["tigana_client_staleness_steps"].add_metric([table], float(st.get("last", 0)))
            by_name["tigana_client_staleness_max_steps"].add_metric([table], float(st.get("max", 0)))
            by_name["tigana_client_staleness_waits"].add_metric([table], float(st.get("waits", 0)))
            if st.get("bound") is not None:
                by_name["tigana_client_staleness_bound_steps"].add_metric([table], float(st["bound"]))
        by_name["tigana_client_pushes_in_flight"].add_metric([], float(stats.get("pushes_in_flight", 0)))
        by_name["tigana_client_map_epoch"].add_metric([], float(stats.get("epoch", 0)))
        yield from families


class _SchedulerCollector(_ClusterCollector):
    """The scheduler's view of the cluster, read at scrape time from ``source() -> {name: value}`` (empty on
    a standby, which then reports only ``leader`` 0)."""

    _PREFIX = "tigana_scheduler_"
    _HELP = {
        "leader": "1 when this scheduler leads (owns the map), 0 on a standby",
        "epoch": "Epoch of the shard map",
        "servers_up": "Servers the map lists as up",
        "servers_down": "Servers the map lists as dead",
        "slots_unavailable": "Slots without a primary",
        "slots_degraded": "Slots with fewer in-sync copies than 1 + replicas",
        "slots_unprotected": "Slots whose primary is their only in-sync copy although the cluster keeps replicas",
        "copies_catching_up": "Copies being built by a slot copy",
        "slots_moving": "Slots whose placement differs from the target being moved toward",
        "slots_domain_degraded": "Slots whose in-sync copies share a failure domain (zone, rack or host): losing "
                                 "that domain loses what they acknowledged",
    }


class SchedulerMetrics(MetricsEndpoint):
    """The metrics of one scheduler, in a registry of its own (kept across leadership terms): failovers, slot
    moves and copy changes as counters, the map's state as gauges read at scrape time from ``state_source``."""

    def __init__(self, state_source: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = new_registry()
        r = self.registry
        self.map_changes = Counter("tigana_scheduler_map_changes", "Shard maps saved (each one epoch)", registry=r)
        self.servers_dead = Counter("tigana_scheduler_servers_declared_dead", "Servers declared dead (no heartbeat "
                                    "within the timeout, or a probe found the port closed)", registry=r)
        self.failovers = Counter("tigana_scheduler_failovers", "Slots whose primary role moved to an in-sync copy "
                                 "because the primary died or restarted, by reason", ["reason"], registry=r)
        self.elections = Counter("tigana_scheduler_unclean_elections", "Slots given a primary by an unclean "
                                 "election (no in-sync copy left; the newest snapshot wins)", registry=r)
        self.copies_added = Counter("tigana_scheduler_copies_added", "Copies started to replace lost ones "
                                    "(re-replication after a failure)", registry=r)
        self.copies_demoted = Counter("tigana_scheduler_copies_demoted", "Copies taken out of the in-sync set, by "
                                      "reason (replication failed, server restarted)", ["reason"], registry=r)
        self.copies_caught_up = Counter("tigana_scheduler_copies_caught_up", "Copies that joined the in-sync set "
                                        "after a slot copy", registry=r)
        self.slot_moves = Counter("tigana_scheduler_slot_moves", "Slot move steps toward a placement target, by "
                                  "step (copy_started, primary_handover, copy_dropped)", ["step"], registry=r)
        self.moves_completed = Counter("tigana_scheduler_slot_moves_completed", "Slots whose move (drain, "
                                       "rebalance, move-slot) reached its target placement", registry=r)
        for reason in ("dead", "restart"):
            self.failovers.labels(reason)
        for reason in ("replication_failed", "restart"):
            self.copies_demoted.labels(reason)
        for step in ("copy_started", "primary_handover", "copy_dropped"):
            self.slot_moves.labels(step)
        if state_source is not None:
            r.register(_SchedulerCollector(state_source))


class _ServingCollector(_ClusterCollector):
    """What ``tigana serve`` holds, read at scrape time from ``source() -> {name: value}``."""

    _PREFIX = "tigana_serving_"
    _HELP = {
        "ready": "1 once a full export is loaded (health SERVING)",
        "rows": "Distinct ids of the table served",
        "dim": "Row width of the table served",
        "seq": "Export log entry the served state is complete up to",
        "base_seq": "Export log entry of the full export the served state started from",
        "deltas_applied": "Deltas applied since this process started",
        "rows_applied": "Rows of deltas applied since this process started",
        "apply_seconds": "Seconds spent loading and applying log entries since this process started",
        "data_age_seconds": "Seconds since the cluster cut the served rows are complete up to (the freshness "
                            "of what lookups return)",
        "version": "The model version served (an entry of the publish log; --model)",
        "step": "The training step of the served model version's dense weights (--model)",
        "version_age_seconds": "Seconds since the cut the served model version is complete up to (--model)",
        "versions_refused": "Model versions the validation gate refused (--model)",
        "pinned": "1 while a rollback pins the served model version (--model)",
    }


class ServingMetrics(MetricsEndpoint):
    """The metrics of one ``tigana serve``: lookups by status, their latency and the ids found or not, calls
    refused by the credential check, and (from ``state_source``) the table and the log position it serves."""

    def __init__(self, state_source: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = new_registry()
        r = self.registry
        self.lookups = Counter("tigana_serving_lookups", "Lookups answered, by status code", ["code"], registry=r)
        self.latency = Histogram("tigana_serving_lookup_seconds", "Lookup latency in the server",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ids = Counter("tigana_serving_ids", "Ids looked up, by whether the table held them (found) or they got "
                           "the default row", ["found"], registry=r)
        self.auth_rejected = Counter("tigana_auth_rejected", "Calls refused by the credential check, by method and "
                                     "reason (missing, invalid, expired, role)", ["method", "reason"], registry=r)
        self.predictions = Counter("tigana_serving_predictions", "Predict calls answered, by status code", ["code"],
                                   registry=r)
        self.predict_latency = Histogram("tigana_serving_predict_seconds", "Predict latency in the server",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.predicted_rows = Counter("tigana_serving_predicted_rows", "Feature rows scored", registry=r)
        for found in ("true", "false"):
            self.ids.labels(found)
        if state_source is not None:
            r.register(_ServingCollector(state_source))

    def count_auth_rejection(self, method: str, reason: str) -> None:
        """A call refused by the credential check; never the token itself."""
        self.auth_rejected.labels(method.rsplit("/", 1)[-1], reason).inc()

    def observe(self, code: str, seconds: float, found: int = 0, missing: int = 0) -> None:
        """Count one answered lookup and its ids."""
        self.lookups.labels(code).inc()
        self.latency.observe(seconds)
        if found:
            self.ids.labels("true").inc(found)
        if missing:
            self.ids.labels("false").inc(missing)

    def observe_predict(self, code: str, seconds: float, rows: int = 0) -> None:
        """Count one answered Predict call and its rows."""
        self.predictions.labels(code).inc()
        self.predict_latency.observe(seconds)
        if rows:
            self.predicted_rows.inc(rows)
