"""How a training run is configured: one frozen dataclass and the loader that fills it.

Sources, lowest to highest priority: the dataclass defaults, the tuned defaults of the data set (and model)
the run trains (``TUNED``: epochs, batch size, learning rates... that train that data set well, so a user
who gives only ``--model``, ``--dataset`` and ``--data`` gets a good model), a YAML file (``--config
train.yaml``; keys are the field names, ``-`` or ``_``), ``TIGANA_<FIELD>`` environment variables (e.g.
``TIGANA_BATCH_SIZE=1024``, ``TIGANA_PS=host1:7101,host2:7101``), then command-line flags. Every value is
checked, and a bad one raises ``ConfigError`` naming the field and where it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tigana.ps import settings

__all__ = ["DATASETS", "MODELS", "TUNED", "ConfigError", "TrainConfig", "Tuned", "add_arguments",
           "config_from_args", "load_config", "load_config_sources", "tuned_settings"]

MODELS = ("deepfm", "dlrm", "wide_deep", "dcn_v2")
DATASETS = ("synthetic", "criteo", "movielens-100k")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
PS_COMPRESSIONS = ("none", "fp16", "bf16", "int8", "adaptive")


class ConfigError(ValueError):
    """A configuration value that is missing, of the wrong type or out of range; the message names it."""


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Sizes are per trainer process unless stated."""

    model: str = "deepfm"
    dataset: str = "synthetic"
    data: str | None = None                 # data folder or file; synthetic needs none
    ps: tuple[str, ...] = ()                # a scheduler, or shard addresses; empty: an embedded local cluster
    shards: int = 2                         # shards of the embedded local cluster
    epochs: int = 1
    batch_size: int = 512
    eval_batch_size: int = 4096
    max_steps: int | None = None            # stop after this many steps in total (None: run every epoch)
    dim: int = 16                           # embedding width
    lr: float = 1e-3                        # dense optimizer (Adam) learning rate
    weight_decay: float = 0.0
    embedding_optimizer: str = "adagrad"    # server-side optimizer of the tables
    embedding_lr: float = 0.05
    init_std: float = 0.01
    staleness: int = 1                      # steps of its own pushes a trainer's pulls may miss
    prefetch: bool = True                   # pull batch t+1 while batch t computes (needs staleness >= 1)
    sparse_aggregation: bool = False        # merge the pushes of a node's ranks at the node leader
    table_prefix: str = ""                  # prefix of every table name (to share a cluster between runs)
    fuse_tables: bool = True                # store all tables in one PS table (one pull/push per shard a step)
    allreduce: str = "hierarchical"         # hierarchical | flat
    compression: str = "none"               # none | fp16 | bf16 (dense all-reduce)
    nproc: int = 1                          # trainer processes to spawn when not under a launcher
    ranks_per_node: int | None = None       # simulate nodes of this many ranks on one machine
    backend: str | None = None              # gloo | nccl (default: nccl with CUDA, else gloo)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0               # steps between checkpoints; 0: at the end of every epoch
    resume: str | None = None               # "latest" (newest in checkpoint_dir), "auto" (the same, or a fresh
    #                                         start when there is none: a restarted pod) or a checkpoint folder
    max_restarts: int = 0                   # --nproc: start the trainers again this many times when one dies
    elastic_every: int = 20                 # steps between elastic states (dense weights + data position)
    logdir: str | None = None               # TensorBoard logs (rank 0)
    log_every: int = 50                     # steps between TensorBoard scalars
    seed: int = 0
    synthetic_rows: int = 200_000           # synthetic data: training rows (held-out rows: a fifth of it)
    synthetic_vocab: int = 100_000          # synthetic data: distinct ids per feature
    progress: bool = True                   # tqdm progress bar on rank 0 (stderr)
    metrics_port: int = 0                   # Prometheus /metrics of each rank: N + local rank; 0 off, -1 any free
    metrics_host: str = "127.0.0.1"         # address the metrics endpoint binds
    wandb_project: str | None = None        # Weights & Biases project (rank 0; pip install 'tigana[wandb]')
    ps_compression: str = "none"            # wire codec of the PS tables: none | fp16 | bf16 | int8 | adaptive
    cache_rows: int = 0                     # hot rows cached in each trainer per PS table (0: no cache)
    cache_max_age: int | None = None        # steps a cached row may serve (None: bounded by staleness only)
    cache_policy: str = "lfu"               # which cached rows a full cache evicts: lfu | lru
    unseen: str = "zeros"                   # evaluation's row of an id the tables lack: zeros | initial | a number
    publish_dir: str | None = None          # publish the model for serving here (rank 0; tigana serve --model)
    publish_every: str = "100"              # steps between publishes, or seconds with an s ("30s"); and at the end
    publish_keep: int = 20                  # published dense versions kept (a rollback needs its version's)

    def __post_init__(self) -> None:
        _check(self)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ps"] = list(self.ps)
        return d


def _unseen_ok(text: str) -> bool:
    from tigana.ps import Unseen

    try:
        Unseen.parse(text)
    except ValueError:
        return False
    return True


def _check(c: TrainConfig) -> None:
    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"{name}: {what}, got {getattr(c, name)!r}")

    need(c.model in MODELS, "model", f"must be one of {MODELS}")
    need(-1 <= c.metrics_port <= 65535, "metrics_port", "must be -1 (any free port), 0 (off) or a port")
    need(c.dataset in DATASETS, "dataset", f"must be one of {DATASETS}")
    need(c.embedding_optimizer in OPTIMIZERS, "embedding_optimizer", f"must be one of {OPTIMIZERS}")
    need(c.allreduce in ("hierarchical", "flat"), "allreduce", "must be hierarchical or flat")
    need(c.compression in ("none", "fp16", "bf16"), "compression", "must be none, fp16 or bf16")
    need(c.backend in (None, "gloo", "nccl"), "backend", "must be gloo or nccl")
    need(c.ps_compression in PS_COMPRESSIONS, "ps_compression", f"must be one of {PS_COMPRESSIONS}")
    need(c.cache_policy in ("lfu", "lru"), "cache_policy", "must be lfu or lru")
    need(c.cache_rows >= 0, "cache_rows", "must be >= 0")
    need(_unseen_ok(c.unseen), "unseen", "must be 'zeros', 'initial' or a finite number")
    need(c.cache_max_age is None or c.cache_max_age >= 0, "cache_max_age", "must be >= 0")
    need(not (c.cache_rows and c.sparse_aggregation), "cache_rows",
         "needs every rank to send its own pushes (no sparse_aggregation)")
    for name in ("shards", "epochs", "batch_size", "eval_batch_size", "dim", "nproc", "log_every",
                 "synthetic_rows", "synthetic_vocab"):
        need(getattr(c, name) >= 1, name, "must be >= 1")
    need(c.elastic_every >= 1, "elastic_every", "must be >= 1")
    for name in ("staleness", "checkpoint_every", "seed", "max_restarts"):
        need(getattr(c, name) >= 0, name, "must be >= 0")
    for name in ("lr", "embedding_lr"):
        need(getattr(c, name) > 0, name, "must be > 0")
    need(c.init_std >= 0 and c.weight_decay >= 0, "init_std" if c.init_std < 0 else "weight_decay",
         "must be >= 0")
    need(c.max_steps is None or c.max_steps >= 1, "max_steps", "must be >= 1")
    need(publish_interval(c.publish_every) is not None, "publish_every",
         "must be a number of steps (>= 1) or of seconds ending in s (> 0), e.g. 100 or 30s")
    need(c.publish_keep >= 1, "publish_keep", "must be >= 1")
    need(c.publish_dir is None or c.dataset in ("synthetic", "criteo"), "publish_dir",
         f"serves Criteo-format models (datasets synthetic, criteo); {c.dataset} is not served yet")
    need(c.ranks_per_node is None or c.ranks_per_node >= 1, "ranks_per_node", "must be >= 1")
    need(c.resume is None or bool(c.resume), "resume", "must be 'latest', 'auto' or a path")
    need(c.resume not in ("latest", "auto") or c.checkpoint_dir is not None, "resume",
         f"{c.resume!r} needs checkpoint_dir")
    for address in c.ps:
        need(":" in address and address.rsplit(":", 1)[1].isdigit(), "ps", "must list HOST:PORT addresses")


def publish_interval(text: str) -> tuple[int | None, float | None] | None:
    """``--publish-every``: (steps, None) for ``"100"``, (None, seconds) for ``"30s"``; None when neither."""
    text = str(text).strip()
    try:
        if text.endswith("s"):
            seconds = float(text[:-1])
            return (None, seconds) if seconds > 0 else None
        steps = int(text)
        return (steps, None) if steps >= 1 else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Tuned:
    """Settings one data set trains well with, found by a sweep (``tools/tune_defaults.py``; its runs are logged
    in ``tools/tuning/``, the figures are in docs/training.md). They apply only to the fields that
    no flag, ``TIGANA_*`` variable or config file sets; None keeps the TrainConfig default. ``models`` holds
    what one model needs different from the data set's values. With ``max_data_bytes`` the entry applies only
    to data of at most that size (``data``: a file, or a folder's files summed), so a small sample's many
    epochs of small batches never reach the full data set."""

    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    weight_decay: float | None = None
    embedding_optimizer: str | None = None
    embedding_lr: float | None = None
    dim: int | None = None
    init_std: float | None = None
    models: Mapping[str, Tuned] = dataclasses.field(default_factory=dict)
    max_data_bytes: int | None = None

    def own(self) -> dict[str, Any]:
        """The training fields this entry sets (not None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("models", "max_data_bytes") and getattr(self, f.name) is not None}


# Each figure in the comments is the mean held-out AUC over seeds 0-3 (MovieLens) or 0-2 (Criteo head).
TUNED: dict[str, Tuned] = {
    # MovieLens-100K u1 (train u1.base, score u1.test). One epoch of batch 512 with Adagrad 0.05 stops at AUC
    # 0.778, under a logistic regression (0.781). Lazy Adam on the rows at 0.003 with dense weight decay 1e-4
    # reaches 0.798 (DeepFM). Every model overfits after its peak, so the number of epochs depends on the model.
    "movielens-100k": Tuned(
        epochs=10, batch_size=512, embedding_optimizer="adam", embedding_lr=0.003, weight_decay=1e-4,
        models={
            "wide_deep": Tuned(epochs=17, batch_size=1024, weight_decay=1e-5),  # peaks late: 0.7937
            "dlrm": Tuned(epochs=4, batch_size=1024),                          # overfits fast: 0.7842
        }),
    # The 1,999-row Criteo head (every 10th row held out: 199 rows, 47 clicks, an AUC standard error of about
    # 0.046: too few for a stable AUC). The plain defaults give it 4 steps (AUC 0.44-0.66); 2-3 epochs of batch
    # 32 with Adam on the rows reach 0.73-0.74 (each model's best mean over seeds 0-2 of the settings tried).
    # Only for small files: the full DAC data (11 GB) keeps the plain defaults (one epoch of batch 512).
    "criteo": Tuned(
        epochs=2, batch_size=32, embedding_optimizer="adam", embedding_lr=0.0003, max_data_bytes=64 << 20,
        models={
            "deepfm": Tuned(epochs=3),           # 0.7305
            "dlrm": Tuned(embedding_lr=0.001),   # 0.7290
        }),
}


def _data_bytes(data: str | None) -> int | None:
    """Size of ``data`` (a file, or the files directly in a folder); None when it is missing."""
    if not data:
        return None
    try:
        if os.path.isdir(data):
            return sum(e.stat().st_size for e in os.scandir(data) if e.is_file())
        return os.stat(data).st_size
    except OSError:
        return None


def tuned_settings(dataset: str, model: str, data: str | None = None) -> dict[str, tuple[Any, str]]:
    """field -> (value, source) of the tuned defaults of ``dataset`` trained with ``model`` on ``data`` (empty
    for a data set without any, e.g. synthetic, or data over the entry's ``max_data_bytes``). The source reads
    ``dataset default (DATASET)``, or ``dataset default (DATASET, MODEL)`` for a value only that model gets."""
    tuned = TUNED.get(dataset)
    if tuned is None:
        return {}
    if tuned.max_data_bytes is not None:
        size = _data_bytes(data)
        if size is None or size > tuned.max_data_bytes:
            return {}
    out = {name: (value, f"dataset default ({dataset})") for name, value in tuned.own().items()}
    special = tuned.models.get(model)
    if special is not None:
        out.update({name: (value, f"dataset default ({dataset}, {model})") for name, value in special.own().items()})
    return out


def _apply_tuned(values: dict[str, Any], sources: dict[str, str]) -> None:
    """Fill the fields no flag, variable or file gave from the tuned defaults of the run's data set and model."""
    dataset = values.get("dataset", TrainConfig.dataset)
    model = values.get("model", TrainConfig.model)
    for name, (value, source) in tuned_settings(dataset, model, values.get("data")).items():
        if name not in values:
            values[name], sources[name] = value, source


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def load_config_sources(path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None,
                        environ: Mapping[str, str] | None = None) -> settings.Loaded[TrainConfig]:
    """``load_config`` with where each value came from (``tigana config show train --sources``)."""
    flags = {_normalize(k): v for k, v in (overrides or {}).items()}
    unknown = sorted(k for k in flags if k not in _FIELDS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown field")
    return settings.load(TrainConfig, flags=flags, env=environ, file=path, section="train", error=ConfigError,
                         derive=_apply_tuned)


def load_config(path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> TrainConfig:
    """Defaults < the data set's tuned defaults (``TUNED``) < YAML file ``path`` < ``TIGANA_*`` environment <
    ``overrides`` (flags; None values skipped)."""
    return load_config_sources(path, overrides, environ).config


def _normalize(key: str) -> str:
    return key.strip().replace("-", "_").lower()


def _tuned_help(name: str, text: str = "") -> str:
    """Help naming the field's default and every data set's (and model's) tuned value of it."""
    parts = [f"default: {_FIELDS[name].default}"]
    for dataset, tuned in TUNED.items():
        own = tuned.own()
        special = ", ".join(f"{m}: {t.own()[name]}" for m, t in tuned.models.items() if name in t.own())
        if name in own or special:
            value = own.get(name, _FIELDS[name].default)
            where = dataset if tuned.max_data_bytes is None else f"{dataset} up to {tuned.max_data_bytes >> 20} MiB"
            parts.append(f"{where}: {value}" + (f" ({special})" if special else ""))
    return f"{text} ({'; '.join(parts)})".strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training flags (every default is None so only flags given override the file and environment)."""
    parser.add_argument("--config", metavar="FILE", help="YAML file of TrainConfig fields")
    parser.add_argument("--model", choices=MODELS, help="the CTR model")
    parser.add_argument("--dataset", choices=DATASETS, help="where the samples come from")
    parser.add_argument("--data", metavar="PATH", help="data folder or file (criteo, movielens-100k)")
    parser.add_argument("--ps", metavar="ADDRESS[,ADDRESS]",
                        help="a scheduler's address, or a static shard list; without it an embedded local cluster "
                             "(a scheduler and --shards servers, 1 replica) runs for the job")
    parser.add_argument("--shards", type=int, help="shards of the embedded local cluster (default 2)")
    parser.add_argument("--epochs", type=int, help=_tuned_help("epochs", "passes over the training data"))
    parser.add_argument("--batch-size", type=int, help=_tuned_help("batch_size", "per trainer process"))
    parser.add_argument("--eval-batch-size", type=int, help="samples per evaluation batch")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps (none: the epochs decide)")
    parser.add_argument("--dim", type=int, help=_tuned_help("dim", "embedding width"))
    parser.add_argument("--lr", type=float, help=_tuned_help("lr", "dense (Adam) learning rate"))
    parser.add_argument("--weight-decay", type=float, help=_tuned_help("weight_decay", "of the dense Adam"))
    parser.add_argument("--embedding-optimizer", choices=OPTIMIZERS,
                        help=_tuned_help("embedding_optimizer", "server-side optimizer of the tables"))
    parser.add_argument("--embedding-lr", type=float, help=_tuned_help("embedding_lr"))
    parser.add_argument("--init-std", type=float, help=_tuned_help("init_std", "std of new embedding rows"))
    parser.add_argument("--staleness", type=int,
                        help="steps a pull may run ahead of acknowledged pushes (0: read-your-writes)")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                        help="pull the next batch's rows while this step runs (within --staleness)")
    parser.add_argument("--sparse-aggregation", action=argparse.BooleanOptionalAction, default=None,
                        help="merge the pushes of a node's ranks at the node leader")
    parser.add_argument("--table-prefix", help="prefix of the PS tables' names (jobs sharing a cluster)")
    parser.add_argument("--fuse-tables", action=argparse.BooleanOptionalAction, default=None,
                        help="store every table in one PS table, ids salted per table (default: on)")
    parser.add_argument("--allreduce", choices=("hierarchical", "flat"), help="how dense gradients are summed")
    parser.add_argument("--compression", choices=("none", "fp16", "bf16"),
                        help="codec of the dense all-reduce (the PS tables' wire: --ps-compression)")
    parser.add_argument("--ps-compression", choices=PS_COMPRESSIONS,
                        help="wire codec of the PS tables' pulls and pushes; adaptive: chosen per step from the "
                             "measured error, with error feedback, top-k pushes and a guard that backs off to fp32")
    parser.add_argument("--cache-rows", type=int,
                        help="rows of a trainer-side hot-row cache per PS table, served within --staleness own "
                             "pushes missed (0: no cache)")
    parser.add_argument("--cache-max-age", type=int, help="steps a cached row may serve (default: no bound)")
    parser.add_argument("--cache-policy", choices=("lfu", "lru"), help="which rows a full cache evicts")
    parser.add_argument("--unseen", metavar="zeros|initial|NUMBER",
                        help="the row evaluation reads for an id the tables do not hold (never trained, evicted or "
                             "not admitted): zeros, initial (its initializer's row) or a number for every element; "
                             "published with the model, tigana serve gives such ids the same row")
    parser.add_argument("--nproc", type=int, help="trainer processes to spawn (not under torchrun/srun)")
    parser.add_argument("--ranks-per-node", type=int, help="simulate nodes of this many ranks")
    parser.add_argument("--backend", choices=("gloo", "nccl"),
                        help="torch.distributed backend (none: nccl with CUDA, else gloo)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints are written (shared storage)")
    parser.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (0: every epoch)")
    parser.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                        help="resume from a checkpoint folder (default: the newest in --checkpoint-dir); 'auto': the "
                             "newest if there is one, else start fresh (a restarted pod)")
    parser.add_argument("--max-restarts", type=int,
                        help="with --nproc: when a trainer dies, start the trainers again (from the last elastic "
                             "state, the PS cluster untouched) up to this many times")
    parser.add_argument("--elastic-every", type=int,
                        help="steps between elastic states (dense weights and data position, saved by rank 0)")
    parser.add_argument("--publish-dir", metavar="DIR",
                        help="publish the model for serving in DIR (rank 0: its description and dense weights; "
                             "tigana admin export --follow --model DIR adds its tables, tigana serve --model DIR "
                             "serves it)")
    parser.add_argument("--publish-every", metavar="N|Ns",
                        help="publish the dense weights every N steps, or every N seconds with an s (30s); "
                             "and at the end of the run")
    parser.add_argument("--publish-keep", type=int, help="published dense versions kept")
    parser.add_argument("--logdir", metavar="DIR", help="TensorBoard log folder")
    parser.add_argument("--log-every", type=int, help="steps between log lines")
    parser.add_argument("--seed", type=int, help="seed of the model, the tables and the synthetic data")
    parser.add_argument("--synthetic-rows", type=int, help="samples of the synthetic dataset")
    parser.add_argument("--synthetic-vocab", type=int, help="distinct ids per feature of the synthetic dataset")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on rank 0 (stderr)")
    parser.add_argument("--metrics-port", type=int,
                        help="Prometheus /metrics of every rank on this port + its local rank (0 off, -1 any free)")
    parser.add_argument("--metrics-host", help="address the metrics endpoint binds (0.0.0.0: every interface)")
    parser.add_argument("--wandb-project", metavar="PROJECT",
                        help="log the run to Weights & Biases (rank 0; off unless given)")
    settings.describe_defaults(parser, TrainConfig, shown={"ps": "none (an embedded local cluster)"})


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> TrainConfig:
    """The TrainConfig of parsed ``add_arguments`` flags."""
    return config_sources_from_args(args, environ).config


def config_sources_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                             ) -> settings.Loaded[TrainConfig]:
    """``config_from_args`` with where each value came from."""
    overrides = {name: getattr(args, name) for name in _FIELDS if hasattr(args, name)}
    return load_config_sources(getattr(args, "config", None), overrides, environ)
