"""``tigana config show {server,scheduler,train} [--sources] [--json] [FLAGS...]``: the effective configuration
of a command and where each value came from (flag, ``TIGANA_*`` variable, config file, default).

FLAGS are the command's own flags (``--config FILE`` included), read exactly as the command reads them, so
``tigana config show server --port 7000 --sources`` shows what ``tigana server --port 7000`` would run with.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from tigana.ps.errors import PSError

# command -> module with add_arguments(parser) and load(args) -> settings.Loaded
TARGETS = {"server": "tigana.tools.server_cmd", "scheduler": "tigana.tools.scheduler_cmd",
           "train": "tigana.tools.train_cmd"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print the effective configuration of a command",
                          description="print the effective configuration of a command")
    show.add_argument("target", choices=sorted(TARGETS), help="the command")
    show.add_argument("--sources", action="store_true", help="say where each value came from")
    show.add_argument("--json", action="store_true", help="one JSON object: {config, sources}")
    show.add_argument("flags", nargs=argparse.REMAINDER, help="the command's own flags")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(TARGETS[args.target])
    parser = argparse.ArgumentParser(prog=f"tigana {args.target}")
    module.add_arguments(parser)
    # --sources/--json may come after the target, where the remainder (the command's flags) begins
    flags = [f for f in args.flags if f not in ("--", "--sources", "--json")]
    args.sources = args.sources or "--sources" in args.flags
    args.json = args.json or "--json" in args.flags
    try:
        loaded = module.load(parser.parse_args(flags))
    except (PSError, ValueError) as exc:
        print(f"tigana config: {exc}", file=sys.stderr)
        return 2
    rows = loaded.rows()
    if args.json:
        print(json.dumps({"config": {k: _plain(v) for k, v, _ in rows}, "sources": {k: s for k, _, s in rows}}))
        return 0
    width = max(len(k) for k, _, _ in rows)
    for name, value, source in rows:
        text = json.dumps(_plain(value))
        print(f"{name:<{width}}  {text}" + (f"   # {source}" if args.sources else ""))
    return 0
