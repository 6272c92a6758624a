"""Elastic trainers: ``kill -9`` of one of two trainers mid-run; the job starts its trainers again from the last
elastic state, the shard cluster runs on untouched, and the model ends as good as an undisturbed run's. Under
torchrun --nnodes MIN:MAX a node also joins a running job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tigana.tools.bench.elastic import TORCHRUN_ENV, torchrun_command, train, train_args
from tigana.trainer.distributed import free_port
from tigana.trainer.elastic import ElasticState, Position, elastic_state, restart_count

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "movielens-100k"
pytestmark = pytest.mark.timeout(300)


# The mean AUC of undisturbed runs of this job (``tigana bench elastic``, 3 trials: 0.77465, spread 0.0017; in
# docs/training.md). A disturbed run is held to it with the margin one pair of runs needs, instead of running an
# undisturbed job beside it in every suite run (half this test's time).
CALM_AUC = 0.7747


@pytest.mark.skipif(not (DATA / "ml-100k" / "u1.base").is_file(), reason=f"MovieLens-100K not found at {DATA}")
def test_kill_9_of_a_trainer_restarts_it_and_the_job_finishes_as_well(shard_cluster, tmp_path: Path) -> None:
    servers = [p.pid for p in shard_cluster.procs]
    target = ",".join(shard_cluster.addresses)
    hit = train(train_args(DATA, target, tmp_path / "hit"), kill_after_state=tmp_path / "hit" / "elastic")
    assert hit["restarts"] == 1
    assert hit["resumed_from"].startswith("elastic state at step")
    # the job as a whole took every step (a few twice, after the state): an epoch of u1's 80,000 ratings in
    # batches of 512, split over 2 trainers
    assert hit["steps"] == -(-80_000 // 2 // 512), hit
    # Two trainers pushing asynchronously never train the same model twice: undisturbed runs of this job spread
    # by up to ~0.0035 AUC. One run is compared with that margin here; ``tigana bench elastic`` compares the means
    # of several against the 0.002 target.
    assert abs(hit["auc"] - CALM_AUC) <= 0.005, hit["auc"]
    # the shard servers ran on: the same processes, alive, never restarted
    assert [p.pid for p in shard_cluster.procs] == servers and all(p.poll() is None for p in shard_cluster.procs)


@pytest.mark.skipif(not (DATA / "ml-100k" / "u1.base").is_file(), reason=f"MovieLens-100K not found at {DATA}")
def test_under_torchrun_the_agent_restarts_the_workers(shard_cluster, tmp_path: Path) -> None:
    """torchrun --max-restarts: its agent starts both workers again after a kill -9; they rendezvous anew (a
    fresh key prefix per generation in the agent's store) and resume from the elastic state."""
    servers = [p.pid for p in shard_cluster.procs]
    folder = tmp_path / "torchrun"
    args = train_args(DATA, ",".join(shard_cluster.addresses), folder)
    hit = train(args, kill_after_state=folder / "elastic", command=torchrun_command(args))
    assert hit["restarts"] == 1 and hit["resumed_from"].startswith("elastic state")
    assert hit["world_size"] == 2 and hit["auc"] > 0.76
    assert [p.pid for p in shard_cluster.procs] == servers and all(p.poll() is None for p in shard_cluster.procs)


@pytest.mark.skipif(not (DATA / "ml-100k" / "u1.base").is_file(), reason=f"MovieLens-100K not found at {DATA}")
def test_under_torchrun_a_node_joins_a_running_job(shard_cluster, tmp_path: Path) -> None:
    """torchrun --nnodes 1:2: a second agent (node) joins the running job; the agents stop the first worker and
    start a world of 2 from the elastic state (a membership change, not a restart). The job finishes on the same
    shard servers, which never restarted. (With torch's shared agent store this join hangs: ``TORCHRUN_ENV``.)"""
    servers = [p.pid for p in shard_cluster.procs]
    folder = tmp_path / "torchrun"
    state = folder / "elastic" / "state.json"
    # 2 epochs (314 steps of the first node alone): it must not finish the job before the second one's agent has
    # started and joined. On a loaded 2-core machine the join stopped the first node at step 24.
    cmd = torchrun_command(train_args(DATA, ",".join(shard_cluster.addresses), folder, epochs=2), nnodes="1:2",
                           nproc_per_node=1, rdzv_endpoint=f"127.0.0.1:{free_port()}")
    agents: list[subprocess.Popen] = []

    def start(k: int) -> None:
        with open(tmp_path / f"agent{k}.out", "w") as out, open(tmp_path / f"agent{k}.err", "w") as err:
            agents.append(subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **TORCHRUN_ENV},
                                           start_new_session=True))

    def wait_for(what: str, ready) -> None:
        deadline = time.monotonic() + 120
        while not ready():
            ended = [a.returncode for a in agents if a.poll() is not None]
            assert not ended and time.monotonic() < deadline, \
                (what, ended, (tmp_path / "agent0.err").read_text()[-3000:])
            time.sleep(0.05)

    def world() -> int:
        return json.loads(state.read_text())["world_size"] if state.is_file() else 0

    try:
        start(0)
        wait_for("a state of the first node's world", lambda: world() == 1)
        start(1)
        wait_for("a state of the 2-node world", lambda: world() == 2)
        for agent in agents:
            agent.wait(timeout=240)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    assert [a.returncode for a in agents] == [0, 0], (tmp_path / "agent0.err").read_text()[-3000:]
    lines = [json.loads(line) for k in range(2) for line in (tmp_path / f"agent{k}.out").read_text().splitlines()
             if line.startswith("{")]
    results = [r for r in lines if "auc" in r and not r.get("preempted")]
    assert len(results) == 1, lines  # rank 0 of the last generation reports the job
    hit = results[0]
    # a membership change, not a restart: the new world resumed from the state the stopped worker saved
    assert hit["world_size"] == 2 and hit["restarts"] == 0 and hit["resumed_from"].startswith("elastic state")
    assert hit["auc"] > 0.76, hit
    assert json.loads(state.read_text())["finished"]  # a new job in this folder starts fresh
    assert [p.pid for p in shard_cluster.procs] == servers and all(p.poll() is None for p in shard_cluster.procs)


def test_elastic_state_round_trip_and_a_new_world_size(tmp_path: Path) -> None:
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    opt, other_opt = torch.optim.Adam(model.parameters()), torch.optim.Adam(other.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    state = ElasticState(tmp_path, every=5)
    assert state.load(other, other_opt) is None and state.due(10) and not state.due(11)
    state.save(Position(step=10, epoch=1, samples_in_epoch=4 * 2 * 256, world_size=2, batch_size=256), model, opt)
    state.save(Position(step=15, epoch=1, samples_in_epoch=6 * 2 * 256, world_size=2, batch_size=256), model, opt)
    got = state.load(other, other_opt)
    assert got is not None and got.step == 15 and len(list(tmp_path.glob("dense-*.pt"))) == 1
    assert torch.equal(other.weight, model.weight) and other_opt.state_dict()["state"][0]["step"] == 1
    assert got.batches_to_skip(2) == 6 and got.batches_to_skip(3) == 4  # the same samples, fewer batches each
    assert state.peek() == got and not state.finished()
    state.finish()  # the job trained to its end: a restart of it may still resume, a new job starts fresh
    assert state.finished() and state.peek() == got


def test_which_jobs_are_elastic(tmp_path: Path) -> None:
    from tigana.trainer.config import TrainConfig

    config = TrainConfig(checkpoint_dir=str(tmp_path))
    assert elastic_state(config, {}) is None and restart_count({}) == 0
    assert elastic_state(config, {"TORCHELASTIC_MAX_RESTARTS": "2"}).folder == tmp_path / "elastic"
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "1"}) == 1
    with pytest.raises(ValueError, match="checkpoint-dir"):
        elastic_state(TrainConfig(), {"TORCHELASTIC_MAX_RESTARTS": "1"})
