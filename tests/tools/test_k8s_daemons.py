"""tools/k8s: the shard servers and the scheduler. Each daemon's command line is parsed with the real
``tigana`` parser in the environment its pod would have, so an unknown flag fails, and the ports, probes and
health names are compared with what the daemons serve (real ones started here)."""

from __future__ import annotations

from pathlib import Path

from k8s_checks import _check_scheduler, _check_shards, _scheduler_config
from k8s_manifests import _container, _one, _raw, _selects, _target_port

from tigana.ps.health import check_health
from tigana.ps.scheduler import SERVICE_NAME as SCHEDULER_HEALTH_NAME
from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.ps.scheduler.stores.etcd import parse_store_url
from tigana.ps.shard.daemon import COPIES_HEALTH_NAME


# ------------------------------------------------------------------------------------- the shard servers
def test_shard_servers() -> None:
    _check_shards(_raw())


def test_the_shard_readiness_names_are_served(make_shard_server) -> None:
    """The health names the probes ask for are registered by a real shard server (NOT_FOUND otherwise)."""
    handle = make_shard_server(port=0)
    for name in ("", COPIES_HEALTH_NAME):
        assert check_health(handle.address, name, timeout_s=5).serving, name


# ------------------------------------------------------------------------------------------ the scheduler
def test_scheduler() -> None:
    _check_scheduler(_raw())


def test_scheduler_store_is_the_etcd_service() -> None:
    """--store names the etcd Service, on a port whose target is the one etcd serves clients on."""
    docs = _raw()
    [(host, port)], _prefix = parse_store_url(_scheduler_config(docs).store)  # the scheduler's own reading
    svc = _one(docs, "Service", host)
    etcd = _one(docs, "StatefulSet", "tigana-etcd")
    assert _selects(svc["spec"]["selector"], etcd["spec"]["template"]["metadata"]["labels"])
    container = _container(etcd["spec"]["template"]["spec"], "etcd")
    target = _target_port(next(p for p in svc["spec"]["ports"] if p["port"] == port), container)
    assert f"--listen-client-urls=http://0.0.0.0:{target}" in container["command"]


def test_the_scheduler_health_names_are_served(tmp_path: Path) -> None:
    """The names the scheduler's probes ask for are registered by a real scheduler (here a lone one on a file
    store, which leads: both SERVING)."""
    handle = start_scheduler(SchedulerConfig(port=0, data_dir=str(tmp_path)))
    try:
        for name in ("", SCHEDULER_HEALTH_NAME):
            assert check_health(handle.address, name, timeout_s=5).serving, name
    finally:
        handle.close()
