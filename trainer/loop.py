"""The training loop one trainer process runs: data, model, PS tables, DDP, evaluation, checkpoints.

    for each step:  prefetch rows of batch t+1 ─┐
                    forward batch t (rows pulled during step t-1) ──► loss ──► backward
                         │ dense grads: DDP (hierarchical or flat all-reduce)   └─► row grads pushed to the PS
                         └ dense optimizer (Adam) steps the dense parameters only

Every rank reads its own part of the data; ranks agree on each step with one small all-reduce so uneven
parts never leave a rank waiting in a collective. Rank 0 logs to TensorBoard (and Weights & Biases with
``wandb_project``) and shows the progress bar; every rank keeps Prometheus metrics (``trainer.metrics``),
served when ``metrics_port`` is set.

A checkpoint (``checkpoint_dir/step-<n>/``) holds the dense state (model, optimizer, position in the data)
and the PS snapshot taken at the same step: every rank flushes its pushes, the ranks meet at a barrier, rank 0
has every shard snapshot its tables. Resuming restores both and continues from the next batch.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from tigana import ps
from tigana.trainer import preemption
from tigana.trainer.allreduce import register_hook
from tigana.trainer.config import TrainConfig
from tigana.trainer.datasets import TrainData, load_data
from tigana.trainer.distributed import DistEnv, Groups, collective_device
from tigana.trainer.elastic import Position, elastic_state, restart_count, under_torch_elastic
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.inputs import check_inputs, latest_checkpoint
from tigana.trainer.metrics import TrainerMetrics, start_wandb
from tigana.trainer.publish import Publisher
from tigana.trainer.types import Batch, FeatureSpec

__all__ = ["TrainData", "check_inputs", "evaluate", "load_data", "train"]

log = logging.getLogger("tigana.trainer")


# ---------------------------------------------------------------------------------------------- inputs
# ---------------------------------------------------------------------------------------------- model
def _optimizer_of(config: TrainConfig) -> Any:
    lr = config.embedding_lr
    return {"sgd": ps.SGD(lr=lr), "adagrad": ps.Adagrad(lr=lr), "rowwise_adagrad": ps.RowWiseAdagrad(lr=lr),
            "adam": ps.Adam(lr=lr), "ftrl": ps.FTRL(alpha=lr)}[config.embedding_optimizer]


def build(config: TrainConfig, client: Any, data: TrainData, groups: Groups | None = None
          ) -> tuple[nn.Module, PSEmbeddingBags]:
    """The configured model over a PS collection of the data's features (tables created on the shards)."""
    from tigana.trainer.models import build_model

    features = [FeatureSpec(f.name, table=config.table_prefix + f.table_name, pooling=f.pooling)
                for f in data.features]
    aggregate = None
    if config.sparse_aggregation and groups is not None and groups.env.local_world_size > 1:
        aggregate = groups.sparse_node
    options = TableOptions(optimizer=_optimizer_of(config), initializer=ps.Normal(std=config.init_std),
                           staleness=config.staleness, seed=config.seed,
                           compression=None if config.ps_compression == "none" else config.ps_compression,
                           cache_rows=config.cache_rows, cache_max_age=config.cache_max_age,
                           cache_policy=config.cache_policy, unseen=config.unseen)
    fused = f"{config.table_prefix}{config.model}_{config.dataset}_fused" if config.fuse_tables else None
    collection = PSEmbeddingBags(client, features, config.dim, options=options, aggregate_group=aggregate,
                                 fused_table=fused)
    torch.manual_seed(config.seed)  # identical dense init on every rank
    model = build_model(config.model, collection, data.num_dense)
    return model, collection


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    return list(model.dense_parameters()) if hasattr(model, "dense_parameters") else list(model.parameters())


# ---------------------------------------------------------------------------------------------- evaluation
def evaluate(model: nn.Module, batches: Iterator[Batch], collection: PSEmbeddingBags | None = None
             ) -> dict[str, float]:
    """AUC, logloss and row count over ``batches`` (torchmetrics; summed over every rank when a process
    group is up, so every rank must call it)."""
    from torchmetrics.aggregation import SumMetric
    from torchmetrics.classification import BinaryAUROC

    device = next(model.parameters()).device
    # metrics live where the model runs: NCCL can only sum CUDA tensors across ranks
    auroc, loss_sum, rows = BinaryAUROC().to(device), SumMetric().to(device), SumMetric().to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            batches = iter(batches)
            nxt = next(batches, None)
            while nxt is not None:
                batch, nxt = nxt, next(batches, None)
                if nxt is not None and collection is not None:
                    collection.prefetch(nxt.sparse)
                logits = model(batch.dense.to(device), batch.sparse).float()
                labels = batch.labels.to(device)
                auroc.update(torch.sigmoid(logits), labels.long())
                loss_sum.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="sum"))
                rows.update(torch.tensor(float(len(batch)), device=device))
    finally:
        model.train(was_training)
    n = float(rows.compute())
    if n == 0:
        return {"auc": float("nan"), "logloss": float("nan"), "eval_rows": 0}
    return {"auc": float(auroc.compute()), "logloss": float(loss_sum.compute()) / n, "eval_rows": int(n)}


# ---------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(root: Path, *, step: int, epoch: int, batch_in_epoch: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, client: Any, config: TrainConfig) -> Path:
    """Rank 0 only, after every rank flushed its pushes: a cluster checkpoint of the PS tables (rows and
    optimizer state, one cut per table) + the dense state, written atomically."""
    target = root / f"step-{step:09d}"
    tmp = root / f".tmp-step-{step:09d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    client.checkpoint(str(tmp / "ps"))
    state = model.dense_state_dict() if hasattr(model, "dense_state_dict") else model.state_dict()
    torch.save({"model": state, "optimizer": optimizer.state_dict()}, tmp / "dense.pt")
    meta = {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "ps_checkpoint": "ps",
            "ps_addresses": list(client.addresses), "config": config.to_dict(), "time": time.time()}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, client: Any | None
                    ) -> dict[str, Any]:
    """Load the dense state into ``model``/``optimizer``; with ``client`` (rank 0) restore the PS snapshot."""
    meta = json.loads((path / "meta.json").read_text())
    state = torch.load(path / "dense.pt", weights_only=True)
    if hasattr(model, "load_dense_state_dict"):
        model.load_dense_state_dict(state["model"])
    else:
        model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if client is not None:  # any number of servers: the rows go through the cluster's current primaries
        client.restore_checkpoint(str(path / meta.get("ps_checkpoint", "ps")))
    return meta


# ---------------------------------------------------------------------------------------------- training
def _step_flags(has_batch: bool, world: int) -> tuple[bool, bool]:
    """(every rank has a batch for this step, some rank was asked to stop): one tiny MIN all-reduce when there
    are peers, so every rank takes the same decision after the same step (on the backend's device: NCCL)."""
    stop = preemption.requested()
    if world == 1:
        return has_batch, stop
    flags = torch.tensor([1 if has_batch else 0, 0 if stop else 1], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    ready, go_on = flags.tolist()
    return bool(ready), not go_on


def train(config: TrainConfig, env: DistEnv, groups: Groups | None, addresses: list[str],
          metrics: TrainerMetrics | None = None) -> dict[str, Any]:
    """Run the configured training as rank ``env.rank`` (the process group is already up when world > 1).
    Returns the result every rank agrees on: auc, logloss, samples_per_s, steps, eval_rows, ...
    ``metrics``: this rank's metrics (default: new ones, served on ``metrics_port`` + local rank when set)."""
    world, rank = env.world_size, env.rank
    client = ps.connect(addresses)
    writer = wandb_run = None
    metrics = metrics if metrics is not None else TrainerMetrics(rank)
    serving = False  # whether this call started the metrics endpoint (and so stops it)
    try:
        data = load_data(config, rank, world)
        model, collection = build(config, client, data, groups)
        metrics.attach(client, collection)
        port = config.metrics_port
        if port and metrics.http_port is None:
            metrics.serve_http(port + env.local_rank if port > 0 else port, config.metrics_host)
            serving = True
        device = torch.device("cpu")
        if world > 1 and dist.get_backend() == "nccl":
            device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
            model.to(device)
        params = dense_parameters(model)
        net: nn.Module = model
        hook = "none"
        if world > 1:
            net = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
            hook = register_hook(net, groups, mode=config.allreduce, compression=config.compression)
        optimizer = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
        start_epoch, skip, step = 0, 0, 0
        ckpt_root = Path(config.checkpoint_dir) if config.checkpoint_dir else None
        publisher = Publisher.for_run(config, collection, data.num_dense, rank)
        resumed_from = None
        path = None
        if config.resume is not None:  # "auto": the newest checkpoint when there is one, else a fresh start
            path = latest_checkpoint(ckpt_root) if config.resume in ("latest", "auto") else Path(config.resume)
            if path is None and config.resume != "auto":
                raise FileNotFoundError(f"resume: no checkpoint in {ckpt_root}")
        if path is not None:
            if world > 1:
                dist.barrier()
            meta = load_checkpoint(path, model, optimizer, client if rank == 0 else None)
            if world > 1:
                dist.barrier()  # the PS holds the snapshot before anyone pulls
            step, start_epoch, skip = meta["step"], meta["epoch"], meta["batch_in_epoch"]
            resumed_from = str(path)
        elastic = elastic_state(config)
        restarts = restart_count()
        # A new generation takes the dense state and position of a state of its own job (ElasticState.resumable:
        # the job's id, or the restart count and the finished mark), the PS as is; rank 0 discards another job's.
        # A --resume checkpoint newer than the state wins (a requeued, preempted job).
        if elastic is not None:
            newest = elastic.peek() if elastic.resumable(restarts, under_torch_elastic()) else None
            if newest is not None and newest.step > step:
                saved = elastic.load(model, optimizer)
                if saved is not None:
                    step, start_epoch, skip = saved.step, saved.epoch, saved.batches_to_skip(world)
                    resumed_from = f"elastic state at step {saved.step}"
            elif newest is None and rank == 0:
                elastic.discard()
        if rank == 0 and config.logdir:
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(config.logdir)
            writer.add_text("config", json.dumps(config.to_dict(), indent=1))
        if rank == 0 and config.wandb_project:
            wandb_run = start_wandb(config.wandb_project, config.to_dict(), config.logdir)
        bar = None
        if rank == 0 and config.progress:
            from tqdm import tqdm
            total = config.max_steps
            if data.steps_per_epoch is not None:
                planned = data.steps_per_epoch * config.epochs
                total = planned if total is None else min(total, planned)
            bar = tqdm(total=total, initial=step, unit="step", file=sys.stderr, dynamic_ncols=True,
                       desc=f"{config.model} ({world} trainer{'s' if world > 1 else ''})", mininterval=1.0)

        def checkpoint(epoch: int, batch_in_epoch: int) -> None:
            collection.flush()
            if world > 1:
                dist.barrier()
            if rank == 0 and ckpt_root is not None:
                save_checkpoint(ckpt_root, step=step, epoch=epoch, batch_in_epoch=batch_in_epoch, model=model,
                                optimizer=optimizer, client=client, config=config)
            if world > 1:
                dist.barrier()

        def save_elastic(epoch: int, batch_in_epoch: int) -> None:
            """Rank 0: the elastic state where the next step starts (data position in global samples)."""
            elastic.save(Position(step, epoch, batch_in_epoch * world * config.batch_size, world, config.batch_size),
                         model, optimizer)

        samples = 0
        result: dict[str, Any] | None = None
        position: tuple[int, int] | None = None  # (epoch, batch in epoch) the next step starts at
        train_time = 0.0
        loss_sum, loss_n = 0.0, 0
        done = config.max_steps is not None and step >= config.max_steps
        preempted = False
        net.train()
        for epoch in range(start_epoch, config.epochs):
            if done:
                break
            batches = data.train_batches(epoch)
            batch_in_epoch = 0
            if epoch == start_epoch and skip:
                for _ in range(skip):
                    if next(batches, None) is None:
                        break
                batch_in_epoch = skip
            t0 = time.perf_counter()
            metrics.epoch.set(epoch)
            nxt = next(batches, None)
            while True:
                ready, preempted = _step_flags(nxt is not None, world)
                if preempted or not ready:
                    break
                batch = nxt
                nxt = next(batches, None)
                if config.prefetch and nxt is not None:
                    collection.prefetch(nxt.sparse)
                logits = net(batch.dense.to(device), batch.sparse)
                loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if collection.compressors:
                    collection.observe_loss(float(loss.detach()))  # the accuracy guard of adaptive compression
                step += 1
                batch_in_epoch += 1
                samples += len(batch)
                loss_sum += float(loss.detach()) * len(batch)
                loss_n += len(batch)
                metrics.step(len(batch))
                if bar is not None:
                    bar.update(1)
                if step % config.log_every == 0:
                    scalars = metrics.window(loss_sum / max(loss_n, 1))
                    scalars["train/samples_per_s_rank0"] = samples / max(train_time + time.perf_counter() - t0, 1e-9)
                    if writer is not None:
                        for tag, value in scalars.items():
                            writer.add_scalar(tag, value, step)
                    if wandb_run is not None:
                        wandb_run.log(scalars, step=step)
                    loss_sum, loss_n = 0.0, 0
                if elastic is not None and rank == 0 and elastic.due(step):
                    save_elastic(epoch, batch_in_epoch)
                if publisher is not None and publisher.due(step):
                    publisher.publish(step, model)
                if config.checkpoint_every and step % config.checkpoint_every == 0:
                    train_time += time.perf_counter() - t0
                    checkpoint(epoch, batch_in_epoch)
                    t0 = time.perf_counter()
                if config.max_steps is not None and step >= config.max_steps:
                    done = True
                    break
            train_time += time.perf_counter() - t0
            collection.flush()
            if preempted:  # a checkpoint where the next step starts (nxt was read, not trained), no evaluation
                position = (epoch, batch_in_epoch)
                if elastic is not None and rank == 0:  # the next generation (torchrun: a membership change) starts here
                    save_elastic(epoch, batch_in_epoch)
                if ckpt_root is not None:
                    checkpoint(*position)
                break
            finished_epoch = not done or nxt is None
            position = (epoch + 1, 0) if finished_epoch else (epoch, batch_in_epoch)
            if publisher is not None:
                publisher.publish(step, model)  # the end of every epoch, whatever the interval
            if ckpt_root is not None and not config.checkpoint_every:
                checkpoint(*position)
            result = evaluate(model, data.eval_batches(), collection)
            metrics.evaluated(result)
            if writer is not None:
                writer.add_scalar("eval/auc", result["auc"], step)
                writer.add_scalar("eval/logloss", result["logloss"], step)
            if wandb_run is not None:
                wandb_run.log({"eval/auc": result["auc"], "eval/logloss": result["logloss"]}, step=step)
        if bar is not None:
            bar.close()
        if preempted:
            result = {"preempted": True, "auc": float("nan"), "logloss": float("nan")}
        elif ckpt_root is not None and config.checkpoint_every and step % config.checkpoint_every and position:
            checkpoint(*position)  # where this run stopped, so a resume continues from there
        if result is None:  # nothing left to train (resumed at the end): evaluate anyway
            result = evaluate(model, data.eval_batches(), collection)
        total_samples, slowest = _max_time(samples, train_time, world)
        result.update(_ps_figures(client, collection))
        result.update(samples_per_s=total_samples / slowest if slowest > 0 else 0.0, steps=step,
                      train_rows=int(total_samples), world_size=world, model=config.model,
                      dataset=config.dataset, allreduce=hook, train_seconds=round(slowest, 3))
        if resumed_from:
            result["resumed_from"] = resumed_from
        if elastic is not None:
            result["restarts"] = restarts
            if rank == 0 and not preempted:
                elastic.finish()
        if preempted:
            where = f"; checkpoint {latest_checkpoint(ckpt_root)}" if ckpt_root is not None else " (no --checkpoint-dir)"
            log.warning("stopped by SIGTERM after step %d%s", step, where)
        if ckpt_root is not None:
            latest = latest_checkpoint(ckpt_root)
            result["checkpoint"] = str(latest) if latest else None
        if config.logdir:
            result["logdir"] = str(config.logdir)
        if writer is not None:
            writer.add_scalar("train/samples_per_s", result["samples_per_s"], step)
        if wandb_run is not None:
            wandb_run.log({"train/samples_per_s": result["samples_per_s"]}, step=step)
        return result
    finally:
        if writer is not None:
            writer.close()
        if wandb_run is not None:
            wandb_run.finish()
        if serving:
            metrics.close()
        client.close()


def _ps_figures(client: Any, collection: PSEmbeddingBags) -> dict[str, Any]:
    """This rank's data-path bytes (sent + received, pulls and pushes, every PS table of the run), and the
    hot-row cache's hit rate and the adaptive compressor's counters when they are on."""
    stats = client.stats()
    out: dict[str, Any] = {"wire_bytes": int(sum(sum(stats[k].get(t, {}).values())
                                                 for k in ("bytes_sent", "bytes_received")
                                                 for t in collection.ps_tables))}
    own = collection.stats()
    if own["cache"]:
        looked = sum(c["hits"] + c["misses"] for c in own["cache"].values())
        out["cache_hit_rate"] = sum(c["hits"] for c in own["cache"].values()) / looked if looked else 0.0
    if own["compression"]:
        out["compression"] = {t: {k: c[k] for k in ("codec_steps", "push_trips", "pull_trips", "loss_trips",
                                                    "rows_given", "rows_sent")}
                              for t, c in own["compression"].items()}
    return out


def _max_time(samples: int, seconds: float, world: int) -> tuple[float, float]:
    """(samples summed over ranks, the slowest rank's training time)."""
    if world == 1:
        return float(samples), seconds
    device = collective_device()  # NCCL carries CUDA tensors only
    total = torch.tensor([float(samples)], dtype=torch.float64, device=device)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(total.item()), float(slowest.item())


def nan_to_none(result: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe copy (NaN -> None)."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}

