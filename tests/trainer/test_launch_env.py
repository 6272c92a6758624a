"""Which variables make ``tigana train`` one rank of a launched job, and how it stops while waiting for peers.

SLURM variables inherited from an ``salloc`` shell (no srun step) used to make ``tigana train --nproc 2``
ignore ``--nproc`` and wait 300 s for peers that never start; Ctrl-C then printed a raw DistStoreError dump.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tigana.trainer.launch import under_launcher

CLI = [sys.executable, "-m", "tigana.tools.cli"]
SALLOC = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4",
          "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node[1-1]"}
TRAIN = ["train", "--dataset", "synthetic", "--synthetic-rows", "600", "--synthetic-vocab", "100", "--batch-size",
         "64", "--dim", "4", "--eval-batch-size", "512", "--no-progress", "--max-steps", "3", "--shards", "1"]


@pytest.mark.parametrize(("env", "nproc", "expected"), [
    ({}, 1, False),
    ({"WORLD_SIZE": "2", "RANK": "0"}, 1, True),          # torchrun or our srun task wrapper
    ({"WORLD_SIZE": "2", "RANK": "0"}, 4, True),          # a launcher's variables still win over --nproc
    (SALLOC, 1, False),                                   # an salloc shell: no srun step
    ({**SALLOC, "SLURM_STEP_ID": "3"}, 1, True),          # a task of `srun tigana train`
    ({**SALLOC, "SLURM_STEP_ID": "3"}, 2, False),         # --nproc 2 asks for local processes
])
def test_under_launcher(env: dict[str, str], nproc: int, expected: bool) -> None:
    assert under_launcher(env, nproc) is expected


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TIGANA_")) and k not in ("WORLD_SIZE", "RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_nproc_outranks_inherited_slurm_variables(tmp_path: Path) -> None:
    out = subprocess.run([*CLI, *TRAIN, "--nproc", "2", "--log-format", "json"], env=_clean_env(**SALLOC),
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (note,) = [line for line in out.stderr.splitlines() if "ignoring SLURM_PROCID" in line]
    record = json.loads(note)  # the launcher's lifecycle lines are log records: JSON with --log-format json
    assert "ignoring SLURM_PROCID=0 SLURM_NTASKS=4: --nproc 2 starts local processes" in record["message"]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["steps"] == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_masks(pid: int) -> str:
    """The signal masks of a process (/proc/PID/status: blocked, ignored, caught), as hex."""
    status = Path(f"/proc/{pid}/status").read_text()
    wanted = ("SigBlk", "SigIgn", "SigCgt")
    return ", ".join(line.replace("\t", " ") for line in status.splitlines() if line.startswith(wanted))


def test_ctrl_c_while_waiting_for_peers_prints_one_line(tmp_path: Path) -> None:
    # rank 1 of 2 whose rank 0 never starts: it waits for the rendezvous until Ctrl-C
    env = _clean_env(WORLD_SIZE="2", RANK="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    proc = subprocess.Popen([*CLI, *TRAIN, "--ps", "127.0.0.1:1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True)
    try:
        lines = []
        for line in proc.stderr:  # until it logs that it waits for its peers
            lines.append(line)
            if "waiting for the job's 2 ranks" in line:
                break
        assert proc.poll() is None, "".join(lines)[-3000:]
        time.sleep(1)
        masks = _signal_masks(proc.pid)  # what SIGINT meets in the trainer, said if it does not stop
        proc.send_signal(signal.SIGINT)
        try:
            rest = proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            rest = proc.communicate()[1]
            said = ("".join(lines) + rest)[-3000:]
            raise AssertionError(f"SIGINT did not stop the trainer in 60 s ({masks})\n{said}") from None
        err = "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in (1, 130), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "tigana train: interrupted" in err or "could not reach the other ranks" in err, err[-3000:]


def test_resume_auto_starts_fresh_then_resumes(tmp_path: Path) -> None:
    """``--resume=auto`` (the Kubernetes trainer Job's): the newest checkpoint when there is one, else a fresh
    start, so a first pod and a restarted one run the same command line."""
    ckpt = tmp_path / "ckpt"
    common = [*TRAIN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--resume=auto"]
    first = subprocess.run([*CLI, *common], env=_clean_env(), capture_output=True, text=True, timeout=240,
                           cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout.strip().splitlines()[-1]).get("resumed_from") is None
    assert list(ckpt.glob("step-*/meta.json"))
    args = [a if a != "3" else "5" for a in common]  # --max-steps 5
    second = subprocess.run([*CLI, *args], env=_clean_env(), capture_output=True, text=True, timeout=240,
                            cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    result = json.loads(second.stdout.strip().splitlines()[-1])
    assert result["resumed_from"] is not None and result["steps"] == 5
