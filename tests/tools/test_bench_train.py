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


def test_bench_train_reports_the_readme_cluster_against_torchrec_static_and_local(bench_lines):
    """What the lines say the run did is checked against the workload, computed here on its own: every
    trainer trained every batch in every round, the PS cases made one pull and one push per PS table a step
    (one fused table, or 26), and the PS ends up holding exactly the rows the batches touched. The headline is
    the README's cluster (a scheduler, one replica, sync tables), the static one its second line, and every
    line gives the CPU per sample of the trainer alone and of every process."""
    steps, batch_size, vocab = 2, 256, 1000
    argv = ["bench", "train", "--steps", str(steps), "--repeats", "2", "--batch-size", str(batch_size),
            "--vocab", str(vocab), "--shards", "2"]
    assert cli.main(argv) == 0
    out = bench_lines()
    lines = {d["case"]: d for d in out}
    torchrec = importlib.util.find_spec("torchrec") is not None
    expected = ["train_ps_vs_torchrec", "train_ps_static_vs_torchrec"] if torchrec else []
    expected += ["train_ps_vs_static", "train_ps_unfused", "train_ps"]
    assert [d["case"] for d in out] == expected  # the headline first
    gen = SyntheticCriteo(vocab_sizes=tuple(min(v, vocab) for v in CRITEO_KAGGLE_CARDINALITIES), seed=0)
    ids = torch.cat([b.sparse.values.view(NUM_SPARSE, -1) for b in gen.batches(batch_size, batch_size * steps)], 1)
    touched = sum(int(torch.unique(ids[f]).numel()) for f in range(NUM_SPARSE))
    readme = {"replicas": 1, "scheduler": True, "durability": "sync"}
    static = {"replicas": None, "scheduler": False, "durability": None}
    for d in lines.values():
        assert d["unit"] == "samples/s" and d["value"] > 0 and d["peer_value"] > 0
        assert d["samples_per_round"] == batch_size * steps
        assert 0 < d["round_seconds"] < 60 and d["ps_rows"] == touched
        # the trainer's own CPU is part of every process's, and a PS case's daemons did work
        assert 0 < d["trainer_cpu_us_per_sample"] < d["cpu_us_per_sample"], d
        assert 0 < d["peer_trainer_cpu_us_per_sample"] <= d["peer_cpu_us_per_sample"], d
        cluster = static if d["case"] == "train_ps_static_vs_torchrec" else readme
        assert {k: d[k] for k in cluster} == cluster, d
    fused, unfused = lines["train_ps"], lines["train_ps_unfused"]
    assert (fused["ps_tables"], fused["pulls_per_step"], fused["pushes_per_step"]) == (1, 1, 1)
    assert (unfused["ps_tables"], unfused["pulls_per_step"], unfused["pushes_per_step"]) == (26, 26, 26)
    assert fused["fused_tables"] and not unfused["fused_tables"]
    assert fused["peer"] == "local nn.EmbeddingBag" and unfused["peer"] == "the fused PS run"
    assert unfused["peer_value"] == fused["value"]  # the fused run is the unfused one's peer
    vs_static = lines["train_ps_vs_static"]
    assert vs_static["value"] == fused["value"] and "no replica" in vs_static["peer"]
    if torchrec:
        head, second = lines["train_ps_vs_torchrec"], lines["train_ps_static_vs_torchrec"]
        assert head["value"] == fused["value"] and second["value"] == vs_static["peer_value"]
        assert head["peer_cpu_us_per_sample"] == head["peer_trainer_cpu_us_per_sample"]  # TorchRec: one process


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
