"""What a training run reports: TensorBoard scalars (loss, AUC, samples/s, pull/push latency, staleness) in
the event file of a tiny real run against in-process shard servers, the rank's Prometheus metrics scraped
over HTTP, and Weights & Biases refused with a clear message when the package is missing."""

from __future__ import annotations

import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tigana.trainer.config import ConfigError, TrainConfig
from tigana.trainer.distributed import DistEnv
from tigana.trainer.loop import train
from tigana.trainer.metrics import TrainerMetrics, require_wandb, start_wandb


@pytest.mark.timeout(240)
def test_a_tiny_run_writes_the_scalars_and_serves_metrics(tmp_path, shard_servers) -> None:
    config = TrainConfig(model="deepfm", dataset="synthetic", synthetic_rows=2000, synthetic_vocab=300,
                         batch_size=200, eval_batch_size=1000, epochs=1, max_steps=6, staleness=1, seed=5,
                         progress=False, log_every=2, logdir=str(tmp_path / "tb"), table_prefix="tel_")
    metrics = TrainerMetrics(rank=0)
    metrics.serve_http(-1)
    try:
        result = train(config, DistEnv(), None, [h.address for h in shard_servers], metrics=metrics)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics.http_port}/metrics", timeout=10).read().decode()
    finally:
        metrics.close()
    assert result["steps"] == 6

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "eval/auc", "eval/logloss", "train/samples_per_s", "train/samples_per_s_rank0",
                "train/samples_per_s_window", "ps/pull_latency_ms", "ps/push_latency_ms", "ps/pull_wait_ms",
                "ps/staleness_steps"):
        assert tag in tags, f"{tag} not in {sorted(tags)}"
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]
    assert all(e.value > 0 for e in acc.Scalars("ps/pull_latency_ms"))
    assert acc.Scalars("eval/auc")[-1].value == pytest.approx(result["auc"])

    samples = {s.name + str(sorted(s.labels.items())): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["tigana_trainer_samples_total[('rank', '0')]"] == 6 * 200
    assert samples["tigana_trainer_steps_total[('rank', '0')]"] == 6
    assert samples["tigana_trainer_eval_auc[('rank', '0')]"] == pytest.approx(result["auc"])
    assert samples["tigana_trainer_loss[('rank', '0')]"] > 0
    assert samples["tigana_trainer_ps_seconds_count[('op', 'pull'), ('rank', '0')]"] >= 6
    assert samples["tigana_trainer_ps_seconds_count[('op', 'push'), ('rank', '0')]"] == 6
    assert samples["tigana_client_rows_pushed_total[]"] > 0
    table = "tel_deepfm_synthetic_fused"
    assert samples[f"tigana_client_wire_bytes_total[('direction', 'sent'), ('op', 'push'), ('table', '{table}')]"] > 0
    assert f"tigana_client_staleness_steps[('table', '{table}')]" in samples


def test_wandb_is_optional_and_named_when_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: ``import wandb`` raises ImportError
    with pytest.raises(ConfigError, match=r"wandb_project: 'ctr'.*pip install"):
        require_wandb("ctr")
    with pytest.raises(ConfigError, match="wandb package is not installed"):
        start_wandb("ctr", {"model": "deepfm"})
