"""``tigana.tools.tune_defaults``: the ranking that picked the tuned defaults (mean over seeds of every
(settings, epochs) pair, the newest run of a seed counting) and the grid it expands. Fast: nothing trains."""

from __future__ import annotations

import argparse
import json

from tigana.tools import tune_defaults


def _run(model: str, seed: int, aucs: list[float], **settings) -> dict:
    return {"dataset": "movielens-100k", "model": model, "settings": settings, "seed": seed, "epochs": len(aucs),
            "auc": aucs, "logloss": [0.5] * len(aucs)}


def test_ranking_averages_seeds_per_settings_and_epochs() -> None:
    records = [_run("deepfm", 0, [0.70, 0.80], lr=0.01), _run("deepfm", 1, [0.72, 0.78], lr=0.01),
               _run("deepfm", 0, [0.75, 0.77], lr=0.1), _run("dlrm", 0, [0.60], lr=0.01),
               _run("deepfm", 1, [0.50, 0.50], lr=0.01)]  # a newer run of seed 1 replaces the older one
    ranked = tune_defaults.ranking(records)
    assert set(ranked) == {"deepfm", "dlrm"}
    top = ranked["deepfm"][0]
    assert top["settings"] == {"lr": 0.1, "epochs": 2} and top["auc"] == 0.77 and top["seeds"] == [0]
    by = {json.dumps(r["settings"], sort_keys=True): r for r in ranked["deepfm"]}
    two = by[json.dumps({"epochs": 2, "lr": 0.01}, sort_keys=True)]
    assert two["seeds"] == [0, 1] and abs(two["auc"] - 0.65) < 1e-12
    assert (two["min_auc"], two["max_auc"]) == (0.5, 0.8)


def test_the_grid_is_the_product_of_its_axes_over_the_fixed_settings() -> None:
    args = argparse.Namespace(set=["batch_size=1024", "embedding_optimizer=adam"],
                              grid=["embedding_lr=0.001,0.003", "dim=8,16"])
    configs = list(tune_defaults._configs(args))
    assert len(configs) == 4
    assert {"batch_size": 1024, "embedding_optimizer": "adam", "embedding_lr": 0.003, "dim": 8} in configs
    assert all(isinstance(c["dim"], int) and isinstance(c["embedding_lr"], float) for c in configs)
