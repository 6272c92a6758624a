"""Preemption as SLURM, Kubernetes or torchrun do it: SIGTERM to a running ``tigana train`` (2 ranks, an
embedded cluster) stops both ranks after the same step, writes a checkpoint there, exits with status 75
(``"preempted": true`` in its result); the requeue-and-resume is in ``tests/tools/test_slurm_launch.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tigana.trainer import preemption

pytestmark = pytest.mark.timeout(300)
ARGS = ["--dataset", "synthetic", "--synthetic-rows", "40000", "--synthetic-vocab", "2000", "--batch-size", "256",
        "--no-progress", "--nproc", "2", "--checkpoint-every", "5"]


def _steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if (p / "meta.json").is_file())


def test_sigterm_checkpoints_at_a_step_boundary(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "tigana.tools.cli", "train", *ARGS, "--checkpoint-dir", str(ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not _steps(ckpt):  # training runs: a periodic checkpoint exists
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 180 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == preemption.EXIT_PREEMPTED, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["preempted"] is True and result["auc"] is None  # stopped before evaluating
    stopped_at = result["steps"]
    assert stopped_at == _steps(ckpt)[-1]  # the checkpoint is where it stopped, not the last periodic one
    meta = json.loads((ckpt / f"step-{stopped_at:09d}" / "meta.json").read_text())
    assert meta["step"] == stopped_at

    # the resume from it, to exactly this step, runs in tests/tools/test_slurm_launch.py (a requeued job)


def _flags_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from tigana.trainer.loop import _step_flags

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        preemption.reset()
        assert _step_flags(True, world) == (True, False)
        if rank == 1:  # SIGTERM reached one rank only: every rank stops after this step
            preemption.request()
        assert _step_flags(True, world) == (True, True)
        preemption.reset()
        # one rank's part of the data ran out: no rank takes the step (nobody waits in a collective)
        assert _step_flags(rank != 0, world) == (False, False)
        if rank == 0:
            preemption.request()
        assert _step_flags(rank != 1, world) == (False, True)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_share_the_stop_and_the_end_of_their_data() -> None:
    import torch.multiprocessing as mp

    from tigana.trainer.distributed import free_port

    mp.spawn(_flags_worker, args=(2, free_port()), nprocs=2, join=True)


def test_the_flag_is_shared_with_the_step_decision() -> None:
    from tigana.trainer.loop import _step_flags

    preemption.reset()
    try:
        assert _step_flags(True, 1) == (True, False)
        preemption.request()
        assert _step_flags(True, 1) == (True, True)
    finally:
        preemption.reset()
