"""``python -m tigana.trainer`` / ``torchrun --nproc-per-node N -m tigana.trainer ...``: the same flags as
``tigana train``; rank 0 prints the result as one JSON line, the last on stdout."""

from __future__ import annotations

import argparse
import json
import sys

from tigana.trainer.config import ConfigError, add_arguments, config_from_args
from tigana.trainer.launch import run
from tigana.trainer.loop import check_inputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigana.trainer",
                                     description="Train a CTR model through the parameter server.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        check_inputs(config)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    result = run(config)
    if result is not None:
        sys.stdout.flush()
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
