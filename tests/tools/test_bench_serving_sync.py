"""``tigana bench serving-sync --quick`` end to end (a cluster, ``export --follow`` and ``tigana serve`` as real
processes): the five JSON lines with their keys, in well under a minute."""

from __future__ import annotations

import math
import time

import pytest

from tigana.tools import cli

pytestmark = pytest.mark.timeout(180)

CASES = {"serving_sync.lag_p50": "s", "serving_sync.lag_p95": "s", "serving_sync.delta_throughput": "rows/s",
         "serving_sync.lookup_p50": "ms", "serving_sync.lookup_p99": "ms"}


def test_bench_serving_sync_quick(bench_lines) -> None:
    started = time.monotonic()
    assert cli.main(["bench", "serving-sync", "--quick", "--duration", "2"]) == 0  # a 2 s lag phase: ~40 samples
    elapsed = time.monotonic() - started
    lines = bench_lines()
    assert {d["case"]: d["unit"] for d in lines} == CASES and len(lines) == len(CASES)
    for d in lines:
        for key in ("case", "unit", "value", "peer", "peer_value", "ratio", "rows", "dim", "interval_s", "quick"):
            assert key in d, (key, d)
        assert d["quick"] is True and d["value"] > 0 and d["peer_value"] > 0 and math.isfinite(d["ratio"])
    by = {d["case"]: d for d in lines}
    assert by["serving_sync.lag_p50"]["value"] <= by["serving_sync.lag_p95"]["value"] < 10.0
    assert by["serving_sync.lag_p50"]["samples"] >= 20
    assert by["serving_sync.delta_throughput"]["delta_rows"] >= by["serving_sync.delta_throughput"]["rows_pushed"]
    assert by["serving_sync.lookup_p50"]["value"] <= by["serving_sync.lookup_p99"]["value"]
    assert elapsed < 60, f"bench serving-sync --quick took {elapsed:.0f}s"
