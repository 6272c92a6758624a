"""An elastic state is resumed only by the job that saved it. A restarted generation (restart count >= 1) used
to load whatever state ``checkpoint_dir/elastic`` held, also one an earlier, finished job had left there, and
so skipped the new job's training. The state now carries the job's id (``TIGANA_JOB_ID``, which the ``--nproc``
launcher sets, or torchrun's run id); without one (torchrun's default run id ``none``), the first generation of
a job discards a state it does not resume, so that its restarts cannot find it. In-process training runs against
a real local cluster (one for the file, every table dropped after each test); the environment is what the
launchers set."""

from __future__ import annotations

from pathlib import Path

import pytest

from tigana.trainer.config import TrainConfig
from tigana.trainer.distributed import DistEnv
from tigana.trainer.elastic import ElasticState, job_id
from tigana.trainer.loop import train

pytestmark = pytest.mark.timeout(240)
ENV = ("TIGANA_ELASTIC_DIR", "TIGANA_RESTART_COUNT", "TIGANA_JOB_ID", "TORCHELASTIC_RESTART_COUNT",
       "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _config(prefix: str, **changes) -> TrainConfig:
    return TrainConfig(model="deepfm", dataset="synthetic", synthetic_rows=1200, synthetic_vocab=300, batch_size=200,
                       eval_batch_size=600, epochs=1, staleness=0, seed=3, progress=False, elastic_every=2,
                       table_prefix=prefix).replace(**changes)


def test_the_job_id_comes_from_our_launcher_or_torchrun() -> None:
    assert job_id({"TIGANA_JOB_ID": "j1", "TORCHELASTIC_RUN_ID": "r1"}) == "j1"
    assert job_id({"TORCHELASTIC_RUN_ID": "r1"}) == "r1"
    assert job_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default: the same for every job
    assert job_id({}) is None


def test_a_restarted_generation_of_a_new_job_does_not_resume_an_earlier_jobs_state(clean_env, shared_shard_cluster,
                                                                                    tmp_path: Path) -> None:
    folder = tmp_path / "elastic"
    clean_env.setenv("TIGANA_ELASTIC_DIR", str(folder))
    cluster = shared_shard_cluster(1)
    clean_env.setenv("TIGANA_JOB_ID", "job-a")
    clean_env.setenv("TIGANA_RESTART_COUNT", "0")
    first = train(_config("ja_"), DistEnv(), None, [cluster.target])
    assert first["steps"] == 6 and ElasticState(folder, 2).finished()
    # job B: its first generation died before saving a state; the second starts in the same folder
    clean_env.setenv("TIGANA_JOB_ID", "job-b")
    clean_env.setenv("TIGANA_RESTART_COUNT", "1")
    second = train(_config("jb_"), DistEnv(), None, [cluster.target])
    assert "resumed_from" not in second and second["restarts"] == 1
    assert second["train_rows"] == first["train_rows"]  # it trained its own epoch, every step of it
    # and B's own state is resumed by B's next restart
    clean_env.setenv("TIGANA_RESTART_COUNT", "2")
    again = train(_config("jb_"), DistEnv(), None, [cluster.target])
    assert again["resumed_from"] == "elastic state at step 6" and again["train_rows"] == 0


def test_without_a_job_id_a_fresh_first_generation_drops_the_state_it_does_not_resume(clean_env, shared_shard_cluster,
                                                                                       tmp_path: Path) -> None:
    """torchrun without --rdzv-id: every job's run id is "none"."""
    ckpt = tmp_path / "ckpt"
    clean_env.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    cluster = shared_shard_cluster(1)
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    train(_config("na_", checkpoint_dir=str(ckpt / "a")), DistEnv(), None, [cluster.target])
    (ckpt / "b").mkdir(parents=True)
    (ckpt / "a" / "elastic").rename(ckpt / "b" / "elastic")  # the earlier job's finished state, in B's folder
    # job B's first generation (the state is finished: a new job) trains one step and dies before its first
    # state; its restart must start over, not take the earlier job's state
    first = train(_config("nb_", checkpoint_dir=str(ckpt / "b"), max_steps=1), DistEnv(), None,
                  [cluster.target])
    assert "resumed_from" not in first
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = train(_config("nb_", checkpoint_dir=str(ckpt / "b"), elastic_every=100), DistEnv(), None,
                   [cluster.target])
    assert "resumed_from" not in second and second["restarts"] == 1 and second["steps"] == 6
