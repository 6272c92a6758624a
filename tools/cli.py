"""The ``tigana`` command line: one console script, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; benchmarks live in
``tigana.tools.bench.<case>`` with the same two functions. Modules are imported only when their
subcommand runs, so ``tigana --help`` stays fast. The cases built on the testing room (``tigana.tools.testing``:
the simulator, the fault harness, the nemesis) run from a checkout; an install without it exits 2 saying so.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from tigana.trainer.extra import TRAIN_EXTRA  # torch-free: names the modules, imports none

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "server": ("tigana.tools.server_cmd", "run a shard server daemon"),
    "local": ("tigana.tools.local_cmd", "run a local cluster of shard daemons as child processes"),
    "scheduler": ("tigana.tools.scheduler_cmd", "run the scheduler"),
    "admin": ("tigana.tools.admin_cmd", "operate a live cluster"),
    "train": ("tigana.tools.train_cmd", "train a CTR model through the parameter server"),
    "demo": ("tigana.tools.demo_cmd", "train DeepFM on an embedded local cluster"),
    "serve": ("tigana.tools.serve_cmd", "a read-only embedding lookup server for inference, following an export log"),
    "config": ("tigana.tools.config_cmd", "show a command's effective configuration and where each value came from"),
}
BENCHMARKS: dict[str, tuple[str, str]] = {
    "table": ("tigana.tools.bench.table", "storage engine: lookup, update, capacity"),
    "ps": ("tigana.tools.bench.ps", "client + 2 shard daemons over gRPC vs in-process, raw gRPC and Redis"),
    "train": ("tigana.tools.bench.train", "DeepFM samples/s through the PS vs local nn.EmbeddingBag"),
    "allreduce": ("tigana.tools.bench.allreduce", "hierarchical vs flat all-reduce of dense gradients"),
    "failover": ("tigana.tools.bench.failover", "kill -9 of a primary under a push loop: lost, doubled, recovery"),
    "reshard": ("tigana.tools.bench.reshard", "live slot moves: throughput, push p99 during a move, drain, balance"),
    "quality": ("tigana.tools.bench.quality", "the price of every knob: AUC and wire bytes of each PS setting on "
                                              "MovieLens-100K against local nn.EmbeddingBag"),
    "cache": ("tigana.tools.bench.cache", "the trainer's hot-row cache under Zipf(1.05): hit rate and pulled bytes "
                                          "saved at staleness 0, 1, 4, 16, with the AUC cost"),
    "serving": ("tigana.tools.bench.serving", "a trained model served: freshness (push ack to a changed "
                                              "prediction) while training, Predict latency at 1/64/1024 rows vs "
                                              "the model in process, rollback time"),
    "checkpoint": ("tigana.tools.bench.checkpoint", "full, incremental and int8 checkpoints over 10 training "
                                                    "intervals: bytes and seconds against full ones, restore time "
                                                    "and the AUC after each restore"),
    "serving-sync": ("tigana.tools.bench.serving_sync", "continuous sync to serving: push-to-visible lag, delta "
                                                        "throughput, lookup latency of tigana serve"),
    "elastic": ("tigana.tools.bench.elastic", "kill -9 of one of two trainers mid-run: the job restarts it and ends "
                                              "as well as undisturbed runs (AUC), the PS untouched"),
    "scale": ("tigana.tools.bench.scale", "scale curves: pull/push/step rows/s and CPU-s per M rows against shards, "
                                          "client processes, resident rows and batch size"),
    "nemesis": ("tigana.tools.testing.nemesis", "a cluster started as the README says, under planned operations and "
                                              "faults: sync/async updates lost and doubled, demotions, stalls"),
    "sim": ("tigana.tools.bench.sim", "the deterministic simulator over many seeds: invariant violations and "
                                      "the slowest convergence"),
    "faults": ("tigana.tools.testing.faults", "the fault suite: kills, pauses, partitions, disks, corruption, hostile "
                                            "requests, a soak; a ledger counts what was lost"),
}


# testing code, in a checkout and not in the wheel: its cases are listed everywhere and say so where it is absent
TESTING_ROOM = "tigana.tools.testing"


def _in_testing_room(module: str | None) -> bool:
    return module is not None and (module == TESTING_ROOM or module.startswith(TESTING_ROOM + "."))


def _available(table: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    return {name: spec for name, spec in table.items()
            if _in_testing_room(spec[0]) or importlib.util.find_spec(spec[0]) is not None}


def _version() -> str:
    try:
        return version("tigana")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tigana", description="Tigana: a parameter server for recommender models.")
    parser.add_argument("--version", action="version", version=f"tigana {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _available(COMMANDS).items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="run a benchmark; prints one JSON line per case",
                           description="Benchmarks print one JSON line per case on stdout.")
    bench_sub = bench.add_subparsers(dest="bench", metavar="CASE")
    for name, (module, help_text) in _available(BENCHMARKS).items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Two passes: find the subcommand, then let its module add its own flags and parse again.
    # (without -h so that a subcommand's help lists the flags its module adds)
    known, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    module_name = getattr(known, "_module", None)
    if module_name is None:
        if argv:
            parser.parse_args(argv)  # --help prints and exits 0; a bad command exits 2
        parser.print_help()
        return 0 if not argv else 2
    if any(k.startswith("TIGANA_") for k in os.environ):
        from tigana.tools.env_names import unknown

        for var in unknown(os.environ):
            print(f"tigana: warning: {var} is not a setting of any tigana command (a typo?); it is ignored",
                  file=sys.stderr)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _in_testing_room(exc.name):
            return _lacks_testing_room(known)
        if exc.name not in TRAIN_EXTRA:
            raise
        return _lacks_train_extra(known, exc)
    parser = build_parser()
    selected = _attach(parser, argv, module)
    args, extra = parser.parse_known_args(argv)
    if extra:  # with the usage of the (sub)command the user typed, not the top-level one
        _deepest(selected or parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    args._argv = argv  # the command line as typed (``tigana server --workers`` starts its workers with it)
    try:
        return int(module.run(args) or 0)
    except ModuleNotFoundError as exc:  # a command whose --help needs no torch (train) but whose work does
        if exc.name not in TRAIN_EXTRA:
            raise
        return _lacks_train_extra(known, exc)
    except BrokenPipeError:  # the reader went away (``tigana ... | head``): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        if not _settings_error(exc):
            raise
        print(f"tigana {known.command}: {exc}", file=sys.stderr)  # a bad flag, variable or file value
        return 2


def _lacks_train_extra(known: argparse.Namespace, exc: ModuleNotFoundError) -> int:
    """A command that needs a module of the train extra on an install without it: one line naming the extra."""
    command = " ".join(a for a in (known.command, getattr(known, "bench", None)) if a)
    print(f"tigana {command}: needs {exc.name!r}, which this install lacks: it comes with the train extra, "
          f"pip install 'tigana[train]' (a shard server, the scheduler, serve, local and admin need only "
          f"'tigana')", file=sys.stderr)
    return 2


def _lacks_testing_room(known: argparse.Namespace) -> int:
    """A benchmark built on the testing room, on an install without it: one line saying where it runs."""
    command = " ".join(a for a in (known.command, getattr(known, "bench", None)) if a)
    print(f"tigana {command}: runs from a checkout of the repository: it is built on {TESTING_ROOM} (the "
          f"simulator, the fault harness, the nemesis), testing code that the installed package leaves out; "
          f"in a checkout, pip install -e . and run it there", file=sys.stderr)
    return 2


def _settings_error(exc: BaseException) -> bool:
    """A bad setting (flag, TIGANA_* variable, config file) that a command let through: one line, exit 2."""
    errors = sys.modules.get("tigana.ps.errors")  # loaded by every command that reads settings
    trainer = sys.modules.get("tigana.trainer.config")
    kinds = tuple(k for k in (getattr(errors, "InvalidArgument", None), getattr(trainer, "ConfigError", None)) if k)
    return bool(kinds) and isinstance(exc, kinds)


def _attach(parser: argparse.ArgumentParser, argv: list[str], module) -> argparse.ArgumentParser | None:
    """Find the subparser that selected ``module``, let the module add its arguments to it, and check the
    values every command shares at the edge (ports in range, known log levels); returns that subparser."""
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    if child.get_default("_module") == module.__name__:
                        module.add_arguments(child)
                        _check_values(child)
                        _show_defaults(child)
                        return child
                    stack.append(child)
    return None


def _deepest(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subparser ``args`` went through (``tigana admin status``'s, not ``admin``'s)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs and subs[0].dest != argparse.SUPPRESS else None
        if chosen is None or chosen not in subs[0].choices:
            return parser
        parser = subs[0].choices[chosen]


PORT_DESTS = frozenset({"port", "base_port"})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: 0 (a free one) to 65535")
    return value


def log_level(text: str) -> str:
    """An argparse type: a logging level name, any case."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def _check_values(parser: argparse.ArgumentParser) -> None:
    """Give every command's ports and log levels the same checked types (a bad one is an argparse error: the
    subcommand's usage and exit 2, not a traceback or a port that wraps around), and readable metavars."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _check_values(child)
            continue
        if action.dest in PORT_DESTS and action.type is int:
            action.type = port_number
        elif action.dest == "log_level":
            action.type = log_level
        # a flag whose destination differs from its name (--drain-grace -> drain_grace_s, --from -> from_)
        # would show the destination as its metavar: show the flag's name instead
        if action.option_strings and action.metavar is None and action.nargs != 0 and action.choices is None:
            longest = max(action.option_strings, key=len)
            action.metavar = longest.lstrip("-").replace("-", "_").upper()


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """``--help`` shows every flag's default: append it to flags whose help does not say it yet (the layered
    commands describe theirs from their config dataclass, since their flags default to None)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)
            continue
        if (not action.option_strings or action.help in (None, argparse.SUPPRESS) or "default" in action.help
                or action.default is argparse.SUPPRESS or isinstance(action, (argparse._HelpAction,
                                                                              argparse._VersionAction))):
            continue
        action.help = f"{action.help} (default: {'none' if action.default is None else action.default})"


if __name__ == "__main__":
    raise SystemExit(main())
