"""``tigana bench train`` and ``tigana bench allreduce`` end to end on a tiny workload (real shard daemons, real
gloo ranks)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tigana.tools import cli
from tigana.trainer.data import SyntheticCriteo
from tigana.trainer.data.criteo import NUM_SPARSE
from tigana.trainer.data.synthetic import CRITEO_KAGGLE_CARDINALITIES

pytestmark = pytest.mark.timeout(300)


def test_bench_train_reports_ps_against_local_and_torchrec_when_installed(bench_lines):
    """What the lines say the run did is checked against the workload, computed here on its own: every
    trainer trained every batch in every round, the PS cases made one pull and one push per PS table a step
    (one fused table, or 26), and the PS ends up holding exactly the rows the batches touched."""
    steps, batch_size, vocab = 2, 256, 1000
    argv = ["bench", "train", "--steps", str(steps), "--repeats", "2", "--batch-size", str(batch_size),
            "--vocab", str(vocab), "--shards", "1"]
    assert cli.main(argv) == 0
    lines = {d["case"]: d for d in bench_lines()}
    expected = {"train_ps", "train_ps_unfused"} | (
        {"train_ps_vs_torchrec"} if importlib.util.find_spec("torchrec") else set())
    assert set(lines) == expected
    gen = SyntheticCriteo(vocab_sizes=tuple(min(v, vocab) for v in CRITEO_KAGGLE_CARDINALITIES), seed=0)
    ids = torch.cat([b.sparse.values.view(NUM_SPARSE, -1) for b in gen.batches(batch_size, batch_size * steps)], 1)
    touched = sum(int(torch.unique(ids[f]).numel()) for f in range(NUM_SPARSE))
    for d in lines.values():
        assert d["unit"] == "samples/s" and d["value"] > 0 and d["peer_value"] > 0
        assert d["samples_per_round"] == batch_size * steps
        assert 0 < d["round_seconds"] < 60 and d["ps_rows"] == touched
    fused, unfused = lines["train_ps"], lines["train_ps_unfused"]
    assert (fused["ps_tables"], fused["pulls_per_step"], fused["pushes_per_step"]) == (1, 1, 1)
    assert (unfused["ps_tables"], unfused["pulls_per_step"], unfused["pushes_per_step"]) == (26, 26, 26)
    assert fused["fused_tables"] and not unfused["fused_tables"]
    assert fused["peer"] == "local nn.EmbeddingBag"


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
