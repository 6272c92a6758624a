"""``tigana bench train`` and ``tigana bench allreduce`` end to end on a tiny workload (real shard daemons, real
gloo ranks)."""

from __future__ import annotations

import importlib.util

import pytest

from tigana.tools import cli

pytestmark = pytest.mark.timeout(300)


def test_bench_train_reports_ps_against_local_and_torchrec_when_installed(bench_lines):
    argv = ["bench", "train", "--steps", "2", "--repeats", "2", "--batch-size", "256", "--vocab", "1000",
            "--shards", "1"]
    assert cli.main(argv) == 0
    lines = {d["case"]: d for d in bench_lines()}
    expected = {"train_ps", "train_ps_unfused"} | (
        {"train_ps_vs_torchrec"} if importlib.util.find_spec("torchrec") else set())
    assert set(lines) == expected
    for d in lines.values():
        assert d["unit"] == "samples/s" and d["value"] > 0 and d["peer_value"] > 0
        assert d["ratio"] == pytest.approx(d["value"] / d["peer_value"], rel=2e-3)
        assert d["batch_size"] == 256 and d["steps"] == 2 and d["repeats"] == 2 and d["shards"] == 1
        # the best round is never below the median one, for ours and the peer
        assert d["value"] >= d["value_median"] * 0.999 and d["peer_value"] >= d["peer_value_median"] * 0.999
        assert d["ratio_median"] == pytest.approx(d["value_median"] / d["peer_value_median"], rel=2e-3)
    assert lines["train_ps"]["fused_tables"] and not lines["train_ps_unfused"]["fused_tables"]
    assert lines["train_ps"]["peer"] == "local nn.EmbeddingBag"


def test_bench_allreduce_quick(bench_lines):
    assert cli.main(["bench", "allreduce", "--quick", "--repeats", "2"]) == 0
    lines = {d["case"]: d for d in bench_lines()}
    assert set(lines) == {"allreduce_time", "allreduce_cross_node_bytes", "allreduce_fp16_time",
                          "allreduce_fp16_cross_node_bytes"}
    for d in lines.values():
        assert d["value"] > 0 and d["peer_value"] > 0 and d["ranks"] == 4 and d["nodes"] == 2
    # the ring model: hierarchical sends 2/3 of the flat ring's bytes across nodes, 1/3 with fp16
    assert lines["allreduce_cross_node_bytes"]["ratio"] == pytest.approx(2 / 3, rel=1e-3)
    assert lines["allreduce_fp16_cross_node_bytes"]["ratio"] == pytest.approx(1 / 3, rel=1e-3)
