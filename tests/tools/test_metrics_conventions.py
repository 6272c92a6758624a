"""Every metrics endpoint follows the same conventions, checked on real daemons started through the CLI (a
scheduler, a shard server registered with it, and ``tigana serve``, each its own process, so each must set
them up in its own code) and on a trainer rank's endpoint:

- the process collector is there: ``process_resident_memory_bytes`` (RSS) and ``process_cpu_seconds_total``;
- no ``*_created`` series;
- every duration is named in seconds (``..._seconds``), whatever its type.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tigana import ps
from tigana.trainer.metrics import TrainerMetrics

CLI = [sys.executable, "-m", "tigana.tools.cli"]
# A family is a duration when its help says so or its name carries a time unit other than seconds.
_DURATION_HELP = re.compile(r"\b(seconds|latency|duration|time|age|elapsed)\b", re.I)
_DURATION_NAME = re.compile(r"_(s|ms|us|ns|sec|secs|millis|time|latency|duration|age)$")


@contextlib.contextmanager
def _daemon(tmp_path: Path, name: str, *args: str) -> Iterator[dict]:
    """``tigana NAME ARGS --metrics-port auto --ready-file ...`` as a child process; its ready file's JSON."""
    ready = tmp_path / f"{name}.ready.json"
    log = (tmp_path / f"{name}.log").open("w")
    proc = subprocess.Popen([*CLI, name, *args, "--metrics-port", "auto", "--ready-file", str(ready)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"tigana {name} exited with {proc.returncode}: " + \
                (tmp_path / f"{name}.log").read_text()
            with contextlib.suppress(FileNotFoundError, ValueError):
                info = json.loads(ready.read_text())
                break
            assert time.monotonic() < deadline, f"tigana {name} never wrote {ready}"
            time.sleep(0.05)
        assert info["metrics_port"], info
        yield info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        log.close()


def _families(port: int) -> dict[str, tuple[str, str, set[str]]]:
    """name -> (type, help, sample names) of what ``port``'s /metrics exposes."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: (f.type, f.documentation, {s.name for s in f.samples})
            for f in text_string_to_metric_families(text)}


def _check_conventions(who: str, families: dict[str, tuple[str, str, set[str]]]) -> None:
    rss = families.get("process_resident_memory_bytes")
    assert rss and rss[2] == {"process_resident_memory_bytes"}, f"{who}: no process collector"
    assert "process_cpu_seconds" in families, f"{who}: no process CPU"
    created = sorted(s for _, _, samples in families.values() for s in samples if s.endswith("_created"))
    assert not created, f"{who}: _created series {created}"
    durations = {name: text for name, (_, text, _) in families.items()
                 if _DURATION_HELP.search(text) or _DURATION_NAME.search(name)}
    assert "process_cpu_seconds" in durations, f"{who}: the duration check saw nothing"
    wrong = sorted(name for name in durations if not name.endswith("_seconds"))
    assert not wrong, f"{who}: durations not named in seconds: {[(n, durations[n]) for n in wrong]}"


@pytest.mark.timeout(240)
def test_every_daemon_exposes_process_metrics_no_created_series_and_durations_in_seconds(tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    exports.mkdir()
    with _daemon(tmp_path, "scheduler", "--port", "0", "--data-dir", str(tmp_path / "sched"),
                 "--replicas", "0") as sched, \
         _daemon(tmp_path, "server", "--port", "0", "--data-dir", str(tmp_path / "s0"),
                 "--scheduler", sched["address"]) as server, \
         _daemon(tmp_path, "serve", "--from", str(exports), "--port", "0") as serve:
        # traffic, so that labelled counters and histograms have children (and would have _created series)
        with ps.connect(scheduler=sched["address"]) as client:
            client.create_table("conv", dim=4)
            ids = np.arange(100, dtype=np.int64)
            client.push("conv", ids, np.ones((ids.size, 4), np.float32)).result()
            client.pull("conv", ids)
            trainer = TrainerMetrics(rank=0)
            try:
                trainer.attach(client)
                trainer.observe("pull", 0.002, 100)
                trainer.observe("pull_wait", 0.0001, 100)
                trainer.step(100)
                scraped = {"trainer": _families(trainer.serve_http(-1))}
            finally:
                trainer.close()
        scraped |= {name: _families(info["metrics_port"])
                    for name, info in (("scheduler", sched), ("server", server), ("serve", serve))}
    for who, families in scraped.items():
        _check_conventions(who, families)
    assert {"tigana_request_seconds", "tigana_replication_lag_seconds"} <= scraped["server"].keys()
    assert "tigana_requests" in scraped["server"]  # a labelled counter with children: it had a _created series
    assert "tigana_serving_lookup_seconds" in scraped["serve"]
    assert {"tigana_trainer_ps_seconds", "tigana_trainer_pull_wait_seconds"} <= scraped["trainer"].keys()
    assert "tigana_scheduler_failovers" in scraped["scheduler"]


def test_the_checks_catch_what_they_look_for() -> None:
    """The convention check itself fails on each thing it is there to catch."""
    good = {"process_resident_memory_bytes": ("gauge", "Resident memory size in bytes.",
                                              {"process_resident_memory_bytes"}),
            "process_cpu_seconds": ("counter", "Total user and system CPU time spent in seconds.",
                                    {"process_cpu_seconds_total"}),
            "tigana_request_seconds": ("histogram", "RPC latency in the server", {"tigana_request_seconds_count"})}
    _check_conventions("good", good)
    for bad in ({k: v for k, v in good.items() if not k.startswith("process_resident")},
                good | {"tigana_requests": ("counter", "RPCs", {"tigana_requests_total", "tigana_requests_created"})},
                good | {"tigana_replication_lag_s": ("gauge", "Seconds since the slowest copy applied", set())},
                good | {"tigana_pull_ms": ("gauge", "Pull wait", set())}):
        with pytest.raises(AssertionError):
            _check_conventions("bad", bad)
