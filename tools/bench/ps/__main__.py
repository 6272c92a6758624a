"""The echo server child of ``tigana bench ps``: ``python -m tigana.tools.bench.ps --echo-server READY_FILE``."""

import argparse

from tigana.tools.bench.ps.bench import run

if __name__ == "__main__":
    _parser = argparse.ArgumentParser()
    _parser.add_argument("--echo-server")
    raise SystemExit(run(_parser.parse_args()))
