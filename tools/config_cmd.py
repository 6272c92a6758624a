"""``tigana config show [{server,scheduler,serve,train}] [--sources] [--json] [FLAGS...]``: the effective
configuration of a command and where each value came from (flag, ``TIGANA_*`` variable, config file, default).

FLAGS are the command's own flags (``--config FILE`` included), read exactly as the command reads them, so
``tigana config show server --port 7000 --sources`` shows what ``tigana server --port 7000`` would run with.
Without a target, every command's settings (those of ``train`` only when torch is installed). Settings are
shown by their one name, the one of the flag, the file key and the ``TIGANA_*`` variable (``snapshot_every``).
``serve`` has a required ``--from``: without it, ``(from)`` stands in.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from typing import Any

from tigana.ps.errors import PSError
from tigana.ps.settings import public_name

# command -> module with add_arguments(parser) and load(args) -> settings.Loaded
TARGETS = {"server": "tigana.tools.server_cmd", "scheduler": "tigana.tools.scheduler_cmd",
           "serve": "tigana.tools.serve_cmd", "train": "tigana.tools.train_cmd"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print the effective configuration of a command",
                          description="print the effective configuration of a command")
    show.add_argument("target", nargs="?", choices=sorted(TARGETS), help="the command (default: every command)")
    show.add_argument("--sources", action="store_true", help="say where each value came from")
    show.add_argument("--json", action="store_true", help="one JSON object: {config, sources}")
    show.add_argument("flags", nargs=argparse.REMAINDER, help="the command's own flags")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _load(target: str, flags: list[str]) -> list[tuple[str, Any, str]]:
    module = importlib.import_module(TARGETS[target])
    parser = argparse.ArgumentParser(prog=f"tigana {target}")
    module.add_arguments(parser)
    if target == "serve" and "--from" not in flags:
        flags = [*flags, "--from", "(from)"]
    return [(public_name(k), v, s) for k, v, s in module.load(parser.parse_args(flags)).rows()]


def _available(target: str) -> bool:
    """train needs torch (the train extra)."""
    return target != "train" or importlib.util.find_spec("torch") is not None


def run(args: argparse.Namespace) -> int:
    # --sources/--json may come after the target, where the remainder (the command's flags) begins
    flags = [f for f in args.flags if f not in ("--", "--sources", "--json")]
    args.sources = args.sources or "--sources" in args.flags
    args.json = args.json or "--json" in args.flags
    if args.target is None and flags:
        print("tigana config show: flags need a target (server, scheduler, serve or train)", file=sys.stderr)
        return 2
    targets = [args.target] if args.target else [t for t in TARGETS if _available(t)]
    try:
        shown = {t: _load(t, flags) for t in targets}
    except (PSError, ValueError) as exc:
        print(f"tigana config: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {t: {"config": {k: _plain(v) for k, v, _ in rows}, "sources": {k: s for k, _, s in rows}}
               for t, rows in shown.items()}
        print(json.dumps(out[args.target] if args.target else out))
        return 0
    for target, rows in shown.items():
        if not args.target:
            print(f"[{target}]")
        width = max(len(k) for k, _, _ in rows)
        for name, value, source in rows:
            text = json.dumps(_plain(value))
            print(f"{name:<{width}}  {text}" + (f"   # {source}" if args.sources else ""))
    return 0
