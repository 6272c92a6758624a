"""tools/k8s: the trainers, as an indexed Job, a Kubeflow PyTorchJob or a Kubeflow Trainer TrainJob: torchrun's
and ``tigana train``'s command lines parsed in the environment each pod would have, and the init container's
wait for the cluster run against a real scheduler."""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

from k8s_checks import _check_pytorchjob, _check_trainer_job, _check_trainjob, _wait_for_cluster
from k8s_manifests import _environ, _one, _raw

from tigana.ps.scheduler import SchedulerConfig, start_scheduler
from tigana.tools import cli


# ------------------------------------------------------------------------------------------- the trainers
def test_trainers_as_an_indexed_job() -> None:
    _check_trainer_job(_raw())


def test_trainers_as_a_pytorchjob() -> None:
    _check_pytorchjob(_raw())


def test_trainers_as_a_trainjob() -> None:
    _check_trainjob(_raw())


def test_the_trainers_wait_until_a_real_cluster_is_placed(tmp_path: Path, make_shard_server) -> None:
    """The init container's check, run against a real scheduler: it holds before any server registered (no
    slot has a server) and lets the trainers go once one has and the scheduler placed the slots."""
    argv, text = _wait_for_cluster(_raw(), _one(_raw(), "Job", "tigana-train")["spec"]["template"]["spec"])
    sched = start_scheduler(SchedulerConfig(port=0, data_dir=str(tmp_path / "sched"), replicas=0,
                                            expect_servers=1, bootstrap_wait_s=0.0))
    argv = [sched.address if a == argv[argv.index("--scheduler") + 1] else a for a in argv]

    def check() -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), _environ({}):
            rc = cli.main(argv)
        return rc, out.getvalue()

    try:
        rc, out = check()
        assert rc == 0 and '"unavailable_slots": 4096' in out and text not in out
        make_shard_server(port=0, scheduler=sched.address, heartbeat_interval_s=0.1)
        deadline = time.monotonic() + 20
        while text not in check()[1]:
            assert time.monotonic() < deadline, "the cluster was never reported placed"
            time.sleep(0.2)
    finally:
        sched.close()
