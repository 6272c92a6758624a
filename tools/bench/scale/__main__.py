"""A client process of ``tigana bench scale``: ``python -m tigana.tools.bench.scale --worker``."""

import argparse

from tigana.tools.bench.scale.bench import add_arguments, run

if __name__ == "__main__":
    _parser = argparse.ArgumentParser()
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
