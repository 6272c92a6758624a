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


def needed(config: TrainConfig, rank0: bool = True) -> list[str]:
    """The extra's modules a rank of a run of ``config`` imports: torch for the model, torchmetrics for the
    evaluation every run ends with, and on rank 0 tensorboard with ``logdir`` and tqdm with ``progress``."""
    return ["torch", "torchmetrics"] + (["tensorboard"] if rank0 and config.logdir else []) + (
        ["tqdm"] if rank0 and config.progress else [])


def require(config: TrainConfig, rank0: bool = True) -> None:
    """Raise ``ModuleNotFoundError`` (naming the module) for the first module ``needed`` that this install
    lacks: before anything starts, not at the evaluation after the last step."""
    lacking = next((name for name in needed(config, rank0) if importlib.util.find_spec(name) is None), None)
    if lacking is not None:
        raise ModuleNotFoundError(f"No module named {lacking!r}", name=lacking)
