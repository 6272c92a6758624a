"""Elastic training: trainer processes die and come back while the parameter-server cluster runs on.

Every table lives on the shard servers, so a trainer holds only the dense model, its optimizer and its place
in the data. Losing one costs what it held since the last *elastic state*: rank 0 saves the dense state and
the data position (not the tables) every ``elastic_every`` steps, atomically. When the workers are started
again (``tigana train --nproc N --max-restarts R``: the launcher kills the surviving ranks of a failed
generation and starts a new one; ``torchrun --max-restarts R``: torch elastic does the same and sets
``TORCHELASTIC_RESTART_COUNT``), every rank loads the newest state and goes on from its position, with the
tables as the servers hold them now.

What a restart costs, and why it is safe:
- The steps between the state and the failure are trained again: the dense side from the saved weights, the
  sparse side on rows that already took those steps' pushes (at most ``elastic_every`` steps twice).
- A dead trainer's pushes in flight are applied exactly once or not at all: each carries (client id, seq),
  the servers apply a (client id, seq) once per slot, and nobody re-sends a dead client's pushes (a new
  generation connects with new client ids).
- A state is this job's only: it carries the job's id (``job_id``), and a generation resumes only a state of
  its own job, never one an earlier job left in ``checkpoint_dir/elastic``. Without an id (torchrun's default
  run id ``none``), a first generation that does not resume the state in the folder discards it, so that its
  own restarts cannot take it.
- The position is kept in global samples, so a generation with another number of ranks (torchrun
  ``--nnodes MIN:MAX``) starts its ranks where the job as a whole stopped (each rank's part of an epoch
  depends on the world size, so a few samples may be seen twice or skipped around the cut).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tigana.embeddings.files import atomic_replace, atomic_write

if TYPE_CHECKING:  # torch is imported where a state is saved or loaded: the launcher reads the names above only
    import torch
    from torch import nn

__all__ = ["ElasticState", "Position", "elastic_state", "job_id", "restart_count"]

RESTART_ENV = "TIGANA_RESTART_COUNT"       # set by ``tigana train --nproc`` for each new generation
ELASTIC_DIR_ENV = "TIGANA_ELASTIC_DIR"     # the job's elastic state folder (the launcher makes one)
JOB_ID_ENV = "TIGANA_JOB_ID"               # the job's id (the launcher makes one per job); set it for others
_TORCH_RESTARTS = "TORCHELASTIC_RESTART_COUNT"
_TORCH_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
_TORCH_RUN_ID = "TORCHELASTIC_RUN_ID"      # torchrun's --rdzv-id ("none" unless given; --standalone makes one)


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times this job's workers were started again before this generation (0: the first)."""
    env = os.environ if environ is None else environ
    for key in (RESTART_ENV, _TORCH_RESTARTS):
        if env.get(key):
            return int(env[key])
    return 0


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id every generation of this job shares and no other job has: ``TIGANA_JOB_ID`` (the ``--nproc``
    launcher sets one per job), else torchrun's run id unless it is its default ``none``; None without one."""
    env = os.environ if environ is None else environ
    run_id = env.get(_TORCH_RUN_ID, "")
    return env.get(JOB_ID_ENV) or (run_id if run_id not in ("", "none") else None)


def under_torch_elastic(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun may restart this worker (``--max-restarts`` > 0)."""
    env = os.environ if environ is None else environ
    return int(env.get(_TORCH_MAX_RESTARTS, "0") or 0) > 0


def elastic_state(config: Any, environ: Mapping[str, str] | None = None) -> ElasticState | None:
    """This job's elastic state, or None when its trainers are not restarted: the folder the ``--nproc``
    launcher made (``TIGANA_ELASTIC_DIR``), or ``checkpoint_dir/elastic`` under torchrun ``--max-restarts``
    (a folder every node sees)."""
    env = os.environ if environ is None else environ
    if env.get(ELASTIC_DIR_ENV):
        return ElasticState(env[ELASTIC_DIR_ENV], config.elastic_every, job_id(env))
    if under_torch_elastic(env):
        if not config.checkpoint_dir:
            raise ValueError("checkpoint_dir: torchrun --max-restarts needs --checkpoint-dir (a folder every node "
                             "sees) for the trainers' elastic state")
        return ElasticState(Path(config.checkpoint_dir) / "elastic", config.elastic_every, job_id(env))
    return None


@dataclass(frozen=True)
class Position:
    """Where the job stands: steps done by every rank, and the place in the data as (epoch, global samples
    into it), with the world size and batch size it was counted in."""

    step: int
    epoch: int
    samples_in_epoch: int
    world_size: int
    batch_size: int

    def batches_to_skip(self, world_size: int) -> int:
        """This rank's batches of the epoch to skip in a generation of ``world_size`` ranks."""
        return self.samples_in_epoch // (self.batch_size * max(world_size, 1))


class ElasticState:
    """The job's elastic state in ``folder`` (``state.json`` + ``dense.pt``, replaced atomically together:
    the JSON names the weights file it goes with, and the id of the job that saved it)."""

    def __init__(self, folder: str | os.PathLike, every: int, job: str | None = None) -> None:
        self.folder = Path(folder)
        self.every = int(every)
        self.job = job
        self.folder.mkdir(parents=True, exist_ok=True)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, position: Position, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Rank 0: the dense state at ``position`` (ranks agree on the dense weights after every step)."""
        import torch

        weights = f"dense-{position.step:09d}.pt"
        state = model.dense_state_dict() if hasattr(model, "dense_state_dict") else model.state_dict()
        with atomic_replace(self.folder / weights) as tmp:
            torch.save({"model": state, "optimizer": optimizer.state_dict()}, tmp)
        self._write_meta({**position.__dict__, "weights": weights, "job": self.job, "time": time.time()})  # the switch
        for old in self.folder.glob("dense-*.pt"):
            if old.name != weights:
                old.unlink(missing_ok=True)

    def peek(self) -> Position | None:
        """The position of the newest state, without loading it; None when there is none."""
        meta = self._meta()
        if meta is None:
            return None
        return Position(int(meta["step"]), int(meta["epoch"]), int(meta["samples_in_epoch"]),
                        int(meta["world_size"]), int(meta["batch_size"]))

    def _meta(self) -> dict[str, Any] | None:
        path = self.folder / "state.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def _write_meta(self, meta: dict[str, Any]) -> None:
        """Replace ``state.json`` atomically: a reader sees the old state or the new one, never a mix."""
        atomic_write(self.folder / "state.json", json.dumps(meta))

    def finish(self) -> None:
        """Rank 0 at the end of a job that trained to its end: mark the state finished. A restart of this job
        (a rank failing after the end) still resumes it; a later job started in the same folder begins fresh."""
        meta = self._meta()
        if meta is not None:
            self._write_meta({**meta, "finished": True})

    def finished(self) -> bool:
        """Whether the newest state is that of a job that trained to its end."""
        meta = self._meta()
        return bool(meta and meta.get("finished"))

    def resumable(self, restarts: int, torch_elastic: bool) -> bool:
        """Whether the folder holds a state of this job for a generation after ``restarts`` restarts to resume.
        With a job id, exactly the states saved under it. Without one, any state once the job restarted (its
        first generation discarded the state it did not take: ``discard``), and under torchrun (which does
        not count a membership change as a restart) a state not marked finished at restart 0."""
        meta = self._meta()
        if meta is None:
            return False
        if self.job is not None or meta.get("job") is not None:
            return meta.get("job") == self.job
        return bool(restarts) or (torch_elastic and not meta.get("finished"))

    def discard(self) -> None:
        """Rank 0 of a generation that starts fresh: remove the state another job left, so that a restart of
        this job never resumes it."""
        (self.folder / "state.json").unlink(missing_ok=True)
        for old in self.folder.glob("dense-*.pt"):
            old.unlink(missing_ok=True)

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Position | None:
        """Load the newest state into ``model``/``optimizer``; None when there is none yet."""
        meta = self._meta()
        if meta is None:
            return None
        import torch

        state = torch.load(self.folder / meta["weights"], weights_only=True)
        if hasattr(model, "load_dense_state_dict"):
            model.load_dense_state_dict(state["model"])
        else:
            model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return Position(int(meta["step"]), int(meta["epoch"]), int(meta["samples_in_epoch"]),
                        int(meta["world_size"]), int(meta["batch_size"]))
