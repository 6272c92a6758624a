"""The per-data-set tuned defaults (``trainer.config.TUNED``): they fill only the fields that no flag,
``TIGANA_*`` variable or config file sets, ``tigana config show train --sources`` names them, every entry
makes a valid configuration for every model, and Criteo's apply to small files only. Fast: nothing trains
here but the last test (one short run on MovieLens-100K, skipped without the data)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tigana.tools import cli
from tigana.trainer.config import (
    DATASETS,
    MODELS,
    TUNED,
    TrainConfig,
    add_arguments,
    config_sources_from_args,
    tuned_settings,
)

ML = ("--model", "deepfm", "--dataset", "movielens-100k", "--data", "/nowhere/ml")


def _loaded(*argv: str, environ: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_sources_from_args(parser.parse_args(list(argv)), environ or {})


@pytest.fixture
def small_criteo(tmp_path) -> str:
    path = tmp_path / "train.txt"
    path.write_text("0\t1" + "\t" * 38 + "\n")
    return str(path)


@pytest.mark.parametrize("dataset", sorted(TUNED))
@pytest.mark.parametrize("model", MODELS)
def test_only_model_dataset_and_data_get_the_tuned_values(dataset: str, model: str, small_criteo: str) -> None:
    data = small_criteo if dataset == "criteo" else "/nowhere"
    loaded = _loaded("--model", model, "--dataset", dataset, "--data", data)
    tuned = tuned_settings(dataset, model, data)
    assert tuned, f"{dataset} has no tuned defaults"
    for name, (value, source) in tuned.items():
        assert getattr(loaded.config, name) == value, name
        assert loaded.sources[name] == source and source.startswith(f"dataset default ({dataset}")
    untouched = {"staleness", "shards", "seed", "eval_batch_size"}
    assert all(loaded.sources[name] == "default" for name in untouched)
    assert (loaded.sources["model"], loaded.sources["dataset"]) == ("flag --model", "flag --dataset")


def test_the_tuned_values_differ_from_the_plain_defaults_where_it_matters(small_criteo: str) -> None:
    """The reason they exist: one epoch of batch 512 undertrains MovieLens-100K (AUC 0.778, below a logistic
    regression) and gives only 4 steps on the 1,999-row Criteo head."""
    plain = TrainConfig()
    assert _loaded("--dataset", "movielens-100k", "--data", "/nowhere").config.epochs > plain.epochs
    criteo = _loaded("--dataset", "criteo", "--data", small_criteo).config
    assert criteo.epochs > plain.epochs and criteo.batch_size < plain.batch_size


def test_criteo_values_are_for_small_files_only(tmp_path, small_criteo: str) -> None:
    """A few epochs of batch 32 suit the 1,999-row head, not the 45 M rows of the full data set."""
    limit = TUNED["criteo"].max_data_bytes
    assert limit is not None
    big = tmp_path / "big" / "train.txt"
    big.parent.mkdir()
    with big.open("wb") as f:
        f.truncate(limit + 1)  # sparse: no disk used
    for data in (str(big), str(big.parent), str(tmp_path / "missing")):
        loaded = _loaded("--dataset", "criteo", "--data", data)
        assert loaded.config.epochs == TrainConfig.epochs and loaded.sources["epochs"] == "default", data
    folder = str(Path(small_criteo).parent)  # a folder of small files counts as small
    assert _loaded("--dataset", "criteo", "--data", folder).sources["epochs"].startswith("dataset default (criteo")


def test_a_flag_a_variable_or_a_file_beats_the_tuned_value(tmp_path) -> None:
    tuned = {name: value for name, (value, _) in tuned_settings("movielens-100k", "deepfm").items()}
    assert {"epochs", "batch_size"} <= set(tuned)
    epochs, batch = tuned["epochs"] + 3, tuned["batch_size"] * 2 + 1
    loaded = _loaded(*ML, "--epochs", str(epochs))
    assert loaded.config.epochs == epochs and loaded.sources["epochs"] == "flag --epochs"
    assert loaded.config.batch_size == tuned["batch_size"]  # the rest keep the tuned values
    loaded = _loaded(*ML, environ={"TIGANA_BATCH_SIZE": str(batch)})
    assert loaded.config.batch_size == batch and loaded.sources["batch_size"] == "env TIGANA_BATCH_SIZE"
    path = tmp_path / "train.yaml"
    path.write_text(f"epochs: {epochs}\nembedding-lr: 0.123\n")
    loaded = _loaded("--config", str(path), *ML)
    assert (loaded.config.epochs, loaded.config.embedding_lr) == (epochs, 0.123)
    assert loaded.sources["epochs"] == loaded.sources["embedding_lr"] == f"file {path}"
    # the data set and model may come from the file or the environment too
    path.write_text("dataset: movielens-100k\nmodel: dlrm\n")
    loaded = _loaded("--config", str(path), "--data", "/nowhere/ml")
    assert loaded.config.epochs == tuned_settings("movielens-100k", "dlrm")["epochs"][0]
    loaded = _loaded("--data", "/nowhere/ml", environ={"TIGANA_DATASET": "movielens-100k"})
    assert loaded.sources["epochs"].startswith("dataset default (movielens-100k")


def test_synthetic_keeps_the_plain_defaults() -> None:
    assert "synthetic" not in TUNED and tuned_settings("synthetic", "deepfm") == {}
    assert _loaded().config == TrainConfig()
    assert _loaded("--dataset", "synthetic").config == TrainConfig()


def test_every_entry_is_valid_for_every_model() -> None:
    assert set(TUNED) <= set(DATASETS)
    for dataset, tuned in TUNED.items():
        assert set(tuned.models) <= set(MODELS), dataset
        for model in MODELS:
            values = {name: value for name, (value, _) in tuned_settings(dataset, model).items()}
            TrainConfig(model=model, dataset=dataset, **values)  # checks every value


def test_config_show_names_the_dataset_default(capsys) -> None:
    assert cli.main(["config", "show", "train", "--sources", *ML, "--batch-size", "64"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["epochs"].endswith("# dataset default (movielens-100k)")
    assert lines["batch_size"].endswith("# flag --batch-size")
    assert lines["staleness"].endswith("# default")
    assert cli.main(["config", "show", "train", "--json", *ML]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["epochs"] == tuned_settings("movielens-100k", "deepfm")["epochs"][0]


def test_help_shows_the_tuned_values(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    epochs = TUNED["movielens-100k"].own()["epochs"]
    assert f"movielens-100k: {epochs}" in out


ML_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "movielens-100k"


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (ML_DATA / "ml-100k" / "u1.base").is_file(), reason=f"MovieLens-100K not at {ML_DATA}")
def test_tigana_train_runs_with_the_tuned_values_and_the_epochs_flag() -> None:
    """``tigana train`` with only --model/--dataset/--data and ``--epochs 1``: the flag's epochs, the tuned batch
    size (so the step count) and the tuned optimizers; one epoch already ranks well above chance (0.768; the
    full default, 10 epochs, reaches 0.797: docs/training.md's table)."""
    batch = tuned_settings("movielens-100k", "deepfm")["batch_size"][0]
    out = subprocess.run([sys.executable, "-m", "tigana.tools.cli", "train", "--model", "deepfm", "--dataset",
                          "movielens-100k", "--data", str(ML_DATA), "--epochs", "1", "--no-progress"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == math.ceil(80_000 / batch) and result["eval_rows"] == 20_000
    assert result["auc"] >= 0.76, result
