"""The hyper-parameter sweep behind the per-dataset training defaults (``trainer/config.py``, ``TUNED``).

Every run trains one configuration through an embedded 2-shard cluster (the same code path as ``tigana
train``) and evaluates after every epoch, so one run of ``--epochs N`` measures epochs 1..N. Each run
appends one JSON line to the log (the settings that differ from the dataclass defaults, the seed, AUC and
logloss per epoch, seconds); configurations already in the log are skipped, so a sweep can be resumed or
widened. The log holds results only, never rows of the data. Settings are relative to the plain
``TrainConfig`` defaults (the tuned ones do not apply here). Each run has its own table prefix, and the initial
rows are drawn per salted id, so a seed fixes the data order and the dense initialization, not the rows.

    python -m tigana.tools.tune_defaults run --dataset movielens-100k --data DIR --model deepfm \\
        --set batch_size=1024 --grid embedding_lr=0.02,0.05,0.1 --grid lr=3e-4,1e-3 --epochs 8 \\
        --log tools/tuning/movielens-100k.jsonl
    python -m tigana.tools.tune_defaults best --log tools/tuning/movielens-100k.jsonl [--top 5]

``best`` ranks (settings, epochs) pairs by the mean AUC over the seeds logged for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tigana.ps import settings
from tigana.trainer.config import TrainConfig

_TUNABLE = ("batch_size", "lr", "weight_decay", "embedding_optimizer", "embedding_lr", "dim", "init_std",
            "staleness")
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _value(name: str, text: str) -> Any:
    return settings.convert(TrainConfig, name, text)


def _pairs(items: list[str], many: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, _, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if name not in _FIELDS:
            raise SystemExit(f"unknown field {name!r}")
        out[name] = [_value(name, t) for t in text.split(",")] if many else _value(name, text)
    return out


def _key(record: dict[str, Any]) -> str:
    return json.dumps([record["dataset"], record["model"], record["settings"], record["seed"], record["epochs"]],
                      sort_keys=True)


def _read(log: Path) -> list[dict[str, Any]]:
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


class _Recorder:
    """Stands in for ``TrainerMetrics``: keeps every evaluation (one per epoch) and ignores the rest."""

    http_port = None

    def __init__(self) -> None:
        self.evaluations: list[dict[str, Any]] = []

    def attach(self, client: Any, collection: Any = None) -> None:
        pass

    def step(self, samples: int) -> None:
        pass

    def window(self, loss: float) -> dict[str, float]:
        return {}

    def evaluated(self, result: dict[str, Any]) -> None:
        self.evaluations.append(dict(result))

    def __getattr__(self, name: str) -> Any:  # gauges the loop sets (epoch): accept and ignore
        return _Ignore()


class _Ignore:
    def set(self, *_: Any) -> None:
        pass


def _configs(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    base = _pairs(args.set or [], many=False)
    grid = _pairs(args.grid or [], many=True)
    names = list(grid)
    for values in itertools.product(*(grid[n] for n in names)):
        yield {**base, **dict(zip(names, values, strict=True))}


def run(args: argparse.Namespace) -> int:
    """Train every configuration of the grid for every model and seed not yet in the log."""
    import torch

    from tigana.ps.allocator import tune_allocator
    from tigana.trainer.distributed import DistEnv
    from tigana.trainer.launch import start_cluster
    from tigana.trainer.loop import train

    log = Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    done = {_key(r) for r in _read(log)}
    torch.set_num_threads(args.threads)
    tune_allocator(top_pad=64 << 20)
    jobs = [(model, settings, seed) for model in args.model for settings in _configs(args) for seed in args.seed]
    with start_cluster(2) as cluster:
        for model, settings, seed in jobs:
            record = {"dataset": args.dataset, "model": model, "settings": settings, "seed": seed,
                      "epochs": args.epochs}
            if _key(record) in done:
                continue
            config = TrainConfig(model=model, dataset=args.dataset, data=args.data, epochs=args.epochs, seed=seed,
                                 progress=False, table_prefix=f"t{uuid.uuid4().hex[:8]}_", **settings)
            recorder = _Recorder()
            t0 = time.perf_counter()
            train(config, DistEnv(), None, [cluster.target], metrics=recorder)  # type: ignore[arg-type]
            record.update(auc=[round(e["auc"], 5) for e in recorder.evaluations],
                          logloss=[round(e["logloss"], 5) for e in recorder.evaluations],
                          seconds=round(time.perf_counter() - t0, 1))
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            best = max(range(len(record["auc"])), key=lambda i: record["auc"][i])
            print(f"{model} {settings} seed {seed}: best epoch {best + 1} auc {record['auc'][best]:.4f} "
                  f"(by epoch {record['auc']}) {record['seconds']} s", flush=True)
    return 0


def ranking(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per model: every (settings, epochs) pair with its mean AUC over the seeds logged, best first."""
    by: dict[tuple[str, str, int], list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        for epoch, (auc, loss) in enumerate(zip(r["auc"], r["logloss"], strict=True), 1):
            settings = json.dumps({**r["settings"], "epochs": epoch}, sort_keys=True)
            by[(r["model"], settings, r["seed"])].append((auc, loss))
    merged: dict[tuple[str, str], list[tuple[int, float, float]]] = defaultdict(list)
    for (model, settings, seed), values in by.items():
        auc, loss = values[-1]  # the newest run of that seed
        merged[(model, settings)].append((seed, auc, loss))
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (model, settings), runs in merged.items():
        aucs = [a for _, a, _ in runs]
        out[model].append({"settings": json.loads(settings), "auc": sum(aucs) / len(aucs), "min_auc": min(aucs),
                           "max_auc": max(aucs), "logloss": sum(x for _, _, x in runs) / len(runs),
                           "seeds": sorted(s for s, _, _ in runs)})
    for rows in out.values():
        rows.sort(key=lambda row: -row["auc"])
    return dict(out)


def best(args: argparse.Namespace) -> int:
    """Print the best (settings, epochs) per model; with --min-seeds only pairs measured on that many seeds."""
    ranked = ranking(_read(Path(args.log)))
    for model in sorted(ranked):
        rows = [r for r in ranked[model] if len(r["seeds"]) >= args.min_seeds]
        print(f"{model}: {len(ranked[model])} (settings, epochs) pairs")
        for row in rows[:args.top]:
            print(f"  auc {row['auc']:.4f} [{row['min_auc']:.4f}, {row['max_auc']:.4f}] seeds {row['seeds']} "
                  f"logloss {row['logloss']:.4f}  {json.dumps(row['settings'], sort_keys=True)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigana.tools.tune_defaults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    r = sub.add_parser("run", help="train a grid of configurations, appending to the log")
    r.add_argument("--dataset", required=True)
    r.add_argument("--data")
    r.add_argument("--model", action="append", required=True, help="repeatable")
    r.add_argument("--set", action="append", metavar="FIELD=VALUE", help=f"a fixed setting ({', '.join(_TUNABLE)})")
    r.add_argument("--grid", action="append", metavar="FIELD=V1,V2", help="an axis of the grid (repeatable)")
    r.add_argument("--seed", type=int, action="append", help="repeatable (default: 0)")
    r.add_argument("--epochs", type=int, default=8, help="train this long, evaluating after every epoch")
    r.add_argument("--threads", type=int, default=2, help="torch threads")
    r.add_argument("--log", required=True, help="JSON-lines log of the runs")
    b = sub.add_parser("best", help="the best (settings, epochs) per model in a log")
    b.add_argument("--log", required=True)
    b.add_argument("--top", type=int, default=5)
    b.add_argument("--min-seeds", type=int, default=1)
    args = parser.parse_args(argv)
    if args.action == "run":
        args.seed = args.seed or [0]
        return run(args)
    return best(args)


if __name__ == "__main__":
    sys.exit(main())
