"""``tigana train``: train a CTR model whose embeddings live on the parameter server.

Flags override the ``--config`` YAML file and ``TIGANA_*`` variables (see ``tigana.trainer.config``). Without
``--ps`` an embedded local cluster runs for the job. The last line on stdout is one JSON object (auc, logloss,
samples_per_s, steps, eval_rows, ...); progress and logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from tigana.trainer import config as train_config
from tigana.trainer import launch
from tigana.trainer.loop import check_inputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    train_config.add_arguments(parser)


def load(args: argparse.Namespace):
    """The effective settings of parsed flags and where each came from (``tigana config show train``)."""
    return train_config.config_sources_from_args(args)


def run(args: argparse.Namespace) -> int:
    try:
        config = train_config.config_from_args(args)
        check_inputs(config)
    except (train_config.ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"tigana train: {exc}", file=sys.stderr)
        return 2
    result = launch.run(config)
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0
