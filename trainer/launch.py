"""Starting a training job: under a launcher (torchrun, srun, Kubeflow), or as N local processes.

- Under a launcher (``WORLD_SIZE`` set, or ``SLURM_PROCID``/``SLURM_NTASKS`` inside an srun step) this process
  is one rank; without ``--ps``, rank 0 starts an embedded local cluster and tells the others its addresses.
  SLURM's variables inherited by a shell (``salloc``, the batch script itself: no ``SLURM_STEP_ID``) do not
  make a launcher, and an explicit ``--nproc N`` > 1 outranks them.
- Otherwise ``--nproc N`` spawns N trainer processes (multiprocessing's spawn) that rendezvous on a
  free loopback port; without ``--ps`` this process starts the embedded cluster first and stops it after,
  so every process the job started is gone when ``run`` returns, also on failure.

The launcher of ``--nproc N`` never imports torch (about 1.5 s of CPU a launch): what a rank runs is
``trainer.rank``, imported by the ranks themselves.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tigana import ps
from tigana.ps.allocator import ALLOCATOR_ENV
from tigana.trainer import preemption
from tigana.trainer.config import TrainConfig
from tigana.trainer.elastic import JOB_ID_ENV, under_torch_elastic
from tigana.trainer.extra import require as require_extra
from tigana.trainer.inputs import check_inputs
from tigana.trainer.launcher_env import DistEnv, free_port, read_env

log = logging.getLogger("tigana.trainer")

__all__ = ["run", "start_cluster", "under_launcher"]


def under_launcher(environ: Mapping[str, str] | None = None, nproc: int = 1) -> bool:
    """True when a launcher started this process as one rank of a job.

    torch's ``WORLD_SIZE`` always counts. SLURM's ``SLURM_PROCID``/``SLURM_NTASKS`` count only in a task of an
    srun step (``SLURM_STEP_ID`` set) and only when ``nproc`` is 1: an ``salloc`` shell exports them too, and a
    job that asks for ``--nproc 2`` there means two local processes, not 2 of the allocation's tasks.
    """
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        return True
    return nproc <= 1 and "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def _ignored_slurm(environ: Mapping[str, str] | None, nproc: int) -> str | None:
    """A note when SLURM rank variables are present but do not make this process a rank, else None."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env or not ("SLURM_PROCID" in env and "SLURM_NTASKS" in env):
        return None
    if nproc > 1:
        why = f"--nproc {nproc} starts local processes"
    elif "SLURM_STEP_ID" not in env:
        why = "not inside an srun step (an salloc or batch shell exports them); run under srun for one rank a task"
    else:
        return None
    return (f"tigana train: ignoring SLURM_PROCID={env['SLURM_PROCID']} SLURM_NTASKS={env['SLURM_NTASKS']}: "
            f"{why}")


def start_cluster(shards: int = 2, data_dir: str | os.PathLike | None = None, replicas: int | None = 1
                  ) -> ps.LocalCluster:
    """A local cluster (a scheduler and ``shards`` daemons, every slot with ``replicas`` copies; child
    processes, ``close()`` stops them) tuned for training. ``cluster.target`` is what ``ps.connect`` takes."""
    return ps.LocalCluster(shards=shards, replicas=replicas, data_dir=data_dir, env={**ALLOCATOR_ENV, **os.environ})


def _spawned(index: int, nproc: int, port: int, config: TrainConfig, addresses: list[str], out: str,
             elastic: tuple[str, int, str] | None = None) -> None:
    """A trainer process of ``--nproc N`` (multiprocessing's spawn): torch is imported here, not in the
    launcher."""
    from tigana.trainer.rank import run_spawned

    try:
        run_spawned(index, nproc, port, config, addresses, out, elastic)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the group: the launcher says so, once
        sys.exit(130)


def run(config: TrainConfig, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Run the job this process is part of. Returns the result on rank 0 (None on other launcher ranks)."""
    check_inputs(config)
    note = _ignored_slurm(environ, config.nproc)
    if note:
        log.warning("%s", note)  # through logging: one JSON object with --log-format json
    if under_launcher(environ, config.nproc):
        env = read_env(config.ranks_per_node, _without_ignored_slurm(environ))
        if not config.ps and env.num_nodes > 1 and config.ranks_per_node is None:
            raise ValueError("ps: a job on several nodes needs --ps (an embedded cluster listens on loopback "
                             "of one node only)")
        if under_torch_elastic(environ) and not config.ps:
            raise ValueError("ps: torchrun --max-restarts needs --ps (an embedded cluster would stop with the "
                             "rank that started it, and the tables with it)")
        require_extra(config, rank0=env.rank == 0)
        from tigana.trainer.rank import run_rank

        result = run_rank(config, env, list(config.ps) or None)
        return result if env.rank == 0 else None
    require_extra(config)  # before a cluster or a trainer starts, not in the evaluation after the last step
    in_process = config.nproc == 1 and not config.max_restarts
    if in_process:
        from tigana.trainer.rank import run_rank
    cluster = None
    try:
        addresses = list(config.ps)
        if not addresses:
            cluster = start_cluster(config.shards)  # its data in a temp dir: a checkpoint holds the tables
            addresses = [cluster.target]
        if in_process:
            return run_rank(config, DistEnv(), addresses)
        with tempfile.TemporaryDirectory(prefix="tigana-train-") as tmp:
            out = os.path.join(tmp, "result.json")
            preemption.install()
            job = os.environ.get(JOB_ID_ENV) or uuid.uuid4().hex  # keys the elastic state to this job
            for restarts in range(config.max_restarts + 1):
                folder = os.path.join(config.checkpoint_dir or tmp, "elastic")
                elastic = (folder, restarts, job) if config.max_restarts else None
                processes = _start(config, free_port(), addresses, out, elastic)
                try:
                    failed = _supervise(processes)
                except BaseException:  # Ctrl-C (KeyboardInterrupt) or a bug: no trainer outlives this process
                    _stop(processes)
                    raise
                if failed is None:
                    return json.loads(Path(out).read_text())
                if preemption.requested() or restarts == config.max_restarts:
                    raise RuntimeError(f"trainer rank {failed[0]} exited with {failed[1]}"
                                       + (f" after {restarts} restart(s)" if restarts else ""))
                log.warning("tigana train: trainer rank %d exited with %s; starting the trainers again (%d of %d) "
                            "from the last elastic state", failed[0], failed[1], restarts + 1, config.max_restarts)
            raise AssertionError("unreachable")
    finally:
        if cluster is not None:
            cluster.close()


def _start(config: TrainConfig, port: int, addresses: list[str], out: str, elastic: tuple[str, int, str] | None
           ) -> list[multiprocessing.process.BaseProcess]:
    """One generation of ``config.nproc`` trainer processes (spawned: a fresh interpreter each, no fork of this
    one's threads), rendezvousing on loopback ``port``."""
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=_spawned, args=(index, config.nproc, port, config, addresses, out, elastic),
                               name=f"tigana-trainer-{index}") for index in range(config.nproc)]
    try:
        for p in processes:
            p.start()
    except BaseException:
        _stop([p for p in processes if p.pid is not None])
        raise
    return processes


def _without_ignored_slurm(environ: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``environ`` as ``read_env`` should see it: SLURM's rank variables only inside an srun step."""
    env = os.environ if environ is None else environ
    if "SLURM_STEP_ID" in env or "WORLD_SIZE" not in env:
        return environ
    return {k: v for k, v in env.items() if k not in _SLURM_RANK_VARS}


def _stop(processes: list[Any]) -> None:
    """SIGKILL the trainer processes still running and reap them all."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join()


_SLURM_RANK_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE")


def _supervise(processes: list[Any]) -> tuple[int, int] | None:
    """Wait for one generation of trainer processes: None when all exit 0; else (rank, exit code) of the first
    that failed, after killing the others (they would wait on a dead peer). Forwards a SIGTERM this process
    gets to every rank once (they stop together at a step boundary)."""
    forwarded = False
    while True:
        codes = [p.exitcode for p in processes]
        bad = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if bad:
            _stop(processes)  # a survivor's pushes in flight: applied once or not at all (client id, seq)
            return bad[0]
        if all(code == 0 for code in codes):
            return None
        if preemption.requested() and not forwarded:
            for p in processes:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)
            forwarded = True
        time.sleep(0.1)
