"""``tigana bench serving`` end to end in a small form (a cluster, the follower, ``tigana train`` and ``tigana
serve --model`` as real processes): every case's JSON line with its keys and a peer measured in the run."""

from __future__ import annotations

import math

import pytest

from tigana.tools import cli

pytestmark = pytest.mark.timeout(240)

CASES = {"serving.freshness_p50": "s", "serving.freshness_p95": "s", "serving.predict_p50": "ms",
         "serving.predict_p99": "ms", "serving.predict_rows": "rows/s", "serving.rollback": "s",
         "serving.resume": "s", "serving.rollback_rebuilt": "s"}


def test_bench_serving_small(bench_lines) -> None:
    assert cli.main(["bench", "serving", "--quick", "--rows", "30000", "--requests", "5", "--probe-every", "0.05"]) == 0
    lines = bench_lines()
    assert {d["case"]: d["unit"] for d in lines} == CASES
    assert len(lines) == 2 + 3 * 3 + 3  # each predict case at 1, 64 and 1024 rows a request
    for d in lines:
        for key in ("case", "unit", "value", "peer", "peer_value", "ratio", "model", "train_rows", "settings"):
            assert key in d, (key, d)
        assert d["value"] > 0 and d["peer_value"] > 0 and math.isfinite(d["ratio"])
    by = {d["case"]: d for d in lines}
    assert by["serving.freshness_p50"]["value"] <= by["serving.freshness_p95"]["value"]
    assert by["serving.freshness_p50"]["samples"] >= 20
    assert sorted(d["rows_per_request"] for d in lines if d["case"] == "serving.predict_p50") == [1, 64, 1024]
    assert by["serving.rollback"]["to_version"] < by["serving.rollback"]["from_version"]
    assert by["serving.rollback_rebuilt"]["held"] is False
