"""``tigana train``: train a CTR model whose embeddings live on the parameter server.

Flags override the ``--config`` YAML file and ``TIGANA_*`` variables (see ``tigana.trainer.config``). Without
``--ps`` an embedded local cluster runs for the job. The last line on stdout is one JSON object (auc, logloss,
samples_per_s, steps, eval_rows, ...); progress and logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

# torch's C++ store logs every failed connection to a peer not up yet with a C++ stack trace: keep its warnings
# out of the job's log unless asked for (our own messages say what is being waited for)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from tigana.ps.logs import FORMATS, setup_logging
from tigana.tools.daemon_flags import say
from tigana.trainer import config as train_config
from tigana.trainer import launch, preemption
from tigana.trainer.inputs import check_inputs


def _rendezvous_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an error of torch's rendezvous store (``DistError``: DistStoreError,
    DistNetworkError, ...). torch is loaded only where a rank ran in this process: the ``--nproc N`` launcher
    never imports it."""
    dist = sys.modules.get("torch.distributed")
    error = getattr(dist, "DistError", None)
    return isinstance(error, type) and isinstance(exc, error)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    train_config.add_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    parser.add_argument("--log-format", default="text", choices=FORMATS,
                        help="text lines, or one JSON object per line (default: text)")


def load(args: argparse.Namespace):
    """The effective settings of parsed flags and where each came from (``tigana config show train``)."""
    return train_config.config_sources_from_args(args)


def run(args: argparse.Namespace) -> int:
    try:
        config = train_config.config_from_args(args)
        check_inputs(config)
    except (train_config.ConfigError, FileNotFoundError, ValueError) as exc:
        say(args, f"tigana train: {exc}", logging.ERROR)
        return 2
    setup_logging(args.log_level, args.log_format)
    try:
        result = launch.run(config)
    except KeyboardInterrupt:
        say(args, "tigana train: interrupted (Ctrl-C); the trainers and any cluster they started are stopped",
            logging.WARNING)
        return 130
    except Exception as exc:  # the rendezvous with the other ranks failed (a peer never came, or went away)
        if not _rendezvous_error(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        say(args, f"tigana train: could not reach the other ranks of the job ({type(exc).__name__}: {first}). Under "
            "srun or torchrun, check that every rank started and MASTER_ADDR/MASTER_PORT are reachable; for "
            "local processes use --nproc N outside a launcher", logging.ERROR)
        return 1
    if result is not None:
        print(json.dumps(result), flush=True)
    # a preempted run (SIGTERM) checkpointed and stopped: a distinct status tells a batch script to requeue it
    stopped = result.get("preempted", False) if result is not None else preemption.requested()
    return preemption.EXIT_PREEMPTED if stopped else 0
