"""Starting a training job: under a launcher (torchrun, srun, Kubeflow), or as N local processes.

- Under a launcher (``WORLD_SIZE`` or ``SLURM_PROCID`` set) this process is one rank; without ``--ps``,
  rank 0 starts an embedded local cluster and tells the others its addresses.
- Otherwise ``--nproc N`` spawns N trainer processes (torch.multiprocessing, spawn) that rendezvous on a
  free loopback port; without ``--ps`` this process starts the embedded cluster first and stops it after,
  so every process the job started is gone when ``run`` returns, also on failure.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tigana import ps
from tigana.ps.daemon import ALLOCATOR_ENV, tune_allocator
from tigana.trainer import preemption
from tigana.trainer.config import TrainConfig
from tigana.trainer.distributed import DistEnv, free_port, init_distributed, read_env, shutdown
from tigana.trainer.loop import check_inputs, nan_to_none, train

__all__ = ["run", "start_cluster", "under_launcher"]


def under_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True when a launcher started this process as one rank of a job."""
    env = os.environ if environ is None else environ
    return "WORLD_SIZE" in env or ("SLURM_PROCID" in env and "SLURM_NTASKS" in env)


def start_cluster(shards: int = 2, data_dir: str | os.PathLike | None = None, replicas: int | None = 1
                  ) -> ps.LocalCluster:
    """A local cluster (a scheduler and ``shards`` daemons, every slot with ``replicas`` copies; child
    processes, ``close()`` stops them) tuned for training. ``cluster.target`` is what ``ps.connect`` takes."""
    return ps.LocalCluster(shards=shards, replicas=replicas, data_dir=data_dir, env={**ALLOCATOR_ENV, **os.environ})


def _start_cluster(config: TrainConfig) -> ps.LocalCluster:
    # The embedded cluster's data lives in a temp dir: a checkpoint holds the PS tables themselves.
    return start_cluster(config.shards)


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
                cluster = _start_cluster(config)
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


def _spawned(index: int, nproc: int, port: int, config: TrainConfig, addresses: list[str], out: str) -> None:
    os.environ.update(RANK=str(index), WORLD_SIZE=str(nproc), LOCAL_RANK=str(index),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env = read_env(config.ranks_per_node)
    result = run_rank(config, env, addresses)
    if index == 0:
        Path(out).write_text(json.dumps(result))


def run(config: TrainConfig, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Run the job this process is part of. Returns the result on rank 0 (None on other launcher ranks)."""
    check_inputs(config)
    if under_launcher(environ):
        env = read_env(config.ranks_per_node, environ)
        if not config.ps and env.num_nodes > 1 and config.ranks_per_node is None:
            raise ValueError("ps: a job on several nodes needs --ps (an embedded cluster listens on loopback "
                             "of one node only)")
        result = run_rank(config, env, list(config.ps) or None)
        return result if env.rank == 0 else None
    cluster = None
    try:
        addresses = list(config.ps)
        if not addresses:
            cluster = _start_cluster(config)
            addresses = [cluster.target]
        if config.nproc == 1:
            return run_rank(config, DistEnv(), addresses)
        with tempfile.TemporaryDirectory(prefix="tigana-train-") as tmp:
            out = os.path.join(tmp, "result.json")
            context = mp.start_processes(_spawned, args=(config.nproc, free_port(), config, addresses, out),
                                         nprocs=config.nproc, join=False, start_method="spawn")
            preemption.install()
            forwarded = False
            while not context.join(timeout=0.2):
                if preemption.requested() and not forwarded:  # the ranks stop together at a step boundary
                    for p in context.processes:
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGTERM)
                    forwarded = True
            return json.loads(Path(out).read_text())
    finally:
        if cluster is not None:
            cluster.close()
