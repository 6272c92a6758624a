"""What a training run reads before it starts: the data set's files and the checkpoint to resume from.

``check_inputs`` runs before any cluster or trainer process starts, so a missing or unlabelled file, or a
missing checkpoint, fails the command at once rather than after an epoch of training. No torch here: the
``tigana train --nproc N`` launcher checks its inputs without importing torch (its trainer processes do).
"""

from __future__ import annotations

import os
from pathlib import Path

from tigana.trainer.config import TrainConfig
from tigana.trainer.metrics import require_wandb

__all__ = ["check_inputs", "criteo_files", "latest_checkpoint", "movielens_root"]


def check_inputs(config: TrainConfig) -> None:
    """Fail fast, before a cluster or a trainer process starts, when the data set's files or the checkpoint to
    resume from are missing or a Criteo training file has no labels (``FileNotFoundError``/``ValueError``
    naming the path), or W&B is asked for and not installed (``ConfigError``)."""
    if config.dataset == "movielens-100k":
        movielens_root(config.data)
    elif config.dataset == "criteo":
        criteo_files(config.data)
    if config.wandb_project:
        require_wandb(config.wandb_project)
    if config.resume is not None:
        root = config.checkpoint_dir
        path = (latest_checkpoint(root) if root is not None else None) if config.resume in ("latest", "auto") \
            else Path(config.resume)
        if (path is None and config.resume != "auto") or (path is not None and not (path / "meta.json").is_file()):
            raise FileNotFoundError(f"resume: no checkpoint at {path if path is not None else root}")


def movielens_root(path: str | None) -> Path:
    """The MovieLens-100K folder (holding ``u.user``) at or under ``path``."""
    if path is None:
        raise ValueError("data: the movielens-100k dataset needs --data (the ml-100k folder or its parent)")
    root = Path(path)
    for candidate in (root, root / "ml-100k", root / "movielens-100k" / "ml-100k"):
        if (candidate / "u.user").is_file():
            return candidate
    raise FileNotFoundError(f"data: no MovieLens-100K files (u.user, u1.base...) under {root}")


def criteo_files(path: str | None) -> tuple[Path, Path | None, list[Path]]:
    """(training file, evaluation file or None, evaluation files passed over for having no labels) of
    ``--data``: a file, or a folder whose ``test``/``valid``/``val``/``eval`` file is the evaluation set and
    whose largest other (``train*`` first) file the training set. The Kaggle DAC download (``train.txt`` and a
    ``test.txt`` without labels) evaluates on every 10th row of ``train.txt``: its ``test.txt`` is passed over.
    Raises ValueError, before any training, when the training file has no labels."""
    from tigana.trainer.data.criteo import has_labels

    if path is None:
        raise ValueError("data: the criteo dataset needs --data (a DAC/Kaggle file or a folder holding one)")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data: {p} does not exist")
    evals: list[Path] = []
    if p.is_file():
        train = p
    else:
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".txt", ".csv", ".tsv"))
        evals = [f for f in files if f.stem.split(".")[0] in ("test", "valid", "val", "eval")]
        trains = [f for f in files if f not in evals and f.stem.startswith("train")] or \
                 [f for f in files if f not in evals]
        if not trains:
            raise FileNotFoundError(f"data: no Criteo text file in {p}")
        train = max(trains, key=lambda f: f.stat().st_size)
    if not has_labels(train):
        raise ValueError(f"data: {train} has no click labels (rows of 13 counts and 26 categories, like the Kaggle "
                         "download's test.txt): train on a labelled file such as its train.txt")
    labelled = [f for f in evals if has_labels(f)]
    return train, (labelled[0] if labelled else None), [f for f in evals if f not in labelled]


def _checkpoint_dirs(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("step-*") if (p / "meta.json").is_file()),
                  key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    dirs = _checkpoint_dirs(Path(root))
    return dirs[-1] if dirs else None
