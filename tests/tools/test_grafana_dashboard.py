"""The Grafana dashboard (tools/grafana/tigana.json) queries only metrics the processes really expose: a real
scheduler and a real clustered shard server with their metrics endpoints, a client that pulled and pushed,
and a trainer rank's metrics registry, all scraped over HTTP. And every query is scoped by the dashboard's
``namespace``, ``job`` and ``instance`` variables, so two clusters scraped by one Prometheus are never summed."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tigana import ps
from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.trainer.metrics import TrainerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "tools" / "grafana" / "tigana.json"
_SUFFIX = re.compile(r"_(bucket|sum|count|total|created)$")
# A metric selector in PromQL: the metric's name and its label matchers, if any.
_SELECTOR = re.compile(r"\b((?:tigana|process|python)_[a-z0-9_]+)(\{([^}]*)\})?")
_SCOPE = ('namespace=~"$namespace"', 'job=~"$job"', 'instance=~"$instance"')


def _exprs(panels: list[dict]) -> list[str]:
    out = []
    for p in panels:
        out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
        out += _exprs(p.get("panels", []))
    return out


def _scrape(port: int) -> set[str]:
    """Family and sample names exposed on ``port``'s /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def test_dashboard_panels_cover_the_operations_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("rows/s", "latency p50 / p99", "replication lag", "staleness", "table rows", "table memory",
                  "admissions and evictions", "failovers", "slot moves", "samples/s", "loss", "resident memory",
                  "cpu per process"):
        assert topic in titles, topic
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "tigana"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]


def test_the_dashboard_has_namespace_job_and_instance_variables() -> None:
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert {"datasource", "namespace", "job", "instance"} <= variables.keys()
    for name in ("namespace", "job", "instance"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}", name
        assert v["query"].startswith("label_values(") and v["query"].endswith(f", {name})"), v["query"]
    # chained: the jobs of the chosen cluster, the instances of the chosen jobs
    assert '$namespace' in variables["job"]["query"]
    assert '$namespace' in variables["instance"]["query"] and '$job' in variables["instance"]["query"]
    # one cluster at a time by default; any jobs and instances of it
    assert not variables["namespace"]["includeAll"]
    assert variables["job"]["allValue"] == variables["instance"]["allValue"] == ".*"


def test_every_query_filters_on_namespace_job_and_instance() -> None:
    exprs = _exprs(json.loads(DASHBOARD.read_text())["panels"])
    assert len(exprs) > 40
    for expr in exprs:
        selectors = _SELECTOR.findall(expr)
        assert selectors, f"no metric in {expr}"
        for name, _, matchers in selectors:
            found = [m.strip() for m in matchers.split(",")]
            missing = [m for m in _SCOPE if m not in found]
            assert not missing, f"{name} in {expr!r} lacks {missing}"


def test_the_scope_check_catches_an_unscoped_query() -> None:
    selectors = _SELECTOR.findall('sum(rate(tigana_rows_pulled_total{job=~"$job"}[5m])) / max(tigana_table_rows)')
    assert [name for name, _, _ in selectors] == ["tigana_rows_pulled_total", "tigana_table_rows"]
    assert all(any(m not in matchers for m in _SCOPE) for _, _, matchers in selectors)


@pytest.mark.timeout(120)
def test_every_metric_the_dashboard_queries_is_exposed(tmp_path, make_shard_server) -> None:
    queried = {_SUFFIX.sub("", name) for expr in _exprs(json.loads(DASHBOARD.read_text())["panels"])
               for name, _, _ in _SELECTOR.findall(expr)}
    assert len(queried) > 30 and {"process_resident_memory_bytes", "process_cpu_seconds"} <= queried

    scheduler = start_scheduler(SchedulerConfig(port=0, data_dir=str(tmp_path / "sched"), replicas=0,
                                                metrics_port=-1))
    trainer = TrainerMetrics(rank=0)
    try:
        assert scheduler.metrics_port
        server = make_shard_server(scheduler=scheduler.address, metrics_port=-1)
        with ps.connect(scheduler=scheduler.address) as client:
            client.create_table("dash", dim=8, compression="fp16")
            ids = np.arange(1000, dtype=np.int64)
            client.pull("dash", ids)
            client.push("dash", ids, np.ones((ids.size, 8), np.float32)).result()
            client.pull("dash", ids)
            trainer.attach(client)
            trainer.observe("pull", 0.002, 1000)
            trainer.observe("push", 0.003, 1000)
            trainer.observe("pull_wait", 0.0001, 1000)
            trainer.step(1000)
            trainer.evaluated({"auc": 0.7, "logloss": 0.5})
            trainer.window(0.69)
            trainer.serve_http(-1)
            exposed = _scrape(server.metrics_port) | _scrape(scheduler.metrics_port) | _scrape(trainer.http_port)
    finally:
        trainer.close()
        scheduler.close()
    missing = sorted(name for name in queried if name not in exposed)
    assert not missing, f"the dashboard queries metrics nobody exposes: {missing}"
    # the counters of this run are real: fp16 halves the row bytes on the wire
    text = server.metrics.render().decode()
    raw = {s.labels["method"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.name == "tigana_row_bytes_raw_total"}
    wire = {s.labels["method"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "tigana_row_bytes_wire_total"}
    assert raw["Pull"] == 2 * 1000 * 8 * 4 and wire["Pull"] == raw["Pull"] / 2
    assert raw["Push"] == 1000 * 8 * 4 and wire["Push"] == raw["Push"] / 2
