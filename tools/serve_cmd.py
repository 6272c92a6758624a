"""``tigana serve --from DIR --port P`` or ``tigana serve --model DIR --port P``: a read-only server for inference.

``--model DIR`` serves a published model (``tigana train --publish-dir DIR`` and ``tigana admin export --follow
--model DIR``): every table of it, and ``tigana.v1.Serving/Predict`` over its dense network (it needs the train
extra: torch). The rest of this text is about ``--from``, which works the same way per table.

It follows the export log that ``tigana admin export TABLE --follow --out DIR`` writes (``tigana.ps.serving.exportlog``):
loads the latest full export, applies deltas as they appear, and answers ``tigana.v1.Serving/Lookup`` (ids as
packed int64, rows as packed float32) with gRPC health (SERVING once the first full export is loaded). Unknown
ids read as ``--unseen`` says. TLS and tokens take the flags of ``tigana server`` or their ``TIGANA_*`` variables
(either token file's tokens may look up); ``--metrics-port`` serves Prometheus metrics. SIGTERM or Ctrl-C: health NOT_SERVING, RPCs in
flight finish, exit 0. The design is in ``tigana.ps.serving``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tigana.embeddings.files import atomic_write
from tigana.ps.errors import InvalidArgument
from tigana.ps.logs import FORMATS, setup_logging
from tigana.ps.serving import (
    ENV_FIELDS,
    ServeConfig,
    load_serve_config,
    load_serve_config_sources,
    start_serving,
)
from tigana.tools.daemon_flags import add_metrics_flags, add_security_flags, say
from tigana.tools.signals import StopSignal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source", help="one table's export log folder (tigana admin export TABLE "
                                                       "--follow --out)")
    source.add_argument("--model", help="a published model's folder (tigana train --publish-dir; tigana admin "
                                        "export --follow --model): every table and Predict")
    a("--port", type=int, default=0, help="gRPC port (0: a free port, printed at start)")
    a("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    a("--poll", dest="poll_s", type=float, default=ServeConfig.poll_s,
      help="seconds between polls of the log's manifest")
    a("--unseen", "--default", dest="unseen", default="",
      help="the row of an id the table does not hold, the row the trainer's evaluation reads for it: zeros, "
           "initial (its initializer's row; --model), a number for every element, or mean (the mean row; --from) "
           "(default: the model's own setting, else zeros)")
    a("--max-ids", type=int, default=ServeConfig.max_ids, help="ids in one lookup at most")
    a("--max-rows", type=int, default=ServeConfig.max_rows, help="feature rows in one prediction at most")
    a("--canary", default=ServeConfig.canary,
      help="--model: a labelled file in the training data's format; each new version is scored on it before it "
           "goes live, and refused when its AUC is below the served version's by more than --max-auc-drop")
    a("--max-auc-drop", type=float, default=ServeConfig.max_auc_drop, help="--canary: the AUC a version may lose")
    a("--keep-versions", type=int, default=ServeConfig.keep_versions,
      help="--model: versions held in memory, so a rollback to one of them is a swap")
    a("--no-verify", dest="verify", action="store_false", help="skip the sha256 check of each entry's files (default: checked)")
    add_security_flags(parser, "serving server", "they may look up too")
    add_metrics_flags(parser, "lookups, latency, ids found, log position, freshness")
    a("--ready-file", default=None,
      help="write {address, port, metrics_port, pid} as JSON here once the port is bound (health says when it "
           "serves)")
    a("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    a("--log-format", default="text", choices=FORMATS, help="text lines, or one JSON object per line")


def load(args: argparse.Namespace):
    """The effective settings of parsed flags and where each came from (``tigana config show serve``)."""
    return load_serve_config_sources({f: getattr(args, f) for f in _FLAGS})


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    stop = StopSignal()
    try:
        config = load_serve_config({f: getattr(args, f) for f in _FLAGS})
        handle = start_serving(config, _scorer_loader() if config.model else None)
    except (OSError, InvalidArgument, _MissingExtra) as exc:
        say(args, f"tigana serve: {exc}")
        return 2 if isinstance(exc, (InvalidArgument, _MissingExtra)) else 1
    try:
        if args.ready_file:
            _write_ready(Path(args.ready_file), {"address": handle.address, "port": handle.port,
                                                 "metrics_port": handle.metrics_port, "pid": os.getpid()})
        metrics = f", metrics on :{handle.metrics_port}" if handle.metrics_port else ""
        tls = ", TLS" if handle.security.tls else ""
        what = f"the model in {config.model}" if config.model else config.source
        unseen = config.unseen or ("as the model says" if config.model else "zeros")
        say(args, f"tigana serve: listening on {handle.address}{tls}, following {what} (unseen ids: {unseen}"
              f"{metrics}); SERVING once {'it is' if config.model else 'a full export is'} loaded")
        stop.wait()
        say(args, f"tigana serve: {stop.name}, stopping")
    finally:
        handle.close()
        if args.ready_file:
            Path(args.ready_file).unlink(missing_ok=True)
    return 0


_FLAGS = ("source", "model", "host", "port", "poll_s", "unseen", "max_ids", "max_rows", "canary", "max_auc_drop",
          "keep_versions", "verify", *ENV_FIELDS)


class _MissingExtra(Exception):
    """--model without torch: the train extra is needed to run the model."""


def _scorer_loader():
    """The trainer's scorer loader (torch, the models): imported only for ``--model``."""
    try:
        from tigana.trainer.predict import load_scorer
    except ModuleNotFoundError as exc:
        raise _MissingExtra(f"--model runs the model's dense network and needs {exc.name}: pip install "
                            "'tigana[train]'") from None
    return load_scorer


def _write_ready(path: Path, info: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(info))
