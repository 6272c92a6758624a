"""``tigana bench checkpoint`` end to end in a small form (a real cluster, a DeepFM trained through it, four
chains of checkpoints and a restore of each): every case's JSON line with its keys and its peer."""

from __future__ import annotations

import math

import pytest

from tigana.tools import cli

pytestmark = pytest.mark.timeout(240)

MODES = ["full", "incremental", "int8", "incremental_int8"]


def test_bench_checkpoint_small(bench_lines, tmp_path) -> None:
    assert cli.main(["bench", "checkpoint", "--quick", "--rows", "20000", "--changed", "0.05", "--intervals", "3",
                     "--steps", "1", "--eval-rows", "4096", "--dir", str(tmp_path)]) == 0
    lines = bench_lines()
    by = {(d["case"], d["mode"]): d for d in lines}
    cases = ("checkpoint.bytes", "checkpoint.seconds", "checkpoint.restore_seconds", "checkpoint.auc")
    assert set(by) == {(c, m) for c in cases for m in MODES} and len(lines) == len(by)
    for d in lines:
        for key in ("case", "unit", "value", "peer", "peer_value", "ratio", "bulk_rows", "intervals", "changed"):
            assert key in d, (key, d)
        assert d["value"] > 0 and d["peer_value"] > 0 and math.isfinite(d["ratio"])
    full = by[("checkpoint.bytes", "full")]["value"]
    # an incremental chain writes one full checkpoint and then deltas; int8 shrinks the weights, not the state
    assert by[("checkpoint.bytes", "incremental")]["value"] < 0.7 * full
    assert by[("checkpoint.bytes", "int8")]["value"] < full
    assert by[("checkpoint.bytes", "incremental_int8")]["value"] < by[("checkpoint.bytes", "incremental")]["value"]
    assert by[("checkpoint.bytes", "incremental_int8")]["target_ratio"] == 0.1
    # exact chains restore the model exactly; int8 within the target
    assert by[("checkpoint.auc", "incremental")]["auc_delta"] == 0.0
    assert by[("checkpoint.auc", "full")]["auc_delta"] == 0.0
    for mode in ("int8", "incremental_int8"):
        assert abs(by[("checkpoint.auc", mode)]["auc_delta"]) <= 0.001
    assert not list(tmp_path.iterdir())  # the run's folder is gone
