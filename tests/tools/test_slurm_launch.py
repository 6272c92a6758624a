"""tools/slurm/tigana.sbatch run locally: the real batch script under bash, a real scheduler, real shard
servers and real `tigana train` trainers on loopback addresses. Only SLURM's own tools are stood in for:
`scontrol` (hostnames of the allocation, the job's state, `requeue` recorded) and a launcher in place of
`srun` that starts a step's tasks on this machine with the variables srun gives each task. The allocation's
two "nodes" are 127.0.0.1 and 127.0.0.2 (both loopback), so every address the script hands out names a node.

One test, two runs of the job: the first is preempted (SIGTERM to the batch shell, as
`#SBATCH --signal=B:SIGTERM@120` does), the second is the requeued job resuming from the checkpoint dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tigana.ps.ops import admin

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "tools" / "slurm" / "tigana.sbatch"
JOB_ID = "4242"
HOSTS = ["127.0.0.1", "127.0.0.2"]

FAKE_SCONTROL = r'''
"""Stands in for scontrol: `show hostnames LIST`, `show job ID -o`, `requeue ID` (recorded)."""
import os, re, sys

def hostnames(nodelist):
    out = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        if "[" not in item:
            out.append(item)
            continue
        prefix, body = item.rstrip("]").split("[")
        for part in body.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{n:0{len(lo)}d}")
    return out

args = sys.argv[1:]
if args[:2] == ["show", "hostnames"]:
    print("\n".join(hostnames(args[2] if len(args) > 2 else os.environ["SLURM_JOB_NODELIST"])))
elif args[:2] == ["show", "job"]:
    print(f"JobId={args[2]} JobName=tigana JobState=RUNNING Reason=None RestartCnt="
          f"{os.environ.get('SLURM_RESTART_COUNT', '0')}")
elif args[:1] == ["requeue"]:
    with open(os.environ["FAKE_SLURM_REQUEUES"], "a") as f:
        f.write(" ".join(args) + "\n")
else:
    sys.exit(f"fake scontrol: not supported: {args}")
'''

FAKE_SRUN = r'''
"""Stands in for srun inside an allocation: starts the step's tasks here with SLURM's per-task variables,
forwards SIGTERM/SIGINT to them, --kill-on-bad-exit=1 stops the rest when one fails, and exits with the
highest status (128 + signal for a task killed by one). Options must be written --name=value."""
import json, os, signal, subprocess, sys, time

args = sys.argv[1:]
opts = {}
while args and args[0].startswith("-"):
    name, _, value = args.pop(0).partition("=")
    opts[name] = value
nodelist = opts.get("--nodelist") or os.environ["SLURM_JOB_NODELIST"]
hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                       check=True).stdout.split()
nnodes = int(opts.get("--nodes", len(hosts)))
ntasks = int(opts.get("--ntasks", nnodes))
per_node = int(opts.get("--ntasks-per-node", -(-ntasks // nnodes)))
procs = []
for task in range(ntasks):
    env = dict(os.environ, SLURM_PROCID=str(task), SLURM_LOCALID=str(task % per_node),
               SLURM_NODEID=str(task // per_node), SLURM_NTASKS=str(ntasks), SLURM_NNODES=str(nnodes),
               SLURMD_NODENAME=hosts[task // per_node], SLURM_STEP_NUM_TASKS=str(ntasks))
    procs.append(subprocess.Popen(args, env=env))
with open(os.environ["FAKE_SLURM_STEPS"], "a") as f:
    f.write(json.dumps({"options": opts, "command": args, "pids": [p.pid for p in procs],
                        "cpus_per_task": os.environ.get("SRUN_CPUS_PER_TASK")}) + "\n")

def forward(signum, _frame):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)

signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
while None in (codes := [p.poll() for p in procs]):
    if opts.get("--kill-on-bad-exit") == "1" and any(c not in (None, 0) for c in codes):
        forward(signal.SIGKILL, None)
    time.sleep(0.1)
sys.exit(max((128 - p.returncode) if p.returncode < 0 else p.returncode for p in procs))
'''

# The trainer command of the job: records the environment its launcher gave it, then is `tigana train`.
TRAINER = '#!/bin/sh\nenv > "$ENV_DUMPS/$$.env"\nexec tigana train "$@"\n'

TRAIN_ARGS = ("--dataset synthetic --synthetic-rows 3000 --synthetic-vocab 500 --batch-size 64 --dim 4 "
              "--eval-batch-size 1024 --no-progress --checkpoint-every 5")


def _ports(count: int) -> int:
    """A base port whose ``count`` successors are free on every address."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no block of free ports")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _env_dumps(folder: Path) -> list[dict[str, str]]:
    dumps = []
    for path in sorted(folder.glob("*.env")):
        env = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        env["_PID"] = path.stem
        dumps.append(env)
    return sorted(dumps, key=lambda e: int(e["RANK"]))


def _checkpoints(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("step-*/meta.json"))


class Job:
    """One run of the batch script (its own process group), with its logs in ``folder``."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        folder.mkdir()
        self.folder = folder
        self.stdout, self.stderr = folder / "stdout", folder / "stderr"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.proc = subprocess.Popen(["bash", str(SBATCH)], cwd=folder, env=env, stdout=out, stderr=err,
                                         start_new_session=True)

    def log(self) -> str:
        return self.stderr.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the batch script did not finish in {timeout}s:\n{self.log()[-4000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def _wait_for(what: str, check, job: Job, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        assert job.proc.poll() is None, f"the batch script exited ({job.proc.returncode}) before {what}:\n" \
                                        f"{job.log()[-4000:]}"
        time.sleep(0.2)
    pytest.fail(f"no {what} after {timeout}s:\n{job.log()[-4000:]}")


def _steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sbatch_preempt_requeue_resume(tmp_path: Path) -> None:
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "tigana").exists():
        pytest.skip("the tigana console script is not next to this interpreter")
    try:
        with socket.socket() as s:
            s.bind((HOSTS[1], 0))
    except OSError:
        pytest.skip(f"{HOSTS[1]} is not a loopback address here (the second node of the allocation)")
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, source in (("scontrol", FAKE_SCONTROL), ("srun-local", FAKE_SRUN)):
        (tools / name).write_text(f"#!{sys.executable}\n{source}")
    (tools / "trainer").write_text(TRAINER)
    for path in tools.iterdir():
        path.chmod(0o755)

    base = _ports(1)  # the trainers' rendezvous (the scheduler and the servers take free ports)
    submit = tmp_path / "submit"
    submit.mkdir()
    work = submit / f"tigana-{JOB_ID}"
    checkpoints = work / "checkpoints"
    requeues, steps = tmp_path / "requeues.log", tmp_path / "steps.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TIGANA_"))}
    env.update(
        PATH=f"{tools}{os.pathsep}{venv_bin}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        SLURM_JOB_ID=JOB_ID, SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_NNODES="2", SLURM_NTASKS="4",
        SLURM_NTASKS_PER_NODE="2", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
        SLURM_SUBMIT_DIR=str(submit), SLURM_RESTART_COUNT="0", SLURM_CPUS_PER_TASK="2",
        TIGANA_SRUN=str(tools / "srun-local"), TIGANA_SLURM_TRAIN_CMD=str(tools / "trainer"),
        TIGANA_SLURM_MASTER_PORT=str(base), TIGANA_SLURM_TRAIN_GRACE="20", TIGANA_SLURM_STOP_GRACE="20",
        TIGANA_SLURM_READY_TIMEOUT="60", FAKE_SLURM_REQUEUES=str(requeues), FAKE_SLURM_STEPS=str(steps),
        OMP_NUM_THREADS="1",
    )
    jobs: list[Job] = []
    try:
        # ---- run 1: one task per rank (2 nodes x 2), trains until the batch shell gets SIGTERM
        dumps1 = tmp_path / "env1"
        dumps1.mkdir()
        first = Job(tmp_path / "run1", {**env, "ENV_DUMPS": str(dumps1),
                                        "TIGANA_SLURM_TRAIN_ARGS": f"{TRAIN_ARGS} --epochs 1000"})
        jobs.append(first)
        _wait_for("checkpoint", lambda: _checkpoints(checkpoints), first, 90)
        ranks = _wait_for("4 trainers", lambda: (d := _env_dumps(dumps1)) and len(d) == 4 and d, first, 10)
        for rank, dump in enumerate(ranks):
            assert (dump["RANK"], dump["LOCAL_RANK"], dump["WORLD_SIZE"], dump["LOCAL_WORLD_SIZE"],
                    dump["GROUP_RANK"]) == (str(rank), str(rank % 2), "4", "2", str(rank // 2))
            assert (dump["MASTER_ADDR"], dump["MASTER_PORT"]) == (HOSTS[0], str(base))
            assert dump["SLURMD_NODENAME"] == HOSTS[rank // 2]
        started = _steps(steps)
        services = {s["options"]["--job-name"]: s for s in started}
        # every step gets the job's --cpus-per-task (srun does not inherit it since Slurm 22.05)
        assert {s["cpus_per_task"] for s in started} == {"2"}
        assert services["tigana-scheduler"]["options"]["--nodelist"] == HOSTS[0]
        # free ports, read back from the ready files: two jobs on one node never collide
        assert services["tigana-scheduler"]["command"][:6] == ["tigana", "scheduler", "--host", "0.0.0.0",
                                                               "--port", "0"]
        scheduler = (work / "scheduler.address").read_text().strip()
        host, port = scheduler.rsplit(":", 1)
        assert host == HOSTS[0] and int(port) > 0
        for i in range(2):
            server = services[f"tigana-server-{i}"]
            assert server["options"]["--nodelist"] == HOSTS[i] and "--overlap" in server["options"]
            command = server["command"]
            assert command[command.index("--port") + 1] == "0"
            assert command[command.index("--scheduler") + 1] == scheduler
            assert command[command.index("--advertise") + 1] == f"{HOSTS[i]}:0"  # the bound port fills in
        train = services["tigana-train"]["command"]
        assert train[train.index("--ps") + 1] == scheduler and "--resume" not in train
        # each server's failure domain is its node (SLURMD_NODENAME): the scheduler keeps copies on both nodes
        servers = admin.shard_map(scheduler).servers
        assert sorted(srv.domain.host for srv in servers) == sorted(HOSTS), servers

        first.proc.send_signal(signal.SIGTERM)  # what --signal=B:SIGTERM@120 sends: the batch shell only
        assert first.wait(90) == 0, first.log()
        log = first.log()
        assert "SIGTERM: asking the trainers to checkpoint" in log
        assert "servers stopped (exit status 0)" in log and "scheduler stopped (exit status 0)" in log
        assert log.count("SIGTERM, draining and snapshotting") == 2  # both servers snapshot on the way out
        assert requeues.read_text().split() == ["requeue", JOB_ID]
        assert list((work / "ready").iterdir()) == []  # every daemon exited cleanly (they remove their file)
        for i in range(2):
            assert list((work / "servers" / f"server-{i}").iterdir()), "server data dir is empty"
        assert not _group_alive(first.proc.pid)
        assert not [pid for s in started for pid in s["pids"] if _alive(pid)]
        newest = _checkpoints(checkpoints)[-1]
        resume_step = json.loads((newest / "meta.json").read_text())["step"]
        # the trainers checkpointed where SIGTERM stopped them, not only at the periodic steps. They exit 75;
        # with --kill-on-bad-exit the launcher may SIGKILL ranks still leaving once the first 75 arrives (137):
        # harmless, the checkpoint is written before any rank leaves.
        assert re.search(r"trainers stopped \(exit status (75|137)\)", log), log
        assert f"stopped by SIGTERM after step {resume_step}; checkpoint {newest}" in log

        # ---- run 2: the requeued job (same id, same work dir), one torchrun per node, resumes and finishes
        dumps2 = tmp_path / "env2"
        dumps2.mkdir()
        steps.unlink()
        second = Job(tmp_path / "run2", {
            **env, "ENV_DUMPS": str(dumps2), "SLURM_RESTART_COUNT": "1", "TIGANA_SLURM_LAUNCH": "torchrun",
            "TIGANA_SLURM_TRAIN_ARGS": f"{TRAIN_ARGS} --epochs 1000 --max-steps {resume_step + 3}"})
        jobs.append(second)
        assert second.wait(120) == 0, second.log()
        log = second.log()
        assert "resuming from the newest checkpoint" in log and "trainers finished (exit status 0)" in log
        assert "servers stopped (exit status 0)" in log and "scheduler stopped (exit status 0)" in log
        result = json.loads(second.stdout.read_text().strip().splitlines()[-1])
        assert result["resumed_from"] == str(newest) and result["steps"] == resume_step + 3
        assert result["world_size"] == 4
        ranks = _env_dumps(dumps2)
        seen = [(d["RANK"], d["LOCAL_RANK"], d["WORLD_SIZE"], d["GROUP_RANK"], d["MASTER_ADDR"])
                for d in ranks]
        assert seen == [(str(r), str(r % 2), "4", str(r // 2), HOSTS[0]) for r in range(4)]
        launched = _steps(steps)
        train = next(s for s in launched if s["options"]["--job-name"] == "tigana-train")
        assert train["options"]["--ntasks"] == "2" and "--resume" in train["command"]
        assert requeues.read_text().split() == ["requeue", JOB_ID]  # a finished job is not requeued
        assert not _group_alive(second.proc.pid)
        pids = [pid for s in launched for pid in s["pids"]] + [int(d["_PID"]) for d in ranks]
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        for job in jobs:
            job.kill()
        for record in _steps(steps):
            for pid in record["pids"]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for folder in (tmp_path / "env1", tmp_path / "env2"):
            for dump in _env_dumps(folder) if folder.exists() else []:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(dump["_PID"]), signal.SIGKILL)
        shutil.rmtree(work / "ready", ignore_errors=True)
