"""The modules of the ``train`` extra (``pip install 'tigana[train]'``), and which of them a run needs that this
install lacks. Torch-free and cheap (``importlib.util.find_spec``, nothing imported), so the launcher asks
before it starts a cluster or a trainer, and the CLI names the extra when a command fails on one of them."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tigana.trainer.config import TrainConfig

# Every module the extra installs that a command may import; a ModuleNotFoundError naming one of them means
# "install the extra", not a bug.
TRAIN_EXTRA = frozenset({"torch", "torchmetrics", "tensorboard", "tqdm"})


def needed(config: TrainConfig) -> list[str]:
    """The extra's modules a run of ``config`` imports: torch for the model, torchmetrics for the evaluation
    every run ends with, tensorboard with ``logdir``, tqdm with ``progress``."""
    return ["torch", "torchmetrics"] + (["tensorboard"] if config.logdir else []) + (
        ["tqdm"] if config.progress else [])


def first_missing(config: TrainConfig) -> str | None:
    """The first module ``needed(config)`` that this install lacks, or None."""
    return next((name for name in needed(config) if importlib.util.find_spec(name) is None), None)
