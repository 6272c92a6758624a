"""One rank of a training job: join the process group, train, leave (``run_rank``), in the process a launcher
(torchrun, srun) started or one of the trainer processes ``tigana train --nproc N`` spawned (``run_spawned``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tigana.ps.allocator import tune_allocator
from tigana.trainer import preemption
from tigana.trainer.config import TrainConfig
from tigana.trainer.distributed import DistEnv, init_distributed, read_env, shutdown
from tigana.trainer.elastic import ELASTIC_DIR_ENV, JOB_ID_ENV, RESTART_ENV
from tigana.trainer.launch import start_cluster
from tigana.trainer.loop import nan_to_none, train

__all__ = ["run_rank", "run_spawned"]


def _threads(env: DistEnv) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(env.local_world_size, 1)))


def run_rank(config: TrainConfig, env: DistEnv, addresses: list[str] | None) -> dict[str, Any]:
    """This process's part of the job: join the process group, train, leave. ``addresses`` None: rank 0
    starts an embedded cluster for the job."""
    _threads(env)
    preemption.install()  # SIGTERM: stop after the current step, checkpoint, return "preempted"
    # glibc maps and unmaps every multi-MiB gRPC buffer by default, which costs several times the copy.
    tune_allocator(top_pad=64 << 20)
    groups = init_distributed(env, config.backend) if env.world_size > 1 else None
    cluster = None
    try:
        if addresses is None:
            box: list[Any] = [None]
            if env.rank == 0:
                cluster = start_cluster(config.shards)  # its data in a temp dir: a checkpoint holds the tables
                box = [[cluster.target]]
            if env.world_size > 1:
                dist.broadcast_object_list(box, src=0)
            addresses = box[0]
        result = train(config, env, groups, list(addresses))
        if env.world_size > 1:
            dist.barrier()  # nobody leaves (and rank 0 stops no cluster) while others still use it
        return nan_to_none(result)
    finally:
        if cluster is not None:
            cluster.close()
        shutdown()


def run_spawned(index: int, nproc: int, port: int, config: TrainConfig, addresses: list[str], out: str,
                elastic: tuple[str, int, str] | None = None) -> None:
    """Trainer process ``index`` of ``nproc`` on one machine (rendezvous on loopback ``port``); rank 0 writes
    the job's result to ``out``. ``elastic``: the job's elastic state folder, the generation, the job's id."""
    os.environ.update(RANK=str(index), WORLD_SIZE=str(nproc), LOCAL_RANK=str(index),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if elastic is not None:  # (the job's elastic state folder, this generation's restart count, the job's id)
        os.environ.update({ELASTIC_DIR_ENV: elastic[0], RESTART_ENV: str(elastic[1]), JOB_ID_ENV: elastic[2]})
    env = read_env(config.ranks_per_node)
    result = run_rank(config, env, addresses)
    if index == 0:
        Path(out).write_text(json.dumps(result))
