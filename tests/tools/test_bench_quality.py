"""``tigana bench quality --quick`` (MovieLens-100K; skipped without the data) and ``tigana bench cache`` on a
tiny workload, end to end on real shard daemons: every setting's line with the contract's keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from tigana.tools import cli

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "movielens-100k"
SETTINGS = ["local", "ps", "fp16", "int8", "adaptive", "staleness=0", "staleness=4", "staleness=16", "cache"]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (DATA / "ml-100k" / "u1.base").is_file(), reason=f"MovieLens-100K not found at {DATA}")
def test_bench_quality_quick_prints_every_setting(bench_lines) -> None:
    assert cli.main(["bench", "quality", "--data", str(DATA), "--quick"]) == 0
    lines = bench_lines()
    assert [d["setting"] for d in lines] == SETTINGS
    by = {d["setting"]: d for d in lines}
    for d in lines:
        assert d["case"] == "quality" and d["unit"] == "auc" and d["value"] == pytest.approx(d["auc"], abs=1e-3)
        assert d["peer"] == "local nn.EmbeddingBag" and d["peer_value"] == pytest.approx(by["local"]["auc"], abs=1e-3)
        assert 0.5 < d["auc"] <= 1 and d["logloss"] > 0 and d["samples_per_s"] > 0 and d["quick"] is True
        assert d["auc_delta"] == pytest.approx(d["auc"] - by["local"]["auc"], abs=2e-5)
        for key in ("ratio", "wire_bytes_ratio", "epochs", "batch_size", "seed", "dim", "target", "met"):
            assert key in d
    assert by["local"]["wire_bytes_ratio"] == 0 and by["ps"]["wire_bytes_ratio"] == 1.0
    assert by["staleness=0"]["auc_delta"] == pytest.approx(0, abs=1e-4)  # read-your-writes: the local run's math
    assert 0.5 < by["fp16"]["wire_bytes_ratio"] < 0.6 and 0.35 < by["int8"]["wire_bytes_ratio"] < 0.42
    assert by["adaptive"]["wire_bytes_ratio"] < by["int8"]["wire_bytes_ratio"]
    assert by["adaptive"]["target"] == {"abs_auc_delta_max": 0.001, "wire_bytes_ratio_max": 0.25}
    assert 0 < by["cache"]["cache_hit_rate"] < 1 and by["cache"]["pull_bytes_ratio"] < 1


@pytest.mark.timeout(120)
def test_bench_cache_reports_every_staleness(bench_lines) -> None:
    argv = ["bench", "cache", "--quick", "--steps", "6", "--batch-size", "512", "--vocab", "2000",
            "--cache-rows", "4096"]
    assert cli.main(argv) == 0
    lines = bench_lines()
    assert [d["staleness"] for d in lines] == [0, 1, 4, 16]
    for d in lines:
        assert d["case"] == "cache" and d["unit"] == "pulled bytes" and d["peer"] == "no cache (same client bound)"
        assert d["value"] > 0 and d["peer_value"] > 0 and d["zipf"] == 1.05
        assert d["pulled_bytes_saved"] == pytest.approx(1 - d["value"] / d["peer_value"], abs=1e-3)
        assert 0 <= d["auc"] <= 1 and "auc_delta" in d and 0 <= d["hit_rate"] < 1
    rates = [d["hit_rate"] for d in lines]
    assert rates[0] == 0 and rates == sorted(rates) and rates[-1] > 0.2  # more staleness, more hits
