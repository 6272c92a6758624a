"""What one trainer rank reports while it trains: Prometheus metrics, the scalars of a logging window for
TensorBoard, and optionally Weights & Biases.

``TrainerMetrics`` keeps a registry of its own (never the process-global one), served on a port when the run
asks for one (``TrainConfig.metrics_port``: rank r of a node serves port + its local rank, -1 any free port):
samples, steps, samples/s and loss of the last window, evaluation AUC and logloss, the pull and push latency
the trainer sees (from the call to the rows or the acknowledgement) and the time a forward waited for rows,
plus the PS client's own counters (``ps.metrics.ClientCollector``: wire bytes, retries, observed staleness).
``window()`` closes a logging window and returns its scalars, the tags TensorBoard and W&B get.

Weights & Biases is optional: ``start_wandb`` imports ``wandb`` only when a project is set and says how to
install it when it is missing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tigana.ps.metrics import LATENCY_BUCKETS, ClientCollector, MetricsEndpoint
from tigana.trainer.config import ConfigError

__all__ = ["TrainerMetrics", "require_wandb", "start_wandb"]

_OPS = ("pull", "push", "pull_wait")


class TrainerMetrics(MetricsEndpoint):
    """The metrics of one trainer rank (``rank`` is a label of every series). Thread-safe: pull and push
    latencies arrive on the client's callback threads."""

    def __init__(self, rank: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, str(rank)
        self.rank = rank
        self.samples = Counter("tigana_trainer_samples", "Training samples processed", ["rank"], registry=r
                               ).labels(label)
        self.steps = Counter("tigana_trainer_steps", "Training steps (batches) done", ["rank"], registry=r
                             ).labels(label)
        self.samples_per_s = Gauge("tigana_trainer_samples_per_second", "Training samples per second over the "
                                   "last logging window", ["rank"], registry=r).labels(label)
        self.loss = Gauge("tigana_trainer_loss", "Mean training loss over the last logging window", ["rank"],
                          registry=r).labels(label)
        self.epoch = Gauge("tigana_trainer_epoch", "Epoch being trained", ["rank"], registry=r).labels(label)
        self.eval_auc = Gauge("tigana_trainer_eval_auc", "AUC of the last evaluation (held-out data, all ranks)",
                              ["rank"], registry=r).labels(label)
        self.eval_logloss = Gauge("tigana_trainer_eval_logloss", "Logloss of the last evaluation", ["rank"],
                                  registry=r).labels(label)
        ps_seconds = Histogram("tigana_trainer_ps_seconds", "Pull and push latency seen by the trainer (call to rows "
                               "or acknowledgement, staleness waits included), by op", ["rank", "op"],
                               buckets=LATENCY_BUCKETS, registry=r)
        wait = Histogram("tigana_trainer_pull_wait_seconds", "Time a forward waited for its rows (near 0 when the "
                         "prefetched rows were ready)", ["rank"], buckets=LATENCY_BUCKETS, registry=r)
        self._histograms = {"pull": ps_seconds.labels(label, "pull"), "push": ps_seconds.labels(label, "push"),
                            "pull_wait": wait.labels(label)}
        self._lock = threading.Lock()
        self._ops = {op: [0.0, 0.0, 0] for op in _OPS}  # op -> [seconds summed, max, count] of this window
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self._client: Any = None

    def attach(self, client: Any, collection: Any = None) -> None:
        """Report ``client``'s counters (``Client.stats()``, read when scraped) and time the pulls and pushes of
        ``collection`` (a ``PSEmbeddingBags``)."""
        if self._client is None:
            self.registry.register(ClientCollector(client.stats))
        self._client = client
        if collection is not None:
            collection.observer = self.observe

    def observe(self, op: str, seconds: float, rows: int = 0) -> None:
        """One pull, push or pull wait of ``seconds`` (the collection's observer)."""
        self._histograms[op].observe(seconds)
        with self._lock:
            acc = self._ops[op]
            acc[0] += seconds
            acc[1] = max(acc[1], seconds)
            acc[2] += 1

    def step(self, samples: int) -> None:
        """One training step of ``samples`` rows done."""
        self.samples.inc(samples)
        self.steps.inc()
        with self._lock:
            self._window_samples += samples

    def evaluated(self, result: dict[str, Any]) -> None:
        """An evaluation's ``auc`` and ``logloss``."""
        self.eval_auc.set(float(result.get("auc", float("nan"))))
        self.eval_logloss.set(float(result.get("logloss", float("nan"))))

    def window(self, loss: float) -> dict[str, float]:
        """Close the logging window whose mean training loss is ``loss``: set the gauges and return the window's
        scalars by tag (loss, samples/s, mean and max pull/push latency and pull wait in ms, observed
        staleness), then start the next window."""
        now = time.perf_counter()
        with self._lock:
            seconds, self._window_start = now - self._window_start, now
            samples, self._window_samples = self._window_samples, 0
            ops, self._ops = self._ops, {op: [0.0, 0.0, 0] for op in _OPS}
        rate = samples / seconds if seconds > 0 else 0.0
        self.loss.set(loss)
        self.samples_per_s.set(rate)
        out = {"train/loss": loss, "train/samples_per_s_window": rate}
        for op, (total, most, count) in ops.items():
            if count:
                name = "pull_wait" if op == "pull_wait" else f"{op}_latency"
                out[f"ps/{name}_ms"] = 1000.0 * total / count
                out[f"ps/{name}_max_ms"] = 1000.0 * most
        if self._client is not None:
            staleness = self._client.stats().get("staleness", {})
            if staleness:
                out["ps/staleness_steps"] = float(max(s.get("last", 0) for s in staleness.values()))
                out["ps/staleness_max_steps"] = float(max(s.get("max", 0) for s in staleness.values()))
        return out


def require_wandb(project: str) -> Any:
    """The ``wandb`` module, imported now; ``ConfigError`` saying how to install it when it is missing."""
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError(f"wandb_project: {project!r} asks for Weights & Biases logging, but the wandb package "
                          "is not installed; install it (pip install 'tigana[wandb]' or pip install wandb) or leave "
                          "wandb_project unset") from exc
    return wandb


def start_wandb(project: str, config: dict[str, Any], logdir: str | None = None) -> Any:
    """A Weights & Biases run in ``project`` with the run's ``config`` (files under ``logdir`` when given);
    ``run.log(scalars, step=...)`` and ``run.finish()``. Offline runs: set ``WANDB_MODE=offline``."""
    wandb = require_wandb(project)
    kwargs: dict[str, Any] = {"project": project, "config": config}
    if logdir:
        kwargs["dir"] = logdir
    return wandb.init(**kwargs)
